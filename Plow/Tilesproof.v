(** * Tiles and cost: soundness of checkpoint B (THEOREMS.md T1–T6).

    - T1 [axis_covered_of_bounds], [op_covered_of_axes], [step_unique],
      [tile_unique], [sum_masked_all] (exactly-once), [router_8_under_16].
    - T2 [check_axis_sound], [check_axis_complete], [check_ops_sound],
      [check_ops_complete].
    - T3 [arithmetic_le_padded_work], [charged_ge_arithmetic],
      [charged_comparison_sound].
    - T4 [makespan_ge_bytes], [makespan_ge_flops] (in [Bounds.v]).
    - T5 [check_bounds_reject_sound], [check_tiling_plan_reject_sound].
    - T6 [decode_step_reads_weights], [decode_step_time_ge_weights],
      [decode_per_token_ge_weights] (in [Bounds.v]).
    - The tiling part: [check_tiling_plan_sound].  The tasks and shapes
      ([Partition.v]): [Partitionproof.check_plan_tasks_sound].
    - Top: [checkpoint_b_sound], the two together. *)
From Coq Require Import NArith List Bool Lia.
From Plow Require Import Loc Tiles Bounds Partition Partitionproof.
Import ListNotations.
Local Open Scope N_scope.

(** ** T1: coverage of one axis *)

Lemma axis_covered_of_bounds : forall a,
  0 < ax_tile a -> ax_extent a <= ax_steps a * ax_tile a -> axis_covered a.
Proof.
  intros [e t s] Ht He i Hi; simpl in *.
  exists (i / t). assert (Ht0 : t <> 0) by lia.
  pose proof (N.mul_div_le i t Ht0) as Hle.
  pose proof (N.div_mod i t Ht0) as Hdm.
  pose proof (N.mod_lt i t Ht0) as Hmod.
  split.
  - apply N.div_lt_upper_bound; [exact Ht0 | ]. rewrite N.mul_comm. lia.
  - unfold step_covers. rewrite (N.mul_comm (i / t) t). lia.
Qed.

Lemma axis_no_empty_of_bounds : forall a,
  (0 < ax_steps a -> (ax_steps a - 1) * ax_tile a < ax_extent a) ->
  axis_no_empty_step a.
Proof.
  intros [e t s] H k Hk; simpl in *.
  assert (Hs : 0 < s) by lia. specialize (H Hs).
  assert (k * t <= (s - 1) * t) by (apply N.mul_le_mono_r; lia). lia.
Qed.

(** Coverage forces enough steps (the completeness half of T2). *)
Lemma bounds_of_axis_covered : forall a,
  axis_covered a -> ax_extent a <= ax_steps a * ax_tile a.
Proof.
  intros [e t s] Hc; simpl in *. unfold axis_covered in Hc; simpl in Hc.
  destruct (N.eq_dec e 0) as [->|He]; [lia|].
  destruct (Hc (e - 1)) as [k [Hk [H1 H2]]]; [lia|].
  assert ((k + 1) * t <= s * t) by (apply N.mul_le_mono_r; lia).
  rewrite N.mul_add_distr_r, N.mul_1_l in H. lia.
Qed.

Lemma last_step_of_no_empty : forall a,
  axis_no_empty_step a -> 0 < ax_steps a ->
  (ax_steps a - 1) * ax_tile a < ax_extent a.
Proof. intros a H Hs. apply H. lia. Qed.

(** Exactly once: a covered index is covered by a single step. *)
Lemma step_unique : forall t k1 k2 i,
  0 < t -> step_covers t k1 i -> step_covers t k2 i -> k1 = k2.
Proof.
  unfold step_covers; intros t k1 k2 i Ht [H1 H2] [H3 H4].
  destruct (N.lt_trichotomy k1 k2) as [Hlt|[Heq|Hlt]]; auto.
  - assert ((k1 + 1) * t <= k2 * t) by (apply N.mul_le_mono_r; lia).
    rewrite N.mul_add_distr_r, N.mul_1_l in H. lia.
  - assert ((k2 + 1) * t <= k1 * t) by (apply N.mul_le_mono_r; lia).
    rewrite N.mul_add_distr_r, N.mul_1_l in H. lia.
