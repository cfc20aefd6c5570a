(** * Facts about the step semantics of [Step.v], for every engine

    - [every_iteration_of_invariant]: a state invariant preserved by [step] and implying
      the claim at each iteration proves the claim on every iteration of every run;
    - [form_batch_cap]: a batch never exceeds its [tokens cap];
    - [serve_prefills_full], [admit_loop_full]: once the cap is reached nothing more is
      served (the loops stop at the first request that gets nothing);
    - [arrive_*]: arrivals keep the clock and [served], take a prefix of the pending list,
      and leave a pending head strictly after [now] (so an idle jump moves time forward);
    - [step_wf]: every decoding request has decode left and every prefilling one
      prefill left, the fact under which [Step.finish]'s unconditional filters are
      [interp.py]'s conditional ones. *)
From Coq Require Import List Bool Arith Lia.
From Plow Require Import Serq.Step.
Import ListNotations.

(** ** Invariants give claims on every iteration *)

Definition preserves (E : engine) (I : state -> Prop) (P : view -> Prop) : Prop :=
  forall st, I st ->
    match step E st with
    | Iterated st1 b st' => P (claim_view st1 b) /\ I st'
    | Idle st' | Halted st' => I st'
    end.

Lemma run_invariant (E : engine) (I : state -> Prop) (P : view -> Prop) :
  preserves E I P -> forall n st, I st -> I (run E n st).
Proof.
  intros Hp n; induction n as [|n IH]; intros st Hi; simpl; [exact Hi|].
  apply IH. specialize (Hp st Hi). destruct (step E st); simpl; tauto.
Qed.

Lemma every_iteration_of_invariant (E : engine) (I : state -> Prop) (P : view -> Prop)
    (arrivals : list req) :
  I (init arrivals) -> preserves E I P -> every_iteration E arrivals P.
Proof.
  intros H0 Hp n st1 b st' Hs.
  pose proof (Hp _ (run_invariant E I P Hp n _ H0)) as H. rewrite Hs in H. tauto.
Qed.

Lemma every_iteration_impl (E : engine) (arrivals : list req) (P Q : view -> Prop) :
  (forall v, P v -> Q v) -> every_iteration E arrivals P -> every_iteration E arrivals Q.
Proof. intros Hpq H n st1 b st' Hs. apply Hpq. exact (H n st1 b st' Hs). Qed.

Lemma every_path_impl (E : engine) (g : req -> bool) (P Q : view -> Prop) :
  (forall v, P v -> Q v) -> every_path E g P -> every_path E g Q.
Proof. intros Hpq H arr Hg. exact (every_iteration_impl E arr P Q Hpq (H arr Hg)). Qed.

