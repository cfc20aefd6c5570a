(** * Theorems about the RAD family ([Rad.v]), for every path

    - [rad_token_rate] (B1, Theorem 1 of Bari et al.): with [tokens cap bcol] and RAD's
      cost, on every arrival list (any arrival times, any prefill and decode amounts, in
      any order) every iteration has [served * (tlin + tnl * bcol) <= bcol * now].  It
      needs no schedule: any advance or admission clause under that cap and cost.
    - [rad_batch_tiled] (B2 and B3): with RAD's schedule, on every arrival list whose
      prefill amounts are multiples of [bcol] (the [given] [tiled]), every iteration has
      [tokens == bcol || decoders == residents] and [decoders <= bcol].
    Both hold for every [bcol > 0], [tlin] and [tnl]; [serq prove] instantiates them.

    The proof of B2/B3 is [rad_form_batch]: under the invariant (waiting and prefilling
    amounts multiples of [bcol], prefilling ones positive, at most [bcol] decoders) a RAD
    batch is one of four: Decode Mode, [min(bcol, |D|)] decoders and nothing else;
    Prefill Mode, one tile of the oldest prefill; Prefill Mode, one tile of the admitted
    head of [waiting]; or empty (no iteration).  So at most one request starts decoding
    per iteration, and only when fewer than [bcol] decode. *)
From Coq Require Import List Bool Arith Lia.
From Plow Require Import Serq.Step Serq.Stepproof Serq.Rad.
Import ListNotations.

Lemma mod_pos_ge (a b : nat) : 0 < b -> a mod b = 0 -> 0 < a -> b <= a.
Proof.
  intros Hb Hm Ha. destruct (Nat.le_gt_cases b a) as [H|H]; [exact H|].
  rewrite Nat.mod_small in Hm by exact H. lia.
Qed.

Lemma mod_sub (a b : nat) : 0 < b -> a mod b = 0 -> (a - b) mod b = 0.
Proof.
  intros Hb Hm. destruct (Nat.le_gt_cases b a) as [H|H].
  - rewrite <- (Nat.mod_add (a - b) 1 b) by lia. replace (a - b + 1 * b) with a by lia. exact Hm.
  - replace (a - b) with 0 by lia. apply Nat.mod_0_l. lia.
Qed.

Lemma rad_form_batch (bcol : nat) (E : engine) (st : state) :
  0 < bcol -> rad_schedule bcol E ->
  Forall (fun j => j_pre j mod bcol = 0) (s_waiting st) ->
  Forall (fun j => j_pre j mod bcol = 0 /\ 0 < j_pre j) (s_prefilling st) ->
  let m := rad_mode bcol (view_of st (length (s_waiting st)) 0 0) in
  let nd := Nat.min bcol (length (s_decoding st)) in
  (m = true /\ form_batch E st = mk_batch (Some true) nd [] [] [] 0 nd nd)
  \/ (m = false /\ s_prefilling st <> []
      /\ form_batch E st = mk_batch (Some false) 0 [bcol] [] [] 0 bcol 1)
  \/ (m = false /\ exists h, In h (s_waiting st)
      /\ form_batch E st = mk_batch (Some false) 0 [] [(h, bcol)] [] 1 bcol 1)
  \/ b_tokens (form_batch E st) = 0.
