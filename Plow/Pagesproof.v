(** Soundness of the on-chip page timeline (checkpoint C): theorems M1–M3. *)
From Coq Require Import NArith List Bool Lia.
From Plow Require Import Loc Pages.
Import ListNotations.
Local Open Scope N_scope.

(** * Occupancy *)

Lemma live_at_iff : forall w t,
  live_at w t = true <-> w_start w <= t /\ t < w_end w.
Proof.
  intros w t. unfold live_at. rewrite andb_true_iff, N.leb_le, N.ltb_lt. tauto.
Qed.

Lemma occupancy_app : forall a b t,
  occupancy (a ++ b) t = occupancy a t + occupancy b t.
Proof.
  induction a as [|w a IH]; intros b t; simpl; [reflexivity|].
  rewrite IH. lia.
Qed.

(** No live window, no pages. *)
Lemma occupancy_none_live : forall ws t,
  (forall w, In w ws -> live_at w t = false) -> occupancy ws t = 0.
Proof.
  induction ws as [|w ws IH]; intros t H; simpl; [reflexivity|].
  rewrite (H w (or_introl eq_refl)), IH; [reflexivity|].
  intros w' Hin. apply H. now right.
Qed.

(** Occupancy is monotone in the set of live windows. *)
Lemma occupancy_mono : forall ws t s,
  (forall w, In w ws -> live_at w t = true -> live_at w s = true) ->
  occupancy ws t <= occupancy ws s.
