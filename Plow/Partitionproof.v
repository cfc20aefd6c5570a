(** * Soundness of the task and shape checks of checkpoint B ([Partition.v]).

    - [any_in_spec]: the binary-recursive search is an existential over
      [a, a + n).
    - [tile_masked_snoc]: [tile_masked] decodes a tile index row-major, the
      last axis fastest.
    - [chain_partitions]: consecutive ranges from 0 ending at [lim] partition
      [0, lim), each unit run by exactly one task.
    - [check_task_sound], [check_opx_sound]; top: [check_plan_tasks_sound]
      (a conjunct of [Tilesproof.checkpoint_b_sound]). *)
From Coq Require Import NArith List Bool Lia.
From Plow Require Import Loc Tiles Partition.
Import ListNotations.
Local Open Scope N_scope.

(** ** The search over a range *)

Lemma any_pos_spec : forall f p a,
  any_pos f a p = true <-> exists u, a <= u < a + Npos p /\ f u = true.
Proof.
  intros f p; induction p as [q IH|q IH|]; intros a; simpl any_pos.
  - rewrite !orb_true_iff, IH, IH. split.
    + intros [[H|[u [Hu Hf]]]|[u [Hu Hf]]].
      * exists a. split; [lia | exact H].
      * exists u. split; [lia | exact Hf].
      * exists u. split; [lia | exact Hf].
    + intros [u [Hu Hf]].
      destruct (N.eq_dec u a) as [->|Hne]; [left; left; exact Hf|].
      destruct (N.lt_ge_cases u (a + 1 + Npos q)).
      * left; right. exists u. split; [lia | exact Hf].
      * right. exists u. split; [lia | exact Hf].
  - rewrite orb_true_iff, IH, IH. split.
    + intros [[u [Hu Hf]]|[u [Hu Hf]]]; exists u; split; auto; lia.
    + intros [u [Hu Hf]].
      destruct (N.lt_ge_cases u (a + Npos q)).
      * left. exists u. split; [lia | exact Hf].
      * right. exists u. split; [lia | exact Hf].
  - split.
    + intros H. exists a. split; [lia | exact H].
    + intros [u [Hu Hf]]. assert (u = a) by lia. subst. exact Hf.
Qed.

Lemma any_in_spec : forall f a n,
  any_in f a n = true <-> exists u, a <= u < a + n /\ f u = true.
Proof.
  intros f a [|p]; simpl.
  - split; [discriminate | intros [u [Hu _]]; lia].
  - apply any_pos_spec.
Qed.

(** ** Masked tiles, row-major *)

Lemma masked_digits_cons : forall a r k v,
  k < ax_steps a ->
  masked_digits (a :: r) (k + ax_steps a * v) = masked_step a k || masked_digits r v.
Proof.
  intros a r k v Hk. simpl.
  assert (Hs : ax_steps a <> 0) by lia.
  rewrite (N.mul_comm (ax_steps a) v).
  rewrite N.mod_add, N.div_add by exact Hs.
  rewrite N.mod_small by exact Hk. rewrite N.div_small by exact Hk. reflexivity.
Qed.

(** Tile [v * steps + k] of [axes ++ [a]]: step [k] on the last (fastest)
    axis, tile [v] of the others. *)
Lemma tile_masked_snoc : forall axes a k v,
  k < ax_steps a ->
  tile_masked (axes ++ [a]) (k + ax_steps a * v) = masked_step a k || tile_masked axes v.
Proof.
  intros axes a k v Hk. unfold tile_masked. rewrite rev_app_distr. simpl rev at 1.
  apply masked_digits_cons. exact Hk.
Qed.

(** ** Consecutive ranges partition *)

