(** * Theorem 2 of Bari et al., B4, B5 (per node and joint) and B6, proved:
    [theorem2_one_node_holds], [theorem2_nodes_per_node_holds], [theorem2_nodes_joint_holds],
    [theorem2_compound_holds]

    One RAD node with 128-token tiles ([Theorem2.E128]), a finite slot-arrival distribution
    with rational probabilities, [L < 128]: every reachable state of the job-list chain is
    positive recurrent ([Theorem2.theorem2_one_node]), i.e. the partial sums of
    [P_s(tau_s > k)] are bounded.  The proof, on finite horizons only (no limits, no measure
    theory, no real numbers):

    - [foster_criterion_holds] (Foster's criterion, [Theorem2.foster_criterion]) by
      telescoping: [eps * E_x[min(tau_C, n + 1)] <= eps + E_x[V(X_1)]] once the bound holds
      for [n] outside [C];
    - [slot_step]: one slot keeps the chain's invariant [jl_inv] (waiting and prefilling
      requests have a positive multiple of 128 prefill tokens left, decoding ones none, at
      most 512 decode tokens each), adds at most the slot's arriving tokens to the work
      left, and serves a whole tile when [2^16] or more tokens are left: a RAD batch is
      [min(128, |decoding|)] decoders, or one tile of the oldest prefill, or one tile of
      the admitted head of [waiting] ([rad_form_batch_pos], a sharper
      [Radproof.rad_form_batch]); fewer than 128 tokens means that every resident decodes
      and fewer than 128 do, so at most [127 * 512] tokens are left;
    - [theorem2_one_node_small_set_holds] ([Theorem2.theorem2_one_node_small_set]): the
      work is a Lyapunov function with drift [L - 128] off the small set (work below
      [2^16]), so the small set is reached within [work / (128 - L)] expected slots and
      left-and-reentered within [65664 / (128 - L)];
    - the regeneration step ([hit_regenerate], generic): an empty slot has probability at
      least [1 - L / 129] ([empty_slot]: every request brings at least 129 tokens); [2^16]
      empty slots empty any small job list ([drain_empty], [slot_empty_serves]); and a
      fixed path of positive probability leads from the empty job list to the reachable
      state [s] ([reachable_traj]); so from every small state [s] is hit within
      [T = 2^16 + k] slots with a probability [delta > 0] independent of the state
      ([traj_kill]), and by the Markov property at time [T] ([hit_split]) and at the
      first return to the small set ([hit_via]) the expected return time to [s] is at most
      [work(s) / (128 - L) + const + (T + const) / delta], at every horizon;
    - [pr_hit]: [Theorem2.partial_return] is [hit_partial] of the singleton [{s}];
    - B5's per-node part ([theorem2_nodes_per_node_holds]): the distribution a node sees under
      uniform independent routing to [g] nodes ([Theorem2.route]) is a slot distribution
      (probabilities [>= 0], zero for [g = 1], summing to 1) whose load is [L / g]
      ([route_valid]), and the proof of B4 ([one_node_general]) needs only probabilities
      [>= 0];
    - B5's joint part ([theorem2_nodes_joint_holds], for [bari_rad.sq]'s engine): the sum of the
      squares of the nodes' work as the Lyapunov function (see its section below);
    - B6 ([theorem2_compound_holds]): a prefix of a countable slot law is dominated
      ([dominated], [partial_return_dominated]) by the distribution that keeps its requesting
      entries and puts the rest of the mass on one empty slot ([complete]); that one has mass
      1, load at most [L] and an empty slot of probability at least [1 - L / 129]
      ([complete_valid]), and B4's proof, with its constants made explicit
      ([one_node_empty_bound]: only lower bounds on [128 - L] and on the empty slot's
      probability and an upper bound on [L] enter it), bounds its expected return time to
      the empty job list by one [M] for every prefix. *)
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

Section rad128.
  Variable Eng : engine.
  Hypothesis E_rad : rad128 Eng.
  Let E_schedule : rad_schedule 128 Eng := proj1 E_rad.
  Let E_while : forall c, e_admit Eng = Some c -> forall v, guard (c_while c) v = true := proj2 E_rad.

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
  let b := form_batch Eng st1 in
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
  pose proof (rad_form_batch_pos 128 Eng st1 ltac:(lia) E_schedule E_while HW' HP') as Hfb.
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
  jl_inv (slot Eng a x)
  /\ work (slot Eng a x) <= work x + tokens_of a
  /\ (small_bound <= work x -> work (slot Eng a x) + 128 <= work x + tokens_of a).
