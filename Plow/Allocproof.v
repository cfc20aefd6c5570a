(** Allocation safety (checkpoint F): theorems F1 and F2. *)
From Coq Require Import Arith NArith List Bool Lia RelationClasses Sorted Permutation Relations.
From Plow Require Import Loc Alloc.
From Plow Require Counters Countersproof Dataflow Dataflowproof Flowsweep Flowsweepproof.
Import ListNotations.
Local Open Scope N_scope.

(** * Intervals *)

(** Two half-open intervals [\[a, c)] and [\[b, d)] meet iff the larger
    start is below the smaller end. *)
Lemma intervals_meet : forall a b c d,
  N.max a b < N.min c d <-> exists s, a <= s < c /\ b <= s < d.
Proof.
  intros a b c d. split.
  - intros H. apply N.min_glb_lt_iff in H as [Hc Hd].
    exists (N.max a b). pose proof (N.le_max_l a b). pose proof (N.le_max_r a b).
    lia.
  - intros (s & [Ha Hc] & [Hb Hd]).
    apply N.le_lt_trans with s; [now apply N.max_lub|].
    now apply N.min_glb_lt.
Qed.

(** [conflict] decides exactly "a common live step and a common byte". *)
Lemma conflict_spec : forall x y,
  conflict x y = true <->
  (exists s, live x s /\ live y s) /\ (exists a, holds x a /\ holds y a).
Proof.
  intros x y. unfold conflict, live, holds.
  rewrite andb_true_iff, !N.ltb_lt, !intervals_meet. reflexivity.
Qed.

Lemma conflict_sym : forall x y, conflict x y = conflict y x.
Proof.
  intros x y. unfold conflict.
  rewrite (N.max_comm (b_first x)), (N.min_comm (b_last x)),
          (N.max_comm (b_offset x)), (N.min_comm (b_end x)).
  reflexivity.
Qed.

Lemma no_conflict : forall x y,
  conflict x y = false ->
  forall s, live x s -> live y s -> forall a, ~ (holds x a /\ holds y a).
Proof.
  intros x y Hc s Hx Hy a [Ha Hb].
  assert (conflict x y = true)
    by (apply conflict_spec; split; [exists s|exists a]; split; assumption).
  congruence.
Qed.

(** * Each buffer on its own *)

Lemma check_one_accept : forall arena i b,
  check_one arena i b = Accept -> in_bounds arena b /\ aligned b.
Proof.
  intros arena i b H. unfold check_one in H.
  destruct (N.eqb_spec (b_align b) 0); [discriminate|].
  destruct (N.eqb_spec (b_offset b mod b_align b) 0); [|discriminate].
  destruct (N.ltb_spec arena (b_end b)); [discriminate|].
  unfold in_bounds, aligned. split; [lia|]. split; [lia|assumption].
Qed.

Lemma check_each_accept : forall arena bufs i,
  check_each arena i bufs = Accept ->
  forall k b, nth_error bufs k = Some b -> in_bounds arena b /\ aligned b.
Proof.
  induction bufs as [|x rest IH]; intros i H k b Hk; [destruct k; discriminate|].
  simpl in H. destruct (check_one arena i x) eqn:H1; [|discriminate].
  destruct k as [|k]; simpl in Hk.
  - injection Hk as <-. eapply check_one_accept; eassumption.
  - eapply IH; eassumption.
Qed.

(** * Pairs *)


Lemma leb_trans : Transitive (fun x y => is_true (OffsetOrder.leb x y)).
Proof.
  intros x y z. unfold is_true, OffsetOrder.leb. rewrite !N.leb_le. lia.
Qed.

Lemma sort_sorted : forall l, StronglySorted (fun x y => is_true (OffsetOrder.leb x y))
  (OffsetSort.sort l).
Proof. intros l. apply OffsetSort.StronglySorted_sort. exact leb_trans. Qed.

