(** * Dependencies from data flow (checkpoint D, theorem C10): model and checker.

    Checkpoint D's counter check ([Counters.check_counters]) certifies the
    edges it is given.  Here the dependencies are not given: they are derived
    from what each task reads and writes.  Every task carries its accesses as
    half-open byte ranges [[lo, hi)] of one address space (the arena; the
    payload builder derives them from the bundle's op table, task units and
    arena map), each flagged as a write or a read, and a program key (its op's
    position in the op table and its stage: a task with a smaller key comes
    first in the sequential program).

    Two distinct tasks conflict when an access of one and an access of the
    other share a byte and at least one of the two writes it (read after
    write, write after read, write after write).  The plan is data-race free
    and runs in program order when every conflicting pair is ordered, in key
    order, by the counter protocol's happens-before: the transitive closure of
    [must_precede] (a gate or same-queue order).  Two conflicting tasks with
    the same key (one stage) cannot be ordered and are a race.

    The checker finds every conflicting pair itself: writes are indexed by
    [block]-sized address blocks (every range must lie inside one block, so
    two ranges that share a byte share a block), and each access is compared
    with the writes of its block.  A pair that the protocol orders directly is
    accepted at once; otherwise the payload's untrusted witness chain for that
    pair (the tasks in between) is checked link by link.  Soundness is
    [Dataflowproof.check_dataflow_sound]; with the counter hypotheses it gives
    [Dataflowproof.dataflow_safety]: in every execution, of two conflicting
    tasks the one first in program order runs first. *)
From Coq Require Import List Arith NArith Bool Relations.
From Plow Require Import Loc Counters.
Import ListNotations.

Local Open Scope N_scope.

(** One access: bytes [[lo, hi)], written ([true]) or read. *)
Definition access : Type := (N * N * bool)%type.
Definition acc_lo (a : access) : N := fst (fst a).
Definition acc_hi (a : access) : N := snd (fst a).
Definition acc_write (a : access) : bool := snd a.

(** A witness chain: from, to, the tasks in between (in order). *)
Definition chain : Type := (N * N * list N)%type.

Record dflow : Type := mk_dflow {
  df_keys   : list N;              (** per task, its program key *)
  df_acc    : list (list access);  (** per task, its accesses *)
  df_block  : N;                   (** block size of the write index (> 0) *)
  df_chains : list chain           (** untrusted: chains for pairs not directly ordered *)
}.

Definition key_of (d : dflow) (t : N) : N := nth (N.to_nat t) (df_keys d) 0.
Definition acc_of (d : dflow) (t : N) : list access := nth (N.to_nat t) (df_acc d) [].

(** ** Specification *)

Definition overlap (a b : access) : Prop :=
  exists x, acc_lo a <= x < acc_hi a /\ acc_lo b <= x < acc_hi b.

(** [u] and [t] touch a common byte and one of them writes it. *)
Definition conflict (d : dflow) (u t : N) : Prop :=
  u <> t /\ exists a b, In a (acc_of d u) /\ In b (acc_of d t) /\
    (acc_write a = true \/ acc_write b = true) /\ overlap a b.

