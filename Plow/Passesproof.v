(** * The counter passes preserve the hypotheses of C1 + C2 (C4, C5, C6). *)
From Coq Require Import List Arith NArith Bool Lia.
From Plow Require Import Loc Counters Countersproof Passes.
Import ListNotations.

(** The hypotheses of C1 + C2 with an arbitrary ranking (the passes keep the ranking). *)
Definition hyps (p : cplan) (rk : N -> N) : Prop :=
  queues_partition p /\ edges_covered p /\ thresholds_exact p /\ ranked p rk.

Lemma nth_map_nil (f : list N -> list N) l i :
  f [] = [] -> nth i (map f l) [] = f (nth i l []).
Proof. intros Hf. rewrite <- Hf at 1. apply map_nth. Qed.

Lemma with_counters_partition p w s :
  length s = length (cp_signals p) ->
  queues_partition (with_counters p w s) <-> queues_partition p.
Proof.
  intros Hl. unfold queues_partition, is_task, ntasks, with_counters. simpl. rewrite Hl. tauto.
Qed.

Lemma with_counters_tasks p w s :
  length s = length (cp_signals p) -> tasks (with_counters p w s) = tasks p.
Proof. intros Hl. unfold tasks, ntasks, with_counters. simpl. rewrite Hl. reflexivity. Qed.

Lemma mem_remove_other c c' l : c' <> c -> mem c' (remove N.eq_dec c l) = mem c' l.
Proof.
  intros Hne. apply eq_true_iff_eq. rewrite !mem_spec. split.
  - intros H. apply in_remove in H. tauto.
  - intros H. apply in_in_remove; auto.
Qed.

Lemma in_ids (l : list (list N)) t c : In c (nth (N.to_nat t) l []) -> In t (ids l).
Proof.
  intros H. unfold ids. apply in_map_iff. exists (N.to_nat t). rewrite N2Nat.id.
  split; auto. apply in_seq.
  destruct (Nat.lt_ge_cases (N.to_nat t) (length l)) as [|Hge]; [lia|].
  rewrite nth_overflow in H by exact Hge. destruct H.
Qed.

(** ** C4 *)

Section Drop.
Variables (p : cplan) (c : N).
Let p' := drop_counter c p.

