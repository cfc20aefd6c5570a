(** * Theorem 2 of Bari et al., B4: the Foster-Lyapunov part, proved

    - [foster_criterion_holds]: Foster's criterion for a chain with a finite-support kernel
      and rational probabilities ([Theorem2.foster_criterion]), by telescoping on finite
      horizons: [eps * E_x[min(tau_C, n + 1)] <= eps + E_x[V(X_1)]] once the bound holds for
      [n] outside [C], so no measure theory and no limit is needed.
    - [slot_step]: one slot of the RAD node with 128-token tiles ([Theorem2.E128]) on a
      job list of the chain's invariant [jl_inv] (waiting and prefilling requests have a
      positive multiple of 128 prefill tokens left, decoding ones none, at most 512 decode
      tokens each) keeps the invariant, adds at most the slot's arriving tokens to the work
      left, and serves a whole tile when [2^16] or more tokens are left: a RAD batch is
      [min(128, |decoding|)] decoders, or one tile of the oldest prefill, or one tile of
      the admitted head of [waiting] ([rad_form_batch_pos], a sharper
      [Radproof.rad_form_batch]); fewer than 128 tokens means that every resident decodes
      and fewer than 128 do, so at most [127 * 512] tokens are left.
    - [theorem2_one_node_small_set_holds] ([Theorem2.theorem2_one_node_small_set]): with a
      valid finite slot distribution and [L < 128], from every reachable job list the
      expected time to reach the small set (work below [2^16]) is at most
      [work / (128 - L)], and the expected return time from the small set to itself is at
      most [65664 / (128 - L)].

    Not proved: [Theorem2.theorem2_one_node] itself, positive recurrence of every reachable
    state.  The missing step is the regeneration argument: from every small state, an
    empty slot (probability at least [1 - L / 129] since every request brings at least 129
    tokens) repeated at most [2^16] times empties the node, and a fixed path of positive
    probability leads from the empty job list to any reachable state, so each visit to
    the small set reaches that state within a bounded number of slots with a probability
    bounded below; the geometric bound on the return time from this is not written here. *)
From Coq Require Import List Bool Arith Lia QArith Lqa.
From Plow Require Import Serq.Step Serq.Stepproof Serq.Rad Serq.Radproof Serq.Theorem2.
Import ListNotations.
Local Open Scope Q_scope.
(** ** Sums over lists *)

Lemma qsum_nil {A : Type} (f : A -> Q) : qsum f [] = 0.
Proof. reflexivity. Qed.

Lemma qsum_cons {A : Type} (f : A -> Q) (a : A) (l : list A) : qsum f (a :: l) = f a + qsum f l.
Proof. reflexivity. Qed.

Lemma qsum_le {A : Type} (f g : A -> Q) (l : list A) :
  (forall a, In a l -> f a <= g a) -> qsum f l <= qsum g l.
Proof.
  induction l as [|a l IH]; intros H; rewrite ?qsum_nil, ?qsum_cons; [lra|].
  assert (f a <= g a) by (apply H; now left).
  assert (qsum f l <= qsum g l) by (apply IH; intros; apply H; now right).
  lra.
Qed.

Lemma qsum_scale_le {A : Type} (c : Q) (f g : A -> Q) (l : list A) :
  (forall a, In a l -> c * f a <= g a) -> c * qsum f l <= qsum g l.
Proof.
  induction l as [|a l IH]; intros H; rewrite ?qsum_nil, ?qsum_cons; [lra|].
  assert (c * f a <= g a) by (apply H; now left).
  assert (c * qsum f l <= qsum g l) by (apply IH; intros; apply H; now right).
  lra.
Qed.

Lemma qsum_nonneg {A : Type} (f : A -> Q) (l : list A) :
  (forall a, In a l -> 0 <= f a) -> 0 <= qsum f l.
Proof.
  intros H. apply Qle_trans with (qsum (fun _ => 0) l).
  - clear H. induction l as [|a l IH]; rewrite ?qsum_nil, ?qsum_cons; lra.
  - apply qsum_le. exact H.
Qed.