Qed.

(** Exactly once, counted: the masked widths of the steps add up to the
    extent (no index counted twice, none missed). *)
Lemma sum_masked_min : forall t e n,
  sum_masked t e n = N.min (N.of_nat n * t) e.
Proof.
  intros t e n; induction n as [|n IH]; simpl sum_masked.
  - simpl. destruct e; reflexivity.
  - rewrite IH. unfold masked_width.
    rewrite Nat2N.inj_succ, N.mul_succ_l.
    set (x := N.of_nat n * t).
    destruct (N.min_spec x e) as [[Hx ->]|[Hx ->]];
    destruct (N.min_spec t (e - x)) as [[Hy ->]|[Hy ->]];
    destruct (N.min_spec (x + t) e) as [[Hz ->]|[Hz ->]]; lia.
Qed.

Theorem sum_masked_all : forall a,
  ax_extent a <= ax_steps a * ax_tile a ->
  sum_masked (ax_tile a) (ax_extent a) (N.to_nat (ax_steps a)) = ax_extent a.
Proof.
  intros a H. rewrite sum_masked_min, N2Nat.id. apply N.min_r. exact H.
Qed.

(** ** T1: coverage of a whole op (all axes) *)

Theorem op_covered_of_axes : forall axes,
  Forall axis_covered axes -> op_covered axes.
Proof.
  induction axes as [|a r IH]; intros Hall idx Hin.
  - destruct idx; [exists []; exact I | contradiction].
  - destruct idx as [|i is]; [contradiction|]. destruct Hin as [Hi Hr].
    inversion Hall; subst.
    destruct (H1 i Hi) as [k [Hk Hc]].
    destruct (IH H2 is Hr) as [ks Hks].
    exists (k :: ks). simpl. auto.
Qed.

Theorem tile_unique : forall axes ks1 ks2 idx,
  Forall (fun a => 0 < ax_tile a) axes ->
  tile_covers axes ks1 idx -> tile_covers axes ks2 idx -> ks1 = ks2.
Proof.
  induction axes as [|a r IH]; intros ks1 ks2 idx Hpos H1 H2.
  - destruct ks1, ks2, idx; simpl in *; tauto.
  - destruct ks1 as [|k1 ks1], ks2 as [|k2 ks2], idx as [|i is];
      simpl in *; try tauto.
    inversion Hpos; subst.
    destruct H1 as [_ [Hc1 H1]], H2 as [_ [Hc2 H2]].
    f_equal; [eapply step_unique; eauto | eapply IH; eauto].
Qed.

(** ** T2: the executable check is sound and complete *)

Lemma check_axis_accept_iff : forall min oi ai a,
  check_axis min oi ai a = Accept <->
  (0 < ax_tile a /\ min <= ax_tile a /\ ax_extent a <= ax_steps a * ax_tile a /\
   (0 < ax_steps a -> (ax_steps a - 1) * ax_tile a < ax_extent a)).
Proof.
  intros min oi ai [e t s]; unfold check_axis; simpl.
  destruct (N.eqb_spec t 0); [split; [discriminate | lia]|].
  destruct (N.ltb_spec t min); [split; [discriminate | lia]|].
  destruct (N.ltb_spec (s * t) e); [split; [discriminate | lia]|].
  destruct (N.ltb_spec 0 s); simpl.
  - destruct (N.leb_spec e ((s - 1) * t)); simpl;
      [split; [discriminate | lia] | split; [lia | auto]].
  - split; [intros _; lia | auto].
Qed.

Theorem check_axis_sound : forall min oi ai a,
  check_axis min oi ai a = Accept -> axis_ok min a.
Proof.
  intros min oi ai a H. apply check_axis_accept_iff in H.
  destruct H as [Ht [Hm [Hc Hl]]].
  repeat split; auto.
  - apply axis_covered_of_bounds; auto.
  - apply axis_no_empty_of_bounds; auto.
Qed.

