(** * Counter protocol: soundness (C1 safety, C2 deadlock freedom, C3 checker). *)
From Coq Require Import List Arith NArith Bool Lia FinFun Permutation.
From Plow Require Import Loc Counters.
Import ListNotations.

(** ** Generic list lemmas *)

Lemma find_errN_none {A E} (f : N -> A -> option E) :
  forall l i, find_errN f i l = None ->
  forall k x, nth_error l k = Some x -> f (i + N.of_nat k)%N x = None.
Proof.
  induction l as [|y l IH]; intros i H k x Hk; [destruct k; discriminate|].
  simpl in H. destruct (f i y) eqn:Ef; [discriminate|].
  destruct k as [|k]; simpl in Hk.
  - inversion Hk; subst. rewrite N.add_0_r. exact Ef.
  - replace (i + N.of_nat (S k))%N with (N.succ i + N.of_nat k)%N by lia.
    exact (IH (N.succ i) H k x Hk).
Qed.

Lemma first_err_none {A E} (f : A -> option E) l :
  first_err f l = None -> forall x, In x l -> f x = None.
Proof.
  intros H x Hx. apply In_nth_error in Hx as [j Hj].
  exact (find_errN_none (fun _ x => f x) l 0 H j x Hj).
Qed.

Lemma orelse_none {E} (a b : option E) : orelse a b = None -> a = None /\ b = None.
Proof. destruct a; simpl; intros H; [discriminate | auto]. Qed.

Lemma mem_spec x l : mem x l = true <-> In x l.
Proof.
  unfold mem. rewrite existsb_exists. split.
  - intros [y [Hy E]]. apply N.eqb_eq in E. subst. exact Hy.
  - intros H. exists x. split; [exact H | apply N.eqb_refl].
Qed.

Lemma before_spec u t q :
  before u t q = true ->
  exists i j, (i < j)%nat /\ nth_error q i = Some u /\ nth_error q j = Some t.
Proof.
  induction q as [|x q IH]; simpl; [discriminate|].
  destruct (N.eqb_spec x u) as [->|_]; intros H.
  - apply mem_spec, In_nth_error in H as [j Hj].
    exists 0%nat, (S j). repeat split; auto. lia.
  - destruct (IH H) as [i [j [Hij [Hi Hj]]]].
    exists (S i), (S j). repeat split; auto. lia.
Qed.

Lemma in_tasks p t : In t (tasks p) <-> is_task p t.
Proof.
  unfold tasks, is_task. rewrite in_map_iff. split.
  - intros [j [<- Hj]]. apply in_seq in Hj. rewrite Nat2N.id. lia.
  - intros H. exists (N.to_nat t). rewrite N2Nat.id. split; auto. apply in_seq. lia.
Qed.

Lemma tasks_nodup p : NoDup (tasks p).
Proof.
  apply Injective_map_NoDup; [|apply seq_NoDup].
  intros x y E. apply Nat2N.inj. exact E.
Qed.

Lemma signals_is_task p u c : In c (signals_of p u) -> is_task p u.
Proof.
  unfold signals_of, is_task, ntasks. intros H.
  destruct (Nat.lt_ge_cases (N.to_nat u) (length (cp_signals p))) as [|Hge]; auto.
  rewrite nth_overflow in H by exact Hge. destruct H.
Qed.

Lemma in_signallers p c u : In u (signallers p c) <-> In c (signals_of p u).
Proof.
  unfold signallers. rewrite filter_In, mem_spec, in_tasks. split; [tauto|].
  intros H. split; [eapply signals_is_task; eauto | exact H].
Qed.

Lemma in_concat_pos (qs : list (list N)) x :
  In x (concat qs) <-> exists w i, nth_error (nth w qs []) i = Some x.
Proof.
  induction qs as [|q qs IH]; simpl.
  - split; [intros []|]. intros [w [i H]]. destruct w, i; discriminate.
  - rewrite in_app_iff, IH. split.
    + intros [Hq | [w [i H]]].
      * apply In_nth_error in Hq as [i Hi]. exists 0%nat, i. exact Hi.
      * exists (S w), i. exact H.
    + intros [[|w] [i H]]; [left; eapply nth_error_In; eauto | right; eauto].
Qed.

Lemma nodup_app_disjoint {A} (l1 l2 : list A) x :
  NoDup (l1 ++ l2) -> In x l1 -> In x l2 -> False.
Proof.
  induction l1 as [|y l1 IH]; simpl; [tauto|].
  intros Hnd Hx Hx2. apply NoDup_cons_iff in Hnd as [Hy Hnd].
  destruct Hx as [->|Hx]; [apply Hy, in_app_iff; auto | eauto].
Qed.

Lemma nodup_app_l {A} (l1 l2 : list A) : NoDup (l1 ++ l2) -> NoDup l1.
Proof.
  induction l1 as [|y l1 IH]; simpl; [constructor|].
  intros Hnd. apply NoDup_cons_iff in Hnd as [Hy Hnd]. constructor; auto.
  intros H. apply Hy, in_app_iff. auto.
Qed.

Lemma nodup_app_r {A} (l1 l2 : list A) : NoDup (l1 ++ l2) -> NoDup l2.
Proof.
  induction l1 as [|y l1 IH]; simpl; auto.
  intros Hnd. apply NoDup_cons_iff in Hnd as [_ Hnd]. auto.
Qed.

(** A task occupies at most one position in all the queues together. *)
Lemma concat_unique (qs : list (list N)) :
  NoDup (concat qs) ->
  forall w1 i1 w2 i2 x,
  nth_error (nth w1 qs []) i1 = Some x -> nth_error (nth w2 qs []) i2 = Some x ->
  w1 = w2 /\ i1 = i2.
Proof.
  induction qs as [|q qs IH]; simpl; intros Hnd w1 i1 w2 i2 x H1 H2.
  - destruct w1, i1; discriminate.
  - destruct w1 as [|w1], w2 as [|w2].
    + split; auto. apply nodup_app_l in Hnd.
      rewrite NoDup_nth_error in Hnd. apply Hnd.
      * apply nth_error_Some. congruence.
      * congruence.
    + exfalso. eapply nodup_app_disjoint; [exact Hnd | eapply nth_error_In; eauto |].
      apply in_concat_pos. eauto.
    + exfalso. eapply nodup_app_disjoint; [exact Hnd | eapply nth_error_In; eauto |].
      apply in_concat_pos. eauto.
    + apply nodup_app_r in Hnd. destruct (IH Hnd w1 i1 w2 i2 x H1 H2). auto.