(** ** Foster's criterion *)

Section foster.
  Variables (X : Type) (K : kernel X) (C : X -> bool) (I : X -> Prop) (V : X -> Q) (eps b : Q).
  Hypothesis eps_pos : 0 < eps.
  Hypothesis kernel_ok : forall x, I x -> forall py, In py (K x) -> 0 <= fst py /\ I (snd py).
  Hypothesis v_nonneg : forall x, I x -> 0 <= V x.

  Lemma expect_nonneg (x : X) : I x -> 0 <= expect K V x.
  Proof.
    intros Hx. apply qsum_nonneg. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy].
    cbn [fst snd] in *. pose proof (v_nonneg y Hy). nra.
  Qed.

  (** One step of the telescoping: a bound [eps * E[min(tau_C, n)] <= V] outside [C] gives
      [eps * E_x[min(tau_C, n + 1)] <= eps + E_x[V(X_1)]] everywhere. *)
  Lemma hit_step (n : nat) :
    (forall y, I y -> C y = false -> eps * hit_partial K C n y <= V y) ->
    forall x, I x -> eps * hit_partial K C (S n) x <= eps + expect K V x.
  Proof.
    intros Hn x Hx. cbn [hit_partial].
    assert (H : eps * qsum (fun py => if C (snd py) then 0 else fst py * hit_partial K C n (snd py)) (K x)
                <= expect K V x).
    { apply qsum_scale_le. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy].
      cbn [fst snd] in *. pose proof (v_nonneg y Hy).
      destruct (C y) eqn:Hc.
      - nra.
      - pose proof (Hn y Hy Hc). nra. }
    lra.
  Qed.

  Hypothesis drift : forall x, I x -> C x = false -> expect K V x + eps <= V x.
  Hypothesis inside : forall x, I x -> C x = true -> expect K V x <= b.

  Lemma hit_outside (n : nat) : forall x, I x -> C x = false -> eps * hit_partial K C n x <= V x.
  Proof.
    induction n as [|n IH]; intros x Hx Hc.
    - cbn [hit_partial]. pose proof (v_nonneg x Hx). lra.
    - pose proof (hit_step n IH x Hx). pose proof (drift x Hx Hc). lra.
  Qed.

  Lemma hit_inside (n : nat) : forall x, I x -> C x = true -> eps * hit_partial K C n x <= eps + b.
  Proof.
    intros x Hx Hc. pose proof (inside x Hx Hc). destruct n as [|n].
    - cbn [hit_partial]. pose proof (expect_nonneg x Hx). lra.
    - pose proof (hit_step n (hit_outside n) x Hx). lra.
  Qed.
End foster.

Theorem foster_criterion_holds : foster_criterion.
Proof.
  intros X K C I V eps b He Hk Hv Hd Hi x Hx n. split.
  - intros Hc. eapply hit_outside; eauto.
  - intros Hc. eapply hit_inside; eauto.
Qed.

(** ** The RAD node with 128-token tiles: what one slot does to the work left *)

Local Open Scope nat_scope.

Definition jsum (l : list job) : nat := fold_right (fun j acc => j_pre j + j_dec j + acc) 0 l.

Definition mwork (st : state) : nat :=
  jsum (s_waiting st) + jsum (s_prefilling st) + jsum (s_decoding st).

Lemma jsum_app (l m : list job) : jsum (l ++ m) = jsum l + jsum m.
Proof. induction l as [|j l IH]; simpl; lia. Qed.

Lemma jsum_filter_le (f : job -> bool) (l : list job) : jsum (filter f l) <= jsum l.
Proof. induction l as [|j l IH]; simpl; [lia|]. destruct (f j); simpl; lia. Qed.

Lemma jsum_dec1 (l : list job) :
  Forall (fun j => 0 < j_dec j) l -> jsum (map dec1 l) + length l = jsum l.
Proof. induction 1 as [|j l Hj _ IH]; simpl; lia. Qed.

Lemma forall_filter_keep {A : Type} (P : A -> Prop) (f : A -> bool) (l : list A) :
  Forall P l -> Forall P (filter f l).
Proof.
  intros H. rewrite Forall_forall in *. intros x Hx. apply filter_In in Hx. apply H; tauto.
Qed.

Definition job_w (j : job) : Prop := j_pre j mod 128 = 0 /\ 0 < j_pre j /\ j_dec j <= 512.
Definition job_d (j : job) : Prop := j_pre j = 0 /\ 0 < j_dec j /\ j_dec j <= 512.

Lemma jsum_bounded (m : nat) (l : list job) :
  Forall (fun j => j_pre j + j_dec j <= m) l -> jsum l <= m * length l.
Proof. induction 1 as [|j l Hj _ IH]; cbn [jsum fold_right length]; [lia|]. fold (jsum l). nia. Qed.

Lemma jsum_decoding (l : list job) : Forall job_d l -> jsum l <= 512 * length l.
Proof.
  intros H. apply jsum_bounded. eapply Forall_impl; [|exact H]. intros j (H1 & _ & H3). lia.
Qed.

(** The states of the job-list chain the slots keep to. *)
Definition jl_inv (s : joblist) : Prop :=
  Forall (fun pd => job_w (mk_job 0 (fst pd) (snd pd))) (jl_waiting s)
  /\ Forall (fun pd => job_w (mk_job 0 (fst pd) (snd pd))) (jl_prefilling s)
  /\ Forall (fun pd => job_d (mk_job 0 (fst pd) (snd pd))) (jl_decoding s).

