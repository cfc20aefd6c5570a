(** * Counter protocol (checkpoint D): model, hypotheses, executable checker.

    A plan is a set of tasks (packets) [0 .. n-1], a queue per worker (the
    queues partition the tasks), and counters with thresholds.  Task [t]
    waits on the counters [waits_of p t] and, when it completes, increments
    each counter of [signals_of p t] once.  The task graph's edges
    [(producer, consumer)] are the dependencies the plan must respect.

    The semantics (a small-step interleaving semantics, any number of
    workers) is in this file; soundness proofs are in [Countersproof.v]
    (theorems C1-C3).  Everything the checker touches is a binary number
    ([N]); unary [nat] appears only as list positions in the propositional
    model. *)
From Coq Require Import List Arith NArith Bool.
From Plow Require Import Loc.
Import ListNotations.

Local Open Scope N_scope.

(** ** Plans (the payload, as read by the oracle) *)
Record cplan : Type := mk_cplan {
  cp_workers    : list N;          (** worker of each task (index = task) *)
  cp_queues     : list (list N);   (** per worker, its tasks in order *)
  cp_thresholds : list N;          (** per counter, its threshold *)
  cp_waits      : list (list N);   (** per task, counters it waits on *)
  cp_signals    : list (list N);   (** per task, counters it increments *)
  cp_edges      : list (N * N);    (** dependencies (producer, consumer) *)
  cp_ranks      : list N           (** untrusted witness: a topological rank per task *)
}.

Definition ntasks (p : cplan) : nat := length (cp_signals p).
Definition is_task (p : cplan) (t : N) : Prop := (N.to_nat t < ntasks p)%nat.
Definition tasks (p : cplan) : list N := map N.of_nat (seq 0 (ntasks p)).
Definition waits_of (p : cplan) (t : N) : list N := nth (N.to_nat t) (cp_waits p) [].
Definition signals_of (p : cplan) (t : N) : list N := nth (N.to_nat t) (cp_signals p) [].
Definition threshold (p : cplan) (c : N) : N := nth (N.to_nat c) (cp_thresholds p) 0.
Definition rank_of (p : cplan) (t : N) : N := nth (N.to_nat t) (cp_ranks p) 0.
Definition queue (p : cplan) (w : nat) : list N := nth w (cp_queues p) [].

Definition mem (x : N) (l : list N) : bool := existsb (N.eqb x) l.

(** The tasks that signal counter [c]. *)
Definition signallers (p : cplan) (c : N) : list N :=
  filter (fun t => mem c (signals_of p t)) (tasks p).

(** ** Hypotheses of C1 and C2 *)

(** The queues partition the tasks: every task occurs in exactly one queue,
    exactly once, and nothing else occurs. *)
Definition queues_partition (p : cplan) : Prop :=
  NoDup (concat (cp_queues p)) /\
  (forall t, In t (concat (cp_queues p)) <-> is_task p t).

