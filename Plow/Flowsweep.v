(** * Dependencies from data flow, by a sweep (checkpoint D, C10 at any size).

    [Dataflow.check_dataflow] compares every access with every write of its
    block: the arena reuses the same bytes in every layer, so on a whole
    plan the pairs grow with the square of the layer count.  This checker
    decides the same property ([Dataflow.dataflow_hypotheses], which
    [Dataflowproof.checkpoint_d_flow_sound] consumes) by one sweep over the
    tasks in an untrusted order (a topological order of the counter
    protocol; the payload's [order], which must name every task):

    - per address block a frontier: the writes not yet overwritten and the
      reads since, each trimmed to the bytes no later write covers;
    - each access of a task is compared only with the frontier of its block
      (a read with the writes, a write with both); every overlapping entry of
      another task, one of the two writing, must come earlier in program order
      (smaller key; equal keys are a race) and happen before the task;
    - happens-before is decided by a vector clock per task: for each worker,
      the highest queue position of a task that happens before it (or is
      it), joined from the clocks of the counters it waits on and of its
      worker's previous task; [hbq] reads it.

    Conflicts not compared directly are ordered through the frontier entry
    that overwrote or covers their bytes (transitivity of happens-before).
    Soundness: [Flowsweepproof.check_sweep_sound] ([check_sweep] accepts =>
    [dataflow_hypotheses]) and [Flowsweepproof.checkpoint_d_sweep_sound]. *)
From Coq Require Import List Arith NArith Bool.
From Plow Require Import Loc Counters Dataflow.
Import ListNotations.

Local Open Scope N_scope.

(** ** Vector clocks: per worker (trie key), a queue position. *)
Definition vclock : Type := trie N.

Definition omax (a b : option N) : option N :=
  match a, b with
  | Some x, Some y => Some (N.max x y)
  | None, _ => b
  | _, None => a
  end.

Fixpoint tjoin (a b : vclock) : vclock :=
  match a, b with
  | Leaf, _ => b
  | _, Leaf => a
  | Node l1 o1 r1, Node l2 o2 r2 => Node (tjoin l1 l2) (omax o1 o2) (tjoin r1 r2)
  end.

(** Raise worker [w]'s entry to at least [i]. *)
Definition bump (v : vclock) (w i : N) : vclock :=
  tadd (nkey w) (match tfind (nkey w) v with Some j => N.max i j | None => i end) v.

(** A task at queue position [q] (worker, position) happens before the owner
    of clock [v] (or is it): the position is covered by the clock's entry for
    its worker. *)
Definition hbq_at (q : option (N * N)) (v : vclock) : bool :=
  match q with
  | Some (w, i) => match tfind (nkey w) v with Some j => i <=? j | None => false end
  | None => false
  end.

(** [u] happens before the owner of clock [v] (or is it). *)
Definition hbq (pm : trie (N * N)) (v : vclock) (u : N) : bool := hbq_at (tfind (nkey u) pm) v.

(** The clock of [t]: the counters it waits on, its worker's previous swept
    task (if that one is before [t] in the queue), and its own position. *)
Definition clock_of (wtm : trie (list N)) (pm : trie (N * N)) (cv : trie vclock)
  (wv : trie (N * vclock)) (t : N) : vclock :=
  let v := fold_left (fun v c => tjoin v (get cv Leaf c)) (get wtm [] t) Leaf in
  match tfind (nkey t) pm with
  | Some (w, i) =>
      let v' := match tfind (nkey w) wv with
                | Some (a, va) => if qbefore pm a t then tjoin v va else v
                | None => v
                end in
      bump v' w i
  | None => v
  end.

(** ** Frontier *)

(** A frontier entry's task: its index, its program key and its queue position
    ([get km 0 u], [tfind (nkey u) pm]), looked up once when the task is swept, so
    that comparing an access with the entry looks nothing up. *)
Definition tinfo : Type := (N * N * option (N * N))%type.

(** A frontier entry: a task and bytes it wrote or read. *)
Definition entry : Type := (tinfo * access)%type.

(** Per block: the writes, then the reads. *)
Definition frontier : Type := (list entry * list entry)%type.

Inductive sweep_error : Type :=
| SErr_flow (e : dataflow_error)
    (** lengths, block size, a range, a race or an unordered pair, as [check_dataflow] *)
| SErr_missing (t : N)
    (** task [t] is not in the sweep order *)
| SErr_order (u t lo hi : N)
    (** [u], swept before [t], conflicts with it on bytes [[lo, hi)] but comes later in
        program order (the sweep order is not a topological order of the data flow) *).

Definition overlaps (a b : access) : bool := (acc_lo a <? acc_hi b) && (acc_lo b <? acc_hi a).

(** The sweep's address blocks: 4096 bytes ([N.shiftr], not a division). *)
Definition blk (x : N) : N := N.shiftr x 12.

(** Every access is non-empty and inside one of the sweep's blocks. *)
Definition srange_ok (a : access) : bool :=
  (acc_lo a <? acc_hi a) && (blk (acc_lo a) =? blk (acc_hi a - 1)).

Definition check_sranges (d : dflow) : option dataflow_error :=
  find_errN (fun t l =>
    find_errN (fun k a =>
      if srange_ok a then None
      else Some (DErr_range t k (acc_lo a) (acc_hi a))) 0 l) 0 (df_acc d).

(** Access [a] of task [t] (key [kt], clock [vt]) against one frontier entry
    (its task [u], key [ku], queue position [qu]). *)
Definition check_entry (vt : vclock) (t kt : N) (a : access) (f : entry) : option sweep_error :=
  let '((u, ku, qu), b) := f in
  if u =? t then None
  else if overlaps a b && (acc_write a || acc_write b) then
    if ku <? kt then
      (if hbq_at qu vt then None
       else Some (SErr_flow (DErr_unordered u t (N.max (acc_lo a) (acc_lo b))
                                                (N.min (acc_hi a) (acc_hi b)))))
    else if kt <? ku then
      Some (SErr_order u t (N.max (acc_lo a) (acc_lo b)) (N.min (acc_hi a) (acc_hi b)))
    else Some (SErr_flow (DErr_race u t (N.max (acc_lo a) (acc_lo b)) (N.min (acc_hi a) (acc_hi b))))
  else None.

(** The parts of entry [f] outside the bytes of [a] ([f] itself when they do not meet). *)
Definition pieces (a : access) (f : entry) : list entry :=
  let '(u, b) := f in
  if overlaps a b then
    (if acc_lo b <? acc_lo a then [(u, (acc_lo b, acc_lo a, acc_write b))] else []) ++
    (if acc_hi a <? acc_hi b then [(u, (acc_hi a, acc_hi b, acc_write b))] else [])
  else [f].

Definition trim (a : access) (l : list entry) : list entry := flat_map (pieces a) l.

(** Sweep the accesses [l] of task [t]. *)
(** [first_err f l], also counting the elements looked at (added to [n]). *)
Fixpoint scan {A E : Type} (f : A -> option E) (l : list A) (n : N) : sum E N :=
  match l with
  | [] => inr n
  | x :: l' => match f x with Some e => inl e | None => scan f l' (N.succ n) end
  end.

(** Sweep the accesses [l] of task [t] (key [kt], queue position [qt]); [n] counts the
    frontier entries compared. *)
Fixpoint sweep_accs (vt : vclock) (t kt : N) (qt : option (N * N))
  (l : list access) (fm : trie frontier) (n : N) : sum sweep_error (trie frontier * N) :=
  match l with
  | [] => inr (fm, n)
  | a :: l' =>
      let k := blk (acc_lo a) in
      let fr := get fm ([], []) k in
      match scan (check_entry vt t kt a) (fst fr) n with
      | inl e => inl e
      | inr n1 =>
          match (if acc_write a then scan (check_entry vt t kt a) (snd fr) n1 else inr n1) with
          | inl e => inl e
          | inr n2 =>
              let fr' := if acc_write a then (((t, kt, qt), a) :: trim a (fst fr), trim a (snd fr))
                         else (fst fr, ((t, kt, qt), a) :: snd fr) in
              sweep_accs vt t kt qt l' (tadd (nkey k) fr' fm) n2
          end
      end
  end.

Record sstate : Type := mk_sstate {
  ss_front : trie frontier;       (** per block *)
  ss_cv    : trie vclock;         (** per counter: the join of its signallers' clocks *)
  ss_wv    : trie (N * vclock)    (** per worker: its last swept task and that task's clock *)
}.

Definition sig_clocks (vt : vclock) (cv : trie vclock) (cs : list N) : trie vclock :=
  fold_left (fun m c => tadd (nkey c) (tjoin (get m Leaf c) vt) m) cs cv.

Fixpoint sweep_tasks (km : trie N) (pm : trie (N * N)) (wtm sgm : trie (list N))
  (accm : trie (list access)) (order : list N) (s : sstate) (n : N) : sum sweep_error N :=
  match order with
  | [] => inr n
  | t :: order' =>
      let vt := clock_of wtm pm (ss_cv s) (ss_wv s) t in
      match sweep_accs vt t (get km 0 t) (tfind (nkey t) pm) (get accm [] t) (ss_front s) n with
      | inl e => inl e
      | inr (fm, n') =>
          let wv := match tfind (nkey t) pm with
                    | Some (w, _) => tadd (nkey w) (t, vt) (ss_wv s)
                    | None => ss_wv s
                    end in
          sweep_tasks km pm wtm sgm accm order'
            (mk_sstate fm (sig_clocks vt (ss_cv s) (get sgm [] t)) wv) n'
      end
  end.

(** Every task occurs in the order. *)
Definition order_set (order : list N) : trie unit :=
  fold_left (fun m t => tadd (nkey t) tt m) order Leaf.

Definition check_missing (d : dflow) (order : list N) : option sweep_error :=
  let om := order_set order in
  find_errN (fun t _ => match tfind (nkey t) om with Some _ => None | None => Some (SErr_missing t) end)
    0 (df_acc d).

(** The data-flow check by the sweep, with the number of frontier entries compared;
    [df_block] and [df_chains] play no part (the sweep's blocks are [blk]'s). *)
Definition sweep_count (p : cplan) (d : dflow) (order : list N) : sum sweep_error N :=
  let n := lengthN (cp_signals p) in
  let nk := lengthN (df_keys d) in
  let na := lengthN (df_acc d) in
  if negb ((nk =? n) && (na =? n)) then inl (SErr_flow (DErr_lengths n nk na))
  else match check_sranges d with
       | Some e => inl (SErr_flow e)
       | None =>
           match check_missing d order with
           | Some e => inl e
           | None =>
               sweep_tasks (index_map (df_keys d)) (pos_map (cp_queues p))
                 (index_map (cp_waits p)) (index_map (cp_signals p)) (index_map (df_acc d))
                 order (mk_sstate Leaf Leaf Leaf) 0
           end
       end.

Definition check_sweep (p : cplan) (d : dflow) (order : list N) : option sweep_error :=
  match sweep_count p d order with inl e => Some e | inr _ => None end.

(** Checkpoint D from data flow by the sweep: the counter protocol and scopes
    ([check_checkpoint_d]), then [check_sweep]. *)
Inductive ds_error : Type :=
| DSProto (e : counter_error)
| DSFlow (e : sweep_error).

Definition check_checkpoint_d_sweep (p : cplan) (scopes : list N) (wpg : N) (d : dflow)
  (order : list N) : verdict ds_error :=
  match check_checkpoint_d p scopes wpg with
  | Reject e => Reject (DSProto e)
  | Accept => match check_sweep p d order with None => Accept | Some e => Reject (DSFlow e) end
  end.

(** What the oracle runs: the same verdict (one sweep), and on accept the number of frontier
    entries compared ([Flowsweepproof.checkpoint_d_sweep_counted_verdict]). *)
Definition check_checkpoint_d_sweep_counted (p : cplan) (scopes : list N) (wpg : N) (d : dflow)
  (order : list N) : verdict ds_error * N :=
  match check_checkpoint_d p scopes wpg with
  | Reject e => (Reject (DSProto e), 0)
  | Accept => match sweep_count p d order with
              | inl e => (Reject (DSFlow e), 0)
              | inr n => (Accept, n)
              end
  end.
