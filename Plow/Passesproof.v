(** * The counter passes preserve the hypotheses of C1 + C2 (C4, C5). *)
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
