(** * Routed slices on C7's two-stage model: when fine gates cannot win (C7r).

    C7 / C8 ([Plow.Collapse]) need every consumer slice to cost the same.  The
    slices of routed experts do not: in one routing some expert tiles are busy
    and the rest idle, so the cost table is unequal and C8 certifies nothing.
    This file states the weaker condition the schedule checks per sampled
    routing ([plow/schedule/routing.py], [latest_gated]).

    Model (C7's with one producer and one consumer stage, any slice counts):
    producer slice [k] finishes at [nth k f 0]; consumer slice [j] (cost
    [nth j c 0]) starts when the producers in its gate [nth j P []] have
    finished; the barrier opens when the last consumer finishes.  Coarse gates
    wait for every producer: the barrier is [maxl f + maxl c].

    C7r: if some costliest consumer slice waits on a latest producer slice,
    fine gates open the barrier exactly when coarse gates do (and they never
    open it later, whatever the gates). *)
From Coq Require Import List Arith Bool Lia.
Import ListNotations.
From Plow Require Import Collapse.

(** The barrier with fine gates: consumer [j] waits for the producers [P j]. *)
Definition fine_barrier (f c : list nat) (P : list (list nat)) : nat :=
  maxl (map (fun cp => maxl (map (fun k => nth k f 0) (snd cp)) + fst cp) (combine c P)).

(** The barrier with coarse gates: every consumer waits for every producer. *)
Definition coarse_barrier (f c : list nat) : nat := maxl f + maxl c.

(** Gates name existing producers, one gate per consumer. *)
Definition gates_in_range (f c : list nat) (P : list (list nat)) : Prop :=
  length P = length c /\ forall p k, In p P -> In k p -> k < length f.

(** The executable test: some consumer of the largest cost has, in its gate,
    a producer of the latest finish. *)
Definition latest_gated (f c : list nat) (P : list (list nat)) : bool :=
  existsb
    (fun cp =>
       Nat.eqb (fst cp) (maxl c)
       && existsb (fun k => Nat.eqb (nth k f 0) (maxl f)) (snd cp))
    (combine c P).
