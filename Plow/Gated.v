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
    open it later, whatever the gates).

    C7r for every routing ([coupled_ok], [Plow.Gatedproof.coupled_c7r_all_routings]):
    a routing is any busy set of atoms [b : nat -> bool] (an atom: one expert over
    one row range of one layer; every top-k routing is one such set, and so is
    every set no router can produce).  Producer slice [k] has one atom
    [nth k keys 0] and costs [lo] when it is idle, [lo + hi] when it is busy;
    consumer slice [j] costs [clo + cw * (its busy tiles)], its tiles' atoms
    being [nth j atoms []].  When every consumer's atoms are keys of producers in
    its gate, every producer's key is some consumer's atom, and busy tiles cost
    more ([0 < cw]) -- or the producers cost the same in every routing
    ([hi = 0]) -- [latest_gated] holds in every routing, so fine gates never open
    the barrier earlier than coarse ones.  Where a clause fails the statement can
    fail: see [tests/schedule/test_moe_counters.py]'s counterexamples. *)
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

(** ** The structured model of a routed edge, for every routing *)

(** Producer slice with key atom [e]: [lo] idle, [lo + hi] busy. *)
Definition producer_cost (b : nat -> bool) (lo hi e : nat) : nat :=
  lo + (if b e then hi else 0).

(** Consumer slice with tiles of atoms [l]: [clo + cw * (busy tiles)]. *)
Definition consumer_cost (b : nat -> bool) (clo cw : nat) (l : list nat) : nat :=
  clo + cw * length (filter b l).

(** The executable condition, decided on the plan's structure (no routing in it):
    one gate per consumer, every gate non-empty and in range; and either the
    producers cost the same in every routing ([hi = 0]) or busy tiles cost
    more, every producer key is an atom of some consumer, and every atom of a
    consumer is the key of a producer in its gate. *)
Definition coupled_ok (keys : list nat) (hi cw : nat) (atoms P : list (list nat)) : bool :=
  (0 <? length atoms) && (length P =? length atoms)
  && forallb (fun p => (0 <? length p) && forallb (fun k => k <? length keys) p) P
  && (Nat.eqb hi 0
      || ((0 <? cw)
          && forallb (fun e => existsb (fun l => existsb (Nat.eqb e) l) atoms) keys
          && forallb
               (fun ap => forallb
                            (fun a => existsb (fun k => Nat.eqb (nth k keys 0) a) (snd ap))
                            (fst ap))
               (combine atoms P))).