(** A buffer that starts at or after [x]'s end shares no byte with [x]. *)
Lemma conflict_past_end : forall x y,
  b_end x <= b_offset y -> conflict x y = false.
Proof.
  intros x y H. destruct (conflict x y) eqn:Hc; [|reflexivity].
  apply conflict_spec in Hc as [_ (a & [Hx1 Hx2] & [Hy1 Hy2])]. lia.
Qed.

Lemma scan_accept : forall i x rest,
  StronglySorted (fun x y => is_true (OffsetOrder.leb x y)) rest ->
  scan i x rest = Accept -> forall e, In e rest -> conflict x (snd e) = false.
Proof.
  induction rest as [|[j y] rest IH]; intros Hs H e Hin; [destruct Hin|].
  inversion Hs as [|? ? Hs' Hall]; subst. simpl in H.
  destruct (N.leb_spec (b_end x) (b_offset y)) as [Hend|Hend].
  - apply conflict_past_end. destruct Hin as [<-|Hin]; [exact Hend|].
    eapply Forall_forall in Hall; [|exact Hin].
    unfold is_true, OffsetOrder.leb in Hall. apply N.leb_le in Hall. simpl in Hall.
    lia.
  - destruct (conflict x y) eqn:Hc; [discriminate|].
    destruct Hin as [<-|Hin]; [exact Hc|]. eapply IH; eassumption.
Qed.

Lemma sweep_accept : forall l,
  StronglySorted (fun x y => is_true (OffsetOrder.leb x y)) l ->
  sweep l = Accept ->
  forall e1 e2, In e1 l -> In e2 l -> fst e1 <> fst e2 ->
  conflict (snd e1) (snd e2) = false.
Proof.
  induction l as [|[i x] rest IH]; intros Hs H e1 e2 H1 H2 Hne; [destruct H1|].
  inversion Hs as [|? ? Hs' Hall]; subst. simpl in H.
  destruct (scan i x rest) eqn:Hscan; [|discriminate].
  destruct H1 as [<-|H1], H2 as [<-|H2].
  - now destruct Hne.
  - eapply scan_accept; eassumption.
  - rewrite conflict_sym. eapply scan_accept; eassumption.
  - eapply IH; eassumption.
Qed.

Lemma index_from_in : forall bufs i e,
  In e (index_from i bufs) ->
  i <= fst e /\ nth_error bufs (N.to_nat (fst e - i)) = Some (snd e).
Proof.
  induction bufs as [|b rest IH]; intros i e Hin; [destruct Hin|].
  destruct Hin as [<-|Hin].
  - simpl. rewrite N.sub_diag. split; [lia|reflexivity].
  - destruct (IH _ _ Hin) as [Hle Hn]. split; [lia|].
    replace (N.to_nat (fst e - i)) with (S (N.to_nat (fst e - N.succ i))) by lia.
    exact Hn.
Qed.

Lemma index_from_nth : forall bufs i k b,
  nth_error bufs k = Some b -> In (i + N.of_nat k, b) (index_from i bufs).
Proof.
  induction bufs as [|b0 rest IH]; intros i k b Hk; [destruct k; discriminate|].
  destruct k as [|k]; simpl in Hk.
  - injection Hk as <-. left. f_equal. lia.
  - right. replace (i + N.of_nat (S k)) with (N.succ i + N.of_nat k) by lia.
    now apply IH.
Qed.

Lemma index_from_nodup : forall bufs i, NoDup (map fst (index_from i bufs)).
Proof.
  induction bufs as [|b rest IH]; intros i; simpl; constructor; [|apply IH].
  intros Hin. apply in_map_iff in Hin as (e & He & Hin).
  apply index_from_in in Hin as [Hle _]. lia.
Qed.

Lemma check_pairs_accept : forall bufs,
  check_pairs bufs = Accept ->
  forall p q bp bq, p <> q ->
  nth_error bufs p = Some bp -> nth_error bufs q = Some bq ->
  conflict bp bq = false.
Proof.
  intros bufs H p q bp bq Hpq Hp Hq. unfold check_pairs in H.
  pose proof (OffsetSort.Permuted_sort (index_from 0 bufs)) as Hperm.
  apply (sweep_accept _ (sort_sorted _) H (N.of_nat p, bp) (N.of_nat q, bq)).
  - eapply Permutation_in; [exact Hperm|]. apply (index_from_nth bufs 0 p bp Hp).
  - eapply Permutation_in; [exact Hperm|]. apply (index_from_nth bufs 0 q bq Hq).
  - simpl. lia.
Qed.

(** * F2: the executable check is sound *)

Theorem check_alloc_sound : forall arena bufs,
  check_alloc arena bufs = Accept -> alloc_safe arena bufs.
Proof.
  intros arena bufs H. unfold check_alloc in H.
  destruct (check_each arena 0 bufs) eqn:He; [|discriminate].
  split.
  - eapply check_each_accept; eassumption.
  - intros i j bi bj Hij Hi Hj. apply no_conflict.
    eapply check_pairs_accept; eassumption.
Qed.

(** * F1: what a safe allocation guarantees *)

(** No byte belongs to two buffers that are live at the same step. *)
Theorem alloc_safe_exclusive : forall arena bufs,
  alloc_safe arena bufs ->
  forall i j bi bj s a,
  nth_error bufs i = Some bi -> nth_error bufs j = Some bj ->
  live bi s -> live bj s -> holds bi a -> holds bj a -> i = j.
Proof.
  intros arena bufs [_ Hdis] i j bi bj s a Hi Hj Hsi Hsj Hai Haj.
  destruct (Nat.eq_dec i j) as [|Hne]; [assumption|].
  exfalso. exact (Hdis i j bi bj Hne Hi Hj s Hsi Hsj a (conj Hai Haj)).
Qed.

(** Every byte of every buffer lies inside the arena, at an aligned offset. *)
Theorem alloc_safe_in_arena : forall arena bufs,
  alloc_safe arena bufs ->
  forall i b, nth_error bufs i = Some b ->
  (forall a, holds b a -> a < arena) /\
  0 < b_align b /\ b_offset b mod b_align b = 0.
Proof.
  intros arena bufs [Hb _] i b Hi.
  destruct (Hb i b Hi) as [Hin [Hpos Hmod]]. unfold in_bounds in Hin.
  split; [|split; assumption].
  intros a Ha. unfold holds in Ha. lia.
Qed.

(** A memory: a value per byte address; writing buffer [b] replaces the bytes
    it holds. *)
Definition holdsb (b : buffer) (a : N) : bool :=
  (b_offset b <=? a) && (a <? b_end b).

Definition write_buffer {V : Type} (b : buffer) (data : N -> V) (m : N -> V) : N -> V :=
  fun a => if holdsb b a then data a else m a.

(** Frame property: at a step where buffers [i] and [j] are both live, writing
    buffer [i] leaves every byte of buffer [j] unchanged. *)
Theorem alloc_safe_frame : forall arena bufs,
  alloc_safe arena bufs ->
  forall i j bi bj s, i <> j ->
  nth_error bufs i = Some bi -> nth_error bufs j = Some bj ->
  live bi s -> live bj s ->
  forall V (data m : N -> V) a, holds bj a -> write_buffer bi data m a = m a.
Proof.
  intros arena bufs [_ Hdis] i j bi bj s Hne Hi Hj Hsi Hsj V data m a Ha.
  unfold write_buffer. destruct (holdsb bi a) eqn:Hh; [|reflexivity].
  exfalso. apply (Hdis i j bi bj Hne Hi Hj s Hsi Hsj a). split; [|exact Ha].
  unfold holdsb in Hh. apply andb_true_iff in Hh as [H1 H2].
  apply N.leb_le in H1. apply N.ltb_lt in H2. unfold holds. lia.
Qed.

(** F1 + F2 together: an accepted allocation is exclusive, in bounds and
    aligned. *)
Corollary check_alloc_exclusive : forall arena bufs,
  check_alloc arena bufs = Accept ->
  forall i j bi bj s a,
  nth_error bufs i = Some bi -> nth_error bufs j = Some bj ->
  live bi s -> live bj s -> holds bi a -> holds bj a -> i = j.
Proof.
  intros arena bufs H. apply alloc_safe_exclusive with arena.
  now apply check_alloc_sound.
Qed.

(** Rejections are genuine: an [Overlap] names two distinct buffers, at the
    reported address ranges, that are both live at every step of the
    reported (nonempty) step range and share a byte. *)
Lemma scan_reject : forall i x rest i' lo hi j lo' hi' sl sh,
  scan i x rest = Reject (Overlap i' lo hi j lo' hi' sl sh) ->
  exists y, In (j, y) rest /\ conflict x y = true /\ i' = i /\
    lo = b_offset x /\ hi = b_end x /\ lo' = b_offset y /\ hi' = b_end y /\
    sl = N.max (b_first x) (b_first y) /\ sh = N.min (b_last x) (b_last y).
Proof.
  induction rest as [|[j0 y] rest IH]; intros i' lo hi j lo' hi' sl sh H;
    [discriminate|].
  simpl in H. destruct (b_end x <=? b_offset y); [discriminate|].
  destruct (conflict x y) eqn:Hc.
  - injection H as <- <- <- <- <- <- <- <-. exists y. split; [now left|]. auto 10.
  - destruct (IH _ _ _ _ _ _ _ _ H) as (y' & Hin & Hrest).
    exists y'. split; [now right|exact Hrest].
Qed.

Lemma sweep_reject : forall l i lo hi j lo' hi' sl sh,
  NoDup (map fst l) ->
  sweep l = Reject (Overlap i lo hi j lo' hi' sl sh) ->
  exists x y, In (i, x) l /\ In (j, y) l /\ i <> j /\ conflict x y = true /\
    lo = b_offset x /\ hi = b_end x /\ lo' = b_offset y /\ hi' = b_end y /\
    sl = N.max (b_first x) (b_first y) /\ sh = N.min (b_last x) (b_last y).
Proof.
  induction l as [|[i0 x] rest IH]; intros i lo hi j lo' hi' sl sh Hnd H;
    [discriminate|].
  simpl in Hnd. apply NoDup_cons_iff in Hnd as [Hni Hnd']. simpl in H.
  destruct (scan i0 x rest) as [|e] eqn:Hscan.
  - destruct (IH _ _ _ _ _ _ _ _ Hnd' H) as (x' & y & Hx & Hy & Hrest).
    exists x', y. split; [now right|]. split; [now right|exact Hrest].
  - injection H as ->.
    destruct (scan_reject _ _ _ _ _ _ _ _ _ _ _ Hscan) as (y & Hin & Hc & Hii & Hr). subst i.
    exists x, y. split; [now left|]. split; [now right|]. split; [|auto].
    intros Heq. subst j. apply Hni. apply in_map_iff. exists (i0, y). auto.
Qed.

Lemma check_each_no_overlap : forall arena bufs i i' lo hi j' lo' hi' sl sh,
  check_each arena i bufs <> Reject (Overlap i' lo hi j' lo' hi' sl sh).
Proof.
  induction bufs as [|x rest IH]; intros i i' lo hi j' lo' hi' sl sh H;
    simpl in H; [discriminate|].
  destruct (check_one arena i x) eqn:H1.
  - eapply IH; eassumption.
  - injection H as ->. unfold check_one in H1.
    destruct (b_align x =? 0); [discriminate|].
    destruct (negb _); [discriminate|].
    destruct (arena <? b_end x); discriminate.
Qed.

Theorem check_alloc_overlap_genuine : forall arena bufs i lo hi j lo' hi' sl sh,
  check_alloc arena bufs = Reject (Overlap i lo hi j lo' hi' sl sh) ->
  exists x y, i <> j /\
    nth_error bufs (N.to_nat i) = Some x /\ nth_error bufs (N.to_nat j) = Some y /\
    lo = b_offset x /\ hi = b_end x /\ lo' = b_offset y /\ hi' = b_end y /\
    sl < sh /\ (forall s, sl <= s < sh -> live x s /\ live y s) /\
    exists a, holds x a /\ holds y a.
Proof.
  intros arena bufs i lo hi j lo' hi' sl sh H. unfold check_alloc in H.
  destruct (check_each arena 0 bufs) eqn:He;
    [|injection H as ->; exfalso; eapply check_each_no_overlap; eassumption].
  unfold check_pairs in H.
  assert (Hnd : NoDup (map fst (OffsetSort.sort (index_from 0 bufs)))).
  { eapply Permutation_NoDup; [apply Permutation_map, OffsetSort.Permuted_sort|].
    apply index_from_nodup. }
  destruct (sweep_reject _ _ _ _ _ _ _ _ _ Hnd H)
    as (x & y & Hx & Hy & Hij & Hc & Hlo & Hhi & Hlo' & Hhi' & -> & ->).
  apply (Permutation_in _ (Permutation_sym (OffsetSort.Permuted_sort _))) in Hx, Hy.
  apply index_from_in in Hx as [_ Hx]. apply index_from_in in Hy as [_ Hy].
  simpl in Hx, Hy. rewrite N.sub_0_r in Hx, Hy.
  exists x, y. split; [exact Hij|]. do 6 (split; [assumption|]).
  apply conflict_spec in Hc as ((s & Hsx & Hsy) & Ha).
  unfold live in *.
  pose proof (N.le_max_l (b_first x) (b_first y)).
  pose proof (N.le_max_r (b_first x) (b_first y)).
  pose proof (N.le_min_l (b_last x) (b_last y)).
  pose proof (N.le_min_r (b_last x) (b_last y)).
  split; [|split; [|exact Ha]].
  - apply N.le_lt_trans with s; [apply N.max_lub; lia|apply N.min_glb_lt; lia].
  - intros s' Hs'. lia.
Qed.

(** * F3: shared bytes only between ordered buffers *)

Lemma tfind_tmeet : forall (a b : vclock) i,
  Counters.tfind i (tmeet a b) = omin (Counters.tfind i a) (Counters.tfind i b).
Proof.
  induction a as [|l1 IH1 o1 r1 IH2]; intros b i.
  - simpl. rewrite Countersproof.tfind_leaf. reflexivity.
  - destruct b as [|l2 o2 r2].
    + simpl tmeet. rewrite Countersproof.tfind_leaf.
      destruct (Counters.tfind i (Counters.Node l1 o1 r1)); reflexivity.
    + destruct i; simpl; auto.
Qed.

Lemma covers_meet : forall p a b P Q,
  Flowsweepproof.covers p a P -> Flowsweepproof.covers p b Q ->
  Flowsweepproof.covers p (tmeet a b) (fun x => P x /\ Q x).
Proof.
  intros p a b P Q Ha Hb w j i x Hw Hx Hi. rewrite tfind_tmeet in Hw.
  destruct (Counters.tfind (Counters.nkey w) a) as [ja|] eqn:Ea;
    destruct (Counters.tfind (Counters.nkey w) b) as [jb|] eqn:Eb;
    simpl in Hw; try discriminate.
  injection Hw as <-. split.
  - eapply Ha; [exact Ea|exact Hx|]. lia.
  - eapply Hb; [exact Eb|exact Hx|]. lia.
Qed.

(** Every clock [task_clocks] records names only tasks that happen before its
    task (or the task itself). *)
Lemma task_clocks_good : forall p order cv wv m,
  (forall c v, Counters.tfind (Counters.nkey c) cv = Some v -> Flowsweepproof.cgood p c v) ->
  (forall w a v, Counters.tfind (Counters.nkey w) wv = Some (a, v) ->
     Flowsweepproof.tgood p a v) ->
  (forall t v, Counters.tfind (Counters.nkey t) m = Some v -> Flowsweepproof.tgood p t v) ->
  forall t v,
  Counters.tfind (Counters.nkey t)
    (task_clocks (Counters.index_map (Counters.cp_waits p))
       (Counters.index_map (Counters.cp_signals p))
       (Counters.pos_map (Counters.cp_queues p)) order cv wv m) = Some v ->
  Flowsweepproof.tgood p t v.
Proof.
  intros p order. induction order as [|t0 order IH]; intros cv wv m Hcv Hwv Hm; simpl;
    [exact Hm|].
  assert (Hvt : Flowsweepproof.tgood p t0
    (Flowsweep.clock_of (Counters.index_map (Counters.cp_waits p))
       (Counters.pos_map (Counters.cp_queues p)) cv wv t0)).
  { exact (Flowsweepproof.clock_good p (Flowsweep.mk_sstate Counters.Leaf cv wv) t0
             (conj Hcv Hwv)). }
  apply IH.
  - eapply Flowsweepproof.sig_clocks_good; [exact Hvt|exact Hcv|].
    intros c Hc. rewrite Countersproof.get_index_map in Hc. exact Hc.
  - destruct (Counters.tfind (Counters.nkey t0) (Counters.pos_map (Counters.cp_queues p)))
      as [[w0 i0]|]; [|exact Hwv].
    intros w a v Hf. destruct (N.eq_dec w w0) as [->|Hne].
    + rewrite Countersproof.find_add_eq in Hf. injection Hf as <- <-. exact Hvt.
    + rewrite Countersproof.find_add_neq in Hf by exact Hne. exact (Hwv w a v Hf).
  - intros t v Hf. destruct (N.eq_dec t t0) as [->|Hne].
    + rewrite Countersproof.find_add_eq in Hf. injection Hf as <-. exact Hvt.
    + rewrite Countersproof.find_add_neq in Hf by exact Hne. exact (Hm t v Hf).
Qed.

Lemma clocks_good : forall p order t,
  Flowsweepproof.tgood p t
    (clock (task_clocks (Counters.index_map (Counters.cp_waits p))
       (Counters.index_map (Counters.cp_signals p))
       (Counters.pos_map (Counters.cp_queues p)) order Counters.Leaf Counters.Leaf
       Counters.Leaf) t).
Proof.
  intros p order t. unfold clock, Counters.get.
  destruct (Counters.tfind (Counters.nkey t) _) as [v|] eqn:E.
  - eapply task_clocks_good; [| | |exact E];
      intros; rewrite Countersproof.tfind_leaf in *; discriminate.
  - apply Flowsweepproof.covers_leaf.
Qed.

Lemma meet_clocks_good : forall p cm,
  (forall t, Flowsweepproof.tgood p t (clock cm t)) ->
  forall ts m, meet_clocks cm ts = Some m ->
  Flowsweepproof.covers p m (fun x => forall t, In t ts -> x = t \/ Dataflow.hb p x t).
Proof.
  intros p cm Hc. induction ts as [|t ts IH]; intros m H; [discriminate|].
  simpl in H. injection H as <-.
  destruct (meet_clocks cm ts) as [m'|] eqn:Em.
  - eapply Flowsweepproof.covers_mono; [|apply covers_meet; [apply (Hc t)|apply (IH m' eq_refl)]].
    intros x [Hx Hxs] t' [<-|Ht']; auto.
  - destruct ts as [|t1 ts]; [|discriminate].
    eapply Flowsweepproof.covers_mono; [|apply (Hc t)].
    intros x Hx t' [<-|[]]. exact Hx.
Qed.

Lemma get_map_in : forall {A B : Type} (f : A -> B) (l : list A) (a : A) (d : B) i,
  (i < length l)%nat ->
  Counters.get (Counters.index_map (map f l)) d (N.of_nat i) = f (nth i l a).
Proof.
  intros A B f l a d i Hi. rewrite Countersproof.get_index_map, Nat2N.id.
  rewrite (nth_indep _ d (f a)) by (rewrite map_length; exact Hi). apply map_nth.
Qed.

Lemma get_map_N : forall {A B : Type} (f : A -> B) (l : list A) (a : A) (d : B) i,
  (N.to_nat i < length l)%nat ->
  Counters.get (Counters.index_map (map f l)) d i = f (nth (N.to_nat i) l a).
Proof.
  intros A B f l a d i Hi. rewrite Countersproof.get_index_map.
  rewrite (nth_indep _ d (f a)) by (rewrite map_length; exact Hi). apply map_nth.
Qed.

Lemma bump_mono : forall v w i w' j,
  Counters.tfind (Counters.nkey w') v = Some j ->
  exists j', Counters.tfind (Counters.nkey w') (Flowsweep.bump v w i) = Some j' /\ j <= j'.
Proof.
  intros v w i w' j H. unfold Flowsweep.bump.
  destruct (N.eq_dec w' w) as [->|Hne].
  - rewrite Countersproof.find_add_eq, H. eexists. split; [reflexivity|lia].
  - rewrite Countersproof.find_add_neq by exact Hne. exists j. split; [exact H|lia].
Qed.

Lemma bump_self : forall v w i,
  exists j', Counters.tfind (Counters.nkey w) (Flowsweep.bump v w i) = Some j' /\ i <= j'.
Proof.
  intros v w i. unfold Flowsweep.bump. rewrite Countersproof.find_add_eq.
  destruct (Counters.tfind (Counters.nkey w) v); eexists; split; try reflexivity; lia.
Qed.

(** [join_pos] covers every task's position, and only grows its clock. *)
Lemma join_pos_spec : forall pm us v J,
  join_pos pm us v = Some J ->
  (forall w j, Counters.tfind (Counters.nkey w) v = Some j ->
     exists k, Counters.tfind (Counters.nkey w) J = Some k /\ j <= k) /\
  (forall u, In u us -> exists w i k, Counters.tfind (Counters.nkey u) pm = Some (w, i) /\
     Counters.tfind (Counters.nkey w) J = Some k /\ i <= k).
Proof.
  intros pm. induction us as [|u us IH]; intros v J H; simpl in H.
  - injection H as <-. split; [|intros u []]. intros w j Hj. exists j. split; [exact Hj|lia].
  - destruct (Counters.tfind (Counters.nkey u) pm) as [[w i]|] eqn:Ep; [|discriminate].
    destruct (IH _ _ H) as [Hmono Hus]. split.
    + intros w' j Hj. destruct (bump_mono v w i w' j Hj) as (j' & Hj' & Hle).
      destruct (Hmono w' j' Hj') as (k & Hk & Hle'). exists k. split; [exact Hk|lia].
    + intros u' [<-|Hin]; [|exact (Hus u' Hin)].
      destruct (bump_self v w i) as (j' & Hj' & Hle).
      destruct (Hmono w j' Hj') as (k & Hk & Hle'). exists w, i, k. split; [exact Ep|]. split; [exact Hk|lia].
Qed.

Lemma tle_spec : forall (a b : vclock), tle a b = true ->
  forall q j, Counters.tfind q a = Some j -> exists k, Counters.tfind q b = Some k /\ j <= k.
Proof.
  induction a as [|l1 IH1 o1 r1 IH2]; intros b H q j Hf.
  - rewrite Countersproof.tfind_leaf in Hf. discriminate.
  - destruct b as [|l2 o2 r2]; simpl in H; apply andb_true_iff in H as [H Hr];
      apply andb_true_iff in H as [Ho Hl].
    + destruct q as [q|q|]; simpl in Hf.
      * destruct (IH2 _ Hr q j Hf) as (k & Hk & _). rewrite Countersproof.tfind_leaf in Hk.
        discriminate.
      * destruct (IH1 _ Hl q j Hf) as (k & Hk & _). rewrite Countersproof.tfind_leaf in Hk.
        discriminate.
      * subst o1. discriminate.
    + destruct q as [q|q|]; simpl in Hf; simpl.
      * exact (IH2 _ Hr q j Hf).
      * exact (IH1 _ Hl q j Hf).
      * subst o1. destruct o2 as [k|]; [|discriminate]. apply N.leb_le in Ho.
        exists k. split; [reflexivity|exact Ho].
Qed.

Lemma get_meets : forall cm accs j,
  Counters.get (Counters.index_map (map (meet_clocks cm) accs)) None j =
  meet_clocks cm (nth (N.to_nat j) accs []).
Proof.
  intros cm accs j. rewrite Countersproof.get_index_map.
  change None with (meet_clocks cm []). apply map_nth.
Qed.

Section Sweep.
Variable p : cplan.
Variable order : list N.
Variable accs : list (list N).

Let pm := Counters.pos_map (Counters.cp_queues p).
Let cm := task_clocks (Counters.index_map (Counters.cp_waits p))
            (Counters.index_map (Counters.cp_signals p)) pm order
            Counters.Leaf Counters.Leaf Counters.Leaf.
Let am := Counters.index_map accs.
Let jm := Counters.index_map (map (fun us => join_pos pm us Counters.Leaf) accs).
Let mm := Counters.index_map (map (meet_clocks cm) accs).

Let acc (i : N) : list N := nth (N.to_nat i) accs [].

(** Every task of buffer [i] is, or happens before, every task of buffer [j]. *)
Definition reach (i j : N) : Prop :=
  forall u t, In u (acc i) -> In t (acc j) -> u = t \/ Dataflow.hb p u t.

Lemma reach_trans : forall i z j, reach i z -> reach z j -> acc z <> [] -> reach i j.
Proof.
  intros i z j H1 H2 Hz u t Hu Ht.
  destruct (acc z) as [|s rest] eqn:E; [now destruct Hz|].
  assert (Hs : In s (acc z)) by (rewrite E; left; reflexivity).
  destruct (H1 u s Hu Hs) as [->|Hus]; destruct (H2 s t Hs Ht) as [->|Hst]; auto.
  right. eapply t_trans; eauto.
Qed.

Lemma covered_reach : forall z j,
  covered (Counters.get jm None z) (Counters.get mm None j) = true -> reach z j.
Proof.
  intros z j Hc u t Hu Ht. unfold acc in Hu, Ht.
  assert (Hli : (N.to_nat z < length accs)%nat).
  { destruct (Nat.lt_ge_cases (N.to_nat z) (length accs)) as [Hl|Hl]; [exact Hl|].
    rewrite nth_overflow in Hu by exact Hl. destruct Hu. }
  unfold jm, mm in Hc.
  rewrite get_meets, (get_map_N _ _ [] None _ Hli) in Hc.
  destruct (meet_clocks cm (nth (N.to_nat j) accs [])) as [m|] eqn:Em.
  2: { destruct (nth (N.to_nat j) accs []); [destruct Ht|discriminate]. }
  destruct (join_pos pm (nth (N.to_nat z) accs []) Counters.Leaf) as [J|] eqn:EJ;
    [|discriminate].
  simpl in Hc.
  destruct (proj2 (join_pos_spec _ _ _ _ EJ) u Hu) as (w & iu & k & Hpu & Hk & Hle).
  destruct (tle_spec _ _ Hc _ _ Hk) as (k' & Hk' & Hle').
  assert (Hcov := meet_clocks_good p cm (clocks_good p order) _ _ Em).
  apply (Countersproof.pos_map_ok (Counters.cp_queues p)) in Hpu.
  exact (Hcov w k' iu u Hk' Hpu ltac:(lia) t Ht).
Qed.

Lemma fcheck_none : forall my lo hi fr, fcheck jm my lo hi fr = None ->
  forall z a b, In (z, a, b) fr -> meets lo hi a b = true ->
  covered (Counters.get jm None z) my = true.
Proof.
  induction fr as [|[[z0 a0] b0] fr IH]; intros H z a b Hin Hm; [destruct Hin|].
  simpl in H. destruct (meets lo hi a0 b0 && negb (covered (Counters.get jm None z0) my)) eqn:E;
    [discriminate|].
  destruct Hin as [Heq|Hin]; [|exact (IH H z a b Hin Hm)].
  injection Heq as <- <- <-. rewrite Hm in E. simpl in E.
  apply negb_false_iff in E. exact E.
Qed.

Lemma meets_spec : forall lo hi a b x, lo <= x < hi -> a <= x < b -> meets lo hi a b = true.
Proof.
  intros lo hi a b x H1 H2. unfold meets. apply andb_true_iff. split; apply N.ltb_lt; lia.
Qed.

Lemma ftrim_keeps : forall lo hi fr z a b x, In (z, a, b) fr -> a <= x < b -> ~ (lo <= x < hi) ->
  exists a' b', In (z, a', b') (ftrim lo hi fr) /\ a' <= x < b'.
Proof.
  intros lo hi fr z a b x Hin Hx Hn. unfold ftrim.
  assert (H : exists a' b', In (z, a', b') (outside lo hi (z, a, b)) /\ a' <= x < b').
  { unfold outside. destruct (meets lo hi a b) eqn:Hm.
    - destruct (N.lt_ge_cases x lo) as [Hl|Hl].
      + exists a, lo. split; [|lia]. apply in_or_app. left.
        destruct (N.ltb_spec a lo); [left; reflexivity|lia].
      + assert (hi <= x) by lia.
        exists hi, b. split; [|lia]. apply in_or_app. right.
        destruct (N.ltb_spec hi b); [left; reflexivity|lia].
    - exists a, b. split; [left; reflexivity|exact Hx]. }
  destruct H as (a' & b' & Hin' & Hx'). exists a', b'. split; [|exact Hx'].
  apply in_flat_map. exists (z, a, b). auto.
Qed.

Lemma ftrim_sub : forall lo hi fr z a' b', In (z, a', b') (ftrim lo hi fr) ->
  exists a b, In (z, a, b) fr.
Proof.
  intros lo hi fr z a' b' H. unfold ftrim in H. apply in_flat_map in H as ([[z0 a] b] & Hin & Ho).
  unfold outside in Ho. exists a, b.
  destruct (meets lo hi a b).
  - apply in_app_or in Ho.
    destruct Ho as [Ho|Ho]; [destruct (a <? lo)|destruct (hi <? b)]; simpl in Ho;
      try contradiction; destruct Ho as [Ho|[]]; injection Ho as -> _ _; exact Hin.
  - destruct Ho as [Ho|[]]. injection Ho as -> _ _. exact Hin.
Qed.

Definition shares (x y : buffer) : Prop := exists a, holds x a /\ holds y a.

(** The frontier covers every byte of every swept buffer by a piece of a
    buffer it reaches. *)
Definition finv (P : N * buffer -> Prop) (fr : list piece) : Prop :=
  (forall i x a, P (i, x) -> holds x a ->
     exists z lo hi, In (z, lo, hi) fr /\ lo <= a < hi /\ (z = i \/ reach i z)) /\
  (forall z lo hi, In (z, lo, hi) fr -> acc z <> []).

Inductive before {A : Type} : list A -> A -> A -> Prop :=
| before_here : forall a b l, In b l -> before (a :: l) a b
| before_there : forall a b c l, before l a b -> before (c :: l) a b.

Lemma fcheck_no_meet : forall jm' my lo hi fr,
  fr_meets lo hi fr = false -> fcheck jm' my lo hi fr = None.
Proof.
  intros jm' my lo hi fr. induction fr as [|[[z a] b] fr IH]; simpl; intros H; [reflexivity|].
  apply orb_false_iff in H as [H1 H2]. rewrite H1. simpl. apply IH. exact H2.
Qed.

Lemma lazy_fcheck : forall jm' my lo hi fr,
  (if fr_meets lo hi fr then fcheck jm' my lo hi fr else None) = fcheck jm' my lo hi fr.
Proof.
  intros jm' my lo hi fr. destruct (fr_meets lo hi fr) eqn:E; [reflexivity|].
  symmetry. apply fcheck_no_meet. exact E.
Qed.

Lemma get_mm_am : forall j, Counters.get mm None j = meet_clocks cm (Counters.get am [] j).
Proof.
  intros j. unfold mm, am. rewrite get_meets, Countersproof.get_index_map. reflexivity.
Qed.

Lemma fsweep_ok : forall l fr P,
  fsweep pm cm am jm l fr = None -> finv P fr ->
  (forall e, In e l -> acc (fst e) <> []) ->
  (forall e1 e2, P e1 -> In e2 l -> shares (snd e1) (snd e2) -> reach (fst e1) (fst e2)) /\
  (forall e1 e2, before l e1 e2 -> shares (snd e1) (snd e2) -> reach (fst e1) (fst e2)).
Proof.
  induction l as [|[j y] l IH]; intros fr P H [Hcov Hne] Hl.
  { split; [intros e1 e2 _ He2; destruct He2|intros e1 e2 Hb; inversion Hb]. }
  simpl in H. rewrite lazy_fcheck, <- get_mm_am in H.
  destruct (fcheck jm (Counters.get mm None j) (b_offset y) (b_end y) fr) eqn:Hc;
    [discriminate|].
  assert (Hj : acc j <> []) by exact (Hl (j, y) (or_introl eq_refl)).
  (* an old buffer under [y]'s bytes reaches [y] *)
  assert (Hold : forall i x a, P (i, x) -> holds x a -> holds y a -> reach i j).
  { intros i x a Hp Hx Hy.
    destruct (Hcov i x a Hp Hx) as (z & lo & hi & Hin & Ha & Hz).
    assert (Hzj : reach z j).
    { apply covered_reach. eapply fcheck_none; [exact Hc|exact Hin|].
      unfold holds in Hy. eapply meets_spec; [exact Hy|exact Ha]. }
    destruct Hz as [->|Hiz]; [exact Hzj|]. eapply reach_trans; eauto. }
  set (P' := fun e => P e \/ e = (j, y)).
  assert (Hinv : finv P' ((j, b_offset y, b_end y) :: ftrim (b_offset y) (b_end y) fr)).
  { split.
    - intros i x a [Hp|Heq] Hx.
      + destruct (N.le_gt_cases (b_offset y) a) as [H1|H1];
          [destruct (N.lt_ge_cases a (b_end y)) as [H2|H2]|].
        * exists j, (b_offset y), (b_end y). split; [left; reflexivity|]. split; [lia|].
          right. eapply Hold; [exact Hp|exact Hx|]. unfold holds. lia.
        * destruct (Hcov i x a Hp Hx) as (z & lo & hi & Hin & Ha & Hz).
          destruct (ftrim_keeps (b_offset y) (b_end y) fr z lo hi a Hin Ha ltac:(lia))
            as (a' & b' & Hin' & Ha').
          exists z, a', b'. split; [right; exact Hin'|]. auto.
        * destruct (Hcov i x a Hp Hx) as (z & lo & hi & Hin & Ha & Hz).
          destruct (ftrim_keeps (b_offset y) (b_end y) fr z lo hi a Hin Ha ltac:(lia))
            as (a' & b' & Hin' & Ha').
          exists z, a', b'. split; [right; exact Hin'|]. auto.
      + injection Heq as -> ->. exists j, (b_offset y), (b_end y).
        split; [left; reflexivity|]. unfold holds in Hx. split; [lia|left; reflexivity].
    - intros z lo hi [Heq|Hin].
      + injection Heq as -> _ _. exact Hj.
      + destruct (ftrim_sub _ _ _ _ _ _ Hin) as (a & b & Hin0). exact (Hne z a b Hin0). }
  destruct (IH _ P' H Hinv (fun e He => Hl e (or_intror He))) as [HA HB].
  split.
  - intros e1 e2 Hp [<-|He2] Hsh.
    + destruct e1 as [i x]. destruct Hsh as (a & Hx & Hy). exact (Hold i x a Hp Hx Hy).
    + apply HA; [left; exact Hp|exact He2|exact Hsh].
  - intros e1 e2 Hb Hsh. inversion Hb as [a b l0 Hin|a b c l0 Hb']; subst.
    + apply HA; [right; reflexivity|exact Hin|exact Hsh].
    + apply HB; [exact Hb'|exact Hsh].
Qed.

End Sweep.

Lemma sorted_before : forall {A} (R : A -> A -> Prop) l e1 e2,
  StronglySorted R l -> In e1 l -> In e2 l -> ~ R e2 e1 -> (forall e, R e e) ->
  before l e1 e2.
Proof.
  intros A R l. induction l as [|h l IH]; intros e1 e2 Hs H1 H2 Hn Hr; [destruct H1|].
  inversion Hs as [|? ? Hs' Hall]; subst.
  destruct H1 as [<-|H1], H2 as [<-|H2].
  - exfalso. apply Hn, Hr.
  - apply before_here. exact H2.
  - exfalso. apply Hn. eapply Forall_forall in Hall; [exact Hall|exact H1].
  - apply before_there. apply IH; auto.
Qed.

Lemma first_leb_trans : Transitive (fun x y => is_true (FirstOrder.leb x y)).
Proof.
  intros x y z. unfold is_true, FirstOrder.leb. rewrite !N.leb_le. lia.
Qed.

(** F3: an accepted sharing check orders every two byte-sharing buffers. *)
Theorem check_shared_sound : forall bufs p order accs,
  check_shared bufs p order accs = None -> shared_ordered p bufs accs.
Proof.
  intros bufs p order accs H i j bi bj Hij Hi Hj Hlive Hbyte u t Hu Ht.
  unfold check_shared in H.
  set (am := Counters.index_map accs) in H.
  set (es := sharing_entries am bufs) in H.
  assert (Hes : forall k b, nth_error bufs k = Some b -> nth k accs [] <> [] -> 0 < b_size b ->
            In (N.of_nat k, b) es).
  { intros k b Hk Hn Hsz. unfold es, sharing_entries. apply filter_In. split.
    - apply (index_from_nth bufs 0 k b Hk).
    - simpl. unfold am. rewrite Countersproof.get_index_map, Nat2N.id.
      destruct (nth k accs []); [now destruct Hn|]. simpl. apply N.ltb_lt. exact Hsz. }
  assert (Hsz : forall b, (exists a, holds b a) -> 0 < b_size b).
  { intros b (a & Ha). unfold holds, b_end in Ha. lia. }
  destruct Hbyte as (a & Ha & Hb).
  assert (Hei : In (N.of_nat i, bi) es).
  { apply Hes; [exact Hi| |apply Hsz; exists a; exact Ha]. destruct (nth i accs []); [destruct Hu|discriminate]. }
  assert (Hej : In (N.of_nat j, bj) es).
  { apply Hes; [exact Hj| |apply Hsz; exists a; exact Hb]. destruct (nth j accs []); [destruct Ht|discriminate]. }
  destruct (find (fun e => b_last (snd e) <=? b_first (snd e)) es) as [[k e]|] eqn:Hf;
    [discriminate|].
  pose proof (find_none _ _ Hf _ Hei) as Hlv. simpl in Hlv. apply N.leb_gt in Hlv.
  pose proof (FirstSort.Permuted_sort es) as Hperm.
  assert (Hbef : before (FirstSort.sort es) (N.of_nat i, bi) (N.of_nat j, bj)).
  { apply (sorted_before (fun x y => is_true (FirstOrder.leb x y))).
    - apply FirstSort.StronglySorted_sort. exact first_leb_trans.
    - eapply Permutation_in; [exact Hperm|exact Hei].
    - eapply Permutation_in; [exact Hperm|exact Hej].
    - unfold is_true, FirstOrder.leb. simpl. rewrite N.leb_le. lia.
    - intros x. unfold is_true, FirstOrder.leb. apply N.leb_le. lia. }
  assert (Hne : forall e, In e (FirstSort.sort es) -> nth (N.to_nat (fst e)) accs [] <> []).
  { intros [k' b'] He. simpl fst. apply (Permutation_in _ (Permutation_sym Hperm)) in He.
    unfold es, sharing_entries in He. apply filter_In in He as [_ Hk].
    simpl in Hk. unfold am in Hk. rewrite Countersproof.get_index_map in Hk.
    destruct (nth (N.to_nat k') accs []); [simpl in Hk; discriminate Hk|intros Habs; discriminate Habs]. }
  edestruct fsweep_ok with (P := fun _ : N * buffer => False) as [_ HB];
    [exact H|split; [intros ? ? ? []|intros ? ? ? []]|exact Hne|].
  assert (Hr := HB _ _ Hbef (ex_intro _ a (conj Ha Hb))).
  unfold reach in Hr. simpl in Hr. rewrite !Nat2N.id in Hr. exact (Hr u t Hu Ht).
Qed.

(** Checkpoint F with the sharing rule: the allocation is safe (F1, F2) and
    every two byte-sharing buffers are ordered by happens-before (F3). *)
Theorem checkpoint_f_sound : forall arena bufs p order accs,
  check_alloc_ordered arena bufs p order accs = Accept ->
  alloc_safe arena bufs /\ shared_ordered p bufs accs.
Proof.
  intros arena bufs p order accs H. unfold check_alloc_ordered in H.
  destruct (check_alloc arena bufs) eqn:Ha; [|discriminate].
  destruct (check_shared bufs p order accs) eqn:Hs; [discriminate|].
  split; [apply check_alloc_sound; exact Ha|apply (check_shared_sound _ _ _ _ Hs)].
Qed.

(** What F3 gives with checkpoint D's hypotheses on the same counter plan (the
    queues partition the tasks, thresholds are exact): in every execution, a
    task touching the later of two byte-sharing buffers runs only after every
    task touching the earlier one has run. *)
Theorem shared_ordered_safety : forall p bufs accs,
  shared_ordered p bufs accs ->
  Counters.queues_partition p -> Counters.thresholds_exact p ->
  forall i j bi bj, i <> j ->
  nth_error bufs i = Some bi -> nth_error bufs j = Some bj ->
  b_last bi <= b_first bj -> (exists a, holds bi a /\ holds bj a) ->
  forall u t, In u (nth i accs []) -> In t (nth j accs []) -> u <> t ->
  forall tr s s', Counters.exec p Counters.init tr s -> Counters.step p s t s' -> In u tr.
Proof.
  intros p bufs accs Hso Hpart Hthr i j bi bj Hij Hi Hj Hl Hb u t Hu Ht Hne tr s s' Hex Hst.
  destruct (Hso i j bi bj Hij Hi Hj Hl Hb u t Hu Ht) as [->|Hhb]; [now destruct Hne|].
  eapply Dataflowproof.hb_safety; eauto.
Qed.
