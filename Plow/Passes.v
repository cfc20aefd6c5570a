(** * Counter passes (C4, C5, C6): drop counters implied by same-worker order,
    merge counters carrying the same dependency, hoist loads.  Soundness (the hypotheses
    of C1 + C2 survive each pass) is in [Passesproof.v]. *)
From Coq Require Import List NArith Bool.
From Plow Require Import Counters.
Import ListNotations.

Definition with_counters (p : cplan) (waits signals : list (list N)) : cplan :=
  mk_cplan (cp_workers p) (cp_queues p) (cp_thresholds p) waits signals (cp_edges p) (cp_ranks p).

(** ** C4: drop counter [c] — every task stops waiting on and signalling it. *)
Definition drop_counter (c : N) (p : cplan) : cplan :=
  with_counters p (map (remove N.eq_dec c) (cp_waits p)) (map (remove N.eq_dec c) (cp_signals p)).

(** The pass's precondition: every (signaller, waiter) pair of [c] is
    already ordered by one worker's queue. *)
Definition implied_by_order (p : cplan) (c : N) : Prop :=
  forall u t, In c (signals_of p u) -> In c (waits_of p t) -> queue_before p u t.

(** Its executable form, as the pass decides it. *)
Definition ids {A : Type} (l : list A) : list N := map N.of_nat (seq 0 (length l)).

Definition droppable (p : cplan) (c : N) : bool :=
  forallb (fun u => negb (mem c (signals_of p u)) ||
    forallb (fun t => negb (mem c (waits_of p t)) || existsb (before u t) (cp_queues p))
            (ids (cp_waits p)))
    (ids (cp_signals p)).

(** ** C5: merge counter [c2] into [c1] — waiters of [c2] wait on [c1], nobody
    signals [c2] any more. *)
Definition rename_counter (c1 c2 c : N) : N := if N.eqb c c2 then c1 else c.

Definition merge_counters (c1 c2 : N) (p : cplan) : cplan :=
  with_counters p (map (map (rename_counter c1 c2)) (cp_waits p))
                  (map (remove N.eq_dec c2) (cp_signals p)).

(** The pass's precondition: [c1] and [c2] carry the same dependency (the
    same tasks signal them) and have the same threshold. *)
Definition same_dependency (p : cplan) (c1 c2 : N) : Prop :=
  c1 <> c2 /\ (forall t, In c1 (signals_of p t) <-> In c2 (signals_of p t)) /\
  threshold p c1 = threshold p c2.

(** ** C6: hoist a load one place earlier in its queue.

    A load is a task that waits on no counter (its input is resident in
    memory); its output is read by consumers through edges.  Hoisting swaps
    the load [l] with the task [x] just before it in its worker's queue
    [pre ++ x :: l :: post], giving [pre ++ l :: x :: post]; repeated, it
    moves a load any distance earlier.  Precondition: [l] does not depend on
    [x] (no edge [(x, l)]).  Edges, waits and signals are unchanged, so every
    task reads the same producers' values (C1 on the hoisted plan). *)
Definition hoist_load (qs1 : list (list N)) (pre : list N) (x l : N) (post : list N)
           (qs2 : list (list N)) (p : cplan) : cplan :=
  mk_cplan (cp_workers p) (qs1 ++ (pre ++ l :: x :: post) :: qs2) (cp_thresholds p)
           (cp_waits p) (cp_signals p) (cp_edges p) (cp_ranks p).

Definition hoist_ok (qs1 : list (list N)) (pre : list N) (x l : N) (post : list N)
           (qs2 : list (list N)) (p : cplan) : Prop :=
  cp_queues p = qs1 ++ (pre ++ x :: l :: post) :: qs2 /\
  waits_of p l = [] /\ ~ In (x, l) (cp_edges p).

(** The ranking after the hoist: the load takes a slot just below [x]. *)
Definition hoist_rank (rk : N -> N) (x l : N) (y : N) : N :=
  if N.eqb y l then 2 * rk x else 2 * rk y + 1.