(** The counter protocol's happens-before. *)
Definition hb (p : cplan) : N -> N -> Prop := clos_trans N (must_precede p).

(** Every conflicting pair is ordered by happens-before, earlier key first. *)
Definition dataflow_ordered (p : cplan) (d : dflow) : Prop :=
  forall u t, conflict d u t -> key_of d u < key_of d t -> hb p u t.

(** No two tasks of one key conflict. *)
Definition keys_separate (d : dflow) : Prop :=
  forall u t, conflict d u t -> key_of d u <> key_of d t.

(** ** Checker *)

Inductive dataflow_error : Type :=
| DErr_lengths (ntasks nkeys naccs : N)
    (** the per-task lists have different lengths *)
| DErr_block
    (** the block size is 0 *)
| DErr_range (t k lo hi : N)
    (** access [k] of task [t], bytes [[lo, hi)], is empty or crosses a block boundary *)
| DErr_race (u t lo hi : N)
    (** tasks [u] and [t] of one stage both touch bytes [[lo, hi)], one writing *)
| DErr_unordered (u t lo hi : N)
    (** [u] (earlier) and [t] conflict on bytes [[lo, hi)] and nothing orders [u] before [t] *).

(** The protocol orders [u] directly before [t] (waits and signals by task,
    queue positions). *)
Definition direct (wtm sgm : trie (list N)) (pm : trie (N * N)) (u t : N) : bool :=
  existsb (fun c => mem c (get sgm [] u)) (get wtm [] t) || qbefore pm u t.

(** A chain [u, x1, ..., xk, t] whose every link is direct. *)
Fixpoint chain_ok (wtm sgm : trie (list N)) (pm : trie (N * N)) (u : N) (xs : list N) (t : N)
  : bool :=
  match xs with
  | [] => direct wtm sgm pm u t
  | x :: xs' => direct wtm sgm pm u x && chain_ok wtm sgm pm x xs' t
  end.

(** Witness chains by (from, to). *)
Definition add_chain (m : trie (trie (list N))) (c : chain) : trie (trie (list N)) :=
  let '(u, t, xs) := c in
  tadd (nkey u) (tadd (nkey t) xs (get m Leaf u)) m.

Definition chain_map (cs : list chain) : trie (trie (list N)) := fold_left add_chain cs Leaf.

Definition ordered (wtm sgm : trie (list N)) (pm : trie (N * N)) (cm : trie (trie (list N)))
  (u t : N) : bool :=
  direct wtm sgm pm u t ||
  match tfind (nkey t) (get cm Leaf u) with
  | Some xs => chain_ok wtm sgm pm u xs t
  | None => false
  end.

(** Every access is non-empty and inside one block. *)
Definition range_ok (b : N) (a : access) : bool :=
  (acc_lo a <? acc_hi a) && (acc_lo a / b =? (acc_hi a - 1) / b).

Definition check_ranges (d : dflow) : option dataflow_error :=
  find_errN (fun t l =>
    find_errN (fun k a =>
      if range_ok (df_block d) a then None
      else Some (DErr_range t k (acc_lo a) (acc_hi a))) 0 l) 0 (df_acc d).

(** The write index: per block, the writes [(task, lo, hi)] that start in it. *)
Definition add_write (b : N) (u : N) (m : trie (list (N * N * N))) (a : access)
  : trie (list (N * N * N)) :=
  if acc_write a then
    let k := acc_lo a / b in
    tadd (nkey k) ((u, acc_lo a, acc_hi a) :: get m [] k) m
  else m.

Fixpoint write_index_from (b : N) (u : N) (accs : list (list access))
  (m : trie (list (N * N * N))) : trie (list (N * N * N)) :=
  match accs with
  | [] => m
  | l :: accs' => write_index_from b (N.succ u) accs' (fold_left (add_write b u) l m)
  end.

Definition write_index (d : dflow) : trie (list (N * N * N)) :=
  write_index_from (df_block d) 0 (df_acc d) Leaf.

(** Access [a] of task [t] against one write [(u, lo, hi)]. *)
Definition check_pair (d : dflow) (km : trie N) (wtm sgm : trie (list N)) (pm : trie (N * N))
  (cm : trie (trie (list N))) (t : N) (a : access) (w : N * N * N) : option dataflow_error :=
  let '(u, lo, hi) := w in
  if u =? t then None
  else if (acc_lo a <? hi) && (lo <? acc_hi a) then
    let lo' := N.max lo (acc_lo a) in
    let hi' := N.min hi (acc_hi a) in
    let ku := get km 0 u in
    let kt := get km 0 t in
    if ku <? kt then
      (if ordered wtm sgm pm cm u t then None else Some (DErr_unordered u t lo' hi'))
    else if kt <? ku then
      (if ordered wtm sgm pm cm t u then None else Some (DErr_unordered t u lo' hi'))
    else Some (DErr_race u t lo' hi')
  else None.

Definition check_conflicts (p : cplan) (d : dflow) : option dataflow_error :=
  let wi := write_index d in
  let km := index_map (df_keys d) in
  let wtm := index_map (cp_waits p) in
  let sgm := index_map (cp_signals p) in
  let pm := pos_map (cp_queues p) in
  let cm := chain_map (df_chains d) in
  find_errN (fun t l =>
    first_err (fun a =>
      first_err (check_pair d km wtm sgm pm cm t a)
        (get wi [] (acc_lo a / df_block d))) l) 0 (df_acc d).

Definition check_dataflow (p : cplan) (d : dflow) : option dataflow_error :=
  let n := lengthN (cp_signals p) in
  let nk := lengthN (df_keys d) in
  let na := lengthN (df_acc d) in
  if negb ((nk =? n) && (na =? n)) then Some (DErr_lengths n nk na)
  else if df_block d =? 0 then Some DErr_block
  else match check_ranges d with
       | Some e => Some e
       | None => check_conflicts p d
       end.

(** Checkpoint D from data flow: the counter protocol and scopes
    ([check_checkpoint_d], whose edges may be empty), then the data flow. *)
Inductive d_error : Type :=
| DProto (e : counter_error)
| DFlow (e : dataflow_error).

Definition check_checkpoint_d_flow (p : cplan) (scopes : list N) (wpg : N) (d : dflow)
  : verdict d_error :=
  match check_checkpoint_d p scopes wpg with
  | Reject e => Reject (DProto e)
  | Accept => match check_dataflow p d with None => Accept | Some e => Reject (DFlow e) end
  end.