Proof.
  intros Hb [[f [Hc Hf]] [[p [w [g [Ha [Hp Hg]]]]] [p' [w' [g' [Hd [Hp' Hg']]]]]]] HW HP m nd.
  unfold form_batch, serve_decoders, advance_prefills. rewrite Hc, Ha, Hd.
  cbn [bound clause_mode c_only c_each c_while]. rewrite !Hf, !Hp, !Hg, !Hp'.
  fold m. assert (Hm : rad_mode bcol (view_of st (length (s_waiting st)) 0 0) = m) by reflexivity.
  clearbody m.
  assert (Hx : xpos (Some bcol) = true) by (unfold xpos; apply Nat.leb_le; lia).
  cbn [room]. rewrite Nat.sub_0_r, Hx. cbn [xmin andb].
  assert (Hnd : (if negb (length (s_decoding st) =? 0) then Nat.min bcol (length (s_decoding st)) else 0) = nd).
  { subst nd. destruct (length (s_decoding st) =? 0) eqn:H0; [|reflexivity].
    apply Nat.eqb_eq in H0. rewrite H0. simpl. lia. }
  destruct m; cbn [not_mode Bool.eqb negb]; rewrite ?andb_true_r, ?andb_false_r.
  - (* Decode Mode *)
    left. split; [reflexivity|]. rewrite Hnd. cbn iota zeta.
    destruct (negb (length (s_waiting st) =? 0) && xlt nd (Some bcol)) eqn:Hw; [|cbn [length]; rewrite Nat.add_0_r; reflexivity].
    exfalso. apply andb_true_iff in Hw as [Hw Hl]. cbn [xlt] in Hl.
    apply Nat.ltb_lt in Hl. apply negb_true_iff, Nat.eqb_neq in Hw.
    unfold rad_mode, view_of, residents in Hm; cbn [v_decoding v_count] in Hm.
    apply orb_true_iff in Hm as [Hm|Hm]; [apply Nat.leb_le in Hm|apply Nat.eqb_eq in Hm]; lia.
  - (* Prefill Mode *)
    right. destruct (s_prefilling st) as [|p0 ps] eqn:HPe.
    + (* no prefill running: the head of waiting, if it is admitted, takes a tile *)
      right. cbn [length Nat.eqb negb andb]. cbn iota zeta.
      destruct (s_waiting st) as [|h ws] eqn:HWe; [right; reflexivity|].
      cbn [length Nat.eqb negb andb xlt]. replace (0 <? bcol) with true
        by (symmetry; apply Nat.ltb_lt; lia).
      rewrite Hg'. cbn [admit_loop b_tokens].
      destruct (negb (guard w' _)); [right; reflexivity|].
      unfold mode_ok. destruct (j_pre h =? 0) eqn:Hh0; cbn [Bool.eqb negb];
        [right; reflexivity|].
      assert (Hh : bcol <= j_pre h).
      { apply mod_pos_ge; [lia| |apply Nat.eqb_neq in Hh0; lia].
        rewrite Forall_forall in HW. apply HW. rewrite ?HWe. now left. }
      replace (0 <? j_pre h) with true by (symmetry; apply Nat.ltb_lt; lia).
      cbn [room xmin]. replace (Nat.min bcol (Nat.min (bcol - 0) (j_pre h))) with bcol by lia.
      replace (bcol =? 0) with false by (symmetry; apply Nat.eqb_neq; lia).
      rewrite admit_loop_full by (cbn [b_tokens]; lia).
      left. split; [reflexivity|]. exists h. split; [rewrite ?HWe; now left|]. reflexivity.
    + (* the oldest prefill takes a tile *)
      left. split; [reflexivity|]. split; [congruence|].
      assert (Hp0 : bcol <= j_pre p0).
      { rewrite Forall_forall in HP. destruct (HP p0) as [H1 H2]; [rewrite ?HPe; now left|].
        apply mod_pos_ge; lia. }
      cbn [length Nat.eqb negb andb serve_prefills room xmin].
      replace (Nat.min bcol (Nat.min (bcol - 0) (j_pre p0))) with bcol by lia.
      replace (bcol =? 0) with false by (symmetry; apply Nat.eqb_neq; lia).
      rewrite serve_prefills_full by lia. cbn iota zeta.
      cbn [xlt]. rewrite Nat.ltb_irrefl, andb_false_r. reflexivity.
Qed.

(** ** B1 *)

Theorem rad_token_rate (bcol tlin tnl : nat) (E : engine) :
  0 < bcol -> capped bcol E -> rad_cost bcol tlin tnl E ->
  every_path E (fun _ => true) (token_rate bcol tlin tnl).
Proof.
  intros Hb [f [Hc Hf]] Hcost arr _.
  apply every_iteration_of_invariant
    with (I := fun st => s_served st * (tlin + tnl * bcol) <= bcol * s_now st).
  { simpl. lia. }
  intros st Hi.
  destruct (arrive_clock st) as (Hn & Hs & _).
  destruct (arrive_forall st (fun _ => True) (fun _ => True)) as (_ & _ & Hh);
    [tauto|apply Forall_forall; tauto|apply Forall_forall; tauto|].
  unfold step; cbv zeta.
  set (st1 := arrive st) in *. set (b := form_batch E st1).
  destruct (b_tokens b =? 0) eqn:Hz.
  - destruct (s_pending st1) as [|r rs]; cbn [set_now s_served s_now]; rewrite ?Hn, ?Hs;
      [exact Hi|]. nia.
  - split.
    + unfold token_rate, claim_view, view_of. cbn [v_served v_now]. rewrite Hn, Hs. exact Hi.
    + unfold finish. cbn [s_served s_now]. rewrite Hcost. unfold claim_view, view_of.
      cbn [v_tokens].
      pose proof (form_batch_cap E st1 f Hc) as Hk. rewrite Hf in Hk. fold b in Hk.
      apply Nat.eqb_neq in Hz.
      replace (ceil_div (b_tokens b) bcol) with 1.
      2:{ unfold ceil_div. apply (Nat.div_unique _ _ _ (b_tokens b - 1)); lia. }
      rewrite Hn, Hs. nia.
Qed.

(** ** B2 and B3 *)

Definition rad_inv (bcol : nat) (st : state) : Prop :=
  Forall (fun r => r_vp r mod bcol = 0) (s_pending st)
  /\ Forall (fun j => j_pre j mod bcol = 0) (s_waiting st)
  /\ Forall (fun j => j_pre j mod bcol = 0 /\ 0 < j_pre j) (s_prefilling st)
  /\ length (s_decoding st) <= bcol.

Lemma forall_filter_pre (bcol : nat) (l : list job) :
  Forall (fun j => j_pre j mod bcol = 0) l ->
  Forall (fun j => j_pre j mod bcol = 0 /\ 0 < j_pre j) (filter has_pre l).
Proof.
  intros H. rewrite Forall_forall in *. intros x Hx. apply filter_In in Hx as [Hx Hp].
  split; [exact (H x Hx)|]. unfold has_pre in Hp. apply Nat.ltb_lt in Hp. exact Hp.
Qed.

Theorem rad_batch_tiled (bcol : nat) (E : engine) :
  0 < bcol -> rad_schedule bcol E ->
  every_path E (tiled bcol) (fun v => optimal_tiling bcol v /\ decoder_bound bcol v).
Proof.
  intros Hb Hsched arr Hg.
  apply every_iteration_of_invariant with (I := rad_inv bcol).
  { unfold rad_inv; cbn [init s_pending s_waiting s_prefilling s_decoding length].
    refine (conj _ (conj (Forall_nil _) (conj (Forall_nil _) (Nat.le_0_l _)))).
    eapply Forall_impl; [|exact Hg].
    intros r Hr. unfold tiled in Hr. apply Nat.eqb_eq in Hr. rewrite Hr, Nat.mul_comm.
    apply Nat.mod_mul. lia. }
  intros st (Hpe & Hw & Hp & Hd).
  destruct (arrive_forall st (fun r => r_vp r mod bcol = 0) (fun j => j_pre j mod bcol = 0))
    as (Hpe1 & Hw1 & _); [intros k r Hr; exact Hr|exact Hpe|exact Hw|].
  destruct (arrive_clock st) as (_ & _ & Hp1 & Hd1).
  unfold step; cbv zeta.
  set (st1 := arrive st) in *. rewrite <- Hp1 in Hp. rewrite <- Hd1 in Hd.
  pose proof (rad_form_batch bcol E st1 Hb Hsched Hw1 Hp) as Hfb. cbv zeta in Hfb.
  set (b := form_batch E st1) in *.
  destruct (b_tokens b =? 0) eqn:Hz.
  { assert (H1 : rad_inv bcol st1) by (unfold rad_inv; tauto).
    destruct (s_pending st1) as [|r rs]; exact H1. }
  apply Nat.eqb_neq in Hz. clearbody b.
  pose proof (finish_decoding_length st1 b
    (s_now st1 + e_execute E (claim_view st1 b))) as HD.
  unfold rad_mode, view_of, residents in Hfb; cbn [v_decoding v_count] in Hfb.
  destruct Hfb as [[Hm ->] | [[Hm [HPne ->]] | [[Hm [h [Hin ->]]] | Hz0]]]; [| | |contradiction].
  - (* Decode Mode *)
    cbn [b_prefills b_admitted b_admitted_dec length] in HD.
    split.
    + unfold optimal_tiling, decoder_bound, claim_view, view_of, residents.
      cbn [v_tokens v_decoding v_count b_tokens]. split; [|exact Hd].
      apply orb_true_iff in Hm as [Hm|Hm]; [apply Nat.leb_le in Hm|apply Nat.eqb_eq in Hm].
      * left. lia.
      * right. exact Hm.
    + unfold rad_inv. refine (conj Hpe1 (conj Hw1 (conj _ _))); [|eapply Nat.le_trans; [exact HD|lia]].
      unfold finish; cbn [s_prefilling b_prefills b_admitted apply_chunks map].
      rewrite app_nil_r. apply forall_filter_pre. eapply Forall_impl; [|exact Hp]. intros a [Ha _]; exact Ha.
  - (* Prefill Mode: the oldest prefill *)
    apply orb_false_iff in Hm as [Hm1 Hm2]. apply Nat.leb_gt in Hm1.
    cbn [b_prefills b_admitted b_admitted_dec length] in HD.
    split.
    + unfold optimal_tiling, decoder_bound, claim_view, view_of.
      cbn [v_tokens v_decoding]. split; [left; reflexivity|exact Hd].
    + unfold rad_inv. refine (conj Hpe1 (conj Hw1 (conj _ _))); [|eapply Nat.le_trans; [exact HD|lia]].
      unfold finish; cbn [s_prefilling b_prefills b_admitted map].
      rewrite app_nil_r. apply forall_filter_pre. destruct (s_prefilling st1) as [|p0 ps]; [contradiction|].
      cbn [apply_chunks]. inversion Hp as [|? ? [Hm0 Hpos] Hps]; subst.
      constructor; [cbn [j_pre]; apply mod_sub; assumption|].
      eapply Forall_impl; [|exact Hps]. intros a [Ha _]; exact Ha.
  - (* Prefill Mode: the admitted head of waiting *)
    apply orb_false_iff in Hm as [Hm1 Hm2]. apply Nat.leb_gt in Hm1.
    cbn [b_prefills b_admitted b_admitted_dec length] in HD.
    split.
    + unfold optimal_tiling, decoder_bound, claim_view, view_of.
      cbn [v_tokens v_decoding]. split; [left; reflexivity|exact Hd].
    + unfold rad_inv.
      refine (conj Hpe1 (conj (forall_skipn _ _ _ Hw1) (conj _ _)));
        [|eapply Nat.le_trans; [exact HD|lia]].
      unfold finish; cbn [s_prefilling b_prefills b_admitted map apply_chunks].
      apply forall_filter_pre. apply Forall_app. split.
      * eapply Forall_impl; [|exact Hp]. intros a [Ha _]; exact Ha.
      * constructor; [|constructor]. cbn [cut j_pre]. apply mod_sub; [exact Hb|].
        rewrite Forall_forall in Hw1. exact (Hw1 h Hin).
Qed.

(** The three claims of [bari_rad.sq], one statement each. *)
Corollary rad_optimal_tiling (bcol : nat) (E : engine) :
  0 < bcol -> rad_schedule bcol E -> every_path E (tiled bcol) (optimal_tiling bcol).
Proof.
  intros Hb Hs. eapply every_path_impl; [|exact (rad_batch_tiled bcol E Hb Hs)].
  intros v H; apply H.
Qed.

Corollary rad_decoder_bound (bcol : nat) (E : engine) :
  0 < bcol -> rad_schedule bcol E -> every_path E (tiled bcol) (decoder_bound bcol).
Proof.
  intros Hb Hs. eapply every_path_impl; [|exact (rad_batch_tiled bcol E Hb Hs)].
  intros v H; apply H.
Qed.

(** All three at once, for claims that need more than one of them. *)
Corollary rad_all (bcol tlin tnl : nat) (E : engine) :
  0 < bcol -> rad_schedule bcol E -> rad_cost bcol tlin tnl E ->
  every_path E (tiled bcol)
    (fun v => (optimal_tiling bcol v /\ decoder_bound bcol v) /\ token_rate bcol tlin tnl v).
Proof.
  intros Hb Hs Hc arr Hg n st1 b st' Hst. split.
  - exact (rad_batch_tiled bcol E Hb Hs arr Hg n st1 b st' Hst).
  - destruct Hs as [Hcap _].
    refine (rad_token_rate bcol tlin tnl E Hb Hcap Hc arr _ n st1 b st' Hst).
    apply Forall_forall. reflexivity.
Qed.