Theorem check_axis_complete : forall min oi ai a,
  axis_ok min a -> check_axis min oi ai a = Accept.
Proof.
  intros min oi ai a [Ht [Hm [Hc Hn]]]. apply check_axis_accept_iff.
  repeat split; auto.
  - apply bounds_of_axis_covered; auto.
  - intros Hs. apply last_step_of_no_empty; auto.
Qed.

Lemma check_axes_sound : forall min oi l ai,
  check_axes min oi ai l = Accept -> Forall (axis_ok min) l.
Proof.
  induction l as [|a r IH]; intros ai H; simpl in *; [constructor|].
  destruct (check_axis min oi ai a) eqn:E; [|discriminate].
  constructor; [eapply check_axis_sound; eauto | eapply IH; eauto].
Qed.

Lemma check_axes_complete : forall min oi l ai,
  Forall (axis_ok min) l -> check_axes min oi ai l = Accept.
Proof.
  induction l as [|a r IH]; intros ai H; simpl; [reflexivity|].
  inversion H; subst. rewrite (check_axis_complete min oi ai a H2). auto.
Qed.

(** What a checked op satisfies. *)
Definition op_ok (min : N) (o : op) : Prop :=
  Forall (axis_ok min) (op_axes o) /\
  op_flops o = arithmetic o /\
  arithmetic o <= op_charged o /\
  padded_work o <= op_charged o.

Lemma check_op_accept_iff : forall min oi o,
  check_op min oi o = Accept <-> op_ok min o.
Proof.
  intros min oi o; unfold check_op, op_ok.
  destruct (check_axes min oi 0 (op_axes o)) eqn:E.
  - pose proof (check_axes_sound _ _ _ _ E) as Hax.
    destruct (N.eqb_spec (op_flops o) (arithmetic o)); simpl;
      [| split; [discriminate | tauto]].
    destruct (N.ltb_spec (op_charged o) (arithmetic o));
      [split; [discriminate | lia]|].
    destruct (N.ltb_spec (op_charged o) (padded_work o));
      [split; [discriminate | lia]|].
    tauto.
  - split; [discriminate|]. intros [Hax _].
    rewrite (check_axes_complete min oi _ 0 Hax) in E. discriminate.
Qed.

Theorem check_ops_sound : forall min l oi,
  check_ops min oi l = Accept -> Forall (op_ok min) l.
Proof.
  induction l as [|o r IH]; intros oi H; simpl in *; [constructor|].
  destruct (check_op min oi o) eqn:E; [|discriminate].
  constructor; [apply (check_op_accept_iff min oi o); auto | eapply IH; eauto].
Qed.

Theorem check_ops_complete : forall min l oi,
  Forall (op_ok min) l -> check_ops min oi l = Accept.
Proof.
  induction l as [|o r IH]; intros oi H; simpl; [reflexivity|].
  inversion H; subst. rewrite (proj2 (check_op_accept_iff min oi o) H2). auto.
Qed.

(** T1 for a checked op, assembled: every point is covered, by exactly one
    tile, and no step of any axis is empty. *)
Theorem op_ok_covered : forall min o,
  op_ok min o ->
  op_covered (op_axes o) /\
  (forall idx ks1 ks2, tile_covers (op_axes o) ks1 idx ->
     tile_covers (op_axes o) ks2 idx -> ks1 = ks2) /\
  Forall axis_no_empty_step (op_axes o).
Proof.
  intros min o [Hax _]. split; [|split].
  - apply op_covered_of_axes. eapply Forall_impl; [|exact Hax].
    intros a (_ & _ & Hc & _); exact Hc.
  - intros idx ks1 ks2. apply tile_unique.
    eapply Forall_impl; [|exact Hax]. intros a (Ht & _); exact Ht.
  - eapply Forall_impl; [|exact Hax]. intros a (_ & _ & _ & Hn); exact Hn.
Qed.

(** The router case: 8 output columns under a minimum tile width of 16 —
    one masked tile of width 16 covers the axis, with 8 lanes of padding. *)
Definition router_axis : axis := mk_axis 8 16 1.

