(** * Dependencies from data flow: soundness (C10).

    [check_dataflow_sound]: an accepted payload has no two conflicting tasks
    of one key, and every conflicting pair is ordered by the counter
    protocol's happens-before, earlier key first.  [hb_safety]: under the
    counter hypotheses of C1 (queues partition the tasks, thresholds exact),
    happens-before is respected by every execution.  Together
    ([dataflow_safety], [checkpoint_d_flow_sound]): in every execution, any
    interleaving, of two tasks that touch a common byte with one writing it,
    the one first in program order has completed before the other starts. *)
From Coq Require Import List Arith NArith Bool Lia Relations.
From Plow Require Import Loc Counters Countersproof Dataflow.
Import ListNotations.

Local Open Scope N_scope.

(** ** Maps *)

Lemma get_tadd_eq {A} (m : trie A) d k v : get (tadd (nkey k) v m) d k = v.
Proof. unfold get. rewrite find_add_eq. reflexivity. Qed.

Lemma get_tadd_neq {A} (m : trie A) d k k' v : k <> k' -> get (tadd (nkey k') v m) d k = get m d k.
Proof. intros H. unfold get. rewrite find_add_neq; auto. Qed.

Section WriteIndex.
Variable b : N.

Lemma add_write_mono u m a k e :
  In e (get m [] k) -> In e (get (add_write b u m a) [] k).
Proof.
  unfold add_write. destruct (acc_write a); auto.
  destruct (N.eq_dec k (acc_lo a / b)) as [->|Hne].
  - rewrite get_tadd_eq. right. exact H.
  - rewrite get_tadd_neq; auto.
Qed.

Lemma fold_add_write_mono u l : forall m k e,
  In e (get m [] k) -> In e (get (fold_left (add_write b u) l m) [] k).
Proof.
  induction l as [|a l IH]; intros m k e H; simpl; auto.
  apply IH, add_write_mono, H.
Qed.

Lemma fold_add_write_in u l : forall m a,
  In a l -> acc_write a = true ->
  In (u, acc_lo a, acc_hi a) (get (fold_left (add_write b u) l m) [] (acc_lo a / b)).
Proof.
  induction l as [|a' l IH]; intros m a Ha Hw; [destruct Ha|].
  simpl. destruct Ha as [<-|Ha].
  - apply fold_add_write_mono. unfold add_write. rewrite Hw, get_tadd_eq. left. reflexivity.
  - apply IH; auto.
Qed.

Lemma write_index_mono accs : forall u m k e,
  In e (get m [] k) -> In e (get (write_index_from b u accs m) [] k).
Proof.
  induction accs as [|l accs IH]; intros u m k e H; simpl; auto.
  apply IH, fold_add_write_mono, H.
Qed.

Lemma write_index_in accs : forall u m j l a,
  nth_error accs j = Some l -> In a l -> acc_write a = true ->
  In (u + N.of_nat j, acc_lo a, acc_hi a)
     (get (write_index_from b u accs m) [] (acc_lo a / b)).
Proof.
  induction accs as [|l0 accs IH]; intros u m j l a Hj Ha Hw; [destruct j; discriminate|].
  destruct j as [|j]; cbn [nth_error write_index_from] in Hj |- *.
  - inversion Hj; subst. rewrite N.add_0_r.
    apply write_index_mono, fold_add_write_in; auto.
  - replace (u + N.of_nat (S j)) with (N.succ u + N.of_nat j) by lia.
    eapply IH; eauto.
Qed.
End WriteIndex.

(** ** Blocks *)

Lemma range_ok_block b a x :
  b <> 0 -> range_ok b a = true -> acc_lo a <= x < acc_hi a -> x / b = acc_lo a / b.
Proof.
  unfold range_ok. intros Hb H Hx. apply andb_prop in H as [_ H]. apply N.eqb_eq in H.
  apply N.le_antisymm.
  - rewrite H. apply N.div_le_mono; [exact Hb | lia].
  - apply N.div_le_mono; [exact Hb | lia].
Qed.

(** ** Orders *)

Section Order.
Variable p : cplan.
Let wtm := index_map (cp_waits p).
Let sgm := index_map (cp_signals p).
Let pm := pos_map (cp_queues p).

Lemma direct_sound u t : direct wtm sgm pm u t = true -> must_precede p u t.
Proof.
  unfold direct, wtm, sgm, pm. rewrite !get_index_map. fold (waits_of p t) (signals_of p u).
  intros H. apply orb_prop in H as [H|H].
  - left. apply existsb_exists in H as [c [Hc Hs]]. exists c. split; auto. apply mem_spec. auto.
  - right. apply qbefore_spec. exact H.
Qed.

Lemma chain_ok_sound xs : forall u t, chain_ok wtm sgm pm u xs t = true -> hb p u t.
Proof.
  induction xs as [|x xs IH]; intros u t H; simpl in H.
  - apply t_step, direct_sound, H.
  - apply andb_prop in H as [H1 H2]. eapply t_trans; [apply t_step, direct_sound, H1|].
    apply IH, H2.
Qed.

Lemma ordered_sound cm u t : ordered wtm sgm pm cm u t = true -> hb p u t.
Proof.
  unfold ordered. intros H. apply orb_prop in H as [H|H].
  - apply t_step, direct_sound, H.
  - destruct (tfind _ _) as [xs|]; [|discriminate]. eapply chain_ok_sound; eauto.
Qed.
End Order.

(** ** The checker *)

Lemma acc_of_nth d t a :
  In a (acc_of d t) -> exists l, nth_error (df_acc d) (N.to_nat t) = Some l /\ In a l.
Proof.
  unfold acc_of. intros H. destruct (nth_error (df_acc d) (N.to_nat t)) as [l|] eqn:E.
  - exists l. split; auto. rewrite (nth_error_nth _ _ [] E) in H. exact H.
  - apply nth_error_None in E. rewrite nth_overflow in H by exact E. destruct H.
Qed.

Lemma check_ranges_ok d t a : check_ranges d = None -> In a (acc_of d t) -> range_ok (df_block d) a = true.
Proof.
  intros H Ha. apply acc_of_nth in Ha as [l [Hl Ha]].
  pose proof (find_errN_none _ _ 0 H _ _ Hl) as H1. simpl in H1.
  apply In_nth_error in Ha as [k Hk].
  pose proof (find_errN_none _ _ 0 H1 _ _ Hk) as H2. simpl in H2.
  destruct (range_ok _ _); [reflexivity | discriminate].
Qed.

(** One access of [t] against one overlapping write of [u]. *)
Lemma check_conflicts_pair p d t a u w :
  df_block d <> 0 -> check_ranges d = None -> check_conflicts p d = None ->
  In a (acc_of d t) -> In w (acc_of d u) -> acc_write w = true -> overlap a w -> u <> t ->
  key_of d u <> key_of d t /\
  (key_of d u < key_of d t -> hb p u t) /\ (key_of d t < key_of d u -> hb p t u).
Proof.
  intros Hb Hr H Ha Hw Hwr [x [Hxa Hxw]] Hne.
  pose proof (check_ranges_ok d t a Hr Ha) as Ra.
  pose proof (check_ranges_ok d u w Hr Hw) as Rw.
  apply acc_of_nth in Ha as Ha'. destruct Ha' as [l [Hl Hal]].
  apply acc_of_nth in Hw as Hw'. destruct Hw' as [lw [Hlw Hwl]].
  unfold check_conflicts in H.
  pose proof (find_errN_none _ _ 0 H _ _ Hl) as H1. simpl in H1.
  rewrite N2Nat.id in H1.
  pose proof (first_err_none _ _ H1 a Hal) as H2. simpl in H2.
  assert (Hin : In (u, acc_lo w, acc_hi w) (get (write_index d) [] (acc_lo a / df_block d))).
  { rewrite <- (range_ok_block _ a x Hb Ra Hxa), (range_ok_block _ w x Hb Rw Hxw).
    unfold write_index. pose proof (write_index_in (df_block d) (df_acc d) 0 Leaf _ _ _ Hlw Hwl Hwr) as Hi.
    rewrite N.add_0_l, N2Nat.id in Hi. exact Hi. }
  pose proof (first_err_none _ _ H2 _ Hin) as H3. unfold check_pair in H3.
  destruct (N.eqb_spec u t) as [|_]; [contradiction|].
  assert (Hov : ((acc_lo a <? acc_hi w) && (acc_lo w <? acc_hi a))%bool = true).
  { apply andb_true_intro. split; apply N.ltb_lt; lia. }
  rewrite Hov in H3. rewrite !get_index_map in H3. fold (key_of d u) (key_of d t) in H3.
  destruct (N.ltb_spec (key_of d u) (key_of d t)) as [Hlt|Hge].
  - destruct (ordered _ _ _ _ u t) eqn:Eo; [|discriminate].
    split; [lia|]. split; [intros _; eapply ordered_sound; eauto | intros; lia].
  - destruct (N.ltb_spec (key_of d t) (key_of d u)) as [Hlt'|Hge']; [|discriminate].
    destruct (ordered _ _ _ _ t u) eqn:Eo; [|discriminate].
    split; [lia|]. split; [intros; lia | intros _; eapply ordered_sound; eauto].
Qed.

Lemma overlap_sym a b : overlap a b -> overlap b a.
Proof. intros [x [H1 H2]]. exists x. auto. Qed.

(** What an accepted payload guarantees. *)
Definition dataflow_hypotheses (p : cplan) (d : dflow) : Prop :=
  keys_separate d /\ dataflow_ordered p d.

Theorem check_dataflow_sound p d :
  check_dataflow p d = None -> dataflow_hypotheses p d.
Proof.
  unfold check_dataflow.
  destruct (negb _) eqn:E1; [discriminate|].
  destruct (N.eqb_spec (df_block d) 0) as [|Hb]; [discriminate|].
  destruct (check_ranges d) eqn:Hr; [discriminate|]. intros H.
  assert (Hc : forall u t, conflict d u t ->
    key_of d u <> key_of d t /\ (key_of d u < key_of d t -> hb p u t)).
  { intros u t [Hne [a [b [Ha [Hb' [Hw Hov]]]]]]. destruct Hw as [Hw|Hw].
    - destruct (check_conflicts_pair p d t b u a Hb Hr H Hb' Ha Hw (overlap_sym _ _ Hov) Hne)
        as [K [K1 _]]. auto.
    - destruct (check_conflicts_pair p d u a t b Hb Hr H Ha Hb' Hw Hov (not_eq_sym Hne))
        as [K [_ K2]]. auto. }
  split; intros u t Hut; [apply Hc, Hut | apply Hc, Hut].
Qed.

(** ** Executions respect happens-before *)

(** C1's argument for one [must_precede] pair. *)
Lemma must_precede_safety p :
  queues_partition p -> thresholds_exact p ->
  forall tr s t s', exec p init tr s -> step p s t s' ->
  forall u, must_precede p u t -> In u tr.
Proof.
  intros Hpart Hthr tr s t s' Hex Hstep u Hmp.
  destruct (exec_invariant p tr s Hpart Hex) as [Hdone [Hcnt Hnd]].
  inversion Hstep as [s0 w t0 Hh Hen]; subst s0 t0 s'.
  destruct Hmp as [[c [Hw Hs]] | [w' [i [j [Hij [Hi Hj]]]]]].
  - apply (count_all_signallers p c tr Hnd); auto.
    + intros x Hx. eapply done_is_task; [exact Hpart|]. apply Hdone. exact Hx.
    + specialize (Hen c Hw). rewrite Hcnt, (Hthr t c Hw), Nat2N.id in Hen. exact Hen.
  - destruct Hpart as [Hnd' _].
    destruct (concat_unique _ Hnd' w (pos s w) w' j t Hh Hj) as [<- <-].
    apply Hdone. exists w, i. auto.
Qed.

(** An execution that ran [x] reached, before it, a state where [x] stepped. *)
Lemma exec_split p s0 tr s :
  exec p s0 tr s -> forall tr1 x tr2, tr = tr1 ++ x :: tr2 ->
  exists s1 s2, exec p s0 tr1 s1 /\ step p s1 x s2.
Proof.
  induction 1 as [s|s tr s1 t s2 Hex IH Hstep]; intros tr1 x tr2 Heq.
  - destruct tr1; discriminate.
  - destruct tr2 as [|y tr2'] eqn:E.
    + apply app_inj_tail in Heq as [-> ->]. eauto.
    + destruct (exists_last (l := y :: tr2') ltac:(discriminate)) as [tr3 [z Hz]].
      rewrite Hz, app_comm_cons, app_assoc in Heq.
      apply app_inj_tail in Heq as [Heq _]. eapply IH. exact Heq.
Qed.

Theorem hb_safety p :
  queues_partition p -> thresholds_exact p ->
  forall u t, hb p u t ->
  forall tr s s', exec p init tr s -> step p s t s' -> In u tr.
Proof.
  intros Hpart Hthr u t Hhb. apply clos_trans_tn1 in Hhb.
  induction Hhb as [y Hr|y z Hr Hc IH]; intros tr s s' Hex Hstep.
  - eapply must_precede_safety; eauto.
  - pose proof (must_precede_safety p Hpart Hthr tr s z s' Hex Hstep y Hr) as Hy.
    apply in_split in Hy as [tr1 [tr2 Htr]].
    destruct (exec_split p init tr s Hex tr1 y tr2 Htr) as [s1 [s2 [Hex1 Hs1]]].
    rewrite Htr. apply in_or_app. left. eapply IH; eauto.
Qed.

(** In every execution, of two conflicting tasks the one with the smaller key
    has run before the other starts. *)
Definition dataflow_respected (p : cplan) (d : dflow) : Prop :=
  forall u t, conflict d u t -> key_of d u < key_of d t ->
  forall tr s s', exec p init tr s -> step p s t s' -> In u tr.

Theorem dataflow_safety p d :
  counter_hypotheses p -> dataflow_hypotheses p d -> dataflow_respected p d.
Proof.
  intros [Hpart [_ [Hthr _]]] [_ Hord] u t Hc Hk tr s s' Hex Hstep.
  eapply hb_safety; eauto.
Qed.

(** ** Checkpoint D from data flow *)

(** The conjuncts of [checkpoint_d_flow_sound], named. *)
Definition d_protocol_sound (p : cplan) (sc : list N) (wpg : N) : Prop :=
  check_checkpoint_d p sc wpg = Accept.

Theorem checkpoint_d_flow_sound p sc wpg d :
  check_checkpoint_d_flow p sc wpg d = Accept ->
  d_protocol_sound p sc wpg /\ counter_hypotheses p /\ scopes_legal p sc wpg /\
  dataflow_hypotheses p d /\ dataflow_respected p d.
Proof.
  unfold check_checkpoint_d_flow. intros H.
  destruct (check_checkpoint_d p sc wpg) eqn:E; [|discriminate].
  destruct (check_dataflow p d) eqn:Ef; [discriminate|].
  destruct (checkpoint_d_sound p sc wpg E) as [[Hh _] Hs].
  pose proof (check_dataflow_sound p d Ef) as Hd.
  unfold d_protocol_sound.
  split; [exact E|]. split; [exact Hh|]. split; [exact Hs|]. split; [exact Hd|].
  apply dataflow_safety; auto.
Qed.
