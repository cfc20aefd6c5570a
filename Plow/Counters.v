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
    (** [a] must precede [b] but [rank a >= rank b]: possible cycle *).

(** First error of [f i x] over the elements [x] of [l] at positions [i]. *)
Fixpoint find_err {A E : Type} (f : nat -> A -> option E) (i : nat) (l : list A)
  : option E :=
  match l with
  | [] => None
  | x :: l' => match f i x with Some e => Some e | None => find_err f (S i) l' end
  end.

Definition first_err {A E : Type} (f : A -> option E) (l : list A) : option E :=
  find_err (fun _ x => f x) 0%nat l.

(** Sequencing of checks: the first error wins. *)
Definition orelse {E : Type} (a b : option E) : option E :=
  match a with Some e => Some e | None => b end.

Definition check_lengths (p : cplan) : option counter_error :=
  let n := length (cp_signals p) in
  if (Nat.eqb (length (cp_workers p)) n && Nat.eqb (length (cp_waits p)) n
      && Nat.eqb (length (cp_ranks p)) n)%bool then None
  else Some (CErr_lengths (N.of_nat n) (N.of_nat (length (cp_workers p)))
              (N.of_nat (length (cp_waits p))) (N.of_nat (length (cp_ranks p)))).

(** Every queue entry is a task, and that task's [worker] field agrees. *)
Definition check_queue_entries (p : cplan) : option counter_error :=
  let n := N.of_nat (ntasks p) in
  find_err (fun w q =>
    find_err (fun i t =>
      if t <? n then
        if nth (N.to_nat t) (cp_workers p) 0 =? N.of_nat w then None
        else Some (CErr_task_worker t (N.of_nat w))
      else Some (CErr_queue_task (N.of_nat w) (N.of_nat i) t)) 0%nat q) 0%nat (cp_queues p).

(** Every task occurs exactly once in the queues. *)
Definition check_occurrences (p : cplan) : option counter_error :=
  let all := concat (cp_queues p) in
  first_err (fun t =>
    let k := count_occ N.eq_dec all t in
    if Nat.eqb k 1 then None else Some (CErr_task_occurs t (N.of_nat k))) (tasks p).

(** Every counter a task waits on or signals exists. *)
Definition check_counter_refs (p : cplan) : option counter_error :=
  let nc := N.of_nat (length (cp_thresholds p)) in
  let chk t l := first_err (fun c => if c <? nc then None else Some (CErr_counter_ref t c)) l in
  orelse (find_err (fun i ws => chk (N.of_nat i) ws) 0%nat (cp_waits p))
         (find_err (fun i ss => chk (N.of_nat i) ss) 0%nat (cp_signals p)).

(** Every counter's threshold is the number of tasks that signal it. *)
Definition check_thresholds (p : cplan) : option counter_error :=
  find_err (fun c th =>
    let expected := N.of_nat (length (filter (mem (N.of_nat c)) (cp_signals p))) in
    if expected =? th then None else Some (CErr_threshold (N.of_nat c) expected th))
    0%nat (cp_thresholds p).

(** [u] occurs in [q] strictly before [t]. *)
Fixpoint before (u t : N) (q : list N) : bool :=
  match q with
  | [] => false
  | x :: q' => if x =? u then mem t q' else before u t q'
  end.

(** Every edge is covered by a counter or by same-queue order. *)
Definition check_edges (p : cplan) : option counter_error :=
  find_err (fun e (ut : N * N) =>
    let (u, t) := ut in
    if existsb (fun c => mem c (signals_of p u)) (waits_of p t)
       || existsb (before u t) (cp_queues p) then None
    else Some (CErr_uncovered (N.of_nat e) u t)) 0%nat (cp_edges p).

(** Per task: (index, rank, waits, signals). *)
Definition table (p : cplan) : list (N * N * list N * list N) :=
  map (fun j => (N.of_nat j, nth j (cp_ranks p) 0, nth j (cp_waits p) [], nth j (cp_signals p) []))
      (seq 0 (ntasks p)).

(** Ranks increase along every gate: for each waiter [b], each counter [c]
    it waits on, each signaller [a] of [c]: [rank a < rank b]. *)
Definition check_gate_ranks (p : cplan) : option counter_error :=
  let tb := table p in
  first_err (fun (x : N * N * list N * list N) => let '(b, rb, wb, _) := x in
    first_err (fun c =>
      first_err (fun (y : N * N * list N * list N) => let '(a, ra, _, sa) := y in
        if mem c sa then (if ra <? rb then None else Some (CErr_cycle a b ra rb)) else None) tb)
      wb) tb.

(** Ranks increase along each queue (consecutive pairs). *)
Fixpoint check_chain (p : cplan) (q : list N) : option counter_error :=
  match q with
  | a :: ((b :: _) as q') =>
      orelse (if rank_of p a <? rank_of p b then None
              else Some (CErr_cycle a b (rank_of p a) (rank_of p b)))
             (check_chain p q')
  | _ => None
  end.

Definition check_queue_ranks (p : cplan) : option counter_error :=
  first_err (check_chain p) (cp_queues p).

Definition check_all (p : cplan) : option counter_error :=
  orelse (check_lengths p)
  (orelse (check_queue_entries p)
  (orelse (check_occurrences p)
  (orelse (check_counter_refs p)
  (orelse (check_thresholds p)
  (orelse (check_edges p)
  (orelse (check_gate_ranks p)
          (check_queue_ranks p))))))).

(** The checkpoint D checker. *)
Definition check_counters (p : cplan) : verdict counter_error :=
  match check_all p with None => Accept | Some e => Reject e end.
