(** * The RAD node of Bari, Hegde and de Veciana (arXiv 2508.01002) as a family of engines

    [examples/papers/bari_rad.sq] exported to Rocq is one engine; this file says which
    engines form its family, for any tile size [bcol] and costs [tlin], [tnl], and what its
    claims say.  The theorems are in [Radproof.v]; an exported program is proved by
    showing that its engine is in the family (pointwise, on every [view]) and instantiating.

    - [capped bcol E]: [tokens cap bcol];
    - [rad_schedule bcol E]: moreover [advance running only (in_mode()) each at most (bcol)]
      and an admission clause over [waiting] [only (in_mode()) while (...) each at most (bcol)],
      any [while],
      with RAD's mode: Decode Mode when [bcol] requests decode or every resident does;
    - [rad_cost bcol tlin tnl E]: [execute (tlin * ceil(batch.tokens / bcol) + tnl * batch.tokens)];
    - [tiled bcol]: the [given] of Assumption 3, [vp == bcol * floor(vp / bcol)], read on a
      request's prefill amount. *)
From Coq Require Import List Bool Arith.
From Plow Require Import Serq.Step.

Definition rad_mode (bcol : nat) (v : view) : bool :=
  (bcol <=? v_decoding v) || (v_decoding v =? v_count v).

Definition capped (bcol : nat) (E : engine) : Prop :=
  exists f, e_cap E = Some f /\ forall v, f v = bcol.

Definition rad_clause (bcol : nat) (cl : option clause) : Prop :=
  exists p w g, cl = Some (mk_clause (Some p) w (Some g))
    /\ (forall v, p v = rad_mode bcol v) /\ (forall v, g v = bcol).

Definition rad_schedule (bcol : nat) (E : engine) : Prop :=
  capped bcol E /\ rad_clause bcol (e_advance E) /\ rad_clause bcol (e_admit E).

Definition rad_cost (bcol tlin tnl : nat) (E : engine) : Prop :=
  forall v, e_execute E v = tlin * ceil_div (v_tokens v) bcol + tnl * v_tokens v.

Definition tiled (bcol : nat) (r : req) : bool := r_vp r =? bcol * (r_vp r / bcol).

(** B1, Theorem 1: at most [bcol] tokens per [tlin + tnl * bcol] µs. *)
Definition token_rate (bcol tlin tnl : nat) (v : view) : Prop :=
  v_served v * (tlin + tnl * bcol) <= bcol * v_now v.

(** B2, optimal GeMM tiling (§4.2). *)
Definition optimal_tiling (bcol : nat) (v : view) : Prop :=
  v_tokens v = bcol \/ v_decoding v = v_count v.

(** B3, at most [bcol] requests decode (Assumption 4). *)
Definition decoder_bound (bcol : nat) (v : view) : Prop := v_decoding v <= bcol.