Proof.
  intros Hx Ha. rewrite slot_unfold.
  pose proof (arrive_slot a x Hx Ha) as H0. cbv zeta in H0. destruct H0 as (Hpe & Hw & HW & HP & HD).
  unfold step. set (st1 := arrive (slot_state a x)) in *.
  pose proof (rad_iteration st1 (s_now st1 + e_execute Eng (claim_view st1 (form_batch Eng st1))) HW HP HD)
    as H1. cbv zeta in H1. destruct H1 as [(HW' & HP' & HD' & Hk) Hbig].
  destruct (b_tokens (form_batch Eng st1) =? 0) eqn:Hz.
  - rewrite Hpe. cbn [next]. rewrite project_work. split; [apply project_inv; assumption|]. split; [lia|].
    intros Hs. apply Nat.eqb_eq in Hz. specialize (Hbig ltac:(lia)). lia.
  - cbn [next]. rewrite project_work. split; [apply project_inv; assumption|]. split; [lia|].
    intros Hs. specialize (Hbig ltac:(lia)). lia.
Qed.

Definition valid_dist0 (D : dist) : Prop :=
  Forall (fun pa => (0 <= fst pa)%Q /\ Forall valid_type (snd pa)) D
  /\ (fold_right (fun pa acc => fst pa + acc) 0 D == 1)%Q.

Lemma valid_dist_0 (D : dist) : valid_dist D -> valid_dist0 D.
Proof.
  intros [H1 H2]. split; [|exact H2]. eapply Forall_impl; [|exact H1].
  intros pa [Hp Ha]. split; [apply Qlt_le_weak; exact Hp|exact Ha].
Qed.

Lemma reachable_inv (D : dist) (s : joblist) : valid_dist0 D -> reachable Eng D s -> jl_inv s.
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

Lemma chain_ok (D : dist) : valid_dist0 D ->
  forall x, jl_inv x -> forall py, In py (chain Eng D x) -> 0 <= fst py /\ jl_inv (snd py).
Proof.
  intros [HD _] x Hx py Hin. unfold chain in Hin. apply in_map_iff in Hin as [[p a] [<- Hin]].
  rewrite Forall_forall in HD. destruct (HD (p, a) Hin) as [Hp Ha]. cbn [fst snd] in *.
  split; [lra|]. apply (slot_step a x Hx Ha).
Qed.

Lemma chain_expect (D : dist) (x : joblist) :
  expect (chain Eng D) work_q x = qsum (fun pa => fst pa * nq (work (slot Eng (snd pa) x))) D.
Proof. unfold expect, chain. rewrite qsum_map. reflexivity. Qed.

Lemma chain_drift (D : dist) (x : joblist) : valid_dist0 D -> jl_inv x -> small x = false ->
  expect (chain Eng D) work_q x + (inject_Z 128 - load D) <= work_q x.
Proof.
  intros [HD H1] Hx Hs. unfold small in Hs. apply Nat.ltb_ge in Hs.
  rewrite chain_expect.
  assert (Hle : qsum (fun pa => fst pa * nq (work (slot Eng (snd pa) x))) D
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

Lemma chain_inside (D : dist) (x : joblist) : valid_dist0 D -> jl_inv x -> small x = true ->
  expect (chain Eng D) work_q x <= 65536 + load D.
Proof.
  intros [HD H1] Hx Hs. unfold small, small_bound in Hs. apply Nat.ltb_lt in Hs.
  rewrite chain_expect.
  assert (Hle : qsum (fun pa => fst pa * nq (work (slot Eng (snd pa) x))) D
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

Lemma small_set_general : forall D : dist, valid_dist D -> load D < inject_Z 128 ->
  forall s, reachable Eng D s -> forall n,
    (inject_Z 128 - load D) * hit_partial (chain Eng D) small n s
      <= (if small s then inject_Z 65664 else work_q s).
Proof.
  intros D HD' HL s Hr n. pose proof (valid_dist_0 D HD') as HD.
  assert (Hi : jl_inv s) by exact (reachable_inv D s HD Hr).
  change (inject_Z 128) with 128 in *.
  assert (He : 0 < 128 - load D) by lra.
  destruct (foster_criterion_holds joblist (chain Eng D) small jl_inv work_q (128 - load D) (65536 + load D)
              He (chain_ok D HD) (fun x _ => nq_nonneg (work x))
              (fun x Hx Hs => chain_drift D x HD Hx Hs)
              (fun x Hx Hs => chain_inside D x HD Hx Hs) s Hi n) as [Hout Hin].
  destruct (small s) eqn:Hs.
  - pose proof (Hin eq_refl). change (inject_Z 65664) with 65664. lra.
  - exact (Hout eq_refl).
Qed.

(** ** From the small set to every reachable state: the regeneration argument *)

Lemma qsum_eq {A : Type} (f g : A -> Q) (l : list A) :
  (forall a, In a l -> f a == g a) -> qsum f l == qsum g l.
Proof.
  induction l as [|a l IH]; intros H; rewrite ?qsum_nil, ?qsum_cons; [reflexivity|].
  rewrite (H a (or_introl eq_refl)), IH; [reflexivity|]. intros b Hb; apply H; now right.
Qed.

Lemma qsum_lin {A : Type} (u v : Q) (f g : A -> Q) (l : list A) :
  qsum (fun a => u * f a + v * g a) l == u * qsum f l + v * qsum g l.
Proof. induction l as [|a l IH]; rewrite ?qsum_nil, ?qsum_cons; [ring|]. rewrite IH. ring. Qed.

(** One entry [e] of the list gets at least [d] less. *)
Lemma qsum_le_minus {A : Type} (f g : A -> Q) (l : list A) (e : A) (d : Q) :
  In e l -> (forall a, In a l -> f a <= g a) -> f e <= g e - d -> qsum f l <= qsum g l - d.
Proof.
  induction l as [|a l IH]; intros He Hfg Hd; [destruct He|]. rewrite !qsum_cons.
  destruct He as [<-|He].
  - assert (qsum f l <= qsum g l) by (apply qsum_le; intros; apply Hfg; now right). lra.
  - assert (f a <= g a) by (apply Hfg; now left).
    assert (qsum f l <= qsum g l - d) by (apply IH; auto; intros; apply Hfg; now right). lra.
Qed.

Section regeneration.
  Variables (X : Type) (K : kernel X) (I : X -> Prop).
  Hypothesis kernel_ok : forall x, I x -> forall py, In py (K x) -> 0 <= fst py /\ I (snd py).
  Hypothesis mass : forall x, I x -> qsum fst (K x) == 1.

  (** [kill A k f x]: the expectation of [f(X_k)] on the paths that avoid [A] at steps
      [1 .. k]. *)
  Fixpoint kill (A : X -> bool) (k : nat) (f : X -> Q) (x : X) : Q :=
    match k with
    | O => f x
    | S k' => qsum (fun py => if A (snd py) then 0 else fst py * kill A k' f (snd py)) (K x)
    end.

  Lemma kill_mono (A : X -> bool) (k : nat) (f g : X -> Q) :
    (forall y, I y -> f y <= g y) -> forall x, I x -> kill A k f x <= kill A k g x.
  Proof.
    intros Hfg. induction k as [|k IH]; intros x Hx; cbn [kill]; [now apply Hfg|].
    apply qsum_le. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy]. cbn [fst snd] in *.
    destruct (A y); [lra|]. pose proof (IH y Hy). nra.
  Qed.

  Lemma kill_nonneg (A : X -> bool) (k : nat) (f : X -> Q) :
    (forall y, I y -> 0 <= f y) -> forall x, I x -> 0 <= kill A k f x.
  Proof.
    intros Hf. induction k as [|k IH]; intros x Hx; cbn [kill]; [now apply Hf|].
    apply qsum_nonneg. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy]. cbn [fst snd] in *.
    destruct (A y); [lra|]. pose proof (IH y Hy). nra.
  Qed.

  Lemma kill_lin (A : X -> bool) (k : nat) (u v : Q) (f g : X -> Q) (x : X) :
    kill A k (fun y => u * f y + v * g y) x == u * kill A k f x + v * kill A k g x.
  Proof.
    revert x. induction k as [|k IH]; intros x; cbn [kill]; [reflexivity|].
    rewrite <- qsum_lin. apply qsum_eq. intros [p y] _. cbn [fst snd] in *.
    destruct (A y); [ring|]. rewrite IH. ring.
  Qed.

  Lemma mass_avoid (A : X -> bool) (x : X) (g : X -> Q) :
    I x -> (forall y, I y -> 0 <= g y <= 1) ->
    qsum (fun py => if A (snd py) then 0 else fst py * g (snd py)) (K x) <= 1.
  Proof.
    intros Hx Hg. rewrite <- (mass x Hx). apply qsum_le. intros [p y] Hin.
    destruct (kernel_ok x Hx _ Hin) as [Hp Hy]. cbn [fst snd] in *. destruct (Hg y Hy).
    destruct (A y); nra.
  Qed.

  Lemma kill_one_le (A : X -> bool) (k : nat) (x : X) : I x -> kill A k (fun _ => 1) x <= 1.
  Proof.
    revert x. induction k as [|k IH]; intros x Hx; cbn [kill]; [lra|].
    apply (mass_avoid A x (kill A k (fun _ => 1))); [exact Hx|]. intros y Hy. split; [apply kill_nonneg; [intros; lra|exact Hy]|exact (IH y Hy)].
  Qed.

  Lemma kill_one_step (A : X -> bool) (k : nat) (x : X) :
    I x -> kill A (S k) (fun _ => 1) x <= kill A k (fun _ => 1) x.
  Proof.
    revert x. induction k as [|k IH]; intros x Hx.
    - cbn [kill]. apply (mass_avoid A x (fun _ => 1)); [exact Hx|]. intros; lra.
    - change (kill A (S (S k)) (fun _ => 1) x) with
        (qsum (fun py => if A (snd py) then 0 else fst py * kill A (S k) (fun _ => 1) (snd py)) (K x)).
      change (kill A (S k) (fun _ => 1) x) with
        (qsum (fun py => if A (snd py) then 0 else fst py * kill A k (fun _ => 1) (snd py)) (K x)).
      apply qsum_le. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy].
      cbn [fst snd] in *. destruct (A y); [lra|]. pose proof (IH y Hy). nra.
  Qed.

  Lemma kill_one_antitone (A : X -> bool) (j k : nat) (x : X) :
    I x -> kill A (j + k) (fun _ => 1) x <= kill A k (fun _ => 1) x.
  Proof.
    intros Hx. induction j as [|j IH]; [cbn [Nat.add]; lra|].
    apply Qle_trans with (kill A (j + k) (fun _ => 1) x); [|exact IH].
    change (S j + k)%nat with (S (j + k)). apply kill_one_step. exact Hx.
  Qed.

  Lemma kill_lyapunov (A : X -> bool) (V : X -> Q) (L : Q) :
    0 <= L -> (forall y, I y -> 0 <= V y) -> (forall y, I y -> expect K V y <= V y + L) ->
    forall k x, I x -> kill A k V x <= V x + inject_Z (Z.of_nat k) * L.
  Proof.
    intros HL HV Hd k. induction k as [|k IH]; intros x Hx.
    - cbn [kill]. change (inject_Z (Z.of_nat 0)) with 0. lra.
    - cbn [kill].
      assert (H : qsum (fun py => if A (snd py) then 0 else fst py * kill A k V (snd py)) (K x)
                  <= qsum (fun py => 1 * (fst py * V (snd py)) + (inject_Z (Z.of_nat k) * L) * fst py) (K x)).
      { apply qsum_le. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy]. cbn [fst snd] in *.
        pose proof (IH y Hy). pose proof (HV y Hy).
        assert (0 <= inject_Z (Z.of_nat k)) by (change 0 with (inject_Z 0); rewrite <- Zle_Qle; lia).
        assert (Hc : 0 <= inject_Z (Z.of_nat k) * L) by nra.
        set (c := inject_Z (Z.of_nat k) * L) in *. clearbody c.
        destruct (A y); nra. }
      rewrite qsum_lin in H. fold (expect K V x) in H. rewrite (mass x Hx) in H.
      pose proof (Hd x Hx). rewrite Nat2Z.inj_succ, <- Z.add_1_r, inject_Z_plus. change (inject_Z 1) with 1. nra.
  Qed.

  Lemma hit_nonneg (A : X -> bool) (n : nat) (x : X) : I x -> 0 <= hit_partial K A n x.
  Proof.
    revert x. induction n as [|n IH]; intros x Hx; cbn [hit_partial]; [lra|].
    assert (0 <= qsum (fun py => if A (snd py) then 0 else fst py * hit_partial K A n (snd py)) (K x)).
    { apply qsum_nonneg. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy]. cbn [fst snd] in *.
      destruct (A y); [lra|]. pose proof (IH y Hy). nra. }
    lra.
  Qed.

  Lemma hit_le_n (A : X -> bool) (n : nat) (x : X) : I x -> hit_partial K A n x <= inject_Z (Z.of_nat n).
  Proof.
    revert x. induction n as [|n IH]; intros x Hx; cbn [hit_partial]; [change (inject_Z (Z.of_nat 0)) with 0; lra|].
    assert (H : qsum (fun py => if A (snd py) then 0 else fst py * hit_partial K A n (snd py)) (K x)
                <= qsum (fun py => inject_Z (Z.of_nat n) * fst py) (K x)).
    { apply qsum_le. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy]. cbn [fst snd] in *.
      pose proof (IH y Hy). pose proof (hit_nonneg A n y Hy). destruct (A y); nra. }
    assert (E0 : qsum (fun py => inject_Z (Z.of_nat n) * fst py) (K x) == inject_Z (Z.of_nat n)).
    { transitivity (qsum (fun py => inject_Z (Z.of_nat n) * fst py + 0 * fst py) (K x)).
      - apply qsum_eq. intros; ring.
      - rewrite qsum_lin, (mass x Hx). ring. }
    rewrite Nat2Z.inj_succ, <- Z.add_1_r, inject_Z_plus. change (inject_Z 1) with 1. nra.
  Qed.

  (** The Markov property at a fixed time [T]. *)
  Lemma hit_split (A : X -> bool) (T m : nat) (x : X) :
    I x -> hit_partial K A (T + m) x <= inject_Z (Z.of_nat T) + kill A T (hit_partial K A m) x.
  Proof.
    revert x. induction T as [|T IH]; intros x Hx.
    - cbn [Nat.add kill]. change (inject_Z (Z.of_nat 0)) with 0. lra.
    - change (S T + m)%nat with (S (T + m)). cbn [hit_partial kill].
      assert (H : qsum (fun py => if A (snd py) then 0 else fst py * hit_partial K A (T + m) (snd py)) (K x)
                  <= qsum (fun py => inject_Z (Z.of_nat T) * (if A (snd py) then 0 else fst py * 1)
                        + 1 * (if A (snd py) then 0 else fst py * kill A T (hit_partial K A m) (snd py))) (K x)).
      { apply qsum_le. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy]. cbn [fst snd] in *.
        pose proof (IH y Hy). destruct (A y); nra. }
      rewrite qsum_lin in H.
      pose proof (mass_avoid A x (fun _ => 1) Hx ltac:(intros; cbv beta; lra)) as Hm. cbv beta in Hm.
      assert (0 <= inject_Z (Z.of_nat T)) by (change 0 with (inject_Z 0); rewrite <- Zle_Qle; lia).
      rewrite Nat2Z.inj_succ, <- Z.add_1_r, inject_Z_plus. change (inject_Z 1) with 1. nra.
  Qed.

  (** The strong Markov property at the first visit to [C], when [A] is reached from [C]
      within [M] expected steps at every horizon up to [n]. *)
  Lemma hit_via (A C : X -> bool) (M : Q) (n : nat) :
    0 <= M -> (forall m y, (m <= n)%nat -> I y -> C y = true -> hit_partial K A m y <= M) ->
    forall x, I x -> hit_partial K A n x <= hit_partial K C n x + M.
  Proof.
    intros HM. induction n as [|n IH]; intros Hc x Hx; cbn [hit_partial]; [lra|].
    assert (H : qsum (fun py => if A (snd py) then 0 else fst py * hit_partial K A n (snd py)) (K x)
                <= qsum (fun py => 1 * (if C (snd py) then 0 else fst py * hit_partial K C n (snd py))
                                   + M * fst py) (K x)).
    { apply qsum_le. intros [p y] Hin. destruct (kernel_ok x Hx _ Hin) as [Hp Hy]. cbn [fst snd] in *.
      pose proof (hit_nonneg C n y Hy). pose proof (hit_nonneg A n y Hy).
      destruct (C y) eqn:HC.
      - pose proof (Hc n y (Nat.le_succ_diag_r n) Hy HC). destruct (A y); nra.
      - assert (Hn : hit_partial K A n y <= hit_partial K C n y + M).
        { apply IH; [|exact Hy]. intros m z Hm. apply Hc. lia. }
        destruct (A y); nra. }
    rewrite qsum_lin, (mass x Hx) in H. lra.
  Qed.

  (** A path into [A] of [k] steps and probability [r]: [kill A k 1 <= 1 - r]. *)
  Lemma kill_hit_entry (A : X -> bool) (k : nat) (x : X) (p r : Q) (y : X) :
    I x -> In (p, y) (K x) -> (A y = true \/ kill A k (fun _ => 1) y <= 1 - r) -> 0 <= r <= 1 ->
    kill A (S k) (fun _ => 1) x <= 1 - p * r.
  Proof.
    intros Hx Hin Hy Hr. destruct (kernel_ok x Hx _ Hin) as [Hp Hy']. cbn [fst snd] in *.
    cbn [kill]. rewrite <- (mass x Hx).
    apply (qsum_le_minus _ _ _ (p, y)); [exact Hin| |].
    - intros [p' y'] Hin'. destruct (kernel_ok x Hx _ Hin') as [Hp' Hy'']. cbn [fst snd] in *.
      pose proof (kill_one_le A k y' Hy''). pose proof (kill_nonneg A k (fun _ => 1) ltac:(intros; cbv beta; lra) y' Hy'').
      destruct (A y'); nra.
    - cbn [fst snd] in *. destruct Hy as [HA|Hk].
      + rewrite HA. nra.
      + destruct (A y); [nra|]. nra.
  Qed.
End regeneration.

Section regeneration_bound.
  Variables (X : Type) (K : kernel X) (I : X -> Prop).
  Hypothesis kernel_ok : forall x, I x -> forall py, In py (K x) -> 0 <= fst py /\ I (snd py).
  Hypothesis mass : forall x, I x -> qsum fst (K x) == 1.

  (** From every state of [C], [A] is reached within [T] steps with probability at least
      [delta], and the expected time back to [C] after [T] steps is at most [Gb]: then [A] is
      reached from [C] within [(T + Gb) / delta] expected steps, at every horizon. *)
  Lemma hit_regenerate (A C : X -> bool) (G : X -> Q) (T : nat) (delta Gb : Q) :
    (1 <= T)%nat -> 0 < delta -> delta <= 1 -> 0 <= Gb ->
    (forall m z, I z -> hit_partial K C m z <= G z) ->
    (forall y, I y -> C y = true -> kill X K A T (fun _ => 1) y <= 1 - delta) ->
    (forall y, I y -> C y = true -> kill X K A T G y <= Gb) ->
    forall n y, I y -> C y = true ->
      hit_partial K A n y <= / delta * (inject_Z (Z.of_nat T) + Gb).
  Proof.
    intros HT Hd0 Hd1 HGb HG Hkill HkG.
    set (Tq := inject_Z (Z.of_nat T)).
    assert (HTq : 0 <= Tq) by (unfold Tq; change 0 with (inject_Z 0); rewrite <- Zle_Qle; lia).
    set (M := / delta * (Tq + Gb)).
    assert (HMd : M * delta == Tq + Gb) by (unfold M; field; lra).
    assert (HM0 : 0 <= M) by (unfold M; apply Qmult_le_0_compat; [apply Qinv_le_0_compat|]; lra).
    assert (HMT : Tq <= M) by nra.
    assert (Hall : forall N n, (n <= N)%nat -> forall y, I y -> C y = true -> hit_partial K A n y <= M).
    { induction N as [|N IH]; intros n Hn y Hy Hc.
      - replace n with 0%nat by lia. cbn [hit_partial]. exact HM0.
      - destruct (Nat.le_gt_cases n N) as [HnN|HnN]; [exact (IH n HnN y Hy Hc)|].
        destruct (Nat.le_gt_cases n T) as [HnT|HnT].
        + pose proof (hit_le_n X K I kernel_ok mass A n y Hy) as Hle.
          assert (inject_Z (Z.of_nat n) <= Tq) by (unfold Tq; rewrite <- Zle_Qle; lia). lra.
        + replace n with (T + (n - T))%nat by lia.
          pose proof (hit_split X K I kernel_ok mass A T (n - T) y Hy) as Hs. fold Tq in Hs.
          assert (Hv : forall z, I z -> hit_partial K A (n - T) z <= 1 * G z + M * 1).
          { intros z Hz. pose proof (hit_via X K I kernel_ok mass A C M (n - T) HM0) as Hv.
            specialize (Hv ltac:(intros m w Hm Hw Hcw; apply (IH m); [lia|exact Hw|exact Hcw]) z Hz).
            pose proof (HG (n - T)%nat z Hz). lra. }
          pose proof (kill_mono X K I kernel_ok A T _ _ Hv y Hy) as Hk.
          rewrite (kill_lin X K A T 1 M G (fun _ => 1) y) in Hk.
          pose proof (Hkill y Hy Hc). pose proof (HkG y Hy Hc). nra. }
    intros n y Hy Hc. exact (Hall n n (le_n n) y Hy Hc).
  Qed.
End regeneration_bound.

(** ** B4 for the RAD node *)

Local Open Scope nat_scope.

Lemma rad_batch_pos (st1 : state) :
  Forall job_w (s_waiting st1) -> Forall job_w (s_prefilling st1) -> Forall job_d (s_decoding st1) ->
  0 < mwork st1 -> 0 < b_tokens (form_batch Eng st1).
Proof.
  intros HW HP HD Hpos.
  assert (HW' : Forall (fun j => j_pre j mod 128 = 0 /\ 0 < j_pre j) (s_waiting st1))
    by (eapply Forall_impl; [|exact HW]; intros j (H1 & H2 & _); tauto).
  assert (HP' : Forall (fun j => j_pre j mod 128 = 0 /\ 0 < j_pre j) (s_prefilling st1))
    by (eapply Forall_impl; [|exact HP]; intros j (H1 & H2 & _); tauto).
  pose proof (rad_form_batch_pos 128 Eng st1 ltac:(lia) E_schedule E_while HW' HP') as Hfb.
  cbv zeta in Hfb.
  destruct Hfb as [[Hm ->] | [[_ [_ ->]] | [_ [_ [h [ws [_ ->]]]]]]]; cbn [b_tokens]; [|lia|lia].
  destruct (length (s_decoding st1)) as [|nd] eqn:Hl; [|lia]. exfalso.
  unfold rad_mode, view_of, residents in Hm; cbn [v_decoding v_count] in Hm.
  rewrite Hl in Hm. apply orb_true_iff in Hm as [Hm|Hm]; [apply Nat.leb_le in Hm; lia|apply Nat.eqb_eq in Hm].
  assert (HW0 : s_waiting st1 = []) by (apply length_zero_iff_nil; lia).
  assert (HP0 : s_prefilling st1 = []) by (apply length_zero_iff_nil; lia).
  assert (HD0 : s_decoding st1 = []) by (apply length_zero_iff_nil; lia).
  unfold mwork in Hpos. rewrite HW0, HP0, HD0 in Hpos. cbn in Hpos. lia.
Qed.

(** A slot with no arrivals serves at least one token of a node that has work. *)
Lemma slot_empty_serves (x : joblist) :
  jl_inv x -> 0 < work x -> work (slot Eng [] x) < work x.
Proof.
  intros Hx Hw. rewrite slot_unfold.
  pose proof (arrive_slot [] x Hx (Forall_nil _)) as H0. cbv zeta in H0.
  destruct H0 as (Hpe & Hm & HW & HP & HD). cbn [tokens_of fold_right] in Hm. rewrite Nat.add_0_r in Hm.
  unfold step. set (st1 := arrive (slot_state [] x)) in *.
  pose proof (rad_batch_pos st1 HW HP HD ltac:(lia)) as Hb.
  pose proof (rad_iteration st1 (s_now st1 + e_execute Eng (claim_view st1 (form_batch Eng st1))) HW HP HD)
    as H1. cbv zeta in H1. destruct H1 as [(_ & _ & _ & Hk) _].
  destruct (b_tokens (form_batch Eng st1) =? 0) eqn:Hz; [apply Nat.eqb_eq in Hz; lia|].
  cbn [next]. rewrite project_work. lia.
Qed.

Lemma work_zero (x : joblist) : jl_inv x -> work x = 0 -> x = jl_empty.
Proof.
  destruct x as [w p d]. intros (Hw & Hp & Hd) H0. unfold work in H0; cbn [jl_waiting jl_prefilling jl_decoding] in *.
  destruct w as [|[a b] w]; [|inversion Hw as [|? ? (_ & Ha & _) _]; cbn in Ha, H0; lia].
  destruct p as [|[a b] p]; [|inversion Hp as [|? ? (_ & Ha & _) _]; cbn in Ha, H0; lia].
  destruct d as [|[a b] d]; [reflexivity|inversion Hd as [|? ? (_ & Ha & _) _]; cbn in Ha, H0; lia].
Qed.

Fixpoint drain (n : nat) (x : joblist) : joblist :=
  match n with
  | O => x
  | S n' => drain n' (slot Eng [] x)
  end.

Lemma drain_empty (n : nat) (x : joblist) : jl_inv x -> work x <= n -> drain n x = jl_empty.
Proof.
  revert x. induction n as [|n IH]; intros x Hx Hw; cbn [drain].
  - apply work_zero; [exact Hx|lia].
  - destruct (slot_step [] x Hx (Forall_nil _)) as (Hi & Hle & _).
    apply IH; [exact Hi|]. cbn [tokens_of fold_right] in Hle.
    destruct (Nat.eq_dec (work x) 0) as [H0|H0].
    + lia.
    + pose proof (slot_empty_serves x Hx ltac:(lia)). lia.
Qed.

Local Open Scope Q_scope.

Fixpoint qpow (q : Q) (n : nat) : Q :=
  match n with
  | O => 1
  | S n' => q * qpow q n'
  end.

(** Paths of the chain: [traj D x y k r], from [x] to [y] in [k] slots of probability [r]. *)
Inductive traj (D : dist) : joblist -> joblist -> nat -> Q -> Prop :=
  | traj_refl x : traj D x x 0 1
  | traj_step x p a y k r :
      In (p, a) D -> 0 < p -> traj D (slot Eng a x) y k r -> traj D x y (S k) (p * r)
  | traj_eq x y k r r' : traj D x y k r -> r == r' -> traj D x y k r'.

Lemma traj_snoc (D : dist) (x y : joblist) (k : nat) (r : Q) (p : Q) (a : list rtype) :
  traj D x y k r -> In (p, a) D -> 0 < p -> traj D x (slot Eng a y) (S k) (r * p).
Proof.
  intros Ht Hin Hp. induction Ht as [x|x p' a' y k r Hin' Hp' Ht IH|x y k r r' Ht IH Heq].
  - apply traj_eq with (p * 1); [apply (traj_step D x p a); [exact Hin|exact Hp|apply traj_refl]|ring].
  - apply traj_eq with (p' * (r * p)); [apply (traj_step D x p' a'); assumption|ring].
  - apply traj_eq with (r * p); [exact IH|rewrite Heq; reflexivity].
Qed.

Lemma traj_app (D : dist) (x y z : joblist) (k k' : nat) (r r' : Q) :
  traj D x y k r -> traj D y z k' r' -> traj D x z (k + k') (r * r').
Proof.
  intros H1 H2. induction H1 as [x|x p a y k r Hin Hp Ht IH|x y k r r0 Ht IH Heq].
  - apply traj_eq with r'; [exact H2|ring].
  - apply traj_eq with (p * (r * r')); [apply (traj_step D x p a); auto|ring].
  - apply traj_eq with (r * r'); [auto|rewrite Heq; reflexivity].
Qed.

Lemma traj_zero (D : dist) (x y : joblist) (k : nat) (r : Q) :
  traj D x y k r -> k = 0%nat -> x = y /\ r == 1.
Proof.
  induction 1 as [x|x p a y k r _ _ _ _|x y k r r' Ht IH Heq]; intros Hk.
  - split; reflexivity.
  - discriminate.
  - destruct (IH Hk) as [Hxy Hr]. split; [exact Hxy|rewrite <- Heq; exact Hr].
Qed.

Lemma qsum_entry {A : Type} (f : A -> Q) (l : list A) (e : A) :
  In e l -> (forall a, In a l -> 0 <= f a) -> f e <= qsum f l.
Proof.
  induction l as [|a l IH]; intros He Hf; [destruct He|]. rewrite qsum_cons.
  destruct He as [<-|He].
  - assert (0 <= qsum f l) by (apply qsum_nonneg; intros; apply Hf; now right). lra.
  - assert (0 <= f a) by (apply Hf; now left).
    assert (f e <= qsum f l) by (apply IH; auto; intros; apply Hf; now right). lra.
Qed.

Lemma dist_entry_le (D : dist) (p : Q) (a : list rtype) : valid_dist0 D -> In (p, a) D -> p <= 1.
Proof.
  intros [HD H1] Hin. change (fold_right (fun pa acc => fst pa + acc) 0 D) with (qsum fst D) in H1.
  rewrite <- H1. apply (qsum_entry fst D (p, a) Hin).
  intros [p' a'] Hin'. rewrite Forall_forall in HD. destruct (HD _ Hin') as [Hp _]. cbn [fst] in *. lra.
Qed.

Lemma traj_prob (D : dist) (x y : joblist) (k : nat) (r : Q) :
  valid_dist0 D -> traj D x y k r -> 0 < r /\ r <= 1.
Proof.
  intros HD. induction 1 as [x|x p a y k r Hin Hp Ht IH|x y k r r' Ht IH Heq].
  - lra.
  - pose proof (dist_entry_le D p a HD Hin). split; nra.
  - rewrite <- Heq. exact IH.
Qed.

Lemma traj_drain (D : dist) (q : Q) : In (q, []) D -> 0 < q ->
  forall n x, traj D x (drain n x) n (qpow q n).
Proof.
  intros Hin Hq n. induction n as [|n IH]; intros x; cbn [drain qpow]; [apply traj_refl|].
  apply (traj_step D x q []); [exact Hin|exact Hq|apply IH].
Qed.

Lemma reachable_traj (D : dist) (s : joblist) :
  reachable Eng D s -> exists k r, 0 < r /\ traj D jl_empty s k r.
Proof.
  induction 1 as [|x p a Hr IH Hin Hp].
  - exists 0%nat, 1. split; [lra|apply traj_refl].
  - destruct IH as (k & r & Hr0 & Ht). exists (S k), (r * p).
    split; [nra|]. apply traj_snoc; assumption.
Qed.

Lemma chain_mass (D : dist) : valid_dist0 D -> forall x, qsum fst (chain Eng D x) == 1.
Proof. intros [_ H1] x. unfold chain. rewrite qsum_map. exact H1. Qed.

Lemma in_chain (D : dist) (x : joblist) (p : Q) (a : list rtype) :
  In (p, a) D -> In (p, slot Eng a x) (chain Eng D x).
Proof. intros Hin. unfold chain. apply (in_map (fun pa => (fst pa, slot Eng (snd pa) x)) D (p, a) Hin). Qed.

Lemma traj_kill (D : dist) (A : joblist -> bool) (x y : joblist) (k : nat) (r : Q) :
  valid_dist0 D -> traj D x y k r -> jl_inv x -> A y = true -> (1 <= k)%nat ->
  kill joblist (chain Eng D) A k (fun _ => 1) x <= 1 - r.
Proof.
  intros HD. induction 1 as [x|x p a y k r Hin Hp Ht IH|x y k r r' Ht IH Heq]; intros Hx HA Hk.
  - lia.
  - pose proof (traj_prob D _ _ _ _ HD Ht) as Hr.
    assert (Hx' : jl_inv (slot Eng a x)).
    { destruct HD as [HD _]. rewrite Forall_forall in HD. destruct (HD _ Hin) as [_ Ha].
      exact (proj1 (slot_step a x Hx Ha)). }
    apply (kill_hit_entry joblist (chain Eng D) jl_inv (chain_ok D HD) (fun x _ => chain_mass D HD x) A k x p r
             (slot Eng a x) Hx (in_chain D x p a Hin)); [|lra].
    destruct (A (slot Eng a x)) eqn:HA'; [left; reflexivity|right].
    destruct k as [|k].
    + destruct (traj_zero D _ _ _ _ Ht eq_refl) as [Hxy _]. rewrite Hxy in HA'. congruence.
    + apply IH; [exact Hx'|exact HA|lia].
  - pose proof (IH Hx HA Hk). lra.
Qed.

(** An empty slot has positive probability: every request brings at least 129 tokens. *)
Lemma empty_slot (D : dist) : valid_dist0 D -> load D < inject_Z 128 -> exists q, In (q, []) D /\ 0 < q.
Proof.
  intros [HD H1] HL.
  assert (H : (exists q, In (q, []) D /\ 0 < q) \/ 129 * qsum fst D <= load D).
  { clear H1 HL. induction D as [|[p a] D IH].
    - right. cbn. lra.
    - inversion HD as [|? ? [Hp Ha] HD']; subst. destruct (IH HD') as [(q & Hq & Hq0)|Hle].
      + left. exists q. split; [now right|exact Hq0].
      + destruct a as [|t a].
        * destruct (Qlt_le_dec 0 p) as [Hp0|Hp0].
          -- left. exists p. split; [now left|exact Hp0].
          -- right. rewrite qsum_cons. unfold load. cbn [fold_right fst snd].
             change (fold_right (fun pa acc => fst pa * inject_Z (Z.of_nat (tokens_of (snd pa))) + acc) 0 D)
               with (load D).
             cbn [tokens_of fold_right]. change (inject_Z (Z.of_nat 0)) with 0. cbn [fst snd] in Hp. nra.
        * right. rewrite qsum_cons. unfold load. cbn [fold_right fst snd].
          change (fold_right (fun pa acc => fst pa * inject_Z (Z.of_nat (tokens_of (snd pa))) + acc) 0 D)
            with (load D).
          inversion Ha as [|? ? [[k0 [Hk0 Hpt]] Hd] _]; subst.
          assert (Ht : (129 <= tokens_of (t :: a))%nat) by (cbn [tokens_of fold_right]; lia).
          assert (Hq : 129 <= inject_Z (Z.of_nat (tokens_of (t :: a))))
            by (change 129 with (inject_Z 129); rewrite <- Zle_Qle; lia).
          cbn [fst snd] in Hp. nra. }
  destruct H as [H|H]; [exact H|]. exfalso.
  change (fold_right (fun pa acc => fst pa + acc) 0 D) with (qsum fst D) in H1.
  rewrite H1 in H. change (inject_Z 128) with 128 in HL. lra.
Qed.

Lemma pairs_eqb_refl (l : list (nat * nat)) : pairs_eqb l l = true.
Proof.
  unfold pairs_eqb. rewrite Nat.eqb_refl. cbn [andb].
  induction l as [|[a b] l IH]; [reflexivity|]. cbn [combine forallb]. rewrite !Nat.eqb_refl, IH. reflexivity.
Qed.

Lemma jl_eqb_refl (s : joblist) : jl_eqb s s = true.
Proof. unfold jl_eqb. rewrite !pairs_eqb_refl. reflexivity. Qed.

(** [partial_return] is [hit_partial] of the singleton. *)
Fixpoint pr_from (E : engine) (D : dist) (s : joblist) (n : nat) (x : joblist) : Q :=
  match n with
  | O => 0
  | S n' => pr_from E D s n' x + avoid E D s n' x
  end.

Lemma partial_return_from (E : engine) (D : dist) (s : joblist) (n : nat) :
  partial_return E D s n = pr_from E D s n s.
Proof. induction n as [|n IH]; cbn [partial_return pr_from]; [reflexivity|]. rewrite IH. reflexivity. Qed.

Lemma avoid_qsum (E : engine) (D : dist) (s : joblist) (k : nat) (x : joblist) :
  avoid E D s (S k) x
  = qsum (fun py => if jl_eqb (snd py) s then 0 else fst py * avoid E D s k (snd py)) (chain E D x).
Proof. unfold chain. rewrite qsum_map. reflexivity. Qed.

Lemma pr_front (E : engine) (D : dist) (s : joblist) (n : nat) (x : joblist) :
  pr_from E D s (S n) x
  == 1 + qsum (fun py => if jl_eqb (snd py) s then 0 else fst py * pr_from E D s n (snd py)) (chain E D x).
Proof.
  revert x. induction n as [|n IH]; intros x.
  - cbn [pr_from avoid]. transitivity (1 + qsum (fun _ => 0) (chain E D x)).
    + assert (Z0 : forall l : list (Q * joblist), qsum (fun _ => 0) l == 0)
        by (induction l as [|a l IHl]; rewrite ?qsum_nil, ?qsum_cons; [reflexivity|rewrite IHl; ring]).
      rewrite Z0. ring.
    + apply Qplus_inj_l, qsum_eq. intros [p y] _. cbn [fst snd pr_from]. destruct (jl_eqb y s); ring.
  - change (pr_from E D s (S (S n)) x) with (pr_from E D s (S n) x + avoid E D s (S n) x).
    rewrite IH, avoid_qsum.
    transitivity (1 + qsum (fun py => 1 * (if jl_eqb (snd py) s then 0 else fst py * pr_from E D s n (snd py))
                             + 1 * (if jl_eqb (snd py) s then 0 else fst py * avoid E D s n (snd py))) (chain E D x)).
    + rewrite qsum_lin. ring.
    + apply Qplus_inj_l, qsum_eq. intros [p y] _. cbn [fst snd pr_from]. destruct (jl_eqb y s); ring.
Qed.

Lemma pr_hit (E : engine) (D : dist) (s : joblist) (n : nat) (x : joblist) :
  pr_from E D s n x == hit_partial (chain E D) (fun y => jl_eqb y s) n x.
Proof.
  revert x. induction n as [|n IH]; intros x; [reflexivity|].
  rewrite pr_front. cbn [hit_partial]. apply Qplus_inj_l, qsum_eq. intros [p y] _. cbn [fst snd].
  destruct (jl_eqb y s); [reflexivity|]. rewrite IH. reflexivity.
Qed.

Lemma chain_expect_le (D : dist) (x : joblist) : valid_dist0 D -> jl_inv x ->
  expect (chain Eng D) work_q x <= work_q x + load D.
Proof.
  intros [HD H1] Hx. rewrite chain_expect.
  assert (Hle : qsum (fun pa => fst pa * nq (work (slot Eng (snd pa) x))) D
                <= qsum (fun pa => fst pa * (nq (work x) + nq (tokens_of (snd pa)))) D).
  { apply qsum_le. intros [p a] Hin. rewrite Forall_forall in HD. destruct (HD (p, a) Hin) as [Hp Ha].
    cbn [fst snd] in *. destruct (slot_step a x Hx Ha) as (_ & Hd & _).
    pose proof (nq_le_add _ 0 _ _ ltac:(rewrite Nat.add_0_r; exact Hd)) as Hq.
    change (nq 0) with 0 in Hq. nra. }
  pose proof (qsum_affine (nq (work x)) (fun pa => nq (tokens_of (snd pa))) D) as He.
  change (fold_right (fun pa acc => fst pa + acc) 0 D) with (qsum fst D) in H1.
  change (load D) with (qsum (fun pa => fst pa * nq (tokens_of (snd pa))) D).
  change (work_q x) with (nq (work x)).
  rewrite H1 in He. lra.
Qed.

Lemma small_hit_le (D : dist) : valid_dist0 D -> load D < 128 ->
  forall m z, jl_inv z ->
    hit_partial (chain Eng D) small m z <= / (128 - load D) * work_q z + (/ (128 - load D) * 65664) * 1.
Proof.
  intros HD HL m z Hz.
  assert (He : 0 < 128 - load D) by lra.
  destruct (foster_criterion_holds joblist (chain Eng D) small jl_inv work_q (128 - load D) (65536 + load D)
              He (chain_ok D HD) (fun x _ => nq_nonneg (work x))
              (fun x Hx Hs => chain_drift D x HD Hx Hs)
              (fun x Hx Hs => chain_inside D x HD Hx Hs) z Hz m) as [Hout Hin].
  assert (Hb : (128 - load D) * hit_partial (chain Eng D) small m z <= work_q z + 65664).
  { pose proof (nq_nonneg (work z)) as H0. change (nq (work z)) with (work_q z) in H0.
    destruct (small z) eqn:Hs; [pose proof (Hin eq_refl)|pose proof (Hout eq_refl)]; lra. }
  set (h := hit_partial (chain Eng D) small m z) in *. set (e := 128 - load D) in *.
  assert (Hie : 0 < / e) by (apply Qinv_lt_0_compat; exact He).
  assert (Hinv : / e * e == 1) by (field; lra).
  setoid_replace h with (/ e * (e * h)) by (rewrite Qmult_assoc, Hinv; ring).
  nra.
Qed.

Lemma one_node_general (D : dist) : valid_dist0 D -> load D < 128 ->
  forall s, reachable Eng D s -> positive_recurrent Eng D s.
Proof.
  intros HD HL s Hr.
  set (A := fun y => jl_eqb y s).
  set (eps := 128 - load D).
  assert (He : 0 < eps) by (unfold eps; lra).
  assert (HL0 : 0 <= load D).
  { unfold load. destruct HD as [HD _]. clear -HD. induction D as [|[p a] D IH]; cbn [fold_right]; [lra|].
    inversion HD as [|? ? [Hp _] HD']; subst. cbn [fst snd] in *. specialize (IH HD').
    assert (0 <= inject_Z (Z.of_nat (tokens_of a))) by (change 0 with (inject_Z 0); rewrite <- Zle_Qle; lia).
    change (fold_right (fun pa acc => fst pa * inject_Z (Z.of_nat (tokens_of (snd pa))) + acc) 0 D)
      with (load D) in *. nra. }
  destruct (reachable_traj D s Hr) as (k & r & Hr0 & Ht).
  destruct (empty_slot D HD ltac:(change (inject_Z 128) with 128; lra)) as (q & Hq & Hq0).
  set (T := (small_bound + k)%nat).
  set (qp := qpow q small_bound).
  destruct (traj_prob D _ _ _ _ HD (traj_drain D q Hq Hq0 small_bound jl_empty)) as [Hqp0 Hqp1].
  fold qp in Hqp0, Hqp1.
  destruct (traj_prob D _ _ _ _ HD Ht) as [_ Hr1].
  set (delta := qp * r).
  assert (Hd0 : 0 < delta) by (unfold delta; nra).
  assert (Hd1 : delta <= 1) by (unfold delta; nra).
  set (Tq := inject_Z (Z.of_nat T)).
  assert (HTq : 0 <= Tq) by (unfold Tq; change 0 with (inject_Z 0); rewrite <- Zle_Qle; lia).
  set (ie := / eps).
  assert (Hie : 0 < ie) by (apply Qinv_lt_0_compat; exact He).
  set (G := fun z => ie * work_q z + (ie * 65664) * 1).
  set (Gb := ie * (65536 + Tq * load D) + ie * 65664).
  assert (HcL : 0 <= Tq * load D) by nra.
  assert (HGb : 0 <= Gb) by (unfold Gb; nra).
  (* from the small set, [s] within [T] slots with probability at least [delta] *)
  assert (Hkill : forall y, jl_inv y -> small y = true -> kill joblist (chain Eng D) A T (fun _ => 1) y <= 1 - delta).
  { intros y Hy Hs. unfold small in Hs. apply Nat.ltb_lt in Hs.
    pose proof (traj_drain D q Hq Hq0 small_bound y) as Hdr.
    rewrite (drain_empty small_bound y Hy ltac:(lia)) in Hdr.
    pose proof (traj_app D _ _ _ _ _ _ _ Hdr Ht) as Hyt.
    apply (traj_kill D A y s T delta HD); [exact Hyt|exact Hy|apply jl_eqb_refl|unfold T, small_bound; lia]. }
  (* after [T] slots from the small set, the expected time back to it *)
  assert (HkG : forall y, jl_inv y -> small y = true -> kill joblist (chain Eng D) A T G y <= Gb).
  { intros y Hy Hs. unfold small in Hs. apply Nat.ltb_lt in Hs.
    pose proof (kill_lin joblist (chain Eng D) A T ie (ie * 65664) work_q (fun _ => 1) y) as E0.
    cbv beta in E0. fold G in E0.
    pose proof (kill_lyapunov joblist (chain Eng D) jl_inv (chain_ok D HD) (fun x _ => chain_mass D HD x)
                  A work_q (load D) HL0 (fun x _ => nq_nonneg (work x)) (fun x Hx => chain_expect_le D x HD Hx) T y Hy) as HV.
    fold Tq in HV.
    pose proof (kill_one_le joblist (chain Eng D) jl_inv (chain_ok D HD) (fun x _ => chain_mass D HD x) A T y Hy) as H1.
    assert (Hw : work_q y <= 65536)
      by (unfold work_q; change 65536 with (inject_Z 65536); rewrite <- Zle_Qle; unfold small_bound in Hs; lia).
    assert (HV' : kill joblist (chain Eng D) A T work_q y <= 65536 + Tq * load D) by lra.
    set (c := Tq * load D) in *. unfold Gb. clearbody c.
    set (kv := kill joblist (chain Eng D) A T work_q y) in *.
    set (k1 := kill joblist (chain Eng D) A T (fun _ => 1) y) in *.
    nra. }
  assert (HG : forall m z, jl_inv z -> hit_partial (chain Eng D) small m z <= G z)
    by (intros m z Hz; exact (small_hit_le D HD HL m z Hz)).
  pose proof (hit_regenerate joblist (chain Eng D) jl_inv (chain_ok D HD) (fun x _ => chain_mass D HD x)
                A small G T delta Gb ltac:(unfold T, small_bound; lia) Hd0 Hd1 HGb HG Hkill HkG) as Hreg.
  set (M := / delta * (Tq + Gb)) in *.
  assert (HM0 : 0 <= M) by (unfold M; apply Qmult_le_0_compat; [apply Qinv_le_0_compat|]; lra).
  exists (G s + M). intros n.
  rewrite partial_return_from, (pr_hit Eng D s n s).
  pose proof (hit_via joblist (chain Eng D) jl_inv (chain_ok D HD) (fun x _ => chain_mass D HD x)
                A small M n HM0 (fun m y _ Hy Hc => Hreg m y Hy Hc) s (reachable_inv D s HD Hr)) as Hv.
  pose proof (HG n s (reachable_inv D s HD Hr)). fold A. lra.
Qed.

Lemma one_node_for : theorem2_one_node_for Eng.
Proof. intros D HD HL. apply one_node_general; [apply valid_dist_0; exact HD|exact HL]. Qed.

(** ** B5, the per-node part: the routed distribution is a slot distribution with [L / g] *)

Lemma qsum_app {A : Type} (f : A -> Q) (l m : list A) : qsum f (l ++ m) == qsum f l + qsum f m.
Proof. induction l as [|a l IH]; cbn [app]; rewrite ?qsum_nil, ?qsum_cons; [ring|]. rewrite IH. ring. Qed.

Lemma qsum_flat_map {A B : Type} (f : B -> Q) (h : A -> list B) (l : list A) :
  qsum f (flat_map h l) == qsum (fun a => qsum f (h a)) l.
Proof. induction l as [|a l IH]; cbn [flat_map]; rewrite ?qsum_nil, ?qsum_cons; [reflexivity|]. rewrite qsum_app, IH. reflexivity. Qed.

Lemma qsum_scale {A : Type} (c : Q) (f : A -> Q) (l : list A) : qsum (fun a => c * f a) l == c * qsum f l.
Proof. induction l as [|a l IH]; rewrite ?qsum_nil, ?qsum_cons; [ring|]. rewrite IH. ring. Qed.

Lemma nq_add (m n : nat) : nq (m + n) == nq m + nq n.
Proof. unfold nq. rewrite Nat2Z.inj_add, inject_Z_plus. reflexivity. Qed.

Lemma inv_g_bounds (g : positive) : 0 < (1 # g) /\ (1 # g) <= 1.
Proof. split; unfold Qlt, Qle; cbn; lia. Qed.

Lemma route_list_ok (g : positive) (a : list rtype) :
  Forall valid_type a ->
  Forall (fun pr => 0 <= fst pr /\ Forall valid_type (snd pr)) (route_list g a)
  /\ qsum fst (route_list g a) == 1
  /\ qsum (fun pr => fst pr * nq (tokens_of (snd pr))) (route_list g a) == (1 # g) * nq (tokens_of a).
Proof.
  destruct (inv_g_bounds g) as [Hg0 Hg1].
  induction 1 as [|t a Ht Ha (IH1 & IH2 & IH3)].
  - cbn [route_list]. split; [constructor; [split; [cbn; lra|constructor]|constructor]|].
    rewrite !qsum_cons, !qsum_nil. cbn [fst snd tokens_of fold_right]. change (nq 0) with 0. split; ring.
  - cbn [route_list]. split; [|split].
    + apply Forall_forall. intros x Hx. apply in_flat_map in Hx as [pr [Hin Hx]].
      rewrite Forall_forall in IH1. destruct (IH1 pr Hin) as [Hp Hv].
      destruct Hx as [<-|[<-|[]]]; cbn [fst snd]; split; try nra; [constructor; assumption|exact Hv].
    + rewrite qsum_flat_map. rewrite <- IH2. apply qsum_eq. intros pr _.
      rewrite !qsum_cons, qsum_nil. cbn [fst snd]. ring.
    + rewrite qsum_flat_map.
      transitivity (qsum (fun pr => ((1 # g) * nq (fst t + snd t)) * fst pr + 1 * (fst pr * nq (tokens_of (snd pr))))
                      (route_list g a)).
      * apply qsum_eq. intros pr _. rewrite !qsum_cons, qsum_nil. cbn [fst snd tokens_of fold_right].
        fold (tokens_of (snd pr)). rewrite nq_add. ring.
      * rewrite qsum_lin, IH2, IH3. cbn [tokens_of fold_right]. fold (tokens_of a). rewrite (nq_add (fst t + snd t)). ring.
Qed.

Lemma route_valid (g : positive) (D : dist) :
  valid_dist D -> valid_dist0 (route g D) /\ load (route g D) == (1 # g) * load D.
Proof.
  intros [HD H1]. change (fold_right (fun pa acc => fst pa + acc) 0 D) with (qsum fst D) in H1.
  unfold route. split; [split|].
  - apply Forall_forall. intros x Hx. apply in_flat_map in Hx as [[p a] [Hin Hx]].
    apply in_map_iff in Hx as [pr [<- Hpr]]. rewrite Forall_forall in HD. destruct (HD _ Hin) as [Hp Ha].
    cbn [fst snd] in *. destruct (route_list_ok g a Ha) as (Hr & _ & _). rewrite Forall_forall in Hr.
    destruct (Hr pr Hpr) as [Hp' Hv]. split; [nra|exact Hv].
  - change (fold_right (fun pa acc => fst pa + acc) 0 _) with (qsum fst (flat_map (fun pa => map (fun pr => (fst pa * fst pr, snd pr)) (route_list g (snd pa))) D)).
    rewrite qsum_flat_map, <- H1. apply qsum_eq. intros [p a] Hin. rewrite qsum_map. cbn [fst snd].
    rewrite Forall_forall in HD. destruct (HD _ Hin) as [_ Ha]. destruct (route_list_ok g a Ha) as (_ & Hs & _).
    rewrite (qsum_scale p fst), Hs. ring.
  - change (load (flat_map (fun pa => map (fun pr => (fst pa * fst pr, snd pr)) (route_list g (snd pa))) D))
      with (qsum (fun pa => fst pa * nq (tokens_of (snd pa))) (flat_map (fun pa => map (fun pr => (fst pa * fst pr, snd pr)) (route_list g (snd pa))) D)).
    change (load D) with (qsum (fun pa => fst pa * nq (tokens_of (snd pa))) D).
    rewrite qsum_flat_map, <- qsum_scale. apply qsum_eq. intros [p a] Hin. rewrite qsum_map. cbn [fst snd].
    rewrite Forall_forall in HD. destruct (HD _ Hin) as [_ Ha]. destruct (route_list_ok g a Ha) as (_ & _ & Ht).
    transitivity (qsum (fun pr => p * (fst pr * nq (tokens_of (snd pr)))) (route_list g a)).
    + apply qsum_eq. intros pr _. ring.
    + rewrite qsum_scale, Ht. ring.
Qed.

Lemma nodes_per_node_for : theorem2_nodes_per_node_for Eng.
Proof.
  intros g D HD HL s Hr. destruct (route_valid g D HD) as [HD' HLr].
  apply one_node_general; [exact HD'| |exact Hr].
  destruct (inv_g_bounds g) as [Hg0 _].
  assert (Hgg : (1 # g) * inject_Z (Z.pos g) == 1) by (unfold Qeq; cbn; lia).
  rewrite inject_Z_mult in HL. change (inject_Z 128) with 128 in HL.
  rewrite HLr. nra.
Qed.

(** ** B6: countable slot laws *)

Lemma avoid_qsum_dist (E : engine) (D : dist) (s : joblist) (k : nat) (x : joblist) :
  avoid E D s (S k) x
  == qsum (fun pa => fst pa * (if jl_eqb (slot E (snd pa) x) s then 0 else avoid E D s k (slot E (snd pa) x))) D.
Proof.
  cbn [avoid]. generalize (avoid E D s k). intros h. induction D as [|[p a] D IH];
    cbn [fold_right]; rewrite ?qsum_nil, ?qsum_cons; [reflexivity|].
  rewrite IH. cbn [fst snd]. destruct (jl_eqb (slot E a x) s); ring.
Qed.

Lemma avoid_nonneg (E : engine) (D : dist) (s : joblist) :
  Forall (fun pa => 0 <= fst pa) D -> forall k x, 0 <= avoid E D s k x.
Proof.
  intros HD k. induction k as [|k IH]; intros x; [cbn [avoid]; lra|].
  rewrite avoid_qsum_dist. apply qsum_nonneg. intros [p a] Hin. rewrite Forall_forall in HD.
  pose proof (HD _ Hin) as Hp. cbn [fst snd] in *.
  destruct (jl_eqb (slot E a x) s); [lra|]. pose proof (IH (slot E a x)). nra.
Qed.

(** [D'] dominates [D] when it gives every non-negative function of the slot's list at least
    the expectation [D] gives it. *)
Definition dominated (D D' : dist) : Prop :=
  forall f : list rtype -> Q, (forall a, 0 <= f a) ->
    qsum (fun pa => fst pa * f (snd pa)) D <= qsum (fun pa => fst pa * f (snd pa)) D'.

Lemma avoid_dominated (E : engine) (D D' : dist) (s : joblist) :
  Forall (fun pa => 0 <= fst pa) D -> Forall (fun pa => 0 <= fst pa) D' -> dominated D D' ->
  forall k x, avoid E D s k x <= avoid E D' s k x.
Proof.
  intros HD HD' Hdom k. induction k as [|k IH]; intros x; [cbn [avoid]; lra|].
  rewrite !avoid_qsum_dist.
  apply Qle_trans with
    (qsum (fun pa => fst pa * (if jl_eqb (slot E (snd pa) x) s then 0 else avoid E D' s k (slot E (snd pa) x))) D).
  - apply qsum_le. intros [p a] Hin. rewrite Forall_forall in HD. pose proof (HD _ Hin) as Hp.
    cbn [fst snd] in *. destruct (jl_eqb (slot E a x) s); [lra|]. pose proof (IH (slot E a x)). nra.
  - apply (Hdom (fun a => if jl_eqb (slot E a x) s then 0 else avoid E D' s k (slot E a x))).
    intros a. destruct (jl_eqb (slot E a x) s); [lra|]. apply avoid_nonneg. exact HD'.
Qed.

Lemma partial_return_dominated (E : engine) (D D' : dist) (s : joblist) :
  Forall (fun pa => 0 <= fst pa) D -> Forall (fun pa => 0 <= fst pa) D' -> dominated D D' ->
  forall n, partial_return E D s n <= partial_return E D' s n.
Proof.
  intros HD HD' Hdom n. induction n as [|n IH]; cbn [partial_return]; [lra|].
  pose proof (avoid_dominated E D D' s HD HD' Hdom n s). lra.
Qed.

(** A prefix, completed to a distribution: its requesting entries, then one empty slot with
    the rest of the mass. *)
Definition nonempty (pa : Q * list rtype) : bool := match snd pa with [] => false | _ => true end.

Definition complete (D : dist) : dist :=
  filter nonempty D ++ [(1 - qsum fst (filter nonempty D), [])].

Lemma qsum_split {A : Type} (b : A -> bool) (f : A -> Q) (l : list A) :
  qsum f l == qsum f (filter b l) + qsum f (filter (fun a => negb (b a)) l).
Proof.
  induction l as [|a l IH]; cbn [filter]; rewrite ?qsum_nil; [ring|].
  destruct (b a); cbn [negb]; rewrite !qsum_cons, IH; ring.
Qed.

Lemma qsum_empties (f : list rtype -> Q) (D : dist) :
  qsum (fun pa => fst pa * f (snd pa)) (filter (fun pa => negb (nonempty pa)) D)
  == qsum fst (filter (fun pa => negb (nonempty pa)) D) * f [].
Proof.
  induction D as [|[p a] D IH]; cbn [filter]; rewrite ?qsum_nil; [ring|].
  destruct a as [|t a]; cbn [nonempty negb fst snd]; [rewrite !qsum_cons, IH; cbn [fst snd]; ring|exact IH].
Qed.

Lemma complete_dominates (D : dist) :
  Forall (fun pa => 0 <= fst pa) D -> qsum fst D <= 1 -> dominated D (complete D).
Proof.
  intros HD H1 f Hf. unfold complete. rewrite qsum_app, qsum_cons, qsum_nil.
  rewrite (qsum_split nonempty (fun pa => fst pa * f (snd pa)) D), qsum_empties.
  rewrite (qsum_split nonempty fst D) in H1. cbn [fst snd].
  assert (0 <= qsum fst (filter (fun pa => negb (nonempty pa)) D)).
  { apply qsum_nonneg. intros pa Hin. apply filter_In in Hin as [Hin _].
    rewrite Forall_forall in HD. exact (HD _ Hin). }
  pose proof (Hf []). nra.
Qed.

Lemma load_qsum (D : dist) : load D = qsum (fun pa => fst pa * nq (tokens_of (snd pa))) D.
Proof. reflexivity. Qed.

Lemma complete_valid (D : dist) :
  Forall (fun pa => 0 <= fst pa /\ Forall valid_type (snd pa)) D -> qsum fst D <= 1 ->
  valid_dist0 (complete D) /\ load (complete D) <= load D
  /\ 129 * qsum fst (filter nonempty D) <= load D.
Proof.
  intros HD H1.
  assert (HDp : Forall (fun pa => 0 <= fst pa) D) by (eapply Forall_impl; [|exact HD]; intros pa []; assumption).
  assert (Hne : 0 <= qsum fst (filter (fun pa => negb (nonempty pa)) D)).
  { apply qsum_nonneg. intros pa Hin. apply filter_In in Hin as [Hin _].
    rewrite Forall_forall in HDp. exact (HDp _ Hin). }
  assert (Hsplit := qsum_split nonempty fst D).
  assert (Hl : load D == load (filter nonempty D)).
  { rewrite !load_qsum, (qsum_split nonempty (fun pa => fst pa * nq (tokens_of (snd pa))) D).
    rewrite (qsum_empties (fun a => nq (tokens_of a)) D).
    cbv beta. cbn [tokens_of fold_right]. change (nq 0) with 0. rewrite (load_qsum (filter nonempty D)). ring. }
  assert (H129 : 129 * qsum fst (filter nonempty D) <= load (filter nonempty D)).
  { rewrite load_qsum, <- qsum_scale. apply qsum_le. intros [p a] Hin.
    apply filter_In in Hin as [Hin Hn]. rewrite Forall_forall in HD. destruct (HD _ Hin) as [Hp Ha].
    cbn [fst snd nonempty] in *. destruct a as [|t a]; [discriminate|].
    inversion Ha as [|? ? [[k0 [Hk0 Hpt]] Hd] _]; subst.
    assert (Ht : (129 <= tokens_of (t :: a))%nat) by (cbn [tokens_of fold_right]; lia).
    assert (129 <= nq (tokens_of (t :: a))) by (unfold nq; change 129 with (inject_Z 129); rewrite <- Zle_Qle; lia).
    nra. }
  split; [split|split].
  - apply Forall_app. split.
    + apply Forall_forall. intros pa Hin. apply filter_In in Hin as [Hin _]. rewrite Forall_forall in HD. exact (HD _ Hin).
    + constructor; [|constructor]. cbn [fst snd]. split; [lra|constructor].
  - change (fold_right (fun pa acc => fst pa + acc) 0 (complete D)) with (qsum fst (complete D)).
    unfold complete. rewrite qsum_app, qsum_cons, qsum_nil. cbn [fst]. ring.
  - unfold complete. rewrite load_qsum, qsum_app, qsum_cons, qsum_nil, <- load_qsum, Hl. cbn [fst snd tokens_of fold_right].
    change (nq 0) with 0. lra.
  - rewrite Hl. exact H129.
Qed.

(** *** B4's bound at the empty job list, explicit: only a lower bound [eps] on [128 - L],
    an upper bound [Lb] on [L] and a lower bound [q0] on an empty slot's probability enter it. *)

Lemma qpow_pos (q : Q) (n : nat) : 0 < q -> 0 < qpow q n.
Proof. intros Hq. induction n as [|n IH]; cbn [qpow]; [lra|nra]. Qed.

Lemma qpow_mono (q0 q : Q) (n : nat) : 0 <= q0 -> q0 <= q -> qpow q0 n <= qpow q n.
Proof.
  intros H0 H1. induction n as [|n IH]; cbn [qpow]; [lra|].
  assert (0 <= qpow q0 n) by (clear IH; induction n as [|n IHn]; cbn [qpow]; [lra|nra]).
  nra.
Qed.

Lemma small_hit_le_eps (D : dist) (eps : Q) : valid_dist0 D -> 0 < eps -> eps <= 128 - load D ->
  forall m z, jl_inv z ->
    hit_partial (chain Eng D) small m z <= / eps * work_q z + (/ eps * 65664) * 1.
Proof.
  intros HD He Heps m z Hz.
  assert (Hdr : forall x, jl_inv x -> small x = false -> expect (chain Eng D) work_q x + eps <= work_q x).
  { intros x Hx Hs. pose proof (chain_drift D x HD Hx Hs) as H0. change (inject_Z 128) with 128 in H0. lra. }
  destruct (foster_criterion_holds joblist (chain Eng D) small jl_inv work_q eps (65536 + load D)
              He (chain_ok D HD) (fun x _ => nq_nonneg (work x)) Hdr
              (fun x Hx Hs => chain_inside D x HD Hx Hs) z Hz m) as [Hout Hin].
  assert (Hb : eps * hit_partial (chain Eng D) small m z <= work_q z + 65664).
  { pose proof (nq_nonneg (work z)) as H0. change (nq (work z)) with (work_q z) in H0.
    destruct (small z) eqn:Hs; [pose proof (Hin eq_refl)|pose proof (Hout eq_refl)]; lra. }
  set (h := hit_partial (chain Eng D) small m z) in *.
  assert (Hie : 0 < / eps) by (apply Qinv_lt_0_compat; exact He).
  assert (Hinv : / eps * eps == 1) by (field; lra).
  setoid_replace h with (/ eps * (eps * h)) by (rewrite Qmult_assoc, Hinv; ring).
  nra.
Qed.

Definition empty_bound (eps Lb q0 : Q) : Q :=
  / eps * 65664
  + / qpow q0 small_bound
    * (inject_Z (Z.of_nat small_bound)
       + (/ eps * (65536 + inject_Z (Z.of_nat small_bound) * Lb) + / eps * 65664)).

Lemma jl_inv_empty : jl_inv jl_empty.
Proof. unfold jl_inv, jl_empty; cbn. repeat split; constructor. Qed.

Lemma one_node_empty_bound (D : dist) (q q0 eps Lb : Q) :
  valid_dist0 D -> In (q, []) D -> 0 < q0 -> q0 <= q -> 0 < eps -> eps <= 128 - load D ->
  load D <= Lb ->
  forall n, partial_return Eng D jl_empty n <= empty_bound eps Lb q0.
Proof.
  intros HD Hq Hq00 Hq0q He Heps HLb.
  set (A := fun y => jl_eqb y jl_empty).
  assert (Hq0 : 0 < q) by lra.
  assert (HL0 : 0 <= load D).
  { unfold load. destruct HD as [HD _]. clear -HD. induction D as [|[p a] D IH]; cbn [fold_right]; [lra|].
    inversion HD as [|? ? [Hp _] HD']; subst. cbn [fst snd] in *. specialize (IH HD').
    assert (0 <= inject_Z (Z.of_nat (tokens_of a))) by (change 0 with (inject_Z 0); rewrite <- Zle_Qle; lia).
    change (fold_right (fun pa acc => fst pa * inject_Z (Z.of_nat (tokens_of (snd pa))) + acc) 0 D)
      with (load D) in *. nra. }
  assert (HLb0 : 0 <= Lb) by lra.
  set (T := small_bound).
  set (qp := qpow q small_bound).
  destruct (traj_prob D _ _ _ _ HD (traj_drain D q Hq Hq0 small_bound jl_empty)) as [Hqp0 Hqp1].
  fold qp in Hqp0, Hqp1.
  set (delta := qpow q0 small_bound).
  assert (Hd0 : 0 < delta) by (apply qpow_pos; exact Hq00).
  assert (Hdq : delta <= qp) by (apply qpow_mono; lra).
  assert (Hd1 : delta <= 1) by lra.
  set (Tq := inject_Z (Z.of_nat T)).
  assert (HTq : 0 <= Tq) by (unfold Tq; change 0 with (inject_Z 0); rewrite <- Zle_Qle; lia).
  set (ie := / eps).
  assert (Hie : 0 < ie) by (apply Qinv_lt_0_compat; exact He).
  set (G := fun z => ie * work_q z + (ie * 65664) * 1).
  set (Gb := ie * (65536 + Tq * Lb) + ie * 65664).
  assert (HcL : 0 <= Tq * Lb) by nra.
  assert (HGb : 0 <= Gb) by (unfold Gb; nra).
  assert (Hkill : forall y, jl_inv y -> small y = true -> kill joblist (chain Eng D) A T (fun _ => 1) y <= 1 - delta).
  { intros y Hy Hs. unfold small in Hs. apply Nat.ltb_lt in Hs.
    pose proof (traj_drain D q Hq Hq0 small_bound y) as Hdr.
    rewrite (drain_empty small_bound y Hy ltac:(lia)) in Hdr. fold qp in Hdr.
    pose proof (traj_kill D A y jl_empty T qp HD Hdr Hy (jl_eqb_refl jl_empty) ltac:(unfold T, small_bound; lia)).
    lra. }
  assert (HkG : forall y, jl_inv y -> small y = true -> kill joblist (chain Eng D) A T G y <= Gb).
  { intros y Hy Hs. unfold small in Hs. apply Nat.ltb_lt in Hs.
    pose proof (kill_lin joblist (chain Eng D) A T ie (ie * 65664) work_q (fun _ => 1) y) as E0.
    cbv beta in E0. fold G in E0.
    assert (Hexp : forall x, jl_inv x -> expect (chain Eng D) work_q x <= work_q x + Lb).
    { intros x Hx. pose proof (chain_expect_le D x HD Hx). lra. }
    pose proof (kill_lyapunov joblist (chain Eng D) jl_inv (chain_ok D HD) (fun x _ => chain_mass D HD x)
                  A work_q Lb HLb0 (fun x _ => nq_nonneg (work x)) Hexp T y Hy) as HV.
    fold Tq in HV.
    pose proof (kill_one_le joblist (chain Eng D) jl_inv (chain_ok D HD) (fun x _ => chain_mass D HD x) A T y Hy) as H1.
    assert (Hw : work_q y <= 65536)
      by (unfold work_q; change 65536 with (inject_Z 65536); rewrite <- Zle_Qle; unfold small_bound in Hs; lia).
    assert (HV' : kill joblist (chain Eng D) A T work_q y <= 65536 + Tq * Lb) by lra.
    set (c := Tq * Lb) in *. unfold Gb. clearbody c.
    set (kv := kill joblist (chain Eng D) A T work_q y) in *.
    set (k1 := kill joblist (chain Eng D) A T (fun _ => 1) y) in *.
    nra. }
  assert (HG : forall m z, jl_inv z -> hit_partial (chain Eng D) small m z <= G z)
    by (intros m z Hz; exact (small_hit_le_eps D eps HD He Heps m z Hz)).
  pose proof (hit_regenerate joblist (chain Eng D) jl_inv (chain_ok D HD) (fun x _ => chain_mass D HD x)
                A small G T delta Gb ltac:(unfold T, small_bound; lia) Hd0 Hd1 HGb HG Hkill HkG) as Hreg.
  set (M := / delta * (Tq + Gb)) in *.
  assert (HM0 : 0 <= M) by (unfold M; apply Qmult_le_0_compat; [apply Qinv_le_0_compat|]; lra).
  intros n.
  rewrite partial_return_from, (pr_hit Eng D jl_empty n jl_empty).
  pose proof (hit_via joblist (chain Eng D) jl_inv (chain_ok D HD) (fun x _ => chain_mass D HD x)
                A small M n HM0 (fun m y _ Hy Hc => Hreg m y Hy Hc) jl_empty jl_inv_empty) as Hv.
  pose proof (HG n jl_empty jl_inv_empty) as Hge. fold A.
  assert (Hw0 : work_q jl_empty == 0) by reflexivity.
  unfold G in Hge. rewrite Hw0 in Hge.
  unfold empty_bound. fold delta T Tq ie Gb M. lra.
Qed.

(** *** B6 *)

Lemma compound_for : theorem2_compound_for Eng.
Proof.
  intros P L [Hk Hm] HL HL128. change (inject_Z 128) with 128 in HL128.
  set (eps := 128 - L). set (q0 := 1 - (1 # 129) * L).
  exists (empty_bound eps L q0). intros N n.
  set (D := cprefix P N).
  assert (HD : Forall (fun pa => 0 <= fst pa /\ Forall valid_type (snd pa)) D).
  { apply Forall_forall. intros pa Hin. unfold D, cprefix in Hin. apply in_map_iff in Hin as [k [<- _]]. apply Hk. }
  assert (HDp : Forall (fun pa => 0 <= fst pa) D) by (eapply Forall_impl; [|exact HD]; intros pa []; assumption).
  assert (H1 : qsum fst D <= 1) by exact (Hm N).
  pose proof (HL N) as HLN. fold D in HLN.
  destruct (complete_valid D HD H1) as (Hv & Hlc & H129).
  assert (HL0 : 0 <= load D).
  { rewrite load_qsum. apply qsum_nonneg. intros [p a] Hin. rewrite Forall_forall in HDp.
    pose proof (HDp _ Hin). cbn [fst snd] in *. pose proof (nq_nonneg (tokens_of a)). nra. }
  apply Qle_trans with (partial_return Eng (complete D) jl_empty n).
  - apply partial_return_dominated; [exact HDp| |apply complete_dominates; assumption].
    destruct Hv as [Hv _]. eapply Forall_impl; [|exact Hv]. intros pa []; assumption.
  - apply (one_node_empty_bound (complete D) (1 - qsum fst (filter nonempty D)) q0 eps L Hv);
      unfold q0, eps; try lra.
    unfold complete. apply in_or_app. right. now left.
Qed.

End rad128.

(** ** The theorems for [bari_rad.sq]'s engine, and for every engine [serq prove] shows is
    RAD with 128-token tiles *)

Lemma e128_rad : rad128 E128.
Proof. split; [exact e128_schedule|exact e128_while]. Qed.

Theorem theorem2_one_node_small_set_holds : theorem2_one_node_small_set.
Proof. exact (small_set_general E128 e128_rad). Qed.

Theorem theorem2_one_node_holds : theorem2_one_node.
Proof. exact (one_node_for E128 e128_rad). Qed.

Theorem theorem2_nodes_per_node_holds : theorem2_nodes_per_node.
Proof. exact (nodes_per_node_for E128 e128_rad). Qed.

Theorem theorem2_compound_holds : theorem2_compound.
Proof. exact (compound_for E128 e128_rad). Qed.

(** What [serq prove] instantiates: B4, B5 per node and B6 for an engine shown [rad128]. *)
Theorem theorem2_rad128 (E : engine) :
  rad128 E -> theorem2_one_node_for E /\ theorem2_nodes_per_node_for E /\ theorem2_compound_for E.
Proof. intros H. split; [|split]; [exact (one_node_for E H)|exact (nodes_per_node_for E H)|exact (compound_for E H)]. Qed.

(** ** B5's joint part ([theorem2_nodes_joint_holds])

    The joint chain of the [g] nodes under uniform independent routing ([Theorem2.jroute]).
    The summed work is no Lyapunov function here, the sum of the squares of the nodes' work
    ([jV]) is: the routing gives each node [1 / g] of the slot's tokens in expectation
    ([jroute_dot]), so one slot adds at most [2 (L / g)] times the total work and takes [256]
    times the work of every node with a whole tile to serve, plus a constant
    ([jchain_drift], from [node_sq]); a node with [w >= W] tokens left makes the drift at most
    [-1] for [W] large enough ([Qarchimedean]), and Foster's criterion bounds the expected time
    to the set where every node has less than [W] ([jsmall]).  From there [W] empty slots
    empty every node ([jdrain_kill]), and the regeneration lemmas of B4 ([hit_regenerate],
    [hit_via]) bound the expected return time to all nodes empty. *)

Section joint.
  Variable Eng : engine.
  Hypothesis E_rad : rad128 Eng.


Local Open Scope Q_scope.

Definition tok (t : rtype) : nat := (fst t + snd t)%nat.

Definition lsum_tok (arr : list (list rtype)) : nat := fold_right (fun l acc => tokens_of l + acc)%nat 0%nat arr.

Fixpoint wdot (w : list Q) (arr : list (list rtype)) : Q :=
  match w, arr with
  | a :: w', l :: arr' => a * nq (tokens_of l) + wdot w' arr'
  | _, _ => 0
  end.

Lemma add_at_length (i : nat) (t : rtype) (arr : list (list rtype)) : length (add_at i t arr) = length arr.
Proof. revert i. induction arr as [|l arr IH]; intros [|i]; cbn; auto. Qed.

Lemma add_at_tok (i : nat) (t : rtype) (arr : list (list rtype)) :
  (i < length arr)%nat -> lsum_tok (add_at i t arr) = (lsum_tok arr + tok t)%nat.
Proof.
  revert i. induction arr as [|l arr IH]; intros [|i] Hi; cbn [add_at length] in *; try lia.
  - unfold lsum_tok, tok, tokens_of; cbn [fold_right]. lia.
  - unfold lsum_tok in *; cbn [fold_right]. rewrite IH by lia. lia.
Qed.

Lemma add_at_valid (i : nat) (t : rtype) (arr : list (list rtype)) :
  valid_type t -> Forall (Forall valid_type) arr -> Forall (Forall valid_type) (add_at i t arr).
Proof.
  intros Ht H. revert i. induction H as [|l arr Hl Harr IH]; intros [|i]; cbn; try constructor; auto.
Qed.

Lemma wdot_add_at (i : nat) (t : rtype) (arr : list (list rtype)) (w : list Q) :
  (i < length arr)%nat -> length w = length arr ->
  wdot w (add_at i t arr) == wdot w arr + nth i w 0 * nq (tok t).
Proof.
  revert i w. induction arr as [|l arr IH]; intros [|i] [|a w] Hi Hw; cbn in *; try lia.
  - fold (tokens_of l). unfold tok. rewrite nq_add. fold (tokens_of l). ring_simplify.
    change (fold_right (fun t0 n => (fst t0 + snd t0 + n)%nat) 0%nat l) with (tokens_of l).
    rewrite !nq_add. ring.
  - rewrite IH by lia. ring.
Qed.

Lemma wdot_nil (w : list Q) (n : nat) : wdot w (repeat [] n) == 0.
Proof.
  revert w. induction n as [|n IH]; intros [|a w]; cbn; try reflexivity.
  rewrite IH. change (nq 0) with 0. ring.
Qed.

Lemma qsum_seq_const (c : Q) (n : nat) : qsum (fun _ : nat => c) (seq 0 n) == nq n * c.
Proof.
  induction n as [|n IH]; [cbn; change (nq 0) with 0; ring|].
  rewrite seq_S, qsum_app, IH, qsum_cons, qsum_nil. unfold nq. rewrite Nat2Z.inj_succ.
  rewrite <- Z.add_1_r, inject_Z_plus. change (inject_Z 1) with 1. ring.
Qed.

Lemma qsum_seq_nth (w : list Q) : qsum (fun i => nth i w 0) (seq 0 (length w)) == qsum (fun x => x) w.
Proof.
  induction w as [|a w IH]; [reflexivity|]. cbn [length]. rewrite <- cons_seq, qsum_cons, <- seq_shift, qsum_map.
  cbn [nth]. rewrite IH, qsum_cons. reflexivity.
Qed.

Lemma nq_pos_g (g : positive) : nq (Pos.to_nat g) * (1 # g) == 1.
Proof. unfold nq. rewrite positive_nat_Z. unfold Qeq; cbn; lia. Qed.

Lemma jroute_shape (g : positive) (a : list rtype) :
  Forall valid_type a ->
  Forall (fun ro => 0 <= fst ro /\ length (snd ro) = Pos.to_nat g
                    /\ Forall (Forall valid_type) (snd ro) /\ lsum_tok (snd ro) = tokens_of a)
         (jroute g a).
Proof.
  destruct (inv_g_bounds g) as [Hg0 Hg1].
  induction 1 as [|t a Ht Ha IH].
  - cbn. constructor; [|constructor]. cbn [fst snd]. split; [lra|]. split; [apply repeat_length|].
    split; [apply Forall_forall; intros l Hl; apply repeat_spec in Hl; subst; constructor|].
    generalize (Pos.to_nat g). intros n. induction n; cbn; auto.
  - cbn [jroute]. apply Forall_forall. intros ro Hro. apply in_flat_map in Hro as [pr [Hpr Hro]].
    apply in_map_iff in Hro as [i [<- Hi]]. apply in_seq in Hi.
    rewrite Forall_forall in IH. destruct (IH pr Hpr) as (Hp & Hl & Hv & Hs). cbn [fst snd].
    split; [nra|]. split; [rewrite add_at_length; exact Hl|]. split; [apply add_at_valid; assumption|].
    rewrite add_at_tok by lia. rewrite Hs. cbn [tokens_of fold_right]. unfold tok. fold (tokens_of a). lia.
Qed.

Lemma jroute_mass (g : positive) (a : list rtype) : qsum fst (jroute g a) == 1.
Proof.
  induction a as [|t a IH]; [cbn; ring|]. cbn [jroute]. rewrite qsum_flat_map, <- IH.
  apply qsum_eq. intros pr _. rewrite qsum_map. cbn [fst].
  rewrite (qsum_seq_const ((1 # g) * fst pr) (Pos.to_nat g)).
  setoid_replace (nq (Pos.to_nat g) * ((1 # g) * fst pr)) with ((nq (Pos.to_nat g) * (1 # g)) * fst pr) by ring.
  rewrite nq_pos_g. ring.
Qed.

Lemma jroute_length (g : positive) (a : list rtype) :
  Forall (fun ro => length (snd ro) = Pos.to_nat g) (jroute g a).
Proof.
  induction a as [|t a IH]; cbn [jroute]; [constructor; [apply repeat_length|constructor]|].
  apply Forall_forall. intros ro Hro. apply in_flat_map in Hro as [pr [Hpr Hro]].
  apply in_map_iff in Hro as [i [<- Hi]]. cbn [snd]. rewrite add_at_length.
  rewrite Forall_forall in IH. exact (IH pr Hpr).
Qed.

(** What routing gives a node in expectation: [1 / g] of the slot's tokens, so a weighted sum
    of the nodes' arriving tokens has expectation [tokens / g] times the sum of the weights. *)
Lemma jroute_dot (g : positive) (a : list rtype) (w : list Q) :
  length w = Pos.to_nat g ->
  qsum (fun ro => fst ro * wdot w (snd ro)) (jroute g a)
  == (1 # g) * nq (tokens_of a) * qsum (fun x => x) w.
Proof.
  intros Hw. induction a as [|t a IH].
  - cbn [jroute]. rewrite qsum_cons, qsum_nil. cbn [fst snd]. rewrite wdot_nil.
    cbn [tokens_of fold_right]. change (nq 0) with 0. ring.
  - cbn [jroute]. rewrite qsum_flat_map.
    assert (Hsh : forall pr, In pr (jroute g a) -> length (snd pr) = Pos.to_nat g)
      by (apply Forall_forall, jroute_length).
    transitivity (qsum (fun pr => 1 * (fst pr * wdot w (snd pr))
                                  + ((1 # g) * nq (tok t) * qsum (fun x => x) w) * fst pr) (jroute g a)).
    + apply qsum_eq. intros pr Hpr. rewrite qsum_map. cbn [fst snd].
      pose proof (Hsh pr Hpr) as Hl.
      transitivity (qsum (fun i => ((1 # g) * fst pr * wdot w (snd pr)) * 1
                                   + ((1 # g) * fst pr * nq (tok t)) * nth i w 0) (seq 0 (Pos.to_nat g))).
      * apply qsum_eq. intros i Hi. apply in_seq in Hi. rewrite wdot_add_at by lia. ring.
      * rewrite qsum_lin, qsum_seq_const. rewrite <- Hw at 2. rewrite qsum_seq_nth.
        setoid_replace (nq (Pos.to_nat g) * 1) with (nq (Pos.to_nat g)) by ring.
        transitivity ((nq (Pos.to_nat g) * (1 # g)) * fst pr * wdot w (snd pr)
                      + (1 # g) * fst pr * nq (tok t) * qsum (fun x => x) w); [ring|].
        rewrite nq_pos_g. ring.
    + rewrite qsum_lin, IH, jroute_mass. cbn [tokens_of fold_right]. fold (tokens_of a).
      unfold tok. rewrite !nq_add. set (S := qsum (fun x => x) w). ring.
Qed.

(** The Lyapunov function of the joint chain: the sum of the squares of the nodes' work. *)
Definition jV (x : list joblist) : Q := qsum (fun s => nq (work s) * nq (work s)) x.

Definition jws (x : list joblist) : list Q := map (fun s => nq (work s)) x.

(** The work of the nodes with at least [2^16] tokens left (those serve a whole tile). *)
Definition jbig (x : list joblist) : Q := qsum (fun s => if small s then 0 else nq (work s)) x.

Lemma node_sq (a : list rtype) (x : joblist) :
  jl_inv x -> Forall valid_type a ->
  nq (work (slot Eng a x)) * nq (work (slot Eng a x))
  <= nq (work x) * nq (work x) + 2 * nq (work x) * nq (tokens_of a)
     - 256 * (if small x then 0 else nq (work x))
     + (nq (tokens_of a) + 128) * (nq (tokens_of a) + 128).
Proof.
  intros Hx Ha. destruct (slot_step Eng E_rad a x Hx Ha) as (_ & Hle & Hbig).
  pose proof (nq_nonneg (work (slot Eng a x))) as H0. pose proof (nq_nonneg (work x)) as H1.
  pose proof (nq_nonneg (tokens_of a)) as H2.
  set (w' := nq (work (slot Eng a x))) in *. set (w := nq (work x)) in *. set (t := nq (tokens_of a)) in *.
  destruct (small x) eqn:Hs.
  - assert (Hq : w' <= w + t).
    { pose proof (nq_le_add _ 0 _ _ ltac:(rewrite Nat.add_0_r; exact Hle)) as Hq.
      change (nq 0) with 0 in Hq. fold w' w t in Hq. lra. }
    assert (w' * w' <= (w + t) * (w + t)) by nra. nra.
  - unfold small in Hs. apply Nat.ltb_ge in Hs. specialize (Hbig Hs).
    assert (Hq : w' + 128 <= w + t).
    { pose proof (nq_le_add _ 128 _ _ Hbig) as Hq. change (nq 128) with 128 in Hq. fold w' w t in Hq. exact Hq. }
    assert (w' * w' <= (w + t - 128) * (w + t - 128)) by nra. nra.
Qed.

Lemma tokens_le_lsum (l : list rtype) (arr : list (list rtype)) :
  In l arr -> (tokens_of l <= lsum_tok arr)%nat.
Proof.
  induction arr as [|m arr IH]; intros Hin; [destruct Hin|]. unfold lsum_tok in *; cbn [fold_right].
  destruct Hin as [<-|Hin]; [lia|]. specialize (IH Hin). lia.
Qed.

Lemma jslot_V (arr : list (list rtype)) (x : list joblist) (c : Q) :
  length arr = length x -> Forall (Forall valid_type) arr -> Forall jl_inv x ->
  (forall l, In l arr -> (nq (tokens_of l) + 128) * (nq (tokens_of l) + 128) <= c) ->
  jV (jslot Eng arr x) <= jV x + 2 * wdot (jws x) arr - 256 * jbig x + nq (length x) * c.
Proof.
  revert arr. induction x as [|s x IH]; intros arr Hl Ha Hx Hc.
  - destruct arr as [|l arr]; [|discriminate].
    unfold jslot, jV, jws, jbig. cbn [combine map wdot length].
    change (qsum (fun s => nq (work s) * nq (work s)) []) with 0.
    change (qsum (fun s => if small s then 0 else nq (work s)) []) with 0.
    change (nq 0) with 0. lra.
  - destruct arr as [|l arr]; [discriminate|]. cbn [length] in Hl.
    inversion Ha as [|? ? Hla Harr]; subst. inversion Hx as [|? ? Hs Hxs]; subst.
    pose proof (node_sq l s Hs Hla) as Hn.
    pose proof (IH arr ltac:(lia) Harr Hxs ltac:(intros m Hm; apply Hc; now right)) as Hr.
    pose proof (Hc l (or_introl eq_refl)) as Hcl.
    assert (Hj : jslot Eng (l :: arr) (s :: x) = slot Eng l s :: jslot Eng arr x) by reflexivity.
    rewrite Hj. unfold jV, jbig in *. rewrite !qsum_cons. cbn [jws map wdot]. fold (jws x).
    assert (Hn1 : nq (length (s :: x)) == nq (length x) + 1).
    { cbn [length]. unfold nq. rewrite Nat2Z.inj_succ, <- Z.add_1_r, inject_Z_plus. reflexivity. }
    rewrite Hn1. set (ws := jws x) in *. set (c0 := nq (length x)) in *.
    assert (0 <= c) by (pose proof (nq_nonneg (tokens_of l)); nra).
    nra.
Qed.

(** The drift of [jV]: one slot adds at most [2 (L / g)] times the total work, takes [256]
    times the work of the nodes with a whole tile to serve, plus a constant. *)
Lemma jchain_drift (g : positive) (D : dist) (x : list joblist) (c : Q) :
  valid_dist0 D -> length x = Pos.to_nat g -> Forall jl_inv x ->
  (forall pa, In pa D -> (nq (tokens_of (snd pa)) + 128) * (nq (tokens_of (snd pa)) + 128) <= c) ->
  expect (jchain Eng g D) jV x
  <= (jV x - 256 * jbig x + nq (length x) * c) + 2 * ((1 # g) * load D) * qsum (fun q => q) (jws x).
Proof.
  intros [HD H1] Hl Hx Hc.
  change (fold_right (fun pa acc => fst pa + acc) 0 D) with (qsum fst D) in H1.
  set (B0 := jV x - 256 * jbig x + nq (length x) * c).
  set (S := qsum (fun q => q) (jws x)).
  unfold expect, jchain. rewrite qsum_flat_map.
  apply Qle_trans with (qsum (fun pa => fst pa * (B0 * 1 + 2 * ((1 # g) * nq (tokens_of (snd pa)) * S))) D).
  - apply qsum_le. intros [p a] Hin. rewrite qsum_map. cbn [fst snd].
    rewrite Forall_forall in HD. destruct (HD _ Hin) as [Hp Ha].
    assert (Hlw : length (jws x) = Pos.to_nat g) by (unfold jws; rewrite map_length; exact Hl).
    pose proof (jroute_mass g a) as Hm. pose proof (jroute_dot g a (jws x) Hlw) as Hd. fold S in Hd.
    assert (Hsh := jroute_shape g a Ha).
    set (R := jroute g a) in *.
    apply Qle_trans with (qsum (fun ro => p * (B0 * fst ro + 2 * (fst ro * wdot (jws x) (snd ro)))) R).
    + apply qsum_le. intros [q arr] Hro. rewrite Forall_forall in Hsh.
      destruct (Hsh _ Hro) as (Hq & Hla & Hva & Hs). cbn [fst snd] in *.
      assert (Hcl : forall l, In l arr -> (nq (tokens_of l) + 128) * (nq (tokens_of l) + 128) <= c).
      { intros l Hli. pose proof (tokens_le_lsum l arr Hli) as Ht. rewrite Hs in Ht.
        assert (Htq : nq (tokens_of l) <= nq (tokens_of a)) by (unfold nq; rewrite <- Zle_Qle; lia).
        pose proof (nq_nonneg (tokens_of l)). pose proof (Hc (p, a) Hin) as Hca. cbn [snd] in Hca. nra. }
      pose proof (jslot_V arr x c ltac:(lia) Hva Hx Hcl) as Hv. fold B0 in Hv.
      assert (Hpq : 0 <= p * q) by nra.
      set (wd := wdot (jws x) arr) in *. set (v := jV (jslot Eng arr x)) in *.
      assert (Hv' : v <= B0 + 2 * wd) by (unfold B0 in *; lra).
      assert (p * q * v <= p * q * (B0 + 2 * wd)) by nra.
      nra.
    + assert (E1 : qsum (fun ro => p * (B0 * fst ro + 2 * (fst ro * wdot (jws x) (snd ro)))) R
                   == p * (B0 * qsum fst R + 2 * qsum (fun ro => fst ro * wdot (jws x) (snd ro)) R)).
      { pose proof (qsum_scale p (fun ro => B0 * fst ro + 2 * (fst ro * wdot (jws x) (snd ro))) R) as A.
        pose proof (qsum_lin B0 2 fst (fun ro => fst ro * wdot (jws x) (snd ro)) R) as B.
        cbv beta in A, B. rewrite B in A. exact A. }
      rewrite E1, Hm, Hd. apply Qle_refl.
  - assert (E2 : qsum (fun pa => fst pa * (B0 * 1 + 2 * ((1 # g) * nq (tokens_of (snd pa)) * S))) D
                 == B0 * qsum fst D + (2 * (1 # g) * S) * load D).
    { rewrite load_qsum.
      pose proof (qsum_lin B0 (2 * (1 # g) * S) fst (fun pa => fst pa * nq (tokens_of (snd pa))) D) as B.
      cbv beta in B. rewrite <- B. apply qsum_eq. intros pa _. set (t := nq (tokens_of (snd pa))). ring. }
    rewrite E2, H1. set (LD := load D). lra.
Qed.

(** *** The joint chain's kernel *)

Definition jinv (g : positive) (x : list joblist) : Prop := length x = Pos.to_nat g /\ Forall jl_inv x.

Lemma jslot_cons (E : engine) (l : list rtype) (arr : list (list rtype)) (s : joblist) (x : list joblist) :
  jslot E (l :: arr) (s :: x) = slot E l s :: jslot E arr x.
Proof. reflexivity. Qed.

Lemma jslot_length (E : engine) (arr : list (list rtype)) (x : list joblist) :
  length arr = length x -> length (jslot E arr x) = length x.
Proof. intros H. unfold jslot. rewrite map_length, combine_length. lia. Qed.

Lemma jslot_inv (arr : list (list rtype)) (x : list joblist) :
  length arr = length x -> Forall (Forall valid_type) arr -> Forall jl_inv x ->
  Forall jl_inv (jslot Eng arr x).
Proof.
  revert arr. induction x as [|s x IH]; intros arr Hl Ha Hx.
  - destruct arr; [constructor|discriminate].
  - destruct arr as [|l arr]; [discriminate|]. cbn [length] in Hl.
    inversion Ha as [|? ? Hla Harr]; subst. inversion Hx as [|? ? Hs Hxs]; subst.
    rewrite jslot_cons. constructor; [exact (proj1 (slot_step Eng E_rad l s Hs Hla))|].
    apply IH; [lia|exact Harr|exact Hxs].
Qed.

Lemma jchain_ok (g : positive) (D : dist) : valid_dist0 D ->
  forall x, jinv g x -> forall py, In py (jchain Eng g D x) -> 0 <= fst py /\ jinv g (snd py).
Proof.
  intros [HD _] x [Hl Hx] py Hin. unfold jchain in Hin. apply in_flat_map in Hin as [[p a] [Hpa Hin]].
  apply in_map_iff in Hin as [[q arr] [<- Hro]]. cbn [fst snd] in *.
  rewrite Forall_forall in HD. destruct (HD _ Hpa) as [Hp Ha]. cbn [fst snd] in *.
  pose proof (jroute_shape g a Ha) as Hsh. rewrite Forall_forall in Hsh.
  destruct (Hsh _ Hro) as (Hq & Hla & Hva & _). cbn [fst snd] in *.
  split; [nra|]. split; [rewrite jslot_length; lia|apply jslot_inv; [lia|exact Hva|exact Hx]].
Qed.

Lemma jchain_mass (g : positive) (D : dist) : valid_dist0 D -> forall x, qsum fst (jchain Eng g D x) == 1.
Proof.
  intros [_ H1] x. change (fold_right (fun pa acc => fst pa + acc) 0 D) with (qsum fst D) in H1.
  unfold jchain. rewrite qsum_flat_map, <- H1. apply qsum_eq. intros [p a] _. rewrite qsum_map. cbn [fst snd].
  transitivity (qsum (fun ro => p * fst ro) (jroute g a)); [apply qsum_eq; intros; reflexivity|].
  rewrite (qsum_scale p fst (jroute g a)), jroute_mass. ring.
Qed.

Lemma jV_nonneg (x : list joblist) : 0 <= jV x.
Proof. apply qsum_nonneg. intros s _. pose proof (nq_nonneg (work s)). nra. Qed.

Lemma qsum_const {A : Type} (c : Q) (l : list A) : qsum (fun _ => c) l == nq (length l) * c.
Proof.
  induction l as [|a l IH]; [cbn; change (nq 0) with 0; ring|]. rewrite qsum_cons, IH.
  cbn [length]. unfold nq. rewrite Nat2Z.inj_succ, <- Z.add_1_r, inject_Z_plus. change (inject_Z 1) with 1. ring.
Qed.

(** The work-weighted part of the drift, node by node. *)
Definition jh (l : Q) (s : joblist) : Q := 2 * l * nq (work s) - 256 * (if small s then 0 else nq (work s)).

Lemma jdrift_split (l : Q) (x : list joblist) :
  2 * l * qsum (fun q => q) (jws x) - 256 * jbig x == qsum (jh l) x.
Proof.
  unfold jws, jbig. induction x as [|s x IH]; [cbn; ring|]. cbn [map]. rewrite !qsum_cons.
  set (A1 := qsum (fun q => q) (map (fun s0 => nq (work s0)) x)) in *.
  set (A2 := qsum (fun s0 => if small s0 then 0 else nq (work s0)) x) in *.
  set (A3 := qsum (jh l) x) in *. unfold jh. destruct (small s); rewrite <- IH; ring.
Qed.

Lemma jh_le (l : Q) (s : joblist) : 0 <= l -> l < 128 -> jh l s <= 2 * l * 65536.
Proof.
  intros H0 H1. unfold jh. pose proof (nq_nonneg (work s)). destruct (small s) eqn:Hs.
  - unfold small, small_bound in Hs. apply Nat.ltb_lt in Hs.
    assert (nq (work s) <= 65536) by (unfold nq; change 65536 with (inject_Z 65536); rewrite <- Zle_Qle; lia). nra.
  - nra.
Qed.

Lemma jh_big (l : Q) (s : joblist) (W : nat) : 0 <= l -> l < 128 -> (small_bound <= W)%nat -> (W <= work s)%nat ->
  jh l s <= - (2 * (128 - l) * nq W).
Proof.
  intros H0 H1 HW Hw. unfold jh. replace (small s) with false
    by (symmetry; unfold small; apply Nat.ltb_ge; lia).
  assert (nq W <= nq (work s)) by (unfold nq; rewrite <- Zle_Qle; lia). nra.
Qed.

Definition jsmall (W : nat) (x : list joblist) : bool := forallb (fun s => (work s <? W)%nat) x.

Lemma jsmall_false (W : nat) (x : list joblist) : jsmall W x = false -> exists s, In s x /\ (W <= work s)%nat.
Proof.
  induction x as [|s x IH]; [discriminate|]. unfold jsmall; cbn [forallb]. intros H.
  destruct (work s <? W)%nat eqn:Hs.
  - destruct (IH H) as (s' & Hin & Hw). exists s'. split; [now right|exact Hw].
  - exists s. split; [now left|]. apply Nat.ltb_ge in Hs. exact Hs.
Qed.

Lemma jsmall_V (W : nat) (x : list joblist) : jsmall W x = true -> jV x <= nq (length x) * (nq W * nq W).
Proof.
  intros H. unfold jsmall in H. rewrite forallb_forall in H. unfold jV. rewrite <- qsum_const.
  apply qsum_le. intros s Hs. specialize (H s Hs). apply Nat.ltb_lt in H.
  assert (nq (work s) <= nq W) by (unfold nq; rewrite <- Zle_Qle; lia). pose proof (nq_nonneg (work s)). nra.
Qed.

(** *** Emptying every node: empty slots *)

Lemma jslot_empty (x : list joblist) : jslot Eng (repeat [] (length x)) x = map (slot Eng []) x.
Proof. induction x as [|s x IH]; [reflexivity|]. cbn [length repeat]. rewrite jslot_cons, IH. reflexivity. Qed.

Lemma slot_empty_le (s : joblist) (m : nat) : jl_inv s -> (work s <= S m)%nat -> (work (slot Eng [] s) <= m)%nat.
Proof.
  intros Hs Hw. destruct (Nat.eq_dec (work s) 0) as [H0|H0].
  - destruct (slot_step Eng E_rad [] s Hs (Forall_nil _)) as (_ & Hle & _). cbn [tokens_of fold_right] in Hle. lia.
  - pose proof (slot_empty_serves Eng E_rad s Hs ltac:(lia)). lia.
Qed.

Lemma jempty_step (g : positive) (D : dist) (q : Q) (x : list joblist) :
  In (q, []) D -> length x = Pos.to_nat g ->
  In (q * 1, map (slot Eng []) x) (jchain Eng g D x).
Proof.
  intros Hq Hl. unfold jchain. apply in_flat_map. exists (q, []). split; [exact Hq|].
  cbn [snd fst jroute map]. left. rewrite <- Hl, jslot_empty. reflexivity.
Qed.

Lemma jdrain_kill (g : positive) (D : dist) (q : Q) : valid_dist0 D -> In (q, []) D -> 0 < q ->
  forall m x, jinv g x -> Forall (fun s => (work s <= S m)%nat) x ->
  kill (list joblist) (jchain Eng g D) all_empty (S m) (fun _ => 1) x <= 1 - qpow q (S m).
Proof.
  intros HD Hq Hq0. pose proof (dist_entry_le D q [] HD Hq) as Hq1.
  assert (Hok := jchain_ok g D HD). assert (Hm := fun x (_ : jinv g x) => jchain_mass g D HD x).
  induction m as [|m IH]; intros x [Hl Hx] Hw.
  - pose proof (jempty_step g D q x Hq Hl) as Hin.
    pose proof (kill_hit_entry (list joblist) (jchain Eng g D) (jinv g) Hok Hm all_empty 0 x (q * 1) 1
                  (map (slot Eng []) x) (conj Hl Hx) Hin) as Hk.
    assert (He : all_empty (map (slot Eng []) x) = true).
    { unfold all_empty. apply forallb_forall. intros y Hy. apply in_map_iff in Hy as [s [<- Hs]].
      rewrite Forall_forall in Hx, Hw. pose proof (slot_empty_le s 0 (Hx s Hs) (Hw s Hs)) as H0.
      rewrite (work_zero _ (proj1 (slot_step Eng E_rad [] s (Hx s Hs) (Forall_nil _))) ltac:(lia)).
      apply jl_eqb_refl. }
    specialize (Hk (or_introl He) ltac:(lra)). cbn [qpow]. lra.
  - pose proof (jempty_step g D q x Hq Hl) as Hin.
    set (y := map (slot Eng []) x) in *.
    destruct (Hok x (conj Hl Hx) _ Hin) as [_ Hy]. cbn [snd] in Hy.
    assert (Hwy : Forall (fun s => (work s <= S m)%nat) y).
    { apply Forall_forall. intros z Hz. unfold y in Hz. apply in_map_iff in Hz as [s [<- Hs]].
      rewrite Forall_forall in Hx, Hw. exact (slot_empty_le s (S m) (Hx s Hs) (Hw s Hs)). }
    assert (Hr0 : 0 <= qpow q (S m) <= 1).
    { split; [apply Qlt_le_weak, qpow_pos; exact Hq0|].
      clear -Hq0 Hq1. induction (S m) as [|k IHk]; cbn [qpow]; [lra|]. assert (0 <= qpow q k) by
        (clear IHk; induction k; cbn [qpow]; [lra|nra]). nra. }
    pose proof (kill_hit_entry (list joblist) (jchain Eng g D) (jinv g) Hok Hm all_empty (S m) x (q * 1)
                  (qpow q (S m)) y (conj Hl Hx) Hin) as Hk.
    destruct (all_empty y) eqn:Hay.
    + specialize (Hk (or_introl eq_refl) Hr0). change (qpow q (S (S m))) with (q * qpow q (S m)). nra.
    + specialize (Hk (or_intror (IH y Hy Hwy)) Hr0). change (qpow q (S (S m))) with (q * qpow q (S m)). nra.
Qed.

(** *** B5's joint part *)

Lemma jempty_facts (g : positive) (W : nat) : (0 < W)%nat ->
  jinv g (jempty g) /\ jsmall W (jempty g) = true /\ jV (jempty g) == 0.
Proof.
  intros HW. unfold jempty. split; [split; [apply repeat_length|]|split].
  - apply Forall_forall. intros s Hs. apply repeat_spec in Hs. subst. exact jl_inv_empty.
  - unfold jsmall. apply forallb_forall. intros s Hs. apply repeat_spec in Hs. subst.
    apply Nat.ltb_lt. exact HW.
  - generalize (Pos.to_nat g). intros n. induction n as [|n IH]; [reflexivity|].
    cbn [repeat]. unfold jV in *. rewrite qsum_cons, IH. reflexivity.
Qed.

Lemma nodes_joint_for : theorem2_nodes_joint_for Eng.
Proof.
  intros g D HD' HL [q [Hq Hq0]].
  pose proof (valid_dist_0 D HD') as HD.
  assert (Hok := jchain_ok g D HD). assert (Hm := fun x (_ : jinv g x) => jchain_mass g D HD x).
  set (K := jchain Eng g D) in *.
  assert (HL0 : 0 <= load D).
  { rewrite load_qsum. apply qsum_nonneg. intros [p a] Hin. destruct HD as [HDf _].
    rewrite Forall_forall in HDf. destruct (HDf _ Hin) as [Hp _]. cbn [fst snd] in *.
    pose proof (nq_nonneg (tokens_of a)). nra. }
  destruct (inv_g_bounds g) as [Hg0 Hg1].
  set (l := (1 # g) * load D).
  assert (Hl0 : 0 <= l) by (unfold l; nra).
  assert (Hl1 : l < 128).
  { unfold l. assert (Hgg : (1 # g) * inject_Z (Z.pos g) == 1) by (unfold Qeq; cbn; lia).
    rewrite inject_Z_mult in HL. change (inject_Z 128) with 128 in HL. nra. }
  set (c := qsum (fun pa => (nq (tokens_of (snd pa)) + 128) * (nq (tokens_of (snd pa)) + 128)) D).
  assert (Hc : forall pa, In pa D -> (nq (tokens_of (snd pa)) + 128) * (nq (tokens_of (snd pa)) + 128) <= c).
  { intros pa Hin.
    apply (qsum_entry (fun pa => (nq (tokens_of (snd pa)) + 128) * (nq (tokens_of (snd pa)) + 128)) D pa Hin).
    intros [p a] _. cbn [snd]. pose proof (nq_nonneg (tokens_of a)). nra. }
  assert (Hc0 : 0 <= c).
  { apply qsum_nonneg. intros [p a] _. cbn [snd]. pose proof (nq_nonneg (tokens_of a)). nra. }
  set (ng := nq (Pos.to_nat g)).
  assert (Hng : 0 <= ng) by apply nq_nonneg.
  set (B0 := 2 * l * 65536).
  assert (HB0 : 0 <= B0) by (unfold B0; nra).
  set (Lc := ng * c + ng * B0).
  assert (HLc : 0 <= Lc) by (unfold Lc; nra).
  set (e := 2 * (128 - l)).
  assert (He : 0 < e) by (unfold e; lra).
  destruct (Qarchimedean ((Lc + 1) / e)) as [pw Hpw].
  set (m0 := (Pos.to_nat pw + small_bound)%nat).
  set (W := S m0).
  assert (HeW : Lc + 1 <= e * nq W).
  { assert (Hid : (Lc + 1) / e * e == Lc + 1) by (field; lra).
    assert (HWq : (Z.pos pw # 1) <= nq W).
    { unfold nq, W, m0. change (Z.pos pw # 1) with (inject_Z (Z.pos pw)). rewrite <- Zle_Qle. lia. }
    nra. }
  assert (HWb : (small_bound <= W)%nat) by (unfold W, m0; lia).
  (* one-step bounds *)
  assert (Hexp : forall x, jinv g x ->
            expect K jV x <= jV x + ng * c + qsum (jh l) x).
  { intros x [Hl Hx]. pose proof (jchain_drift g D x c HD Hl Hx Hc) as H.
    rewrite Hl in H. fold K ng l in H.
    pose proof (jdrift_split l x) as Hs. set (S := qsum (fun q => q) (jws x)) in *. lra. }
  assert (Hhle : forall x, jinv g x -> qsum (jh l) x <= ng * B0).
  { intros x [Hl _]. unfold ng. rewrite <- Hl, <- qsum_const. apply qsum_le.
    intros s _. exact (jh_le l s Hl0 Hl1). }
  assert (HLy : forall x, jinv g x -> expect K jV x <= jV x + Lc).
  { intros x Hx. pose proof (Hexp x Hx). pose proof (Hhle x Hx). unfold Lc. lra. }
  set (b := ng * (nq W * nq W) + Lc).
  assert (Hdrift : forall x, jinv g x -> jsmall W x = false -> expect K jV x + 1 <= jV x).
  { intros x Hx Hs. destruct (jsmall_false W x Hs) as (s & Hin & Hw).
    pose proof (qsum_le_minus (jh l) (fun _ => B0) x s (B0 + e * nq W) Hin
                  (fun s' _ => jh_le l s' Hl0 Hl1)
                  ltac:(pose proof (jh_big l s W Hl0 Hl1 HWb Hw); unfold e; nra)) as Hq'.
    rewrite qsum_const in Hq'. destruct Hx as [Hl Hxs]. rewrite Hl in Hq'. fold ng in Hq'.
    pose proof (Hexp x (conj Hl Hxs)). unfold Lc in HeW. lra. }
  assert (Hinside : forall x, jinv g x -> jsmall W x = true -> expect K jV x <= b).
  { intros x Hx Hs. pose proof (HLy x Hx). pose proof (jsmall_V W x Hs) as HV.
    destruct Hx as [Hl _]. rewrite Hl in HV. fold ng in HV. unfold b. lra. }
  assert (Hb0 : 0 <= b) by (unfold b; pose proof (nq_nonneg W); nra).
  (* the time to the small set *)
  set (G := fun z => 1 * jV z + (1 + b) * 1).
  assert (HG : forall m z, jinv g z -> hit_partial K (jsmall W) m z <= G z).
  { intros m z Hz.
    destruct (foster_criterion_holds (list joblist) K (jsmall W) (jinv g) jV 1 b ltac:(lra) Hok
                (fun x _ => jV_nonneg x) Hdrift Hinside z Hz m) as [Hout Hin].
    pose proof (jV_nonneg z). unfold G.
    destruct (jsmall W z) eqn:Hs; [pose proof (Hin eq_refl)|pose proof (Hout eq_refl)]; lra. }
  (* from the small set, every node empty within [W] slots with probability [q^W] *)
  set (T := W).
  set (delta := qpow q T).
  pose proof (dist_entry_le D q [] HD Hq) as Hq1.
  assert (Hd0 : 0 < delta) by (apply qpow_pos; exact Hq0).
  assert (Hd1 : delta <= 1).
  { unfold delta. clear -Hq0 Hq1. induction T as [|k IHk]; cbn [qpow]; [lra|].
    assert (0 <= qpow q k) by (clear IHk; induction k; cbn [qpow]; [lra|nra]). nra. }
  assert (Hkill : forall y, jinv g y -> jsmall W y = true -> kill (list joblist) K all_empty T (fun _ => 1) y <= 1 - delta).
  { intros y Hy Hs. unfold T, W, delta. apply (jdrain_kill g D q HD Hq Hq0 m0 y Hy).
    unfold jsmall in Hs. rewrite forallb_forall in Hs. apply Forall_forall. intros s Hin.
    specialize (Hs s Hin). apply Nat.ltb_lt in Hs. fold W in Hs. unfold W in Hs. lia. }
  set (Tq := inject_Z (Z.of_nat T)).
  assert (HTq : 0 <= Tq) by (unfold Tq; change 0 with (inject_Z 0); rewrite <- Zle_Qle; lia).
  set (Gb := ng * (nq W * nq W) + Tq * Lc + (1 + b)).
  assert (HGb : 0 <= Gb) by (unfold Gb; pose proof (nq_nonneg W); nra).
  assert (HkG : forall y, jinv g y -> jsmall W y = true -> kill (list joblist) K all_empty T G y <= Gb).
  { intros y Hy Hs.
    pose proof (kill_lin (list joblist) K all_empty T 1 (1 + b) jV (fun _ => 1) y) as E0.
    cbv beta in E0. fold G in E0.
    pose proof (kill_lyapunov (list joblist) K (jinv g) Hok Hm all_empty jV Lc HLc
                  (fun x _ => jV_nonneg x) HLy T y Hy) as HV. fold Tq in HV.
    pose proof (kill_one_le (list joblist) K (jinv g) Hok Hm all_empty T y Hy) as H1.
    pose proof (kill_nonneg (list joblist) K (jinv g) Hok all_empty T (fun _ => 1) ltac:(intros; cbv beta; lra) y Hy) as H2.
    pose proof (jsmall_V W y Hs) as HW. destruct Hy as [Hl _]. rewrite Hl in HW. fold ng in HW.
    set (kv := kill (list joblist) K all_empty T jV y) in *.
    set (k1 := kill (list joblist) K all_empty T (fun _ => 1) y) in *.
    unfold Gb. nra. }
  pose proof (hit_regenerate (list joblist) K (jinv g) Hok Hm all_empty (jsmall W) G T delta Gb
                ltac:(unfold T, W; lia) Hd0 Hd1 HGb HG Hkill HkG) as Hreg.
  set (M := / delta * (Tq + Gb)) in *.
  assert (HM0 : 0 <= M) by (unfold M; apply Qmult_le_0_compat; [apply Qinv_le_0_compat|]; lra).
  destruct (jempty_facts g W ltac:(unfold W; lia)) as (Hje & Hjs & HjV).
  exists ((1 + b) + M). intros n.
  pose proof (hit_via (list joblist) K (jinv g) Hok Hm all_empty (jsmall W) M n HM0
                (fun m y _ Hy Hc' => Hreg m y Hy Hc') (jempty g) Hje) as Hv.
  pose proof (HG n (jempty g) Hje) as Hg. unfold G in Hg. rewrite HjV in Hg. lra.
Qed.

End joint.

Theorem theorem2_nodes_joint_holds : theorem2_nodes_joint.
Proof. exact (nodes_joint_for E128 e128_rad). Qed.

(** B5's joint part for every [rad128] engine too. *)
Theorem theorem2_joint_rad128 (E : engine) : rad128 E -> theorem2_nodes_joint_for E.
Proof. exact (nodes_joint_for E). Qed.

(** What [serq prove] instantiates: B4, B5 (per node and joint) and B6 for an engine shown
    [rad128]. *)
Theorem theorem2_all_rad128 (E : engine) :
  rad128 E ->
  theorem2_one_node_for E /\ theorem2_nodes_per_node_for E /\ theorem2_nodes_joint_for E
  /\ theorem2_compound_for E.
Proof.
  intros H. destruct (theorem2_rad128 E H) as (H1 & H2 & H3).
  split; [exact H1|split; [exact H2|split; [exact (theorem2_joint_rad128 E H)|exact H3]]].
Qed.