Qed.

Lemma forallb_false {A} (f : A -> bool) l :
  forallb f l = false -> exists x, In x l /\ f x = false.
Proof.
  induction l as [|y l IH]; simpl; [discriminate|].
  destruct (f y) eqn:E; simpl; intros H; [destruct (IH H) as [x [? ?]]; eauto | eauto].
Qed.

(** ** Execution invariant *)

Definition is_done (p : cplan) (s : state) (x : N) : Prop :=
  exists w i, (i < pos s w)%nat /\ nth_error (queue p w) i = Some x.

Definition count_sig (p : cplan) (c : N) (tr : list N) : nat :=
  length (filter (fun t => mem c (signals_of p t)) tr).

Definition exec_inv (p : cplan) (tr : list N) (s : state) : Prop :=
  (forall x, In x tr <-> is_done p s x) /\
  (forall c, cnt s c = count_sig p c tr) /\
  NoDup tr.

Lemma head_not_done p s w t :
  queues_partition p -> nth_error (queue p w) (pos s w) = Some t -> ~ is_done p s t.
Proof.
  intros [Hnd _] Hh [w' [i [Hi Hq]]].
  destruct (concat_unique _ Hnd w (pos s w) w' i t Hh Hq) as [<- Heq]. lia.
Qed.

Lemma exec_invariant p tr s :
  queues_partition p -> exec p init tr s -> exec_inv p tr s.
Proof.
  intros Hpart Hex. remember init as s0 eqn:Hs0. induction Hex as [s|s tr s1 t s2 Hex IH Hstep].
  - subst. split; [|split].
    + intros x. split; [intros []|]. intros [w [i [Hi _]]]. simpl in Hi. lia.
    + intros c. reflexivity.
    + constructor.
  - destruct (IH Hs0) as [Hdone [Hcnt Hnd]]. clear IH.
    inversion Hstep as [s' w t' Hh Hen]; subst s' t' s2.
    split; [|split].
    + intros x. rewrite in_app_iff, Hdone. simpl. split.
      * intros [[w0 [i [Hi Hq]]] | [<- | []]].
        -- exists w0, i. simpl. destruct (Nat.eq_dec w0 w); subst; split; auto; lia.
        -- exists w, (pos s1 w). simpl. destruct (Nat.eq_dec w w); [|congruence]. split; auto.
      * intros [w0 [i [Hi Hq]]]. simpl in Hi. destruct (Nat.eq_dec w0 w) as [->|Hne].
        -- destruct (Nat.eq_dec i (pos s1 w)) as [->|Hne'].
           ++ right. left. congruence.
           ++ left. exists w, i. split; auto. lia.
        -- left. exists w0, i. auto.
    + intros c. simpl. unfold count_sig. rewrite filter_app, app_length. simpl.
      rewrite Hcnt. unfold count_sig.
      destruct (in_dec N.eq_dec c (signals_of p t)) as [Hin|Hin].
      * apply mem_spec in Hin. rewrite Hin. simpl. lia.
      * destruct (mem c (signals_of p t)) eqn:E; [apply mem_spec in E; contradiction|].
        simpl. lia.
    + apply Permutation_NoDup with (t :: tr); [apply Permutation_cons_append|].
      constructor; auto. rewrite Hdone. eapply head_not_done; eauto.
Qed.

Lemma done_is_task p s x : queues_partition p -> is_done p s x -> is_task p x.
Proof.
  intros [_ Hall] [w [i [_ Hq]]]. apply Hall, in_concat_pos. eauto.
Qed.

(** If every signaller of [c] has run, [c] has reached its threshold — and
    conversely, a counter at its threshold means every signaller has run. *)
Lemma count_all_signallers p c tr :
  NoDup tr -> (forall x, In x tr -> is_task p x) ->
  (length (signallers p c) <= count_sig p c tr)%nat ->
  forall u, In c (signals_of p u) -> In u tr.
Proof.
  intros Hnd Htask Hle u Hu.
  destruct (in_dec N.eq_dec u tr) as [|Hnot]; auto. exfalso.
  assert (Hinc : incl (u :: filter (fun t => mem c (signals_of p t)) tr) (signallers p c)).
  { intros x [<- | Hx]; apply in_signallers; auto.
    apply filter_In in Hx as [_ Hx]. apply mem_spec. exact Hx. }
  apply NoDup_incl_length in Hinc.
  - unfold count_sig in Hle. simpl in Hinc. lia.
  - constructor; [|apply NoDup_filter; auto].
    intros Hx. apply filter_In in Hx as [Hx _]. contradiction.
Qed.

Lemma signallers_done_count p c tr :
  (forall u, In c (signals_of p u) -> In u tr) ->
  (length (signallers p c) <= count_sig p c tr)%nat.
Proof.
  intros Hall. unfold count_sig. apply NoDup_incl_length.
  - apply NoDup_filter, tasks_nodup.
  - intros x Hx. apply in_signallers in Hx as Hs. apply filter_In. split; auto.
    apply mem_spec. exact Hs.
Qed.

(** ** C1: safety *)

(** Every execution from the initial state runs a task only after all of
    its task-graph predecessors have completed. *)
Theorem counters_safety p :
  queues_partition p -> edges_covered p -> thresholds_exact p ->
  forall tr s t s', exec p init tr s -> step p s t s' ->
  forall u, In (u, t) (cp_edges p) -> In u tr.
Proof.
  intros Hpart Hcov Hthr tr s t s' Hex Hstep u Hedge.
  destruct (exec_invariant p tr s Hpart Hex) as [Hdone [Hcnt Hnd]].
  inversion Hstep as [s0 w t0 Hh Hen]; subst s0 t0 s'.
  destruct (Hcov u t Hedge) as [[c [Hw Hs]] | [w' [i [j [Hij [Hi Hj]]]]]].
  - (* covered by counter c *)
    apply (count_all_signallers p c tr Hnd); auto.
    + intros x Hx. eapply done_is_task; [exact Hpart|]. apply Hdone. exact Hx.
    + specialize (Hen c Hw). rewrite Hcnt, (Hthr t c Hw), Nat2N.id in Hen. exact Hen.
  - (* covered by queue order *)
    destruct Hpart as [Hnd' _].
    destruct (concat_unique _ Hnd' w (pos s w) w' j t Hh Hj) as [<- <-].
    apply Hdone. exists w, i. auto.
Qed.

(** ** C2: deadlock freedom *)

Definition enabledb (p : cplan) (s : state) (t : N) : bool :=
  forallb (fun c => Nat.leb (N.to_nat (threshold p c)) (cnt s c)) (waits_of p t).

Lemma enabledb_spec p s t : enabledb p s t = true -> enabled p s t.
Proof.
  unfold enabledb, enabled. rewrite forallb_forall. intros H c Hc.
  apply Nat.leb_le. auto.
Qed.

Lemma ranked_queue p rk w i j x y :
  ranked p rk -> (i <= j)%nat -> nth_error (queue p w) i = Some x ->
  nth_error (queue p w) j = Some y -> (rk x <= rk y)%N.
Proof.
  intros Hrk Hij Hx Hy. destruct (Nat.eq_dec i j) as [->|Hne].
  - rewrite Hx in Hy. inversion Hy. lia.
  - apply N.lt_le_incl, Hrk. right. exists w, i, j. repeat split; auto. lia.
Qed.

(** From a reachable state in which some task has not run, some worker can step. *)
Theorem counters_progress p rk :
  queues_partition p -> thresholds_exact p -> ranked p rk ->
  forall tr s, exec p init tr s ->
  (exists x, is_task p x /\ ~ In x tr) -> exists t s', step p s t s'.
Proof.
  intros Hpart Hthr Hrk tr s Hex [x0 [Hx0 Hn0]].
  destruct (exec_invariant p tr s Hpart Hex) as [Hdone [Hcnt Hnd]].
  assert (Htr : forall x, In x tr -> is_task p x).
  { intros x Hx. eapply done_is_task; [exact Hpart|]. apply Hdone. exact Hx. }
  assert (H : forall n x, (N.to_nat (rk x) < n)%nat -> is_task p x -> ~ In x tr ->
                exists t s', step p s t s').
  { induction n as [|n IH]; intros x Hlt Hx Hn; [lia|].
    destruct Hpart as [Hpnd Hall].
    apply Hall, in_concat_pos in Hx as [w [i Hi]].
    assert (Hpos : (pos s w <= i)%nat).
    { destruct (Nat.lt_ge_cases i (pos s w)) as [Hlt'|]; auto.
      exfalso. apply Hn, Hdone. exists w, i. auto. }
    destruct (nth_error (queue p w) (pos s w)) as [h|] eqn:Hh.
    2:{ apply nth_error_None in Hh. assert (i < length (queue p w))%nat.
        { apply nth_error_Some. unfold queue. congruence. } lia. }
    assert (Hrh : (rk h <= rk x)%N) by (eapply ranked_queue; eauto).
    destruct (enabledb p s h) eqn:Hen.
    - exists h, (run_task p s w h). constructor; auto. apply enabledb_spec. exact Hen.
    - apply forallb_false in Hen as [c [Hc Hlow]]. apply Nat.leb_gt in Hlow.
      destruct (forallb (fun a => if in_dec N.eq_dec a tr then true else false)
                        (signallers p c)) eqn:Hall'.
      + exfalso. rewrite forallb_forall in Hall'.
        assert (Hle : (length (signallers p c) <= count_sig p c tr)%nat).
        { apply signallers_done_count. intros u Hu.
          apply in_signallers in Hu. specialize (Hall' u Hu).
          destruct (in_dec N.eq_dec u tr); [auto | discriminate]. }
        rewrite Hcnt, (Hthr h c Hc), Nat2N.id in Hlow. lia.
      + apply forallb_false in Hall' as [a [Ha Hna]].
        destruct (in_dec N.eq_dec a tr) as [|Hnot]; [discriminate|].
        apply in_signallers in Ha as Hsa.
        assert (Hra : (rk a < rk h)%N) by (apply Hrk; left; exists c; auto).
        apply (IH a); auto.
        * lia.
        * eapply signals_is_task; eauto. }
  apply (H (S (N.to_nat (rk x0))) x0); auto.
Qed.

(** Every execution is finite: it runs distinct tasks only. *)
Theorem counters_exec_bounded p tr s :
  queues_partition p -> exec p init tr s ->
  NoDup tr /\ (forall x, In x tr -> is_task p x) /\ (length tr <= ntasks p)%nat.
Proof.
  intros Hpart Hex. destruct (exec_invariant p tr s Hpart Hex) as [Hdone [_ Hnd]].
  assert (Htr : forall x, In x tr -> is_task p x).
  { intros x Hx. eapply done_is_task; [exact Hpart|]. apply Hdone. exact Hx. }
  split; [|split]; auto.
  replace (ntasks p) with (length (tasks p)) by (unfold tasks; rewrite map_length, seq_length; auto).
  apply NoDup_incl_length; auto. intros x Hx. apply in_tasks. auto.
Qed.

(** Hence every maximal execution runs every task. *)
Theorem counters_maximal_runs_all p rk :
  queues_partition p -> thresholds_exact p -> ranked p rk ->
  forall tr s, exec p init tr s -> (forall t s', ~ step p s t s') ->
  forall x, is_task p x -> In x tr.
Proof.
  intros Hpart Hthr Hrk tr s Hex Hstuck x Hx.
  destruct (in_dec N.eq_dec x tr) as [|Hn]; auto. exfalso.
  destruct (counters_progress p rk Hpart Hthr Hrk tr s Hex) as [t [s' Hs]]; eauto.
  eapply Hstuck; eauto.
Qed.

(** A ranking rules out cycles of the must-precede relation. *)
Lemma ranked_acyclic p rk :
  ranked p rk -> forall a b, Relation_Operators.clos_trans N (must_precede p) a b -> (rk a < rk b)%N.
Proof.
  intros Hrk a b H. induction H as [a b H|a b c _ IH1 _ IH2]; [auto | lia].
Qed.

Corollary ranked_no_cycle p rk :
  ranked p rk -> forall a, ~ Relation_Operators.clos_trans N (must_precede p) a a.
Proof. intros Hrk a H. apply (ranked_acyclic p rk Hrk) in H. lia. Qed.

(** ** C3: the checker is sound *)

(** *** Maps *)

Lemma nkey_inj a b : nkey a = nkey b -> a = b.
Proof.
  unfold nkey. intros H. apply N.succ_inj.
  rewrite <- !N.succ_pos_spec, H. reflexivity.
Qed.

Lemma tfind_leaf {A} (i : positive) : tfind i (@Leaf A) = None.
Proof. destruct i; reflexivity. Qed.

Lemma tfind_add_eq {A} (i : positive) (v : A) m : tfind i (tadd i v m) = Some v.
Proof. revert m; induction i as [i IH|i IH|]; intros [|l o r]; simpl; auto. Qed.

Lemma tfind_add_neq {A} (i j : positive) (v : A) m : i <> j -> tfind i (tadd j v m) = tfind i m.
Proof.
  revert j m; induction i as [i IH|i IH|]; intros [j|j|] [|l o r] H; simpl;
    try rewrite IH by congruence; try (destruct i; reflexivity); try reflexivity; try congruence.
Qed.

Lemma find_add_eq {A} (m : trie A) n x : tfind (nkey n) (tadd (nkey n) x m) = Some x.
Proof. apply tfind_add_eq. Qed.

Lemma find_add_neq {A} (m : trie A) n n' x :
  n <> n' -> tfind (nkey n) (tadd (nkey n') x m) = tfind (nkey n) m.
Proof. intros Hne. apply tfind_add_neq. intros H. apply Hne, nkey_inj, H. Qed.

Lemma index_from_lt {A} (l : list A) :
  forall i m n, (n < i)%N -> tfind (nkey n) (index_from i l m) = tfind (nkey n) m.
Proof.
  induction l as [|x l IH]; intros i m n Hn; simpl; auto.
  rewrite IH by lia. apply find_add_neq. lia.
Qed.

Lemma index_from_at {A} (l : list A) :
  forall i m k, tfind (nkey (i + N.of_nat k)) (index_from i l m) =
    match nth_error l k with Some x => Some x | None => tfind (nkey (i + N.of_nat k)) m end.
Proof.
  induction l as [|x l IH]; intros i m k.
  - destruct k; reflexivity.
  - destruct k as [|k].
    + cbn [nth_error index_from].
      rewrite N.add_0_r, index_from_lt by lia. apply find_add_eq.
    + cbn [nth_error index_from].
      replace (i + N.of_nat (S k))%N with (N.succ i + N.of_nat k)%N by lia.
      rewrite IH. destruct (nth_error l k); auto. apply find_add_neq. lia.
Qed.

Lemma find_index_map {A} (l : list A) n :
  tfind (nkey n) (index_map l) = nth_error l (N.to_nat n).
Proof.
  unfold index_map. pose proof (index_from_at l 0 Leaf (N.to_nat n)) as H.
  rewrite N.add_0_l, N2Nat.id in H. rewrite H.
  destruct (nth_error l (N.to_nat n)); auto. apply tfind_leaf.
Qed.

Lemma get_index_map {A} (l : list A) d n : get (index_map l) d n = nth (N.to_nat n) l d.
Proof.
  unfold get. rewrite find_index_map. destruct (nth_error l (N.to_nat n)) eqn:E.
  - symmetry. apply nth_error_nth. exact E.
  - apply nth_error_None in E. rewrite nth_overflow; auto.
Qed.

Lemma lengthN_spec {A} (l : list A) : lengthN l = N.of_nat (length l).
Proof.
  unfold lengthN. assert (H : forall k, fold_left (fun n _ => N.succ n) l k = (k + N.of_nat (length l))%N).
  { induction l as [|x l IH]; intros k; simpl; [lia|]. rewrite IH. lia. }
  rewrite H. lia.
Qed.

Lemma get_add_eq m x v : get (tadd (nkey x) v m) 0%N x = v.
Proof. unfold get. rewrite find_add_eq. reflexivity. Qed.

Lemma get_add_neq m x y v : y <> x -> get (tadd (nkey y) v m) 0%N x = get m 0%N x.
Proof. intros H. unfold get. rewrite find_add_neq; auto. Qed.

Lemma count_into_get l :
  forall m x, get (count_into m l) 0%N x = (get m 0%N x + N.of_nat (count_occ N.eq_dec l x))%N.
Proof.
  induction l as [|y l IH]; intros m x; [simpl; lia|].
  change (count_into m (y :: l)) with (count_into (tadd (nkey y) (N.succ (get m 0%N y)) m) l).
  rewrite IH. simpl count_occ.
  destruct (N.eq_dec y x) as [->|Hne].
  - rewrite get_add_eq. lia.
  - rewrite get_add_neq by auto. reflexivity.
Qed.

Lemma count_occ_app' (l1 l2 : list N) x :
  count_occ N.eq_dec (l1 ++ l2) x = (count_occ N.eq_dec l1 x + count_occ N.eq_dec l2 x)%nat.
Proof.
  induction l1 as [|y l1 IH]; simpl; auto. destruct (N.eq_dec y x); rewrite IH; auto.
Qed.

Lemma occ_map_get qs x :
  get (occ_map qs) 0%N x = N.of_nat (count_occ N.eq_dec (concat qs) x).
Proof.
  unfold occ_map.
  assert (H : forall qs m, get (fold_left count_into qs m) 0%N x =
                           (get m 0%N x + N.of_nat (count_occ N.eq_dec (concat qs) x))%N).
  { induction qs0 as [|q qs0 IH]; intros m; simpl; [lia|].
    rewrite IH, count_into_get, count_occ_app'. lia. }
  rewrite H. unfold get at 1. rewrite tfind_leaf. lia.
Qed.

Lemma undup_in l x : In x (undup l) <-> In x l.
Proof.
  induction l as [|y l IH]; simpl; [tauto|].
  destruct (mem y l) eqn:E; simpl; rewrite IH; [|tauto].
  apply mem_spec in E. split; [auto|]. intros [<-|]; auto.
Qed.

Lemma undup_nodup l : NoDup (undup l).
Proof.
  induction l as [|y l IH]; simpl; [constructor|].
  destruct (mem y l) eqn:E; auto. constructor; auto.
  rewrite undup_in. intros H. apply mem_spec in H. congruence.
Qed.

Lemma count_undup l c :
  count_occ N.eq_dec (undup l) c = if mem c l then 1%nat else 0%nat.
Proof.
  destruct (mem c l) eqn:E.
  - apply mem_spec in E. apply (NoDup_count_occ' N.eq_dec); [apply undup_nodup|].
    apply undup_in. exact E.
  - apply count_occ_not_In. rewrite undup_in, <- mem_spec. congruence.
Qed.

Lemma sig_count_map_get sgs c :
  get (sig_count_map sgs) 0%N c = N.of_nat (length (filter (mem c) sgs)).
Proof.
  unfold sig_count_map.
  assert (H : forall sgs m,
    get (fold_left (fun m s => count_into m (undup s)) sgs m) 0%N c =
    (get m 0%N c + N.of_nat (length (filter (mem c) sgs)))%N).
  { induction sgs0 as [|s sgs0 IH]; intros m; simpl; [lia|].
    rewrite IH, count_into_get, count_undup. destruct (mem c s); simpl; lia. }
  rewrite H. unfold get at 1. rewrite tfind_leaf. lia.
Qed.

(** [pos_map] records true positions. *)
Section PosMap.
Variable qs : list (list N).

Definition pos_ok (m : trie (N * N)) : Prop :=
  forall x w i, tfind (nkey x) m = Some (w, i) ->
  nth_error (nth (N.to_nat w) qs []) (N.to_nat i) = Some x.

Lemma pos_queue_ok w q :
  forall i m, pos_ok m ->
  (forall k y, nth_error q k = Some y ->
     nth_error (nth (N.to_nat w) qs []) (N.to_nat i + k) = Some y) ->
  pos_ok (pos_queue w i q m).
Proof.
  induction q as [|x q IH]; intros i m Hm Hq; simpl; auto.
  apply IH.
  - intros y w' i' Hf. destruct (N.eq_dec y x) as [->|Hne].
    + rewrite find_add_eq in Hf. inversion Hf; subst.
      specialize (Hq 0%nat x eq_refl). rewrite Nat.add_0_r in Hq. exact Hq.
    + rewrite find_add_neq in Hf by auto. apply Hm. exact Hf.
  - intros k y Hk. specialize (Hq (S k) y Hk).
    replace (N.to_nat (N.succ i) + k)%nat with (N.to_nat i + S k)%nat by lia. exact Hq.
Qed.

Lemma pos_queues_ok qs' :
  forall w m, pos_ok m ->
  (forall k q, nth_error qs' k = Some q -> nth (N.to_nat w + k) qs [] = q) ->
  pos_ok (pos_queues w qs' m).
Proof.
  induction qs' as [|q qs' IH]; intros w m Hm Hqs; simpl; auto.
  apply IH.
  - apply pos_queue_ok; auto. intros k y Hk.
    specialize (Hqs 0%nat q eq_refl). rewrite Nat.add_0_r in Hqs. rewrite Hqs. exact Hk.
  - intros k q' Hk. specialize (Hqs (S k) q' Hk).
    replace (N.to_nat (N.succ w) + k)%nat with (N.to_nat w + S k)%nat by lia. exact Hqs.
Qed.

Lemma pos_map_ok : pos_ok (pos_map qs).
Proof.
  apply pos_queues_ok.
  - intros x w i H. rewrite tfind_leaf in H. discriminate.
  - intros k q Hk. apply nth_error_nth. exact Hk.
Qed.
End PosMap.

Lemma qbefore_spec p u t :
  qbefore (pos_map (cp_queues p)) u t = true -> queue_before p u t.
Proof.
  unfold qbefore.
  destruct (tfind (nkey u) _) as [[wu iu]|] eqn:Eu; [|discriminate].
  destruct (tfind (nkey t) _) as [[wt it]|] eqn:Et; [|discriminate].
  intros H. apply andb_prop in H as [Hw Hi]. apply N.eqb_eq in Hw. apply N.ltb_lt in Hi. subst wt.
  apply pos_map_ok in Eu. apply pos_map_ok in Et.
  exists (N.to_nat wu), (N.to_nat iu), (N.to_nat it). unfold queue. repeat split; auto. lia.
Qed.

(** [max_map]: for each signalled counter, an entry whose rank bounds every signaller's. *)
Definition dom (m : trie (N * N)) (c r : N) : Prop :=
  exists a r', tfind (nkey c) m = Some (a, r') /\ (r <= r')%N.

Lemma upd_max_mono a ra m c' c r : dom m c r -> dom (upd_max a ra m c') c r.
Proof.
  intros [a0 [r0 [Hf Hle]]]. unfold upd_max.
  destruct (tfind (nkey c') m) as [[a1 r1]|] eqn:E.
  - destruct (N.ltb_spec r1 ra); [|exists a0, r0; auto].
    destruct (N.eq_dec c c') as [->|Hne].
    + rewrite E in Hf. inversion Hf; subst. exists a, ra. rewrite find_add_eq. split; [reflexivity | lia].
    + exists a0, r0. rewrite find_add_neq by auto. auto.
  - destruct (N.eq_dec c c') as [->|Hne]; [congruence|].
    exists a0, r0. rewrite find_add_neq by auto. auto.
Qed.

Lemma upd_max_self a ra m c : dom (upd_max a ra m c) c ra.
Proof.
  unfold upd_max. destruct (tfind (nkey c) m) as [[a1 r1]|] eqn:E.
  - destruct (N.ltb_spec r1 ra).
    + exists a, ra. rewrite find_add_eq. split; [reflexivity | lia].
    + exists a1, r1. split; [exact E | lia].
  - exists a, ra. rewrite find_add_eq. split; [reflexivity | lia].
Qed.

Lemma fold_upd_mono a ra c r s : forall m, dom m c r -> dom (fold_left (upd_max a ra) s m) c r.
Proof. induction s as [|c' s IH]; intros m H; simpl; auto. apply IH, upd_max_mono, H. Qed.

Lemma fold_upd_self a ra c s : forall m, In c s -> dom (fold_left (upd_max a ra) s m) c ra.
Proof.
  induction s as [|c' s IH]; intros m H; simpl; [destruct H|].
  destruct H as [->|H]; [apply fold_upd_mono, upd_max_self | auto].
Qed.

Lemma max_from_mono c r sgs : forall rks a m, dom m c r -> dom (max_from a sgs rks m) c r.
Proof.
  induction sgs as [|s sgs IH]; intros [|r' rks] a m H; simpl; auto.
  apply IH, fold_upd_mono, H.
Qed.

Lemma max_from_at c sgs : forall rks a m k s r,
  nth_error sgs k = Some s -> nth_error rks k = Some r -> In c s ->
  dom (max_from a sgs rks m) c r.
Proof.
  induction sgs as [|s0 sgs IH]; intros [|r0 rks] a m k s r Hs Hr Hc;
    [destruct k; discriminate .. |].
  simpl. destruct k as [|k]; simpl in Hs, Hr.
  - inversion Hs; inversion Hr; subst. apply max_from_mono, fold_upd_self, Hc.
  - eapply IH; eauto.
Qed.

(** *** The checks *)

Lemma check_lengths_ok p :
  check_lengths p = None ->
  length (cp_workers p) = ntasks p /\ length (cp_waits p) = ntasks p /\
  length (cp_ranks p) = ntasks p.
Proof.
  unfold check_lengths, ntasks. rewrite !lengthN_spec.
  destruct (N.eqb_spec (N.of_nat (length (cp_workers p))) (N.of_nat (length (cp_signals p)))),
           (N.eqb_spec (N.of_nat (length (cp_waits p))) (N.of_nat (length (cp_signals p)))),
           (N.eqb_spec (N.of_nat (length (cp_ranks p))) (N.of_nat (length (cp_signals p))));
    simpl; intros H; try discriminate. repeat split; apply Nat2N.inj; auto.
Qed.

Lemma nth_error_lt {A} (l : list A) d i :
  (i < length l)%nat -> nth_error l i = Some (nth i l d).
Proof.
  intros Hi. destruct (nth_error l i) eqn:E.
  - apply nth_error_nth with (d := d) in E as E'. congruence.
  - apply nth_error_None in E. lia.
Qed.

Lemma check_queue_entries_ok p wm :
  check_queue_entries p wm (lengthN (cp_signals p)) = None ->
  forall x, In x (concat (cp_queues p)) -> is_task p x.
Proof.
  unfold check_queue_entries. intros H x Hx.
  apply in_concat_pos in Hx as [w [i Hi]].
  assert (Hw : nth_error (cp_queues p) w = Some (nth w (cp_queues p) [])).
  { apply nth_error_lt. destruct (Nat.lt_ge_cases w (length (cp_queues p))); auto.
    rewrite nth_overflow in Hi by auto. destruct i; discriminate. }
  pose proof (find_errN_none _ _ _ H w _ Hw) as H1. simpl in H1.
  pose proof (find_errN_none _ _ _ H1 i _ Hi) as H2. simpl in H2.
  rewrite lengthN_spec in H2.
  destruct (N.ltb_spec x (N.of_nat (length (cp_signals p)))) as [Hlt|]; [|discriminate].
  unfold is_task, ntasks. lia.
Qed.

Lemma check_occurrences_ok p :
  check_occurrences p (occ_map (cp_queues p)) = None ->
  (forall x, In x (concat (cp_queues p)) -> is_task p x) ->
  queues_partition p.
Proof.
  unfold check_occurrences. intros H Hin.
  assert (Hone : forall t, is_task p t -> count_occ N.eq_dec (concat (cp_queues p)) t = 1%nat).
  { intros t Ht. unfold is_task, ntasks in Ht.
    pose proof (find_errN_none _ _ _ H _ _ (nth_error_lt _ [] _ Ht)) as H1. simpl in H1.
    rewrite N2Nat.id, occ_map_get in H1.
    destruct (N.eqb_spec (N.of_nat (count_occ N.eq_dec (concat (cp_queues p)) t)) 1);
      [lia | discriminate]. }
  split.
  - apply (NoDup_count_occ N.eq_dec). intros x.
    destruct (in_dec N.eq_dec x (concat (cp_queues p))) as [Hx|Hx].
    + rewrite Hone; auto.
    + apply (count_occ_not_In N.eq_dec) in Hx. lia.
  - intros t. split; auto. intros Ht. apply (count_occ_In N.eq_dec). rewrite Hone; auto.
Qed.

Lemma waits_is_task p t c : In c (waits_of p t) -> length (cp_waits p) = ntasks p -> is_task p t.
Proof.
  unfold waits_of, is_task. intros H Hl.
  destruct (Nat.lt_ge_cases (N.to_nat t) (length (cp_waits p))) as [|Hge]; [lia|].
  rewrite nth_overflow in H by exact Hge. destruct H.
Qed.

Lemma check_counter_refs_ok p :
  check_counter_refs p (lengthN (cp_thresholds p)) = None -> length (cp_waits p) = ntasks p ->
  forall t c, In c (waits_of p t) -> (N.to_nat c < length (cp_thresholds p))%nat.
Proof.
  unfold check_counter_refs. intros H Hl t c Hc.
  destruct (find_errN _ 0 (cp_waits p)) eqn:H0; [discriminate|]. clear H.
  assert (Ht : (N.to_nat t < length (cp_waits p))%nat) by (rewrite Hl; eapply waits_is_task; eauto).
  pose proof (find_errN_none _ _ _ H0 _ _ (nth_error_lt _ [] _ Ht)) as H1. simpl in H1.
  pose proof (first_err_none _ _ H1 c Hc) as H2. simpl in H2. rewrite lengthN_spec in H2.
  destruct (N.ltb_spec c (N.of_nat (length (cp_thresholds p)))); [lia | discriminate].
Qed.

Lemma length_filter_map {A B} (f : B -> bool) (g : A -> B) l :
  length (filter f (map g l)) = length (filter (fun x => f (g x)) l).
Proof. induction l as [|x l IH]; simpl; auto. destruct (f (g x)); simpl; auto. Qed.

Lemma map_nth_seq {A} (l : list A) d :
  map (fun j => nth j l d) (seq 0 (length l)) = l.
Proof.
  induction l as [|x l IH]; simpl; auto. f_equal.
  rewrite <- seq_shift, map_map. simpl. exact IH.
Qed.

Lemma signallers_length p c :
  length (signallers p c) = length (filter (mem c) (cp_signals p)).
Proof.
  unfold signallers, tasks, ntasks, signals_of.
  rewrite length_filter_map.
  rewrite <- (map_nth_seq (cp_signals p) []) at 2.
  rewrite length_filter_map. f_equal. apply filter_ext. intros j. rewrite Nat2N.id. reflexivity.
Qed.

Lemma check_thresholds_ok p :
  check_thresholds p (sig_count_map (cp_signals p)) = None ->
  forall c, (N.to_nat c < length (cp_thresholds p))%nat ->
  threshold p c = N.of_nat (length (signallers p c)).
Proof.
  unfold check_thresholds. intros H c Hc.
  pose proof (find_errN_none _ _ _ H _ _ (nth_error_lt _ 0%N _ Hc)) as H1. simpl in H1.
  rewrite N2Nat.id, sig_count_map_get in H1. rewrite signallers_length. unfold threshold.
  destruct (N.eqb_spec (N.of_nat (length (filter (mem c) (cp_signals p))))
                       (nth (N.to_nat c) (cp_thresholds p) 0%N)); [auto | discriminate].
Qed.

Lemma check_edges_ok p :
  check_edges p (index_map (cp_waits p)) (index_map (cp_signals p)) (pos_map (cp_queues p)) = None ->
  edges_covered p.
Proof.
  unfold check_edges. intros H u t Hut.
  apply In_nth_error in Hut as [e He].
  pose proof (find_errN_none _ _ _ H _ _ He) as H1. simpl in H1.
  rewrite !get_index_map in H1. fold (waits_of p t) (signals_of p u) in H1.
  destruct (existsb (fun c => mem c (signals_of p u)) (waits_of p t)) eqn:E1.
  - left. apply existsb_exists in E1 as [c [Hc Hs]]. exists c. split; auto. apply mem_spec. auto.
  - destruct (qbefore (pos_map (cp_queues p)) u t) eqn:E2; [|discriminate].
    right. apply qbefore_spec. exact E2.
Qed.

Lemma check_chain_ok p q :
  check_chain (index_map (cp_ranks p)) q = None ->
  forall i j x y, (i < j)%nat -> nth_error q i = Some x -> nth_error q j = Some y ->
  (rank_of p x < rank_of p y)%N.
Proof.
  induction q as [|a q IH]; intros H i j x y Hij Hi Hj; [destruct i; discriminate|].
  destruct q as [|b q2].
  - destruct j as [|[|j]]; try lia; discriminate.
  - assert (E : check_chain (index_map (cp_ranks p)) (a :: b :: q2) =
      if (rank_of p a <? rank_of p b)%N then check_chain (index_map (cp_ranks p)) (b :: q2)
      else Some (CErr_cycle a b (rank_of p a) (rank_of p b))).
    { unfold rank_of. rewrite <- !get_index_map. reflexivity. }
    rewrite E in H. clear E.
    destruct (N.ltb_spec (rank_of p a) (rank_of p b)) as [Hlt|]; [|discriminate].
    specialize (IH H).
    destruct i as [|i], j as [|j]; try lia; simpl in Hi, Hj.
    + inversion Hi; subst x. destruct j as [|j].
      * inversion Hj. subst. exact Hlt.
      * specialize (IH 0%nat (S j) b y ltac:(lia) eq_refl Hj). lia.
    + apply (IH i j); auto. lia.
Qed.

Lemma check_ranks_ok p :
  length (cp_waits p) = ntasks p -> length (cp_ranks p) = ntasks p ->
  check_gate_ranks p (index_map (cp_ranks p)) (max_map p) = None ->
  check_queue_ranks p (index_map (cp_ranks p)) = None -> ranked p (rank_of p).
Proof.
  intros Hw Hr Hg Hq a b [[c [Hc Hs]] | [w [i [j [Hij [Hi Hj]]]]]].
  - assert (Ha : is_task p a) by (eapply signals_is_task; eauto).
    assert (Hb : is_task p b) by (eapply waits_is_task; eauto).
    unfold is_task, ntasks in Ha, Hb.
    assert (Hd : dom (max_map p) c (rank_of p a)).
    { apply (max_from_at c _ _ 0 _ (N.to_nat a) (signals_of p a)).
      - apply nth_error_lt. exact Ha.
      - apply nth_error_lt. unfold ntasks in Hr. lia.
      - exact Hs. }
    destruct Hd as [a' [r' [Hf Hle]]].
    unfold check_gate_ranks in Hg.
    assert (Hb' : (N.to_nat b < length (cp_waits p))%nat) by (unfold ntasks in Hw; lia).
    pose proof (find_errN_none _ _ _ Hg _ _ (nth_error_lt _ [] _ Hb')) as H1.
    simpl in H1. rewrite N2Nat.id in H1.
    pose proof (first_err_none _ _ H1 c Hc) as H2. simpl in H2.
    rewrite Hf, get_index_map in H2. fold (rank_of p b) in H2.
    destruct (N.ltb_spec r' (rank_of p b)); [lia | discriminate].
  - unfold check_queue_ranks in Hq.
    assert (Hin : In (queue p w) (cp_queues p)).
    { unfold queue. apply nth_In. destruct (Nat.lt_ge_cases w (length (cp_queues p))); auto.
      unfold queue in Hi. rewrite nth_overflow in Hi by auto. destruct i; discriminate. }
    apply (check_chain_ok p (queue p w) (first_err_none _ _ Hq _ Hin) i j); auto.
Qed.

(** The hypotheses of C1 and C2 that an accepted plan satisfies. *)
Definition counter_hypotheses (p : cplan) : Prop :=
  queues_partition p /\ edges_covered p /\ thresholds_exact p /\ ranked p (rank_of p).

Theorem check_counters_sound p :
  check_counters p = Accept -> counter_hypotheses p.
Proof.
  unfold check_counters, check_all.
  destruct (check_lengths p) eqn:H1; [discriminate|].
  destruct (check_queue_entries _ _ _) eqn:H2; [discriminate|].
  destruct (check_occurrences _ _) eqn:H3; [discriminate|].
  destruct (check_counter_refs _ _) eqn:H4; [discriminate|].
  destruct (check_thresholds _ _) eqn:H5; [discriminate|].
  destruct (check_edges _ _ _ _) eqn:H6; [discriminate|].
  destruct (check_gate_ranks _ _ _) eqn:H7; [discriminate|].
  destruct (check_queue_ranks _ _) eqn:H8; [discriminate|]. intros _.
  destruct (check_lengths_ok p H1) as [Hlw [Hlwt Hlr]].
  split; [|split; [|split]].
  - apply check_occurrences_ok; auto. eapply check_queue_entries_ok; eauto.
  - apply check_edges_ok; auto.
  - intros t c Hc. apply check_thresholds_ok; auto.
    eapply check_counter_refs_ok; eauto.
  - apply check_ranks_ok; auto.
Qed.

(** ** Checkpoint D *)

(** An accepted plan is safe (C1) and deadlock-free (C2): in every execution
    a task runs only after its predecessors, some worker can step until every
    task has run, executions are finite, and every maximal execution runs
    every task — under any interleaving, for any number of workers. *)
Theorem check_counters_conclusions p :
  check_counters p = Accept ->
  counter_hypotheses p /\
  (forall tr s t s', exec p init tr s -> step p s t s' ->
     forall u, In (u, t) (cp_edges p) -> In u tr) /\
  (forall tr s, exec p init tr s -> (exists x, is_task p x /\ ~ In x tr) ->
     exists t s', step p s t s') /\
  (forall tr s, exec p init tr s -> NoDup tr /\ (length tr <= ntasks p)%nat) /\
  (forall tr s, exec p init tr s -> (forall t s', ~ step p s t s') ->
     forall x, is_task p x -> In x tr).
Proof.
  intros H. pose proof (check_counters_sound p H) as Hh.
  split; [exact Hh|]. destruct Hh as [Hpart [Hcov [Hthr Hrk]]]. split; [|split; [|split]].
  - eapply counters_safety; eauto.
  - eapply counters_progress; eauto.
  - intros tr s Hex. destruct (counters_exec_bounded p tr s Hpart Hex) as [? [_ ?]]. auto.
  - eapply counters_maximal_runs_all; eauto.
Qed.

(** ** Scopes *)

Local Open Scope N_scope.

Lemma check_scope_list_ok wpg wm fm scm t l c :
  check_scope_list wpg wm fm scm t l = None -> In c l ->
  exists t0 w0, tfind (nkey c) fm = Some (t0, w0) /\
    scope_ok wpg (get scm 2 c) (get wm 0 t) w0 = true.
Proof.
  intros H Hin. unfold check_scope_list in H.
  pose proof (first_err_none _ _ H c Hin) as Hc. simpl in Hc.
  destruct (tfind (nkey c) fm) as [[t0 w0]|]; [|discriminate].
  exists t0, w0. split; [reflexivity|].
  destruct (scope_ok _ _ _ _); [reflexivity | discriminate].
Qed.

Lemma check_scopes_touch p sc wpg c t :
  check_scopes p sc wpg = None -> touches p c t ->
  exists t0 w0,
    tfind (nkey c) (touch_from 0 (index_map (cp_workers p)) (cp_waits p) (cp_signals p) Leaf)
      = Some (t0, w0) /\
    scope_ok wpg (nth (N.to_nat c) sc 2) (worker_of p t) w0 = true.
Proof.
  intros H [Hw|Hs]; unfold check_scopes in H;
    destruct (find_errN _ 0 (cp_waits p)) eqn:E1; try discriminate.
  - unfold waits_of in Hw.
    destruct (nth_error (cp_waits p) (N.to_nat t)) as [l|] eqn:Et.
    + pose proof (find_errN_none _ _ 0 E1 (N.to_nat t) l Et) as Hl.
      rewrite N.add_0_l, N2Nat.id in Hl.
      rewrite (nth_error_nth _ _ [] Et) in Hw.
      destruct (check_scope_list_ok _ _ _ _ _ _ c Hl Hw) as (t0 & w0 & Hf & Ho).
      exists t0, w0. split; [exact Hf|].
      rewrite !get_index_map in Ho. unfold worker_of. exact Ho.
    + apply nth_error_None in Et. rewrite nth_overflow in Hw by exact Et. contradiction.
  - unfold signals_of in Hs.
    destruct (nth_error (cp_signals p) (N.to_nat t)) as [l|] eqn:Et.
    + pose proof (find_errN_none _ _ 0 H (N.to_nat t) l Et) as Hl.
      rewrite N.add_0_l, N2Nat.id in Hl.
      rewrite (nth_error_nth _ _ [] Et) in Hs.
      destruct (check_scope_list_ok _ _ _ _ _ _ c Hl Hs) as (t0 & w0 & Hf & Ho).
      exists t0, w0. split; [exact Hf|].
      rewrite !get_index_map in Ho. unfold worker_of. exact Ho.
    + apply nth_error_None in Et. rewrite nth_overflow in Hs by exact Et. contradiction.
Qed.

(** Accepted scopes are legal: every two tasks that touch a counter are
    within its scope of each other (both are within it of the counter's
    first toucher, and "same worker" / "same GPU" are equalities). *)
Theorem check_scopes_sound p sc wpg :
  check_scopes p sc wpg = None -> scopes_legal p sc wpg.
Proof.
  intros H c t1 t2 H1 H2.
  destruct (check_scopes_touch p sc wpg c t1 H H1) as (a & wa & Fa & Oa).
  destruct (check_scopes_touch p sc wpg c t2 H H2) as (b & wb & Fb & Ob).
  rewrite Fa in Fb. inversion Fb; subst.
  unfold scope_ok in Oa, Ob. unfold scope_covers.
  destruct (N.eqb_spec (nth (N.to_nat c) sc 2) 0) as [E0|E0].
  - apply N.eqb_eq in Oa. apply N.eqb_eq in Ob. split; [intros _; congruence | lia].
  - destruct (N.eqb_spec (nth (N.to_nat c) sc 2) 1) as [E1|E1].
    + apply N.eqb_eq in Oa. apply N.eqb_eq in Ob. split; [lia | intros _; congruence].
    + split; intros; lia.
Qed.

(** ** Checkpoint D, the whole *)

(** An accepted plan is safe (C1) and deadlock-free (C2) — the conclusions
    of [check_counters_conclusions] — and its counters' scopes are legal for
    the placement of their tasks ([scopes_legal]). *)
Theorem checkpoint_d_sound p sc wpg :
  check_checkpoint_d p sc wpg = Accept ->
  (counter_hypotheses p /\
   (forall tr s t s', exec p init tr s -> step p s t s' ->
      forall u, In (u, t) (cp_edges p) -> In u tr) /\
   (forall tr s, exec p init tr s -> (exists x, is_task p x /\ ~ In x tr) ->
      exists t s', step p s t s') /\
   (forall tr s, exec p init tr s -> NoDup tr /\ (length tr <= ntasks p)%nat) /\
   (forall tr s, exec p init tr s -> (forall t s', ~ step p s t s') ->
      forall x, is_task p x -> In x tr)) /\
  scopes_legal p sc wpg.
Proof.
  unfold check_checkpoint_d. intros H.
  destruct (check_counters p) eqn:E; [|discriminate].
  destruct (check_scopes p sc wpg) eqn:Es; [discriminate|].
  split; [apply check_counters_conclusions; exact E | apply check_scopes_sound; exact Es].
Qed.