Lemma chain_sound : forall oi cls lim ts next,
  chain oi cls lim next ts = None ->
  (forall t, In t ts -> 0 < pt_count t /\ pt_start t + pt_count t <= lim /\ next <= pt_start t) /\
  (forall u, next <= u < lim ->
     exists i t, nth_error ts i = Some t /\ covers t u /\
       forall j t', nth_error ts j = Some t' -> covers t' u -> j = i).
Proof.
  intros oi cls lim ts. induction ts as [|t r IH]; intros next H; simpl in H.
  - destruct (N.ltb_spec next lim); [discriminate|]. split.
    + intros t [].
    + intros u Hu. lia.
  - destruct (N.eqb_spec (pt_count t) 0); [discriminate|].
    destruct (N.ltb_spec lim (pt_start t + pt_count t)); [discriminate|].
    destruct (N.ltb_spec (pt_start t) next); [discriminate|].
    destruct (N.ltb_spec next (pt_start t)); [discriminate|].
    assert (Hs : pt_start t = next) by lia.
    destruct (IH _ H) as [Hall Hcov]. split.
    + intros t' [<-|Hin]; [lia|].
      destruct (Hall t' Hin) as (? & ? & ?). lia.
    + intros u Hu.
      destruct (N.lt_ge_cases u (pt_start t + pt_count t)) as [Hlt|Hge].
      * exists O, t. split; [reflexivity|]. split; [unfold covers; lia|].
        intros [|j] t' Hj Hc; [reflexivity|]. exfalso.
        simpl in Hj. apply nth_error_In in Hj.
        destruct (Hall t' Hj) as (_ & _ & Hst). unfold covers in Hc. lia.
      * destruct (Hcov u ltac:(lia)) as [i [t1 [Hi [Hc Huniq]]]].
        exists (S i), t1. split; [exact Hi|]. split; [exact Hc|].
        intros [|j] t' Hj Hc'.
        -- exfalso. simpl in Hj. inversion Hj; subst. unfold covers in Hc'. lia.
        -- simpl in Hj. f_equal. eapply Huniq; eauto.
Qed.

Theorem chain_partitions : forall oi cls lim ts,
  chain oi cls lim 0 ts = None -> partitions lim ts.
Proof.
  intros oi cls lim ts H. destruct (chain_sound _ _ _ _ _ H) as [Hall Hcov]. split.
  - intros t Hin. destruct (Hall t Hin) as (? & ? & _). auto.
  - intros u Hu. apply Hcov. lia.
Qed.

(** ** One task, one op *)

Lemma first_some_sound : forall {A} (f : A -> option tile_error) l,
  first_some f l = None -> forall x, In x l -> f x = None.
Proof.
  intros A f l; induction l as [|y l IH]; simpl; intros H x Hin; [contradiction|].
  destruct (f y) eqn:E; [discriminate|].
  destruct Hin as [<-|Hin]; auto.
Qed.

Lemma count_n_length : forall {A} (l : list A),
  count_n l = N.of_nat (length l).
Proof.
  intros A l. unfold count_n.
  assert (G : forall k, fold_left (fun n _ => N.succ n) l k = k + N.of_nat (length l)).
  { induction l as [|x l IH]; intros k; simpl; [lia|]. rewrite IH. lia. }
  rewrite G. lia.
Qed.

Lemma check_extents_sound : forall oi l es ai,
  length l = length es -> check_extents oi ai l es = None -> map ax_extent l = es.
Proof.
  intros oi l; induction l as [|a l IH]; intros es ai Hl H; destruct es as [|e es];
    simpl in *; try discriminate; auto.
  destruct (N.eqb_spec (ax_extent a) e) as [He|]; [|discriminate].
  rewrite He. f_equal. eapply IH; [injection Hl; auto | exact H].
Qed.

Lemma overhangs_iff : forall axes t,
  any_in (masked_digits (rev axes)) (pt_start t) (pt_count t) = true <-> overhangs axes t.
Proof.
  intros axes t. rewrite any_in_spec. reflexivity.
Qed.

Lemma flag_eqb : forall fl axes t,
  Bool.eqb fl (any_in (masked_digits (rev axes)) (pt_start t) (pt_count t)) = true ->
  (fl = true <-> overhangs axes t).
Proof.
  intros fl axes t H. apply Bool.eqb_prop in H. rewrite H. apply overhangs_iff.
Qed.

Theorem check_task_sound : forall o x code oi t,
  ox_opcode x = code ->
  check_task (rev (op_axes o)) (ox_kind x) code oi (tiles_of o) t = None ->
  task_ok o x t.
Proof.
  intros o x code oi t Hc H. unfold check_task, task_ok in *.
  destruct (classify t).
  - destruct (N.eqb_spec (pt_opcode t) code); simpl in H; [|discriminate].
    destruct (Bool.eqb _ _) eqn:E; simpl in H; [|discriminate].
    split; [congruence | apply flag_eqb; exact E].
  - destruct (merge_opcode_ok (ox_kind x) code (pt_opcode t)) eqn:E; simpl in H;
      [|discriminate].
    destruct (flag_masked (pt_flags t)); [discriminate|].
    subst. auto.
  - destruct (N.eqb_spec (pt_count t) 0); [discriminate|].
    destruct (N.ltb_spec (tiles_of o) (pt_start t + pt_count t)); [discriminate|].
    destruct (flag_accumulate (pt_flags t)); [discriminate|].
    destruct (Bool.eqb _ _) eqn:E; simpl in H; [|discriminate].
    repeat split; try lia; try reflexivity; apply (flag_eqb _ _ _ E).
Qed.

Theorem check_opx_sound : forall oi o x,
  check_opx oi o x = None -> op_tasks_ok o x.
Proof.
  intros oi o x H. unfold check_opx in H.
  destruct (opcode_of_kind (ox_kind x)) as [code|] eqn:Ek; [|discriminate].
  destruct (N.eqb_spec (ox_opcode x) code) as [Hc|]; simpl in H; [|discriminate].
  destruct (expected_extents x) as [es|] eqn:Ee; [|discriminate].
  destruct (N.eqb_spec (count_n (op_axes o)) (count_n es)) as [Hn|]; simpl in H;
    [|discriminate].
  destruct (check_extents oi 0 (op_axes o) es) eqn:Ex; [discriminate|].
  destruct (chain oi 0 (tiles_of o) 0 (filter is_compute (ox_tasks x))) eqn:C1;
    [discriminate|].
  destruct (chain oi 1 (ox_merge_units x) 0 (filter is_merge (ox_tasks x))) eqn:C2;
    [discriminate|].
  rewrite !count_n_length in Hn.
  apply check_extents_sound in Ex; [|lia].
  unfold op_tasks_ok. split; [congruence|]. split; [congruence|].
  split; [eapply chain_partitions; exact C1|].
  split; [eapply chain_partitions; exact C2|].
  apply Forall_forall. intros t Hin.
  eapply check_task_sound; [exact Hc|]. eapply first_some_sound; eauto.
Qed.

Lemma check_opxs_sound : forall os xs oi,
  length os = length xs -> check_opxs oi os xs = None -> Forall2 op_tasks_ok os xs.
Proof.
  induction os as [|o os IH]; intros [|x xs] oi Hl H; simpl in *; try discriminate;
    [constructor|].
  destruct (check_opx oi o x) eqn:E; [discriminate|].
  constructor; [eapply check_opx_sound; exact E | eapply IH; eauto].
Qed.

(** Accepted: one entry per op, and every op satisfies [op_tasks_ok]:
    opcode and extents per its kind's rule, compute tasks partitioning its
    tiles, merge tasks its merge units, loads within the tiles, every task
    packet's opcode and [MASKED]/[ACCUMULATE] flags as its tiles say. *)
Theorem check_plan_tasks_sound : forall p xs,
  check_plan_tasks p xs = Accept -> Forall2 op_tasks_ok (pl_ops p) xs.
Proof.
  intros p xs H. unfold check_plan_tasks in H.
  destruct (N.eqb_spec (count_n (pl_ops p)) (count_n xs)) as [Hn|]; simpl in H;
    [|discriminate].
  destruct (check_opxs 0 (pl_ops p) xs) eqn:E; [discriminate|].
  rewrite !count_n_length in Hn.
  eapply check_opxs_sound; [lia | exact E].
Qed.