(** [u] comes strictly before [t] in one worker's queue. *)
Definition queue_before (p : cplan) (u t : N) : Prop :=
  exists w i j, (i < j)%nat /\ nth_error (queue p w) i = Some u /\
                nth_error (queue p w) j = Some t.

(** [t] waits on a counter that [u] signals. *)
Definition gate (p : cplan) (u t : N) : Prop :=
  exists c, In c (waits_of p t) /\ In c (signals_of p u).

Definition edge_covered (p : cplan) (u t : N) : Prop := gate p u t \/ queue_before p u t.

Definition edges_covered (p : cplan) : Prop :=
  forall u t, In (u, t) (cp_edges p) -> edge_covered p u t.

(** Every waited counter's threshold is the number of tasks that signal it. *)
Definition thresholds_exact (p : cplan) : Prop :=
  forall t c, In c (waits_of p t) -> threshold p c = N.of_nat (length (signallers p c)).

(** "Must precede": gates (every signaller of a waited counter precedes the
    waiter) plus queue order. *)
Definition must_precede (p : cplan) (a b : N) : Prop := gate p a b \/ queue_before p a b.

(** Acyclicity, in the form the checker establishes it: a topological rank
    that strictly increases along every must-precede pair.  (For a finite
    relation this is equivalent to the absence of cycles; the direction used,
    ranked => no cycle, is [ranked_acyclic] in Countersproof.v.) *)
Definition ranked (p : cplan) (rk : N -> N) : Prop :=
  forall a b, must_precede p a b -> rk a < rk b.

Definition acyclic (p : cplan) : Prop := exists rk, ranked p rk.

(** ** Semantics *)

(** A state: each worker's position in its queue, each counter's value. *)
Record state : Type := mkstate { pos : nat -> nat; cnt : N -> nat }.

Definition init : state := mkstate (fun _ => 0%nat) (fun _ => 0%nat).

Definition enabled (p : cplan) (s : state) (t : N) : Prop :=
  forall c, In c (waits_of p t) -> (N.to_nat (threshold p c) <= cnt s c)%nat.

(** Worker [w] runs task [t]: it advances, and [t]'s counters are incremented. *)
Definition run_task (p : cplan) (s : state) (w : nat) (t : N) : state :=
  mkstate (fun w' => if Nat.eq_dec w' w then S (pos s w) else pos s w')
          (fun c => if in_dec N.eq_dec c (signals_of p t) then S (cnt s c) else cnt s c).

(** A step: some worker whose head task is enabled runs it. *)
Inductive step (p : cplan) : state -> N -> state -> Prop :=
| step_run : forall s w t,
    nth_error (queue p w) (pos s w) = Some t ->
    enabled p s t ->
    step p s t (run_task p s w t).

(** Executions, recording the tasks run in order. *)
Inductive exec (p : cplan) : state -> list N -> state -> Prop :=
| exec_nil : forall s, exec p s [] s
| exec_snoc : forall s tr s1 t s2,
    exec p s tr s1 -> step p s1 t s2 -> exec p s (tr ++ [t]) s2.

(** ** Executable checker *)

Inductive counter_error : Type :=
| CErr_lengths (ntasks nworkers nwaits nranks : N)
    (** the per-task lists have different lengths *)
| CErr_queue_task (w i t : N)
    (** entry [i] of worker [w]'s queue is [t], which is not a task *)
| CErr_task_worker (t w : N)
    (** task [t] is in worker [w]'s queue but its [worker] field says otherwise *)
| CErr_task_occurs (t k : N)
    (** task [t] occurs [k] times in the queues (must be exactly once) *)
| CErr_counter_ref (t c : N)
    (** task [t] waits on / signals counter [c], which does not exist *)
| CErr_threshold (c expected actual : N)
    (** counter [c] has threshold [actual] but [expected] tasks signal it *)
| CErr_uncovered (e u t : N)
    (** edge [e] = [(u, t)] is covered neither by a counter nor by queue order *)
| CErr_cycle (a b ra rb : N)
    (** [a] must precede [b] but [rank a >= rank b]: possible cycle *)
| CErr_scope (c scope t0 w0 t w : N)
    (** counter [c] has [scope] but tasks [t0] (on worker [w0]) and [t] (on [w])
        both wait on or signal it, and the scope does not reach from one to the
        other *).

(** First error of [f i x] over the elements [x] of [l] at (binary) positions [i]. *)
Fixpoint find_errN {A E : Type} (f : N -> A -> option E) (i : N) (l : list A)
  : option E :=
  match l with
  | [] => None
  | x :: l' => match f i x with Some e => Some e | None => find_errN f (N.succ i) l' end
  end.

Definition first_err {A E : Type} (f : A -> option E) (l : list A) : option E :=
  find_errN (fun _ x => f x) 0 l.

(** Sequencing of checks: the first error wins. *)
Definition orelse {E : Type} (a b : option E) : option E :=
  match a with Some e => Some e | None => b end.

(** [u] occurs in [q] strictly before [t]. *)
Fixpoint before (u t : N) (q : list N) : bool :=
  match q with
  | [] => false
  | x :: q' => if x =? u then mem t q' else before u t q'
  end.

(** *** Indexed maps

    The checker looks tasks and counters up by index in binary tries
    (a binary trie keyed by [N.succ_pos n], as in [FMapPositive]), so that a whole check is O((tasks + edges + list
    entries) * log) instead of the quadratic list walks of positions. *)
Inductive trie (A : Type) : Type :=
| Leaf : trie A
| Node : trie A -> option A -> trie A -> trie A.
Arguments Leaf {A}.
Arguments Node {A} _ _ _.

Fixpoint tfind {A : Type} (i : positive) (m : trie A) : option A :=
  match m with
  | Leaf => None
  | Node l o r => match i with xH => o | xO j => tfind j l | xI j => tfind j r end
  end.

Fixpoint tadd {A : Type} (i : positive) (v : A) (m : trie A) : trie A :=
  match m with
  | Leaf =>
      match i with
      | xH => Node Leaf (Some v) Leaf
      | xO j => Node (tadd j v Leaf) None Leaf
      | xI j => Node Leaf None (tadd j v Leaf)
      end
  | Node l o r =>
      match i with
      | xH => Node l (Some v) r
      | xO j => Node (tadd j v l) o r
      | xI j => Node l o (tadd j v r)
      end
  end.

Definition nkey (n : N) : positive := N.succ_pos n.

(** Entry [n] of [m], [d] when absent. *)
Definition get {A : Type} (m : trie A) (d : A) (n : N) : A :=
  match tfind (nkey n) m with Some x => x | None => d end.

Fixpoint index_from {A : Type} (i : N) (l : list A) (m : trie A) : trie A :=
  match l with [] => m | x :: l' => index_from (N.succ i) l' (tadd (nkey i) x m) end.

(** The list [l] as a map from positions: [get (index_map l) d n = nth n l d]. *)
Definition index_map {A : Type} (l : list A) : trie A := index_from 0 l Leaf.

Definition lengthN {A : Type} (l : list A) : N := fold_left (fun n _ => N.succ n) l 0.

(** Occurrence counts: [count_into m l] adds 1 at [x] for each occurrence of [x] in [l]. *)
Definition count_into (m : trie N) (l : list N) : trie N :=
  fold_left (fun m x => tadd (nkey x) (N.succ (get m 0 x)) m) l m.

(** How often each task occurs in the queues. *)
Definition occ_map (qs : list (list N)) : trie N := fold_left count_into qs Leaf.

(** [l] without repetitions (signal lists are short). *)
Fixpoint undup (l : list N) : list N :=
  match l with [] => [] | x :: l' => if mem x l' then undup l' else x :: undup l' end.

(** Per counter, how many tasks signal it. *)
Definition sig_count_map (sgs : list (list N)) : trie N :=
  fold_left (fun m s => count_into m (undup s)) sgs Leaf.

(** Per task, its (worker, position) in the queues. *)
Fixpoint pos_queue (w i : N) (q : list N) (m : trie (N * N)) : trie (N * N) :=
  match q with [] => m | x :: q' => pos_queue w (N.succ i) q' (tadd (nkey x) (w, i) m) end.

Fixpoint pos_queues (w : N) (qs : list (list N)) (m : trie (N * N)) : trie (N * N) :=
  match qs with [] => m | q :: qs' => pos_queues (N.succ w) qs' (pos_queue w 0 q m) end.

Definition pos_map (qs : list (list N)) : trie (N * N) := pos_queues 0 qs Leaf.

(** [u] before [t] in one queue, by their recorded positions. *)
Definition qbefore (pm : trie (N * N)) (u t : N) : bool :=
  match tfind (nkey u) pm, tfind (nkey t) pm with
  | Some (wu, iu), Some (wt, it) => (wu =? wt) && (iu <? it)
  | _, _ => false
  end.

(** Per counter, a signaller of highest rank (the first such) and its rank. *)
Definition upd_max (a ra : N) (m : trie (N * N)) (c : N) : trie (N * N) :=
  match tfind (nkey c) m with
  | Some (_, r) => if r <? ra then tadd (nkey c) (a, ra) m else m
  | None => tadd (nkey c) (a, ra) m
  end.

Fixpoint max_from (a : N) (sgs : list (list N)) (rks : list N) (m : trie (N * N))
  : trie (N * N) :=
  match sgs, rks with
  | s :: sgs', r :: rks' => max_from (N.succ a) sgs' rks' (fold_left (upd_max a r) s m)
  | _, _ => m
  end.

Definition max_map (p : cplan) : trie (N * N) :=
  max_from 0 (cp_signals p) (cp_ranks p) Leaf.

(** *** The checks, in the order they run *)

Definition check_lengths (p : cplan) : option counter_error :=
  let n := lengthN (cp_signals p) in
  let nw := lengthN (cp_workers p) in
  let nwt := lengthN (cp_waits p) in
  let nr := lengthN (cp_ranks p) in
  if ((nw =? n) && (nwt =? n) && (nr =? n))%bool then None
  else Some (CErr_lengths n nw nwt nr).

(** Every queue entry is a task ([< n]), and that task's [worker] field agrees. *)
Definition check_queue_entries (p : cplan) (wm : trie N) (n : N) : option counter_error :=
  find_errN (fun w q =>
    find_errN (fun i t =>
      if t <? n then
        if get wm 0 t =? w then None else Some (CErr_task_worker t w)
      else Some (CErr_queue_task w i t)) 0 q) 0 (cp_queues p).

(** Every task occurs exactly once in the queues ([om] = [occ_map]). *)
Definition check_occurrences (p : cplan) (om : trie N) : option counter_error :=
  find_errN (fun t _ =>
    let k := get om 0 t in
    if k =? 1 then None else Some (CErr_task_occurs t k)) 0 (cp_signals p).

(** Every counter a task waits on or signals exists ([nc] counters). *)
Definition check_counter_refs (p : cplan) (nc : N) : option counter_error :=
  let chk t l := first_err (fun c => if c <? nc then None else Some (CErr_counter_ref t c)) l in
  match find_errN chk 0 (cp_waits p) with
  | Some e => Some e
  | None => find_errN chk 0 (cp_signals p)
  end.

(** Every counter's threshold is the number of tasks that signal it ([sm] = [sig_count_map]). *)
Definition check_thresholds (p : cplan) (sm : trie N) : option counter_error :=
  find_errN (fun c th =>
    let expected := get sm 0 c in
    if expected =? th then None else Some (CErr_threshold c expected th)) 0 (cp_thresholds p).

(** Every edge is covered by a counter or by same-queue order ([wtm], [sgm]:
    waits and signals by task; [pm] = [pos_map]). *)
Definition check_edges (p : cplan) (wtm sgm : trie (list N)) (pm : trie (N * N))
  : option counter_error :=
  find_errN (fun e (ut : N * N) =>
    let (u, t) := ut in
    if existsb (fun c => mem c (get sgm [] u)) (get wtm [] t) || qbefore pm u t then None
    else Some (CErr_uncovered e u t)) 0 (cp_edges p).

(** Ranks increase along every gate: for each waiter [b] and counter [c] it
    waits on, the highest-ranked signaller of [c] ([mm] = [max_map]) ranks
    below [b]. *)
Definition check_gate_ranks (p : cplan) (rkm : trie N) (mm : trie (N * N))
  : option counter_error :=
  find_errN (fun b wb =>
    let rb := get rkm 0 b in
    first_err (fun c =>
      match tfind (nkey c) mm with
      | Some (a, ra) => if ra <? rb then None else Some (CErr_cycle a b ra rb)
      | None => None
      end) wb) 0 (cp_waits p).

(** Ranks increase along each queue (consecutive pairs). *)
Fixpoint check_chain (rkm : trie N) (q : list N) : option counter_error :=
  match q with
  | a :: ((b :: _) as q') =>
      let ra := get rkm 0 a in
      let rb := get rkm 0 b in
      if ra <? rb then check_chain rkm q' else Some (CErr_cycle a b ra rb)
  | _ => None
  end.

Definition check_queue_ranks (p : cplan) (rkm : trie N) : option counter_error :=
  first_err (check_chain rkm) (cp_queues p).

(** All checks, each run only when the previous ones passed; the maps are
    built once. *)
Definition check_all (p : cplan) : option counter_error :=
  match check_lengths p with Some e => Some e | None =>
  match check_queue_entries p (index_map (cp_workers p)) (lengthN (cp_signals p)) with
  | Some e => Some e | None =>
  match check_occurrences p (occ_map (cp_queues p)) with Some e => Some e | None =>
  match check_counter_refs p (lengthN (cp_thresholds p)) with Some e => Some e | None =>
  match check_thresholds p (sig_count_map (cp_signals p)) with Some e => Some e | None =>
  match check_edges p (index_map (cp_waits p)) (index_map (cp_signals p))
                      (pos_map (cp_queues p)) with
  | Some e => Some e | None =>
  let rkm := index_map (cp_ranks p) in
  match check_gate_ranks p rkm (max_map p) with Some e => Some e | None =>
  check_queue_ranks p rkm
  end end end end end end end.

(** The checkpoint D checker. *)
Definition check_counters (p : cplan) : verdict counter_error :=
  match check_all p with None => Accept | Some e => Reject e end.

(** ** Scopes (checkpoint D, continued)

    A counter's scope is the reach of the atomics that signal it and of the
    loads that wait on it: [0] [cta] (one worker), [1] [device] (one GPU: the
    workers [g * wpg .. g * wpg + wpg - 1], [wpg] workers per GPU), [2]
    [system] (anything).  A legal scope covers the placement of every task
    that signals or waits on the counter.  (Scopes enter nothing above: the
    semantics of C1/C2 has one coherent memory; this is the condition under
    which a GPU's scoped atomics give that semantics.) *)

Definition worker_of (p : cplan) (t : N) : N := nth (N.to_nat t) (cp_workers p) 0.

Definition touches (p : cplan) (c t : N) : Prop :=
  In c (waits_of p t) \/ In c (signals_of p t).

Definition scope_covers (wpg s w1 w2 : N) : Prop :=
  (s = 0 -> w1 = w2) /\ (s = 1 -> w1 / wpg = w2 / wpg).

(** The scope of counter [c] is [nth c scopes 2] (absent: [system]). *)
Definition scopes_legal (p : cplan) (scopes : list N) (wpg : N) : Prop :=
  forall c t1 t2, touches p c t1 -> touches p c t2 ->
  scope_covers wpg (nth (N.to_nat c) scopes 2) (worker_of p t1) (worker_of p t2).

Definition scope_ok (wpg s w w0 : N) : bool :=
  if s =? 0 then w =? w0 else if s =? 1 then w / wpg =? w0 / wpg else true.

(** Per counter, the first task (in task order) that waits on or signals it,
    with its worker. *)
Definition touch_first (t w : N) (m : trie (N * N)) (l : list N) : trie (N * N) :=
  fold_left (fun m c => match tfind (nkey c) m with
                        | Some _ => m
                        | None => tadd (nkey c) (t, w) m
                        end) l m.

Fixpoint touch_from (t : N) (wm : trie N) (wts sgs : list (list N)) (m : trie (N * N))
  : trie (N * N) :=
  match wts, sgs with
  | wt :: wts', sg :: sgs' =>
      let w := get wm 0 t in
      touch_from (N.succ t) wm wts' sgs' (touch_first t w (touch_first t w m wt) sg)
  | _, _ => m
  end.

(** Every task that touches a counter is within the counter's scope of the
    counter's first toucher ([fm]); [wm] = workers by task, [scm] = scopes
    by counter. *)
Definition check_scope_list (wpg : N) (wm : trie N) (fm : trie (N * N)) (scm : trie N)
  (t : N) (l : list N) : option counter_error :=
  let w := get wm 0 t in
  first_err (fun c =>
    let s := get scm 2 c in
    match tfind (nkey c) fm with
    | Some (t0, w0) => if scope_ok wpg s w w0 then None else Some (CErr_scope c s t0 w0 t w)
    | None => Some (CErr_scope c s t w t w)
    end) l.

Definition check_scopes (p : cplan) (scopes : list N) (wpg : N) : option counter_error :=
  let wm := index_map (cp_workers p) in
  let fm := touch_from 0 wm (cp_waits p) (cp_signals p) Leaf in
  let scm := index_map scopes in
  match find_errN (check_scope_list wpg wm fm scm) 0 (cp_waits p) with
  | Some e => Some e
  | None => find_errN (check_scope_list wpg wm fm scm) 0 (cp_signals p)
  end.

(** Checkpoint D: the protocol ([check_counters]), then the scopes. *)
Definition check_checkpoint_d (p : cplan) (scopes : list N) (wpg : N)
  : verdict counter_error :=
  match check_counters p with
  | Reject e => Reject e
  | Accept => match check_scopes p scopes wpg with None => Accept | Some e => Reject e end
  end.