Lemma forall_jobs_of (P : job -> Prop) (l : list (nat * nat)) :
  Forall (fun pd => P (mk_job 0 (fst pd) (snd pd))) l -> Forall P (jobs_of l).
Proof.
  intros H. induction H as [|[p d] l Hx _ IH]; constructor; [exact Hx|exact IH].
Qed.

Lemma forall_left_of (P : job -> Prop) (l : list job) :
  (forall j j', j_pre j = j_pre j' -> j_dec j = j_dec j' -> P j -> P j') ->
  Forall P l -> Forall (fun pd => P (mk_job 0 (fst pd) (snd pd))) (left_of l).
Proof.
  intros Hp H. induction H as [|j l Hx _ IH]; constructor; [|exact IH].
  eapply Hp; [| |exact Hx]; reflexivity.
Qed.

Lemma job_w_ext (j j' : job) : j_pre j = j_pre j' -> j_dec j = j_dec j' -> job_w j -> job_w j'.
Proof. unfold job_w. intros -> ->. tauto. Qed.

Lemma job_d_ext (j j' : job) : j_pre j = j_pre j' -> j_dec j = j_dec j' -> job_d j -> job_d j'.
Proof. unfold job_d. intros -> ->. tauto. Qed.

Lemma pairs_work_jobs_of (l : list (nat * nat)) : jsum (jobs_of l) = pairs_work l.
Proof. induction l as [|[p d] l IH]; simpl; lia. Qed.

Lemma pairs_work_left_of (l : list job) : pairs_work (left_of l) = jsum l.
Proof. induction l as [|j l IH]; simpl; lia. Qed.

Lemma project_work (st : state) : work (project st) = mwork st.
Proof. unfold work, project, mwork. cbn [jl_waiting jl_prefilling jl_decoding]. rewrite !pairs_work_left_of. reflexivity. Qed.

Lemma project_inv (st : state) :
  Forall job_w (s_waiting st) -> Forall job_w (s_prefilling st) -> Forall job_d (s_decoding st) ->
  jl_inv (project st).
Proof.
  intros H1 H2 H3. unfold jl_inv, project; cbn [jl_waiting jl_prefilling jl_decoding].
  split; [|split]; (apply forall_left_of; [exact job_w_ext || exact job_d_ext|assumption]).
Qed.

(** *** Arrivals of a slot *)

Definition req_ok (r : req) : Prop := r_arr r = 0 /\ r_vp r mod 128 = 0 /\ 0 < r_vp r /\ r_vd r <= 512.

Definition rsum (l : list req) : nat := fold_right (fun r acc => r_vp r + r_vd r + acc) 0 l.

Lemma absorb_all (n : nat) (l : list req) (w : list job) (e : list (nat * nat)) :
  Forall req_ok l -> Forall job_w w ->
  match absorb 0 n l w e with
  | (_, pending, w', _) => pending = [] /\ jsum w' = jsum w + rsum l /\ Forall job_w w'
  end.
Proof.
  revert n w e; induction l as [|r l IH]; intros n w e Hl Hw; simpl.
  - split; [reflexivity|]. split; [lia|exact Hw].
  - inversion Hl as [|? ? (Ha & Hm & Hp & Hd) Hl']; subst.
    replace (r_arr r <=? 0) with true by (rewrite Ha; reflexivity).
    replace ((r_vp r =? 0) && (r_vd r =? 0)) with false
      by (symmetry; apply andb_false_iff; left; apply Nat.eqb_neq; lia).
    specialize (IH (S n) (w ++ [mk_job n (r_vp r) (r_vd r)]) e Hl').
    destruct (absorb 0 (S n) l _ e) as [[[n' p'] w'] e'].
    destruct IH as (-> & Hs & Hf).
    + apply Forall_app. split; [exact Hw|]. constructor; [|constructor].
      unfold job_w; cbn [j_pre j_dec]. tauto.
    + split; [reflexivity|]. split; [|exact Hf]. rewrite Hs, jsum_app. simpl. lia.
Qed.

Definition reqs_of (a : list rtype) : list req := map (fun '(p, d) => mk_req 0 p d) a.

Lemma reqs_of_ok (a : list rtype) :
  Forall valid_type a -> Forall req_ok (reqs_of a) /\ rsum (reqs_of a) = tokens_of a.
Proof.
  induction 1 as [|[p d] a Ht _ [IH1 IH2]]; simpl; [split; [constructor|reflexivity]|].
  destruct Ht as [[k [Hk Hp]] Hd]. cbn [fst snd] in *. split; [|lia].
  constructor; [|exact IH1]. unfold req_ok; cbn [r_arr r_vp r_vd].
  subst p. rewrite Nat.mul_comm, Nat.mod_mul by lia. lia.
Qed.

Definition slot_state (a : list rtype) (x : joblist) : state :=
  mk_state 0 0 0 0 (reqs_of a)
    (jobs_of (jl_waiting x)) (jobs_of (jl_prefilling x)) (jobs_of (jl_decoding x)) [].

Lemma slot_unfold (E : engine) (a : list rtype) (x : joblist) :
  slot E a x = project (next (step E (slot_state a x))).
Proof. reflexivity. Qed.

Lemma arrive_slot (a : list rtype) (x : joblist) :
  jl_inv x -> Forall valid_type a ->
  let st1 := arrive (slot_state a x) in
  s_pending st1 = [] /\ mwork st1 = work x + tokens_of a
  /\ Forall job_w (s_waiting st1) /\ Forall job_w (s_prefilling st1)
  /\ Forall job_d (s_decoding st1).
Proof.
  intros (Hw & Hp & Hd) Ha st1.
  destruct (reqs_of_ok a Ha) as [Hr Hs].
  assert (Hw' : Forall job_w (jobs_of (jl_waiting x))) by (apply forall_jobs_of; exact Hw).
  pose proof (absorb_all 0 (reqs_of a) (jobs_of (jl_waiting x)) [] Hr Hw') as Hab.
  subst st1. unfold arrive, slot_state, mwork, work. cbn [s_now s_arrived s_pending s_waiting s_ended s_prefilling s_decoding].
  destruct (absorb 0 0 (reqs_of a) (jobs_of (jl_waiting x)) []) as [[[n' p'] w'] e'].
  destruct Hab as (-> & Hj & Hf). cbn [s_pending s_waiting s_prefilling s_decoding].
  rewrite Hj, !pairs_work_jobs_of, Hs. split; [reflexivity|]. split; [lia|].
  split; [exact Hf|]. split; apply forall_jobs_of; assumption.
Qed.

(** *** The batch: [Radproof.rad_form_batch] when every waiting request has prefill left
    and the admission clause's [while] always holds: the empty batch of that lemma is then
    only Decode Mode with nobody decoding, and the admitted request is the head of [waiting]. *)

Lemma rad_form_batch_pos (bcol : nat) (E : engine) (st : state) :
  0 < bcol -> rad_schedule bcol E ->
  (forall c, e_admit E = Some c -> forall v, guard (c_while c) v = true) ->
  Forall (fun j => j_pre j mod bcol = 0 /\ 0 < j_pre j) (s_waiting st) ->
  Forall (fun j => j_pre j mod bcol = 0 /\ 0 < j_pre j) (s_prefilling st) ->
  let m := rad_mode bcol (view_of st (length (s_waiting st)) 0 0) in
  let nd := Nat.min bcol (length (s_decoding st)) in
  (m = true /\ form_batch E st = mk_batch (Some true) nd [] [] [] 0 nd nd)
  \/ (m = false /\ (exists p0 ps, s_prefilling st = p0 :: ps)
      /\ form_batch E st = mk_batch (Some false) 0 [bcol] [] [] 0 bcol 1)
  \/ (m = false /\ s_prefilling st = [] /\ (exists h ws, s_waiting st = h :: ws
      /\ form_batch E st = mk_batch (Some false) 0 [] [(h, bcol)] [] 1 bcol 1)).
Proof.
  intros Hb [[f [Hc Hf]] [[p [w [g [Ha [Hp Hg]]]]] [p' [w' [g' [Hd [Hp' Hg']]]]]]] Hwt HW HP m nd.
  assert (Hwt' : forall v, guard w' v = true) by exact (Hwt _ Hd).
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
    + (* no prefill running: the head of waiting takes a tile *)
      right. split; [reflexivity|]. split; [reflexivity|].
      cbn [length Nat.eqb negb andb]. cbn iota zeta.
      destruct (s_waiting st) as [|h ws] eqn:HWe.
      { exfalso. unfold rad_mode, view_of, residents in Hm; cbn [v_decoding v_count] in Hm.
        rewrite HWe, HPe in Hm. cbn [length Nat.add] in Hm. rewrite Nat.eqb_refl, orb_true_r in Hm.
        discriminate. }
      exists h, ws. split; [reflexivity|].
      cbn [length Nat.eqb negb andb xlt]. replace (0 <? bcol) with true
        by (symmetry; apply Nat.ltb_lt; lia).
      rewrite Hg'. cbn [admit_loop b_tokens]. rewrite Hwt'. cbn [negb].
      assert (Hh : bcol <= j_pre h /\ 0 < j_pre h).
      { rewrite Forall_forall in HW. destruct (HW h) as [H1 H2]; [rewrite ?HWe; now left|].
        split; [apply mod_pos_ge; lia|exact H2]. }
      unfold mode_ok. replace (j_pre h =? 0) with false by (symmetry; apply Nat.eqb_neq; lia).
      cbn [Bool.eqb negb].
      replace (0 <? j_pre h) with true by (symmetry; apply Nat.ltb_lt; lia).
      cbn [room xmin]. replace (Nat.min bcol (Nat.min (bcol - 0) (j_pre h))) with bcol by lia.
      replace (bcol =? 0) with false by (symmetry; apply Nat.eqb_neq; lia).
      rewrite admit_loop_full by (cbn [b_tokens]; lia). reflexivity.
    + (* the oldest prefill takes a tile *)
      left. split; [reflexivity|]. split; [exists p0, ps; reflexivity|].
      assert (Hp0 : bcol <= j_pre p0).
      { rewrite Forall_forall in HP. destruct (HP p0) as [H1 H2]; [rewrite ?HPe; now left|].
        apply mod_pos_ge; lia. }
      cbn [length Nat.eqb negb andb serve_prefills room xmin].
      replace (Nat.min bcol (Nat.min (bcol - 0) (j_pre p0))) with bcol by lia.
      replace (bcol =? 0) with false by (symmetry; apply Nat.eqb_neq; lia).
      rewrite serve_prefills_full by lia. cbn iota zeta.
      cbn [xlt]. rewrite Nat.ltb_irrefl, andb_false_r. reflexivity.
Qed.

Lemma e128_schedule : rad_schedule 128 E128.
Proof.
  split; [exists (fun _ => 128); split; reflexivity|].
  split; [exists (rad_mode 128), None, (fun _ => 128)|
          exists (rad_mode 128), (Some (fun _ => Nat.eqb 0 0)), (fun _ => 128)];
    (split; [reflexivity|split; reflexivity]).
Qed.

Lemma e128_while (c : clause) : e_admit E128 = Some c -> forall v, guard (c_while c) v = true.
Proof. intros H v. cbn in H. injection H as <-. reflexivity. Qed.

(** *** One iteration *)

Lemma forall_dec1 (l : list job) :
  Forall job_d l -> Forall (fun j => j_pre j = 0 /\ j_dec j <= 512) (map dec1 l).
Proof. induction 1 as [|j l (H1 & H2 & H3) _ IH]; constructor; [cbn; lia|exact IH]. Qed.

Lemma forall_decoding_filter (l : list job) :
  Forall (fun j => j_pre j = 0 /\ j_dec j <= 512) l -> Forall job_d (filter has_dec l).
Proof.
  intros H. rewrite Forall_forall in *. intros j Hj. apply filter_In in Hj as [Hj Hd].
  unfold has_dec in Hd. apply Nat.ltb_lt in Hd. destruct (H j Hj). unfold job_d. lia.
Qed.

Lemma forall_d_weak (l : list job) : Forall job_d l -> Forall (fun j => j_pre j = 0 /\ j_dec j <= 512) l.
Proof. intros H. eapply Forall_impl; [|exact H]. intros j (H1 & _ & H3). lia. Qed.

Lemma jsum_cons (j : job) (l : list job) : jsum (j :: l) = j_pre j + j_dec j + jsum l.
Proof. reflexivity. Qed.

Lemma rad_iteration (st1 : state) (t : nat) :
  Forall job_w (s_waiting st1) -> Forall job_w (s_prefilling st1) -> Forall job_d (s_decoding st1) ->
  let b := form_batch E128 st1 in
  let st' := finish st1 b t in
  (Forall job_w (s_waiting st') /\ Forall job_w (s_prefilling st') /\ Forall job_d (s_decoding st')
   /\ mwork st' + b_tokens b <= mwork st1)
  /\ (small_bound <= mwork st1 -> b_tokens b = 128).
Proof.
  intros HW HP HD. cbv zeta.
  assert (HW' : Forall (fun j => j_pre j mod 128 = 0 /\ 0 < j_pre j) (s_waiting st1))
    by (eapply Forall_impl; [|exact HW]; intros j (H1 & H2 & _); tauto).
  assert (HP' : Forall (fun j => j_pre j mod 128 = 0 /\ 0 < j_pre j) (s_prefilling st1))
    by (eapply Forall_impl; [|exact HP]; intros j (H1 & H2 & _); tauto).
  pose proof (rad_form_batch_pos 128 E128 st1 ltac:(lia) e128_schedule e128_while HW' HP') as Hfb.
  cbv zeta in Hfb.
  destruct Hfb as [[Hm ->] | [[Hm [[p0 [ps HPe]] ->]] | [Hm [HPe [h [ws [HWe ->]]]]]]].
  - (* Decode Mode *)
    unfold finish, mwork. cbn [s_waiting s_prefilling s_decoding b_decoders b_prefills b_admitted
      b_admitted_dec b_taken b_tokens apply_chunks firstn skipn map filter app length].
    rewrite !app_nil_r.
    set (nd := Nat.min 128 (length (s_decoding st1))).
    assert (Hlen : length (firstn nd (s_decoding st1)) = nd) by (rewrite firstn_length; lia).
    assert (HDf : Forall job_d (firstn nd (s_decoding st1)) /\ Forall job_d (skipn nd (s_decoding st1)))
      by (rewrite <- (firstn_skipn nd (s_decoding st1)) in HD; apply Forall_app in HD; exact HD).
    destruct HDf as [HD1 HD2].
    split; [split; [exact HW|split; [apply forall_filter_keep; exact HP|split]]|].
    + apply forall_decoding_filter. apply Forall_app.
      split; [apply forall_dec1; exact HD1|apply forall_d_weak; exact HD2].
    + pose proof (jsum_filter_le has_pre (s_prefilling st1)).
      pose proof (jsum_filter_le has_dec (map dec1 (firstn nd (s_decoding st1)) ++ skipn nd (s_decoding st1))) as H0.
      rewrite jsum_app in H0.
      pose proof (jsum_dec1 (firstn nd (s_decoding st1))
        ltac:(eapply Forall_impl; [|exact HD1]; intros j (_ & Hj & _); exact Hj)).
      pose proof (f_equal jsum (firstn_skipn nd (s_decoding st1))) as Hs. rewrite jsum_app in Hs.
      lia.
    + intros Hbig. unfold small_bound in Hbig. subst nd.
      destruct (Nat.le_gt_cases 128 (length (s_decoding st1))) as [Hl|Hl]; [lia|exfalso].
      unfold rad_mode, view_of, residents in Hm; cbn [v_decoding v_count] in Hm.
      apply orb_true_iff in Hm as [Hm|Hm]; [apply Nat.leb_le in Hm; lia|apply Nat.eqb_eq in Hm].
      assert (HW0 : s_waiting st1 = []) by (apply length_zero_iff_nil; lia).
      assert (HP0 : s_prefilling st1 = []) by (apply length_zero_iff_nil; lia).
      rewrite HW0, HP0 in Hbig. change (jsum []) with 0 in Hbig.
      pose proof (jsum_decoding (s_decoding st1) HD). lia.
  - (* Prefill Mode: the oldest prefill *)
    unfold finish, mwork. rewrite HPe. cbn [s_waiting s_prefilling s_decoding b_decoders b_prefills b_admitted
      b_admitted_dec b_taken b_tokens apply_chunks firstn skipn map filter app length].
    rewrite HPe in HP. pose proof (Forall_inv HP) as (Hm0 & Hpos & Hd0). pose proof (Forall_inv_tail HP) as HPs.
    assert (H128 : 128 <= j_pre p0) by (apply mod_pos_ge; lia).
    set (q := mk_job (j_id p0) (j_pre p0 - 128) (j_dec p0)).
    assert (Hq : j_pre q mod 128 = 0) by (unfold q; cbn [j_pre]; apply mod_sub; lia).
    pose proof (jsum_filter_le has_pre ps). pose proof (jsum_filter_le has_dec (s_decoding st1)).
    split; [|intros _; reflexivity].
    destruct (has_pre q) eqn:Hh; cbn [negb filter app]; rewrite ?app_nil_r; unfold has_pre in Hh.
    + apply Nat.ltb_lt in Hh.
      split; [exact HW|split; [constructor; [unfold job_w; refine (conj Hq _); unfold q in *; cbn [j_pre j_dec] in *; lia|apply forall_filter_keep; exact HPs]|split]].
      * apply forall_filter_keep. exact HD.
      * rewrite !jsum_cons. unfold q in *; cbn [j_pre j_dec] in *. lia.
    + apply Nat.ltb_ge in Hh.
      split; [exact HW|split; [apply forall_filter_keep; exact HPs|split]].
      * apply Forall_app. split; [apply forall_filter_keep; exact HD|].
        unfold has_dec; destruct (0 <? j_dec q) eqn:Hd; [|constructor].
        apply Nat.ltb_lt in Hd. constructor; [|constructor]. unfold job_d. unfold q in *; cbn [j_pre j_dec] in *. lia.
      * rewrite jsum_app, jsum_cons. destruct (has_dec q); rewrite ?jsum_cons;
          change (jsum []) with 0; unfold q in *; cbn [j_pre j_dec] in *; lia.
  - (* Prefill Mode: the admitted head of waiting *)
    unfold finish, mwork. rewrite HPe, HWe. cbn [s_waiting s_prefilling s_decoding b_decoders b_prefills b_admitted
      b_admitted_dec b_taken b_tokens apply_chunks firstn skipn map filter app length cut].
    rewrite HWe in HW. pose proof (Forall_inv HW) as (Hm0 & Hpos & Hd0). pose proof (Forall_inv_tail HW) as HWs.
    assert (H128 : 128 <= j_pre h) by (apply mod_pos_ge; lia).
    set (q := mk_job (j_id h) (j_pre h - 128) (j_dec h)).
    assert (Hq : j_pre q mod 128 = 0) by (unfold q; cbn [j_pre]; apply mod_sub; lia).
    pose proof (jsum_filter_le has_dec (s_decoding st1)).
    split; [|intros _; reflexivity].
    destruct (has_pre q) eqn:Hh; cbn [negb filter app]; rewrite ?app_nil_r; unfold has_pre in Hh.
    + apply Nat.ltb_lt in Hh.
      split; [exact HWs|split; [constructor; [unfold job_w; refine (conj Hq _); unfold q in *; cbn [j_pre j_dec] in *; lia|constructor]|split]].
      * apply forall_filter_keep. exact HD.
      * rewrite !jsum_cons. change (jsum []) with 0. unfold q in *; cbn [j_pre j_dec] in *. lia.
    + apply Nat.ltb_ge in Hh.
      split; [exact HWs|split; [constructor|split]].
      * apply Forall_app. split; [apply forall_filter_keep; exact HD|].
        destruct (has_dec q) eqn:Hd; [|constructor]. unfold has_dec in Hd.
        apply Nat.ltb_lt in Hd. constructor; [|constructor]. unfold job_d. unfold q in *; cbn [j_pre j_dec] in *. lia.
      * rewrite jsum_app, !jsum_cons. destruct (has_dec q); rewrite ?jsum_cons;
          change (jsum []) with 0; unfold q in *; cbn [j_pre j_dec] in *; lia.
Qed.

Lemma slot_step (a : list rtype) (x : joblist) :
  jl_inv x -> Forall valid_type a ->
  jl_inv (slot E128 a x)
  /\ work (slot E128 a x) <= work x + tokens_of a
  /\ (small_bound <= work x -> work (slot E128 a x) + 128 <= work x + tokens_of a).
Proof.
  intros Hx Ha. rewrite slot_unfold.
  pose proof (arrive_slot a x Hx Ha) as H0. cbv zeta in H0. destruct H0 as (Hpe & Hw & HW & HP & HD).
  unfold step. set (st1 := arrive (slot_state a x)) in *.
  pose proof (rad_iteration st1 (s_now st1 + e_execute E128 (claim_view st1 (form_batch E128 st1))) HW HP HD)
    as H1. cbv zeta in H1. destruct H1 as [(HW' & HP' & HD' & Hk) Hbig].
  destruct (b_tokens (form_batch E128 st1) =? 0) eqn:Hz.
  - rewrite Hpe. cbn [next]. rewrite project_work. split; [apply project_inv; assumption|]. split; [lia|].
    intros Hs. apply Nat.eqb_eq in Hz. specialize (Hbig ltac:(lia)). lia.
  - cbn [next]. rewrite project_work. split; [apply project_inv; assumption|]. split; [lia|].
    intros Hs. specialize (Hbig ltac:(lia)). lia.
Qed.

Lemma reachable_inv (D : dist) (s : joblist) : valid_dist D -> reachable E128 D s -> jl_inv s.
Proof.
  intros [HD _] Hr. induction Hr as [|x p a Hr IH Hin Hp].
  - unfold jl_inv, jl_empty; cbn. repeat split; constructor.
  - rewrite Forall_forall in HD. destruct (HD (p, a) Hin) as [_ Ha].
    apply (slot_step a x IH Ha).
Qed.

(** ** The drift of the work, and B4's part *)

Local Open Scope Q_scope.

Definition nq (n : nat) : Q := inject_Z (Z.of_nat n).

Lemma nq_le_add (m k n t : nat) : (m + k <= n + t)%nat -> nq m + nq k <= nq n + nq t.
Proof.
  intros H. unfold nq. rewrite <- !inject_Z_plus, <- Zle_Qle. lia.
Qed.

Lemma nq_nonneg (n : nat) : 0 <= nq n.
Proof. unfold nq. change 0 with (inject_Z 0). rewrite <- Zle_Qle. lia. Qed.

Lemma nq_lt (m n : nat) : (m < n)%nat -> nq m <= nq n.
Proof. intros H. unfold nq. rewrite <- Zle_Qle. lia. Qed.

Lemma qsum_map {A B : Type} (f : B -> Q) (g : A -> B) (l : list A) :
  qsum f (map g l) = qsum (fun a => f (g a)) l.
Proof. induction l as [|a l IH]; [reflexivity|]. cbn [map]. rewrite !qsum_cons, IH. reflexivity. Qed.

Lemma qsum_affine (c : Q) (g : Q * list rtype -> Q) (D : dist) :
  qsum (fun pa => fst pa * (c + g pa)) D == c * qsum fst D + qsum (fun pa => fst pa * g pa) D.
Proof.
  induction D as [|pa D IH]; rewrite ?qsum_nil, ?qsum_cons; [lra|]. rewrite IH. ring.
Qed.

Lemma chain_ok (D : dist) : valid_dist D ->
  forall x, jl_inv x -> forall py, In py (chain E128 D x) -> 0 <= fst py /\ jl_inv (snd py).
Proof.
  intros [HD _] x Hx py Hin. unfold chain in Hin. apply in_map_iff in Hin as [[p a] [<- Hin]].
  rewrite Forall_forall in HD. destruct (HD (p, a) Hin) as [Hp Ha]. cbn [fst snd] in *.
  split; [lra|]. apply (slot_step a x Hx Ha).
Qed.

Lemma chain_expect (D : dist) (x : joblist) :
  expect (chain E128 D) work_q x = qsum (fun pa => fst pa * nq (work (slot E128 (snd pa) x))) D.
Proof. unfold expect, chain. rewrite qsum_map. reflexivity. Qed.

Lemma chain_drift (D : dist) (x : joblist) : valid_dist D -> jl_inv x -> small x = false ->
  expect (chain E128 D) work_q x + (inject_Z 128 - load D) <= work_q x.
Proof.
  intros [HD H1] Hx Hs. unfold small in Hs. apply Nat.ltb_ge in Hs.
  rewrite chain_expect.
  assert (Hle : qsum (fun pa => fst pa * nq (work (slot E128 (snd pa) x))) D
                <= qsum (fun pa => fst pa * ((nq (work x) - 128) + nq (tokens_of (snd pa)))) D).
  { apply qsum_le. intros [p a] Hin. rewrite Forall_forall in HD. destruct (HD (p, a) Hin) as [Hp Ha].
    cbn [fst snd] in *. destruct (slot_step a x Hx Ha) as (_ & _ & Hd).
    pose proof (nq_le_add _ 128 _ _ (Hd Hs)) as Hq. change (nq 128) with 128 in Hq. nra. }
  pose proof (qsum_affine (nq (work x) - 128) (fun pa => nq (tokens_of (snd pa))) D) as He.
  change (fold_right (fun pa acc => fst pa + acc) 0 D) with (qsum fst D) in H1.
  change (load D) with (qsum (fun pa => fst pa * nq (tokens_of (snd pa))) D).
  change (work_q x) with (nq (work x)). change (inject_Z 128) with 128.
  rewrite H1 in He. lra.
Qed.

Lemma chain_inside (D : dist) (x : joblist) : valid_dist D -> jl_inv x -> small x = true ->
  expect (chain E128 D) work_q x <= 65536 + load D.
Proof.
  intros [HD H1] Hx Hs. unfold small, small_bound in Hs. apply Nat.ltb_lt in Hs.
  rewrite chain_expect.
  assert (Hle : qsum (fun pa => fst pa * nq (work (slot E128 (snd pa) x))) D
                <= qsum (fun pa => fst pa * (nq (work x) + nq (tokens_of (snd pa)))) D).
  { apply qsum_le. intros [p a] Hin. rewrite Forall_forall in HD. destruct (HD (p, a) Hin) as [Hp Ha].
    cbn [fst snd] in *. destruct (slot_step a x Hx Ha) as (_ & Hd & _).
    pose proof (nq_le_add _ 0 _ _ ltac:(rewrite Nat.add_0_r; exact Hd)) as Hq.
    change (nq 0) with 0 in Hq. nra. }
  pose proof (qsum_affine (nq (work x)) (fun pa => nq (tokens_of (snd pa))) D) as He.
  change (fold_right (fun pa acc => fst pa + acc) 0 D) with (qsum fst D) in H1.
  change (load D) with (qsum (fun pa => fst pa * nq (tokens_of (snd pa))) D).
  assert (Hw : nq (work x) <= 65536) by (unfold nq; change 65536 with (inject_Z 65536); rewrite <- Zle_Qle; lia).
  rewrite H1 in He. lra.
Qed.

Theorem theorem2_one_node_small_set_holds : theorem2_one_node_small_set.
Proof.
  intros D HD HL s Hr n.
  assert (Hi : jl_inv s) by exact (reachable_inv D s HD Hr).
  change (inject_Z 128) with 128 in *.
  assert (He : 0 < 128 - load D) by lra.
  destruct (foster_criterion_holds joblist (chain E128 D) small jl_inv work_q (128 - load D) (65536 + load D)
              He (chain_ok D HD) (fun x _ => nq_nonneg (work x))
              (fun x Hx Hs => chain_drift D x HD Hx Hs)
              (fun x Hx Hs => chain_inside D x HD Hx Hs) s Hi n) as [Hout Hin].
  destruct (small s) eqn:Hs.
  - pose proof (Hin eq_refl). change (inject_Z 65664) with 65664. lra.
  - exact (Hout eq_refl).
Qed.