Lemma drop_waits t : waits_of p' t = remove N.eq_dec c (waits_of p t).
Proof. apply nth_map_nil. reflexivity. Qed.
Lemma drop_signals t : signals_of p' t = remove N.eq_dec c (signals_of p t).
Proof. apply nth_map_nil. reflexivity. Qed.
Lemma drop_len : length (cp_signals p') = length (cp_signals p).
Proof. apply map_length. Qed.

Lemma drop_signallers c' : c' <> c -> signallers p' c' = signallers p c'.
Proof.
  intros Hne. unfold signallers. unfold p', drop_counter. rewrite with_counters_tasks by apply map_length.
  apply filter_ext. intros t. fold p'. rewrite drop_signals. apply mem_remove_other. auto.
Qed.

Lemma drop_gate a b : gate p' a b -> gate p a b.
Proof.
  intros [c' [Hw Hs]]. rewrite drop_waits in Hw. rewrite drop_signals in Hs.
  apply in_remove in Hw as [Hw _]. apply in_remove in Hs as [Hs _]. exists c'. auto.
Qed.

(** C4: dropping a counter whose every (signaller, waiter) pair is ordered
    by a queue preserves the hypotheses of C1 + C2, with the same ranking. *)
Theorem drop_counter_preserves rk :
  implied_by_order p c -> hyps p rk -> hyps p' rk.
Proof.
  intros Himp [Hpart [Hcov [Hthr Hrk]]]. split; [|split; [|split]].
  - apply with_counters_partition; [apply map_length | exact Hpart].
  - intros u t Hut. destruct (Hcov u t Hut) as [[c' [Hw Hs]] | Hq].
    + destruct (N.eq_dec c' c) as [->|Hne].
      * right. apply Himp; auto.
      * left. exists c'. rewrite drop_waits, drop_signals. split; apply in_in_remove; auto.
    + right. exact Hq.
  - intros t c' Hw. rewrite drop_waits in Hw. apply in_remove in Hw as [Hw Hne].
    rewrite drop_signallers by exact Hne. apply (Hthr t c' Hw).
  - intros a b [Hg | Hq]; apply Hrk; [left; apply drop_gate; exact Hg | right; exact Hq].
Qed.

Lemma droppable_sound : droppable p c = true -> implied_by_order p c.
Proof.
  unfold droppable. rewrite forallb_forall. intros H u t Hu Ht.
  specialize (H u (in_ids _ _ _ Hu)). apply mem_spec in Hu. rewrite Hu in H. simpl in H.
  rewrite forallb_forall in H. specialize (H t (in_ids _ _ _ Ht)).
  apply mem_spec in Ht. rewrite Ht in H. simpl in H.
  apply existsb_exists in H as [q [Hq Hb]].
  apply before_spec in Hb as [i [j [Hij [Hi Hj]]]].
  apply In_nth_error in Hq as [w Hw]. apply nth_error_nth with (d := []) in Hw.
  exists w, i, j. unfold queue. rewrite Hw. auto.
Qed.

End Drop.

(** ** C5 *)

Section Merge.
Variables (p : cplan) (c1 c2 : N).
Let p' := merge_counters c1 c2 p.

Lemma merge_waits t : waits_of p' t = map (rename_counter c1 c2) (waits_of p t).
Proof. apply nth_map_nil. reflexivity. Qed.
Lemma merge_signals t : signals_of p' t = remove N.eq_dec c2 (signals_of p t).
Proof. apply nth_map_nil. reflexivity. Qed.

Lemma merge_signallers c : c <> c2 -> signallers p' c = signallers p c.
Proof.
  intros Hne. unfold signallers. unfold p', merge_counters. rewrite with_counters_tasks by apply map_length.
  apply filter_ext. intros t. fold p'. rewrite merge_signals. apply mem_remove_other. auto.
Qed.

Lemma rename_other c : c <> c2 -> rename_counter c1 c2 c = c.
Proof. intros Hne. unfold rename_counter. destruct (N.eqb_spec c c2); congruence. Qed.

Lemma rename_c2 : rename_counter c1 c2 c2 = c1.
Proof. unfold rename_counter. rewrite N.eqb_refl. reflexivity. Qed.

Lemma signallers_same :
  (forall t, In c1 (signals_of p t) <-> In c2 (signals_of p t)) -> signallers p c1 = signallers p c2.
Proof.
  intros H. unfold signallers. apply filter_ext. intros t.
  apply eq_true_iff_eq. rewrite !mem_spec. apply H.
Qed.

(** C5: merging [c2] into [c1] (same signallers, same threshold) preserves
    the hypotheses of C1 + C2, with the same ranking. *)
Theorem merge_counters_preserves rk :
  same_dependency p c1 c2 -> hyps p rk -> hyps p' rk.
Proof.
  intros [Hne [Hsame Hth]] [Hpart [Hcov [Hthr Hrk]]]. split; [|split; [|split]].
  - apply with_counters_partition; [apply map_length | exact Hpart].
  - intros u t Hut. destruct (Hcov u t Hut) as [[c [Hw Hs]] | Hq]; [left | right; exact Hq].
    destruct (N.eq_dec c c2) as [->|Hc].
    + exists c1. rewrite merge_waits, merge_signals. split.
      * apply in_map_iff. exists c2. split; [apply rename_c2 | exact Hw].
      * apply in_in_remove; auto. apply Hsame. exact Hs.
    + exists c. rewrite merge_waits, merge_signals. split.
      * apply in_map_iff. exists c. split; [apply rename_other; exact Hc | exact Hw].
      * apply in_in_remove; auto.
  - intros t c' Hw. rewrite merge_waits in Hw. apply in_map_iff in Hw as [c [<- Hw]].
    destruct (N.eq_dec c c2) as [->|Hc].
    + rewrite rename_c2, merge_signallers by auto. unfold p', merge_counters, threshold.
      simpl. fold (threshold p c1). rewrite Hth, (Hthr t c2 Hw), signallers_same; auto.
    + rewrite rename_other by exact Hc. rewrite merge_signallers by exact Hc.
      apply (Hthr t c Hw).
  - intros a b [[c' [Hw Hs]] | Hq]; apply Hrk; [left | right; exact Hq].
    rewrite merge_signals in Hs. apply in_remove in Hs as [Hs Hc'].
    rewrite merge_waits in Hw. apply in_map_iff in Hw as [c [Hr Hw]].
    destruct (N.eq_dec c c2) as [->|Hc].
    + rewrite rename_c2 in Hr. subst c'. exists c2. split; auto. apply Hsame. exact Hs.
    + rewrite rename_other in Hr by exact Hc. subst c'. exists c. auto.
Qed.

End Merge.

(** ** C6 *)

Definition sw (n i : nat) : nat :=
  if Nat.eq_dec i n then S n else if Nat.eq_dec i (S n) then n else i.

Lemma sw_nth (pre post : list N) (a b : N) i :
  nth_error (pre ++ b :: a :: post) i = nth_error (pre ++ a :: b :: post) (sw (length pre) i).
Proof.
  unfold sw. destruct (Nat.eq_dec i (length pre)) as [->|H1].
  - rewrite !nth_error_app2 by lia. rewrite Nat.sub_diag. replace (S (length pre) - length pre) with 1 by lia. reflexivity.
  - destruct (Nat.eq_dec i (S (length pre))) as [->|H2].
    + rewrite !nth_error_app2 by lia. rewrite Nat.sub_diag. replace (S (length pre) - length pre) with 1 by lia. reflexivity.
    + destruct (Nat.lt_ge_cases i (length pre)).
      * rewrite !nth_error_app1 by lia. reflexivity.
      * rewrite !nth_error_app2 by lia. destruct (i - length pre) as [|[|k]] eqn:E; try lia. reflexivity.
Qed.

Lemma sw_sw n i : sw n (sw n i) = i.
Proof. unfold sw. repeat (destruct Nat.eq_dec; simpl); lia. Qed.

Lemma nth_mid {A} (qs1 qs2 : list (list A)) q w :
  nth w (qs1 ++ q :: qs2) [] = if Nat.eq_dec w (length qs1) then q else nth w (qs1 ++ [] :: qs2) [].
Proof.
  destruct (Nat.eq_dec w (length qs1)) as [->|Hne].
  - rewrite app_nth2 by lia. rewrite Nat.sub_diag. reflexivity.
  - destruct (Nat.lt_ge_cases w (length qs1)).
    + rewrite !app_nth1 by lia. reflexivity.
    + rewrite !app_nth2 by lia. destruct (w - length qs1) eqn:E; [lia | reflexivity].
Qed.

Section Hoist.
Variables (qs1 : list (list N)) (pre : list N) (x l : N) (post : list N) (qs2 : list (list N))
          (p : cplan).
Let p' := hoist_load qs1 pre x l post qs2 p.
Let W := length qs1.
Let n := length pre.
Let q := pre ++ x :: l :: post.
Let q' := pre ++ l :: x :: post.
Hypothesis Hok : hoist_ok qs1 pre x l post qs2 p.

Lemma hoist_queue w : queue p' w = if Nat.eq_dec w W then q' else queue p w.
Proof.
  unfold queue, p', hoist_load. simpl. destruct Hok as [Hq _]. rewrite Hq.
  rewrite (nth_mid qs1 qs2 q'), (nth_mid qs1 qs2 q). fold W. destruct (Nat.eq_dec w W); reflexivity.
Qed.

Lemma hoist_queue_W : queue p W = q.
Proof.
  unfold queue. destruct Hok as [Hq _]. rewrite Hq, nth_mid. fold W.
  destruct (Nat.eq_dec W W); [reflexivity | congruence].
Qed.

Lemma hoist_perm : Permutation.Permutation (concat (cp_queues p)) (concat (cp_queues p')).
Proof.
  destruct Hok as [Hq _]. unfold p', hoist_load. simpl. rewrite Hq, !concat_app. simpl.
  apply Permutation.Permutation_app_head, Permutation.Permutation_app_tail.
  apply Permutation.Permutation_app_head. constructor.
Qed.

Lemma hoist_partition : queues_partition p -> queues_partition p'.
Proof.
  intros [Hnd Hall]. split.
  - eapply Permutation.Permutation_NoDup; [apply hoist_perm | exact Hnd].
  - intros t. change (is_task p' t) with (is_task p t). rewrite <- Hall. split; intros H.
    + eapply Permutation.Permutation_in; [apply Permutation.Permutation_sym, hoist_perm | exact H].
    + eapply Permutation.Permutation_in; [apply hoist_perm | exact H].
Qed.

Lemma hoist_q_x : nth_error (queue p W) n = Some x.
Proof. rewrite hoist_queue_W. unfold q, n. rewrite nth_error_app2 by lia. rewrite Nat.sub_diag. reflexivity. Qed.

Lemma hoist_q_l : nth_error (queue p W) (S n) = Some l.
Proof.
  rewrite hoist_queue_W. unfold q, n. rewrite nth_error_app2 by lia.
  replace (S (length pre) - length pre) with 1 by lia. reflexivity.
Qed.

Lemma hoist_q' i : nth_error (queue p' W) i = nth_error (queue p W) (sw n i).
Proof.
  rewrite hoist_queue, hoist_queue_W. destruct (Nat.eq_dec W W); [|congruence]. apply sw_nth.
Qed.

(** C6: hoisting a load preserves the hypotheses of C1 + C2 (with the
    ranking [hoist_rank rk x l]). *)
Theorem hoist_load_preserves rk :
  hyps p rk -> hyps p' (hoist_rank rk x l).
Proof.
  intros [Hpart [Hcov [Hthr Hrk]]].
  destruct Hok as [_ [Hload Hnoedge]].
  pose proof Hpart as [Hnd _].
  assert (Huniq : forall w1 i1 w2 i2 y, nth_error (queue p w1) i1 = Some y ->
            nth_error (queue p w2) i2 = Some y -> w1 = w2 /\ i1 = i2)
    by (intros; eapply concat_unique; eauto).
  assert (Hxl : (rk x < rk l)%N).
  { apply Hrk. right. exists W, n, (S n). repeat split; [lia | apply hoist_q_x | apply hoist_q_l]. }
  assert (Hneq : x <> l).
  { intros E. pose proof hoist_q_x as H1. rewrite E in H1.
    destruct (Huniq _ _ _ _ _ H1 hoist_q_l). lia. }
  (* queue order of p', read back in p *)
  assert (Hback : forall w i y, nth_error (queue p' w) i = Some y ->
            exists i0, nth_error (queue p w) i0 = Some y /\
              (if Nat.eq_dec w W then i0 = sw n i else i0 = i)).
  { intros w i y H. destruct (Nat.eq_dec w W) as [->|Hw].
    - exists (sw n i). rewrite <- hoist_q'. auto.
    - exists i. rewrite hoist_queue in H. destruct (Nat.eq_dec w W); [contradiction|]. auto. }
  split; [|split; [|split]].
  - apply hoist_partition. exact Hpart.
  - intros u t Hut. destruct (Hcov u t Hut) as [Hg | [w [i [j [Hij [Hi Hj]]]]]]; [left; exact Hg|].
    right. destruct (Nat.eq_dec w W) as [->|Hw].
    + destruct (Nat.eq_dec i n) as [->|Hin].
      * destruct (Nat.eq_dec j (S n)) as [->|Hjn].
        -- rewrite hoist_q_x in Hi. rewrite hoist_q_l in Hj.
           injection Hi as Eu. injection Hj as Et. subst u t. contradiction.
        -- exists W, (sw n n), (sw n j). rewrite !hoist_q', !sw_sw. repeat split; auto.
           unfold sw. repeat destruct Nat.eq_dec; lia.
      * exists W, (sw n i), (sw n j). rewrite !hoist_q', !sw_sw. repeat split; auto.
        unfold sw. repeat destruct Nat.eq_dec; lia.
    + exists w, i, j. rewrite !hoist_queue. destruct (Nat.eq_dec w W); [contradiction|]. auto.
  - intros t c Hc. apply (Hthr t c Hc).
  - assert (Hl : forall a, (a =? l)%N = true -> a = l) by (intros a; apply N.eqb_eq).
    intros a b [[c [Hw Hs]] | [w [i [j [Hij [Hi Hj]]]]]].
    + assert (Hb : b <> l) by (intros ->; change (waits_of p l) with (waits_of p' l) in Hload; rewrite Hload in Hw; destruct Hw).
      assert (Hab : (rk a < rk b)%N) by (apply Hrk; left; exists c; auto).
      unfold hoist_rank. destruct (N.eqb_spec b l); [contradiction|].
      destruct (N.eqb_spec a l) as [->|]; lia.
    + destruct (Hback w i a Hi) as [i0 [Hi0 Ei]]. destruct (Hback w j b Hj) as [j0 [Hj0 Ej]].
      assert (Hposl : forall k y, nth_error (queue p w) k = Some y -> y = l -> w = W /\ k = S n).
      { intros k y Hk ->. exact (Huniq _ _ _ _ _ Hk hoist_q_l). }
      unfold hoist_rank.
      destruct (Nat.eq_dec w W) as [->|Hw].
      * subst i0 j0.
        destruct (Nat.eq_dec i n) as [->|Hin]; [destruct (Nat.eq_dec j (S n)) as [->|Hjn]|].
        -- (* the swapped pair: l then x *)
           unfold sw in Hi0, Hj0.
           destruct (Nat.eq_dec n n); [|congruence].
           destruct (Nat.eq_dec (S n) n); [lia|]. destruct (Nat.eq_dec (S n) (S n)); [|congruence].
           rewrite hoist_q_l in Hi0. rewrite hoist_q_x in Hj0.
           injection Hi0 as Ea. injection Hj0 as Eb. subst a b.
           rewrite N.eqb_refl. destruct (N.eqb_spec x l); [contradiction|]. lia.
        -- (* a = l, b after x *)
           assert (Ha : a = l).
           { unfold sw in Hi0. destruct (Nat.eq_dec n n); [|congruence]. rewrite hoist_q_l in Hi0. congruence. }
           subst a. assert (Hsj : sw n j = j) by (unfold sw; repeat destruct Nat.eq_dec; lia).
           rewrite Hsj in Hj0.
           assert (Hlb : (rk l < rk b)%N).
           { apply Hrk. right. exists W, (S n), j. repeat split; auto; [lia | apply hoist_q_l]. }
           rewrite N.eqb_refl. destruct (N.eqb_spec b l) as [->|]; [|lia].
           destruct (Hposl _ _ Hj0 eq_refl). lia.
        -- (* a is not the hoisted load *)
           assert (Ha : a <> l).
           { intros ->. destruct (Hposl _ _ Hi0 eq_refl) as [_ E]. unfold sw in E.
             repeat destruct Nat.eq_dec; lia. }
           destruct (N.eqb_spec a l); [contradiction|].
           destruct (N.eqb_spec b l) as [->|Hb].
           ++ (* b = l: a sits before x in p *)
              destruct (Hposl _ _ Hj0 eq_refl) as [_ E].
              assert (Hj' : j = n) by (unfold sw in E; repeat destruct Nat.eq_dec; lia). subst j.
              assert (Hsi : sw n i = i) by (unfold sw; repeat destruct Nat.eq_dec; lia).
              rewrite Hsi in Hi0.
              assert ((rk a < rk x)%N).
              { apply Hrk. right. exists W, i, n. repeat split; auto. apply hoist_q_x. }
              lia.
           ++ assert ((rk a < rk b)%N); [|lia].
              apply Hrk. right. exists W, (sw n i), (sw n j). repeat split; auto.
              unfold sw. repeat destruct Nat.eq_dec; lia.
      * subst i0 j0.
        assert (Ha : a <> l) by (intros ->; destruct (Hposl _ _ Hi0 eq_refl); contradiction).
        assert (Hb : b <> l) by (intros ->; destruct (Hposl _ _ Hj0 eq_refl); contradiction).
        destruct (N.eqb_spec a l); [contradiction|]. destruct (N.eqb_spec b l); [contradiction|].
        assert ((rk a < rk b)%N); [|lia].
        apply Hrk. right. exists w, i, j. auto.
Qed.

(** The values each task reads are unchanged: the hoisted plan has the same
    edges (so the same producers), and in every execution of it a task runs
    only after all of its producers have completed (C1 on the hoisted plan). *)
Theorem hoist_load_reads_same rk :
  hyps p rk ->
  cp_edges p' = cp_edges p /\
  forall tr s t s', exec p' init tr s -> step p' s t s' ->
    forall u, In (u, t) (cp_edges p) -> In u tr.
Proof.
  intros H. split; [reflexivity|].
  destruct (hoist_load_preserves rk H) as [Hpart [Hcov [Hthr _]]].
  intros tr s t s' Hex Hst u Hu. eapply counters_safety; eauto.
Qed.

End Hoist.