Theorem router_8_under_16 :
  check_axis 16 0 0 router_axis = Accept /\
  axis_ok 16 router_axis /\
  (forall i, i < 8 -> step_covers 16 0 i) /\
  masked_width 16 8 0 = 8.
Proof.
  split; [reflexivity|]. split; [apply (check_axis_sound 16 0 0); reflexivity|].
  split; [unfold step_covers; intros; lia | reflexivity].
Qed.

(** ** T3: charged cost >= arithmetic *)

Lemma prodN_le : forall (f g : axis -> N) l,
  Forall (fun a => f a <= g a) l -> prodN (map f l) <= prodN (map g l).
Proof.
  induction l as [|a r IH]; intros H; simpl; [lia|].
  inversion H; subst. apply N.mul_le_mono; auto.
Qed.

Theorem arithmetic_le_padded_work : forall o,
  Forall (fun a => ax_extent a <= ax_steps a * ax_tile a) (op_axes o) ->
  arithmetic o <= padded_work o.
Proof.
  intros o H. unfold arithmetic, padded_work. apply N.mul_le_mono_l.
  apply prodN_le. exact H.
Qed.

Theorem charged_ge_arithmetic : forall min o,
  op_ok min o -> arithmetic o <= padded_work o <= op_charged o.
Proof.
  intros min o (Hax & _ & _ & Hp). split; auto.
  apply arithmetic_le_padded_work. eapply Forall_impl; [|exact Hax].
  intros a Ha. apply bounds_of_axis_covered. apply Ha.
Qed.