(** A claim that needs a stronger [given] still holds under a weaker... the other way:
    a [given] that implies the proof's [given] inherits the proof. *)
Lemma every_path_given (E : engine) (g g' : req -> bool) (P : view -> Prop) :
  (forall r, g' r = true -> g r = true) -> every_path E g P -> every_path E g' P.
Proof.
  intros Hg H arr Ha. apply H. eapply Forall_impl; [|exact Ha]. exact Hg.
Qed.

(** ** The cap *)

Lemma serve_prefills_bounds (each : option nat) (c t : nat) (ps : list job) :
  t <= c -> t <= snd (serve_prefills each (Some c) t ps) <= c.
Proof.
  revert t; induction ps as [|p ps IH]; intros t Ht; cbn [serve_prefills]; [simpl; lia|].
  set (k := xmin each (xmin (room (Some c) t) (j_pre p))).
  assert (Hk : k <= c - t).
  { subst k; destruct each; cbn [xmin room]; lia. }
  destruct (k =? 0) eqn:E0; [simpl; lia|].
  destruct (serve_prefills each (Some c) (t + k) ps) as [cs t'] eqn:Es; simpl.
  specialize (IH (t + k) ltac:(lia)). rewrite Es in IH; simpl in IH. lia.
Qed.

Lemma serve_prefills_full (each : option nat) (c t : nat) (ps : list job) :
  c <= t -> serve_prefills each (Some c) t ps = ([], t).
Proof.
  destruct ps as [|p ps]; intros Ht; simpl; [reflexivity|].
  replace (c - t) with 0 by lia.
  destruct each; simpl; rewrite ?Nat.min_0_r, ?Nat.min_0_l; reflexivity.
Qed.

Lemma admit_loop_bounds (st : state) (mode : option bool) (w : option (view -> bool))
    (each : option nat) (c : nat) (ws : list job) (b : batch) :
  b_tokens b <= c ->
  b_tokens b <= b_tokens (admit_loop st mode w each (Some c) ws b) <= c.
Proof.
  revert b; induction ws as [|h ws IH]; intros b Hb; cbn [admit_loop]; [lia|].
  destruct (negb _); [lia|]. destruct (negb (mode_ok mode h)); [lia|].
  destruct (0 <? j_pre h).
  - set (k := xmin each (xmin (room (Some c) (b_tokens b)) (j_pre h))).
    assert (Hk : k <= c - b_tokens b) by (subst k; destruct each; cbn [xmin room]; lia).
    destruct (k =? 0); [lia|].
    match goal with |- context [admit_loop st mode w each (Some c) ws ?b'] =>
      specialize (IH b' ltac:(cbn [b_tokens]; lia)); cbn [b_tokens] in IH; lia end.
  - destruct (xpos each && xpos (room (Some c) (b_tokens b))) eqn:Hx; [|lia].
    apply andb_true_iff in Hx as [_ Hx]; cbn [xpos room] in Hx; apply Nat.leb_le in Hx.
    match goal with |- context [admit_loop st mode w each (Some c) ws ?b'] =>
      specialize (IH b' ltac:(cbn [b_tokens]; lia)); cbn [b_tokens] in IH; lia end.
Qed.

Lemma admit_loop_full (st : state) (mode : option bool) (w : option (view -> bool))
    (each : option nat) (c : nat) (ws : list job) (b : batch) :
  c <= b_tokens b -> admit_loop st mode w each (Some c) ws b = b.
Proof.
  destruct ws as [|h ws]; intros Hb; simpl; [reflexivity|].
  destruct (negb _); [reflexivity|]. destruct (negb (mode_ok mode h)); [reflexivity|].
  replace (c - b_tokens b) with 0 by lia.
  destruct (0 <? j_pre h).
  - destruct each; simpl; rewrite ?Nat.min_0_r, ?Nat.min_0_l; reflexivity.
  - rewrite andb_false_r. reflexivity.
Qed.

Lemma serve_decoders_cap (E : engine) (st : state) (c : nat) :
  serve_decoders E st (Some c) <= c.
Proof.
  unfold serve_decoders. destruct (e_advance E); [|lia].
  destruct (_ && _); [|lia]. destruct (_ && _); simpl; lia.
Qed.

Lemma form_batch_cap (E : engine) (st : state) (f : view -> nat) :
  e_cap E = Some f ->
  b_tokens (form_batch E st) <= f (view_of st (length (s_waiting st)) 0 0).
Proof.
  intros Hc. unfold form_batch. rewrite Hc. cbn [bound].
  set (c := f _).
  pose proof (serve_decoders_cap E st c) as Hd.
  set (nd := serve_decoders E st (Some c)) in *.
  assert (Ht : nd <= snd (advance_prefills E st (Some c) nd) <= c).
  { unfold advance_prefills. destruct (e_advance E); [|simpl; lia].
    destruct (_ && _); [apply serve_prefills_bounds; lia|simpl; lia]. }
  destruct (advance_prefills E st (Some c) nd) as [cs t1]; simpl in Ht.
  destruct (e_admit E); [|simpl; lia].
  destruct (_ && _); [|simpl; lia].
  apply admit_loop_bounds; simpl; lia.
Qed.

(** ** Arrivals *)

Lemma absorb_spec (now n : nat) (pending : list req) (waiting : list job)
    (ended : list (nat * nat)) :
  match absorb now n pending waiting ended with
  | (_, pending', waiting', _) =>
      (exists pre, pending = pre ++ pending'
         /\ waiting' = waiting ++ map (fun '(k, r) => mk_job k (r_vp r) (r_vd r))
                          (filter (fun '(_, r) => negb ((r_vp r =? 0) && (r_vd r =? 0)))
                             (combine (seq n (length pre)) pre)))
      /\ match pending' with [] => True | r :: _ => now < r_arr r end
  end.
Proof.
  revert n waiting ended; induction pending as [|r rest IH]; intros n waiting ended; simpl.
  - split; [|exact I]. exists []. simpl. rewrite app_nil_r. split; reflexivity.
  - destruct (r_arr r <=? now) eqn:Ha.
    + destruct ((r_vp r =? 0) && (r_vd r =? 0)) eqn:Hz.
      * specialize (IH (S n) waiting (ended ++ [(n, r_arr r)])).
        destruct (absorb now (S n) rest waiting _) as [[[n' p'] w'] e'].
        destruct IH as [[pre [-> ->]] Hh]. split; [|exact Hh].
        exists (r :: pre). split; [reflexivity|]. simpl. rewrite Hz. reflexivity.
      * specialize (IH (S n) (waiting ++ [mk_job n (r_vp r) (r_vd r)]) ended).
        destruct (absorb now (S n) rest _ ended) as [[[n' p'] w'] e'].
        destruct IH as [[pre [-> ->]] Hh]. split; [|exact Hh].
        exists (r :: pre). split; [reflexivity|]. simpl. rewrite Hz. simpl.
        rewrite <- app_assoc. reflexivity.
    + split; [exists []; simpl; rewrite app_nil_r; split; reflexivity|].
      apply Nat.leb_gt. exact Ha.
Qed.

Lemma arrive_clock (st : state) :
  s_now (arrive st) = s_now st /\ s_served (arrive st) = s_served st
  /\ s_prefilling (arrive st) = s_prefilling st /\ s_decoding (arrive st) = s_decoding st.
Proof.
  unfold arrive. destruct (absorb _ _ _ _ _) as [[[n p] w] e]. simpl. tauto.
Qed.

(** What arrives: every pending request satisfying [Pr] becomes a waiting job satisfying
    [Pj]; what is still pending is a suffix, and its head is after [now]. *)
Lemma arrive_forall (st : state) (Pr : req -> Prop) (Pj : job -> Prop) :
  (forall k r, Pr r -> Pj (mk_job k (r_vp r) (r_vd r))) ->
  Forall Pr (s_pending st) -> Forall Pj (s_waiting st) ->
  Forall Pr (s_pending (arrive st)) /\ Forall Pj (s_waiting (arrive st))
  /\ match s_pending (arrive st) with [] => True | r :: _ => s_now st < r_arr r end.
Proof.
  intros Hrj Hp Hw. unfold arrive.
  pose proof (absorb_spec (s_now st) (s_arrived st) (s_pending st) (s_waiting st)
                (s_ended st)) as Hs.
  destruct (absorb _ _ _ _ _) as [[[n p] w] e]. simpl.
  destruct Hs as [[pre [Hpre ->]] Hh]. split; [|split; [|exact Hh]].
  - rewrite Hpre in Hp. apply Forall_app in Hp. tauto.
  - apply Forall_app; split; [exact Hw|].
    rewrite Hpre in Hp; apply Forall_app in Hp as [Hp _].
    apply Forall_forall. intros j Hj. apply in_map_iff in Hj as [[k r] [<- Hin]].
    apply filter_In in Hin as [Hin _]. apply in_combine_r in Hin.
    apply Hrj. rewrite Forall_forall in Hp. exact (Hp r Hin).
Qed.

(** ** Well-formedness *)

Definition wf (st : state) : Prop :=
  Forall (fun j => has_dec j = true) (s_decoding st)
  /\ Forall (fun j => has_pre j = true) (s_prefilling st).

Lemma forall_filter {A} (f : A -> bool) (l : list A) : Forall (fun x => f x = true) (filter f l).
Proof. apply Forall_forall. intros x Hx. apply filter_In in Hx. tauto. Qed.

Lemma step_wf (E : engine) (st : state) : wf st -> wf (next (step E st)).
Proof.
  intros [Hd Hp]. unfold step.
  destruct (arrive_clock st) as (_ & _ & Hp1 & Hd1).
  destruct (b_tokens _ =? 0).
  - destruct (s_pending (arrive st)); unfold wf; simpl; rewrite Hp1, Hd1; tauto.
  - unfold wf, finish; simpl. split.
    + apply Forall_app; split; [apply forall_filter|].
      apply Forall_app; split; apply forall_filter.
    + apply forall_filter.
Qed.

Lemma filter_all {A} (f : A -> bool) (l : list A) :
  (forall x, In x l -> f x = true) -> filter f l = l.
Proof.
  induction l as [|x l IH]; intros H; simpl; [reflexivity|].
  rewrite (H x (or_introl eq_refl)), IH; [reflexivity|]. intros y Hy. apply H. now right.
Qed.

(** Under [wf], [finish]'s filter of [decoding] is [interp.py]'s: when no served decoder
    finished, the list is kept as it is. *)
Lemma finish_decoding_unfiltered (ds : list job) (nd : nat) :
  Forall (fun j => has_dec j = true) ds ->
  filter (fun j => negb (has_dec j)) (map dec1 (firstn nd ds)) = [] ->
  filter has_dec (map dec1 (firstn nd ds) ++ skipn nd ds) = map dec1 (firstn nd ds) ++ skipn nd ds.
Proof.
  intros Hd Hf. apply filter_all. intros x Hx. apply in_app_or in Hx as [Hx|Hx].
  - destruct (has_dec x) eqn:Hx'; [reflexivity|].
    assert (In x (filter (fun j => negb (has_dec j)) (map dec1 (firstn nd ds)))) as Hin
      by (apply filter_In; rewrite Hx'; tauto).
    rewrite Hf in Hin. destruct Hin.
  - rewrite Forall_forall in Hd. apply Hd.
    rewrite <- (firstn_skipn nd ds). apply in_or_app. tauto.
Qed.

(** ** The end of an iteration *)

Lemma filter_length_le {A} (f : A -> bool) (l : list A) : length (filter f l) <= length l.
Proof. induction l as [|x l IH]; simpl; [lia|]. destruct (f x); simpl; lia. Qed.

Lemma forall_skipn {A} (P : A -> Prop) (n : nat) (l : list A) :
  Forall P l -> Forall P (skipn n l).
Proof.
  intros H. rewrite <- (firstn_skipn n l) in H. apply Forall_app in H. tauto.
Qed.

(** Requests start decoding only from the served prefills and the admitted. *)
Lemma finish_decoding_length (st : state) (b : batch) (t : nat) :
  length (s_decoding (finish st b t)) <= length (s_decoding st) + length (b_prefills b)
    + length (b_admitted b) + length (b_admitted_dec b).
Proof.
  unfold finish; cbn [s_decoding]. rewrite !app_length.
  set (d0 := map dec1 (firstn (b_decoders b) (s_decoding st)) ++ skipn (b_decoders b) (s_decoding st)).
  assert (H0 : length d0 = length (s_decoding st)).
  { subst d0. rewrite app_length, map_length, <- app_length, firstn_skipn. reflexivity. }
  set (d1 := filter (fun j => negb (has_pre j))
               (firstn (length (b_prefills b)) (apply_chunks (b_prefills b) (s_prefilling st)))).
  assert (H1 : length d1 <= length (b_prefills b)).
  { subst d1. etransitivity; [apply filter_length_le|]. rewrite firstn_length. lia. }
  set (d2 := filter (fun j => negb (has_pre j)) (map cut (b_admitted b))).
  assert (H2 : length d2 <= length (b_admitted b)).
  { subst d2. etransitivity; [apply filter_length_le|]. rewrite map_length. lia. }
  pose proof (filter_length_le has_dec d0).
  pose proof (filter_length_le has_dec (d1 ++ d2)). rewrite app_length in *.
  pose proof (filter_length_le has_dec (map dec1 (b_admitted_dec b))). rewrite map_length in *.
  lia.
Qed.

(** ** Draws in [execute] (the sample stream of [Step.stepd])

    - [stepd_of_engine], [rund_of_engine], [every_path_d_of_engine]: an engine without
      draws runs the same under the stream semantics, for every stream, so every claim
      proved with [every_path] holds with [every_path_d];
    - [every_path_d_of_invariant]: an invariant preserved by the iteration at every
      sample proves a claim for every stream and every arrival list;
    - [form_batch_at_draw]: the batch does not depend on the sample, so claims on the
      batch ([tokens <= cap]) carry over from any one sample ([every_path_d_cap]). *)

Lemma at_draw_of_engine (E : engine) (u : nat) : at_draw (of_engine E) u = E.
Proof. destruct E; reflexivity. Qed.

Lemma stepd_of_engine (E : engine) (draws : nat -> nat) (st : state) :
  stepd (of_engine E) draws st = step E st.
Proof. unfold stepd. now rewrite at_draw_of_engine. Qed.

Lemma rund_of_engine (E : engine) (draws : nat -> nat) (n : nat) (st : state) :
  rund (of_engine E) draws n st = run E n st.
Proof.
  revert st; induction n as [|n IH]; intros st; simpl; [reflexivity|].
  rewrite stepd_of_engine. apply IH.
Qed.

Lemma every_path_d_of_engine (E : engine) (g : req -> bool) (P : view -> Prop) :
  every_path_d (of_engine E) g P <-> every_path E g P.
Proof.
  split.
  - intros H arr Hg n st1 b st' Hs. apply (H (fun _ => 0) arr Hg n st1 b st').
    now rewrite rund_of_engine, stepd_of_engine.
  - intros H draws arr Hg n st1 b st' Hs. apply (H arr Hg n st1 b st').
    now rewrite rund_of_engine, stepd_of_engine in Hs.
Qed.

Lemma rund_invariant (D : dengine) (draws : nat -> nat) (I : state -> Prop)
    (P : view -> Prop) :
  (forall u, preserves (at_draw D u) I P) -> forall n st, I st -> I (rund D draws n st).
Proof.
  intros Hp n; induction n as [|n IH]; intros st Hi; simpl; [exact Hi|].
  apply IH. specialize (Hp (draws (s_iter st)) st Hi). unfold stepd.
  destruct (step (at_draw D (draws (s_iter st))) st); simpl; tauto.
Qed.

Lemma every_path_d_of_invariant (D : dengine) (g : req -> bool) (I : state -> Prop)
    (P : view -> Prop) :
  (forall arr, Forall (fun r => g r = true) arr -> I (init arr)) ->
  (forall u, preserves (at_draw D u) I P) -> every_path_d D g P.
Proof.
  intros H0 Hp draws arr Hg n st1 b st' Hs.
  pose proof (rund_invariant D draws I P Hp n _ (H0 arr Hg)) as Hi.
  specialize (Hp (draws (s_iter (rund D draws n (init arr)))) _ Hi).
  unfold stepd in Hs. rewrite Hs in Hp. tauto.
Qed.

Lemma form_batch_at_draw (D : dengine) (u u' : nat) (st : state) :
  form_batch (at_draw D u) st = form_batch (at_draw D u') st.
Proof. reflexivity. Qed.

Lemma every_path_d_cap (D : dengine) (g : req -> bool) (c : nat) :
  d_cap D = Some (fun _ => c) -> every_path_d D g (fun v => v_tokens v <= c).
Proof.
  intros Hc. apply (every_path_d_of_invariant D g (fun _ => True)); [auto|].
  intros u st _. unfold step. cbv zeta.
  destruct (b_tokens (form_batch (at_draw D u) (arrive st)) =? 0).
  - destruct (s_pending (arrive st)); exact I.
  - split; [|exact I]. unfold claim_view, view_of; cbn [v_tokens].
    exact (form_batch_cap (at_draw D u) (arrive st) (fun _ => c) Hc).
Qed.