Proof.
  induction ws as [|w ws IH]; intros t s H; simpl; [lia|].
  assert (Hr : occupancy ws t <= occupancy ws s)
    by (apply IH; intros w' Hin; apply H; now right).
  destruct (live_at w t) eqn:Ht.
  - rewrite (H w (or_introl eq_refl) Ht). lia.
  - destruct (live_at w s); lia.
Qed.

(** Among the windows that have opened by [t], one opened last. *)
Lemma latest_start : forall ws t,
  (forall w, In w ws -> t < w_start w) \/
  (exists w, In w ws /\ w_start w <= t /\
     forall w', In w' ws -> w_start w' <= t -> w_start w' <= w_start w).
Proof.
  induction ws as [|w ws IH]; intros t.
  - left. intros w [].
  - destruct (IH t) as [Hnone | (m & Hm & Hmt & Hmax)];
      destruct (N.le_gt_cases (w_start w) t) as [Hw | Hw].
    + right. exists w. split; [now left|]. split; [exact Hw|].
      intros w' [<-|Hin] Hw'; [lia|]. specialize (Hnone w' Hin). lia.
    + left. intros w' [<-|Hin]; [exact Hw|]. now apply Hnone.
    + destruct (N.le_gt_cases (w_start w) (w_start m)).
      * right. exists m. split; [now right|]. split; [exact Hmt|].
        intros w' [<-|Hin] Hw'; [assumption|]. now apply Hmax.
      * right. exists w. split; [now left|]. split; [exact Hw|].
        intros w' [<-|Hin] Hw'; [lia|]. specialize (Hmax w' Hin Hw'). lia.
    + right. exists m. split; [now right|]. split; [exact Hmt|].
      intros w' [<-|Hin] Hw'; [lia|]. now apply Hmax.
Qed.

(** The occupancy is piecewise constant and rises only where a window opens:
    at every cycle it is either zero or at most its value at the start of
    some window.  Checking the window starts is therefore enough. *)
Theorem occupancy_max_at_start : forall ws t,
  occupancy ws t = 0 \/
  exists w, In w ws /\ occupancy ws t <= occupancy ws (w_start w).
Proof.
  intros ws t. destruct (latest_start ws t) as [Hnone | (m & Hm & Hmt & Hmax)].
  - left. apply occupancy_none_live. intros w Hin.
    specialize (Hnone w Hin). unfold live_at.
    destruct (N.leb_spec (w_start w) t); [lia|reflexivity].
  - right. exists m. split; [exact Hm|]. apply occupancy_mono.
    intros w Hin Hlive. apply live_at_iff in Hlive as [H1 H2].
    apply live_at_iff. specialize (Hmax w Hin H1). lia.
Qed.

(** * M1: temporal fit *)

Lemma fits_single : forall budget w,
  w_pages w <= budget -> fits budget [w].
Proof.
  intros budget w H t. simpl. destruct (live_at w t); lia.
Qed.

(** M1, general form: if every window of [ps] (producers) closes before every
    window of [cs] (consumers) opens, and each side fits the budget on its
    own, the two together fit at every cycle. *)
Theorem temporal_fit_groups : forall budget ps cs,
  (forall p c, In p ps -> In c cs -> closes_before p c) ->
  fits budget ps -> fits budget cs -> fits budget (ps ++ cs).
Proof.
  intros budget ps cs Hord Hps Hcs t. rewrite occupancy_app.
  destruct (existsb (fun c => live_at c t) cs) eqn:Hex.
  - apply existsb_exists in Hex as (c & Hc & Hlive).
    apply live_at_iff in Hlive as [Hc1 _].
    rewrite (occupancy_none_live ps t); [specialize (Hcs t); lia|].
    intros p Hp. specialize (Hord p c Hp Hc). unfold closes_before in Hord.
    unfold live_at. destruct (N.ltb_spec t (w_end p)); [lia|].
    now rewrite andb_false_r.
  - rewrite (occupancy_none_live cs t); [specialize (Hps t); lia|].
    intros c Hc. destruct (live_at c t) eqn:Hl; [|reflexivity].
    exfalso. assert (existsb (fun c => live_at c t) cs = true)
      by (apply existsb_exists; eauto). congruence.
Qed.

(** M1 for one producer window and one consumer window. *)
Theorem temporal_fit : forall budget p c,
  closes_before p c -> w_pages p <= budget -> w_pages c <= budget ->
  fits budget [p; c].
Proof.
  intros budget p c Hord Hp Hc.
  apply (temporal_fit_groups budget [p] [c]).
  - intros p' c' [<-|[]] [<-|[]]. exact Hord.
  - now apply fits_single.
  - now apply fits_single.
Qed.

(** M1 for a list: windows that close, in list order, before each later one
    opens, each within the budget, fit at every cycle. *)
Theorem temporal_fit_chain : forall budget ws,
  ForallOrdPairs closes_before ws ->
  (forall w, In w ws -> w_pages w <= budget) ->
  fits budget ws.
Proof.
  intros budget ws Hord. induction Hord as [|w rest Hw Hrest IH]; intros Hfit.
  - intros t. simpl. lia.
  - change (w :: rest) with ([w] ++ rest). apply temporal_fit_groups.
    + intros p c [<-|[]] Hc. eapply Forall_forall; eassumption.
    + apply fits_single. apply Hfit. now left.
    + apply IH. intros w' Hin. apply Hfit. now right.
Qed.

(** * M2: both hypotheses of M1 are load-bearing *)

(** Two windows of 10 pages each, overlapping on cycles 5..9, budget 16. *)
Definition m2_overlap_p : window := mk_window 0 10 10.
Definition m2_overlap_c : window := mk_window 5 15 10.

Lemma m2_overlap_overflows :
  w_pages m2_overlap_p <= 16 /\ w_pages m2_overlap_c <= 16 /\
  ~ closes_before m2_overlap_p m2_overlap_c /\
  occupancy [m2_overlap_p; m2_overlap_c] 5 = 20.
Proof.
  unfold closes_before. simpl. repeat split; try lia; reflexivity.
Qed.

(** Dropping "closes before opens" allows an overflow. *)
Theorem temporal_fit_needs_order :
  ~ (forall budget p c, w_pages p <= budget -> w_pages c <= budget ->
       fits budget [p; c]).
Proof.
  intros H. specialize (H 16 m2_overlap_p m2_overlap_c).
  destruct m2_overlap_overflows as (Hp & Hc & _ & Hocc).
  specialize (H Hp Hc 5). rewrite Hocc in H. lia.
Qed.

(** A 20-page producer that closes at cycle 10, a 1-page consumer that opens
    at cycle 10, budget 16. *)
Definition m2_big_p : window := mk_window 0 10 20.
Definition m2_big_c : window := mk_window 10 20 1.

Lemma m2_big_overflows :
  closes_before m2_big_p m2_big_c /\ w_pages m2_big_c <= 16 /\
  16 < w_pages m2_big_p /\ occupancy [m2_big_p; m2_big_c] 0 = 20.
Proof.
  unfold closes_before. simpl. repeat split; try lia; reflexivity.
Qed.

(** Dropping "each side fits" (even for one side only) allows an overflow. *)
Theorem temporal_fit_needs_each_side :
  ~ (forall budget p c, closes_before p c -> w_pages c <= budget ->
       fits budget [p; c]).
Proof.
  intros H. specialize (H 16 m2_big_p m2_big_c).
  destruct m2_big_overflows as (Hord & Hc & _ & Hocc).
  specialize (H Hord Hc 0). rewrite Hocc in H. lia.
Qed.

(** * M3: the executable timeline check is sound *)

Lemma check_starts_accept : forall budget worker all ws i,
  check_starts budget worker all i ws = Accept ->
  forall w, In w ws -> occupancy all (w_start w) <= budget.
Proof.
  induction ws as [|w ws IH]; intros i Hc w' Hin; [destruct Hin|].
  simpl in Hc. destruct (N.leb_spec (occupancy all (w_start w)) budget);
    [|discriminate].
  destruct Hin as [<-|Hin]; [assumption|]. eapply IH; eassumption.
Qed.

Lemma check_worker_sound : forall budget worker ws,
  check_worker budget worker ws = Accept -> fits budget ws.
Proof.
  intros budget worker ws Hc t.
  destruct (occupancy_max_at_start ws t) as [H0 | (w & Hin & Hle)]; [lia|].
  pose proof (check_starts_accept budget worker ws ws 0 Hc w Hin). lia.
Qed.

Lemma check_workers_accept : forall budget tl k,
  check_workers budget k tl = Accept ->
  forall j ws, nth_error tl j = Some ws ->
  check_worker budget (k + N.of_nat j) ws = Accept.
Proof.
  induction tl as [|ws0 tl IH]; intros k Hc j ws Hj;
    [destruct j; discriminate|].
  simpl in Hc. destruct (check_worker budget k ws0) eqn:H0; [|discriminate].
  destruct j as [|j]; simpl in Hj.
  - injection Hj as <-. now rewrite N.add_0_r.
  - specialize (IH (N.succ k) Hc j ws Hj).
    replace (k + N.of_nat (S j)) with (N.succ k + N.of_nat j) by lia.
    exact IH.
Qed.

(** M3: an accepted timeline never exceeds the budget, on any worker, at
    any cycle. *)
Theorem check_pages_sound : forall budget tl,
  check_pages budget tl = Accept -> timeline_fits budget tl.
Proof.
  intros budget tl Hc k ws Hk.
  eapply check_worker_sound. eapply check_workers_accept; eassumption.
Qed.

(** A rejection is genuine: the named worker really is over budget at the
    named cycle, which is the start of the named window. *)
Lemma check_starts_reject : forall budget worker all ws i wi t o b,
  check_starts budget worker all i ws = Reject (Over_budget worker wi t o b) ->
  exists w, nth_error ws (N.to_nat (wi - i)) = Some w /\ i <= wi /\
    w_start w = t /\ occupancy all t = o /\ b = budget /\ budget < o.
Proof.
  induction ws as [|w ws IH]; intros i wi t o b Hc; [discriminate|].
  simpl in Hc. destruct (N.leb_spec (occupancy all (w_start w)) budget).
  - destruct (IH _ _ _ _ _ Hc) as (w' & Hn & Hi & Ht & Ho & Hb & Hlt).
    exists w'. split; [|repeat split; auto; lia].
    replace (N.to_nat (wi - i)) with (S (N.to_nat (wi - N.succ i))) by lia.
    exact Hn.
  - injection Hc as <- <- <- <-. exists w.
    rewrite N.sub_diag. simpl. repeat split; auto; lia.
Qed.

Lemma check_starts_worker : forall budget worker all ws i worker' wi t o b,
  check_starts budget worker all i ws = Reject (Over_budget worker' wi t o b) ->
  worker' = worker.
Proof.
  induction ws as [|w ws IH]; intros i worker' wi t o b Hc; [discriminate|].
  simpl in Hc. destruct (occupancy all (w_start w) <=? budget).
  - eapply IH; eassumption.
  - congruence.
Qed.

Lemma check_workers_reject : forall budget tl k worker wi t o b,
  check_workers budget k tl = Reject (Over_budget worker wi t o b) ->
  exists ws, nth_error tl (N.to_nat (worker - k)) = Some ws /\ k <= worker /\
    check_worker budget worker ws = Reject (Over_budget worker wi t o b).
Proof.
  induction tl as [|ws tl IH]; intros k worker wi t o b Hc; [discriminate|].
  simpl in Hc. destruct (check_worker budget k ws) as [|e] eqn:H0.
  - destruct (IH _ _ _ _ _ _ Hc) as (ws' & Hn & Hk & Hw).
    exists ws'. split; [|split; [lia|exact Hw]].
    replace (N.to_nat (worker - k)) with (S (N.to_nat (worker - N.succ k))) by lia.
    exact Hn.
  - injection Hc as ->.
    pose proof (check_starts_worker _ _ _ _ _ _ _ _ _ _ H0) as ->.
    exists ws. rewrite N.sub_diag. repeat split; auto; lia.
Qed.

Theorem check_pages_reject_genuine : forall budget tl worker wi t o b,
  check_pages budget tl = Reject (Over_budget worker wi t o b) ->
  exists ws w, nth_error tl (N.to_nat worker) = Some ws /\
    nth_error ws (N.to_nat wi) = Some w /\ w_start w = t /\
    occupancy ws t = o /\ b = budget /\ budget < o.
Proof.
  intros budget tl worker wi t o b Hc.
  destruct (check_workers_reject _ _ _ _ _ _ _ _ Hc) as (ws & Hn & _ & Hw).
  rewrite N.sub_0_r in Hn. unfold check_worker in Hw.
  destruct (check_starts_reject _ _ _ _ _ _ _ _ _ Hw)
    as (w & Hw' & _ & Ht & Ho & Hb & Hlt).
  rewrite N.sub_0_r in Hw'. exists ws, w. auto 7.
Qed.