(** Comparisons of charged costs are sound: if tiling [o1] is charged no
    more than [o2], then the work [o1] really does (padding included) is no
    more than [o2]'s charge, and its true arithmetic no more either. *)
Theorem charged_comparison_sound : forall min o1 o2,
  op_ok min o1 -> op_ok min o2 -> op_charged o1 <= op_charged o2 ->
  padded_work o1 <= op_charged o2 /\ arithmetic o1 <= op_charged o2 /\
  arithmetic o2 <= op_charged o2.
Proof.
  intros min o1 o2 H1 H2 Hle.
  pose proof (charged_ge_arithmetic _ _ H1). pose proof (charged_ge_arithmetic _ _ H2).
  lia.
Qed.

(** ** T5: the bounds check, and its contrapositive as rejection *)

Lemma check_bounds_accept : forall p,
  check_bounds p = Accept ->
  pl_weight_bytes p <= plan_bytes p /\
  plan_bytes p * ns_per_s <= pl_budget_ns p * tg_bandwidth (pl_target p) /\
  plan_flops p * ns_per_s <= pl_budget_ns p * tg_peak (pl_target p).
Proof.
  intros p; unfold check_bounds.
  destruct (N.ltb_spec (plan_bytes p) (pl_weight_bytes p)); [discriminate|].
  destruct (N.ltb_spec (pl_budget_ns p * tg_bandwidth (pl_target p)) (plan_bytes p * ns_per_s));
    [discriminate|].
  destruct (N.ltb_spec (pl_budget_ns p * tg_peak (pl_target p)) (plan_flops p * ns_per_s));
    [discriminate|].
  intros _; lia.
Qed.

(** Rejections of the bounds check carry their reason: which resource, the
    total that overflows it, and the op that dominates it. *)
Lemma check_bounds_reject : forall p e,
  check_bounds p = Reject e ->
  (e = E_weights_undercounted (plan_bytes p) (pl_weight_bytes p) /\
   plan_bytes p < pl_weight_bytes p) \/
  (e = E_bandwidth (argmax op_bytes (pl_ops p)) (plan_bytes p) /\
   pl_budget_ns p * tg_bandwidth (pl_target p) < plan_bytes p * ns_per_s) \/
  (e = E_compute (argmax op_flops (pl_ops p)) (plan_flops p) /\
   pl_budget_ns p * tg_peak (pl_target p) < plan_flops p * ns_per_s).
Proof.
  intros p e; unfold check_bounds.
  destruct (N.ltb_spec (plan_bytes p) (pl_weight_bytes p));
    [intros He; inversion He; subst; auto|].
  destruct (N.ltb_spec (pl_budget_ns p * tg_bandwidth (pl_target p)) (plan_bytes p * ns_per_s));
    [intros He; inversion He; subst; auto|].
  destruct (N.ltb_spec (pl_budget_ns p * tg_peak (pl_target p)) (plan_flops p * ns_per_s));
    [intros He; inversion He; subst; auto|].
  discriminate.
Qed.

Definition bound_error (e : tile_error) : bool :=
  match e with
  | E_weights_undercounted _ _ | E_bandwidth _ _ | E_compute _ _ => true
  | _ => false
  end.

Lemma check_ops_not_bound_error : forall min l oi e,
  check_ops min oi l = Reject e -> bound_error e = false.
Proof.
  induction l as [|o r IH]; intros oi e H; simpl in H; [discriminate|].
  destruct (check_op min oi o) eqn:E; [eapply IH; eauto|].
  inversion H; subst. clear H. unfold check_op in E.
  destruct (check_axes min oi 0 (op_axes o)) eqn:Ea.
  - destruct (negb _); [inversion E; reflexivity|].
    destruct (_ <? _); [inversion E; reflexivity|].
    destruct (_ <? _); inversion E; reflexivity.
  - inversion E; subst. clear E. revert Ea. generalize 0.
    induction (op_axes o) as [|a l IHl]; intros ai Ea; simpl in Ea; [discriminate|].
    destruct (check_axis min oi ai a) eqn:Eb; [eapply IHl; eauto|].
    inversion Ea; subst. unfold check_axis in Eb.
    repeat match goal with
    | H : context [if ?c then _ else _] |- _ => destruct c
    end; inversion Eb; reflexivity.
Qed.

Lemma check_tiling_plan_bound_error : forall p e,
  check_tiling_plan p = Reject e -> bound_error e = true -> check_bounds p = Reject e.
Proof.
  intros p e H Hb. unfold check_tiling_plan in H.
  destruct (check_ops (tg_min_tile (pl_target p)) 0 (pl_ops p)) eqn:E; auto.
  inversion H; subst. apply check_ops_not_bound_error in E. congruence.
Qed.

(** T5: a plan rejected for bandwidth or compute cannot be run within its
    budget by any schedule on the target: every schedule that performs it
    has a makespan above the budget. *)
Theorem bound_reject_sound : forall p peaks s,
  (pl_budget_ns p * tg_bandwidth (pl_target p) < plan_bytes p * ns_per_s \/
   pl_budget_ns p * tg_peak (pl_target p) < plan_flops p * ns_per_s) ->
  runs_on (pl_target p) peaks s -> performs s p ->
  pl_budget_ns p < makespan s.
Proof.
  intros p peaks s Hb Hr Hp.
  destruct (makespan_lower_bounds p peaks s Hr Hp) as [B F].
  destruct (N.lt_ge_cases (pl_budget_ns p) (makespan s)) as [|Hle]; auto.
  exfalso. destruct Hb as [Hb|Hb].
  - assert (makespan s * tg_bandwidth (pl_target p) <=
            pl_budget_ns p * tg_bandwidth (pl_target p)) by (apply N.mul_le_mono_r; auto).
    lia.
  - assert (makespan s * tg_peak (pl_target p) <=
            pl_budget_ns p * tg_peak (pl_target p)) by (apply N.mul_le_mono_r; auto).
    lia.
Qed.

Theorem check_tiling_plan_reject_sound : forall p i x peaks s,
  (check_tiling_plan p = Reject (E_bandwidth i x) \/
   check_tiling_plan p = Reject (E_compute i x)) ->
  runs_on (pl_target p) peaks s -> performs s p ->
  pl_budget_ns p < makespan s.
Proof.
  intros p i x peaks s H. apply bound_reject_sound.
  assert (Hb : check_bounds p = Reject (E_bandwidth i x) \/
               check_bounds p = Reject (E_compute i x)).
  { destruct H as [H|H]; [left|right]; apply check_tiling_plan_bound_error; auto. }
  destruct Hb as [Hb|Hb]; apply check_bounds_reject in Hb;
    destruct Hb as [[He _]|[[He H1]|[He H1]]]; try discriminate; auto.
Qed.

(** A plan rejected for undercounting its weights misstates its traffic:
    no decode step that reads all weights is accounted by it (T6). *)
Theorem weights_reject_sound : forall p b w s trace,
  check_tiling_plan p = Reject (E_weights_undercounted b w) ->
  reads_all_weights (pl_weight_bytes p) trace ->
  N.of_nat (length trace) <= sched_bytes s ->
  sched_bytes s <> plan_bytes p.
Proof.
  intros p b w s trace H Hr Ht Heq.
  apply check_tiling_plan_bound_error in H; [|reflexivity].
  apply check_bounds_reject in H.
  destruct H as [[_ Hlt]|[[He _]|[He _]]]; try discriminate.
  pose proof (plan_bytes_ge_weights p s _ _ Hr Ht Heq). lia.
Qed.

(** ** Checkpoint B *)

(** What an accepted tiling establishes, op by op (T1, T2, T3) and for the
    plan (T4/T5 bounds within the budget, T6 weight traffic accounted). *)
Definition tiling_plan_ok (p : plan) : Prop :=
  let min := tg_min_tile (pl_target p) in
  Forall (fun o =>
    (* T1/T2: every axis legally tiled, every point covered exactly once *)
    Forall (axis_ok min) (op_axes o) /\
    op_covered (op_axes o) /\
    (forall idx ks1 ks2, tile_covers (op_axes o) ks1 idx ->
       tile_covers (op_axes o) ks2 idx -> ks1 = ks2) /\
    Forall (fun a => sum_masked (ax_tile a) (ax_extent a) (N.to_nat (ax_steps a))
                     = ax_extent a) (op_axes o) /\
    (* T3: declared flops are the arithmetic; charged >= padded >= arithmetic *)
    op_flops o = arithmetic o /\
    arithmetic o <= padded_work o <= op_charged o) (pl_ops p) /\
  (* T6: the step's bytes account for every weight byte *)
  pl_weight_bytes p <= plan_bytes p /\
  (* T4/T5: the lower bounds fit the budget *)
  plan_bytes p * ns_per_s <= pl_budget_ns p * tg_bandwidth (pl_target p) /\
  plan_flops p * ns_per_s <= pl_budget_ns p * tg_peak (pl_target p).

Theorem check_tiling_plan_sound : forall p,
  check_tiling_plan p = Accept -> tiling_plan_ok p.
Proof.
  intros p H. unfold tiling_plan_ok. unfold check_tiling_plan in H.
  destruct (check_ops (tg_min_tile (pl_target p)) 0 (pl_ops p)) eqn:E; [|discriminate].
  apply check_ops_sound in E. apply check_bounds_accept in H.
  split; [|exact H].
  eapply Forall_impl; [|exact E]. intros o Ho.
  destruct (op_ok_covered _ _ Ho) as (Hc & Hu & _).
  pose proof (charged_ge_arithmetic _ _ Ho) as Hcost.
  destruct Ho as (Hax & Hfl & _).
  repeat split; auto; try apply Hcost.
  eapply Forall_impl; [|exact Hax]. intros a Ha. apply sum_masked_all.
  apply bounds_of_axis_covered. apply Ha.
Qed.

(** Checkpoint B, the whole: the tiling ([tiling_plan_ok]) and, when the
    payload lists the tasks (always, from a bundle), the task partition,
    extents = shapes, opcodes and flags of every op ([op_tasks_ok]). *)
Theorem checkpoint_b_sound : forall p xs,
  check_checkpoint_b p xs = Accept ->
  tiling_plan_ok p /\
  (forall l, xs = Some l -> Forall2 op_tasks_ok (pl_ops p) l).
Proof.
  intros p xs H. unfold check_checkpoint_b in H.
  destruct (check_tiling_plan p) eqn:E; [|discriminate].
  split; [apply check_tiling_plan_sound; exact E|].
  intros l ->. apply check_plan_tasks_sound. exact H.
Qed.
