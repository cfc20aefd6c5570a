(** * Dependencies from data flow by a sweep: soundness.

    [check_sweep_sound]: an accepted payload satisfies
    [Dataflow.dataflow_hypotheses] (no two conflicting tasks of one key; every
    conflicting pair ordered by happens-before, earlier key first), the
    property that [Dataflowproof.check_dataflow_sound] gives for the pairwise
    checker; [checkpoint_d_sweep_sound] then reuses [Dataflowproof.dataflow_safety].

    The argument: a vector clock only names tasks that happen before its
    owner ([clock_good]); and after every swept access, each byte of every
    access swept so far is covered by a frontier entry of its block whose
    task the access's task reaches ([reach]: equal, or happens before with a
    smaller key), a write's by a write entry ([finv]).  A new access that
    conflicts with an old one is compared with that entry. *)
From Coq Require Import List Arith NArith Bool Lia Relations.
From Plow Require Import Loc Counters Countersproof Dataflow Dataflowproof Flowsweep.
Import ListNotations.

Local Open Scope N_scope.

Section Sweep.
Variable p : cplan.
Variable d : dflow.

Let qs := cp_queues p.
Let pm := pos_map qs.
Let km := index_map (df_keys d).
Let wtm := index_map (cp_waits p).
Let sgm := index_map (cp_signals p).
Let accm := index_map (df_acc d).

(** ** Clocks *)

Definition covers (v : vclock) (P : N -> Prop) : Prop :=
  forall w j i x, tfind (nkey w) v = Some j ->
  nth_error (nth (N.to_nat w) qs []) (N.to_nat i) = Some x -> i <= j -> P x.

Lemma covers_leaf P : covers Leaf P.
Proof. intros w j i x H. rewrite tfind_leaf in H. discriminate. Qed.

Lemma covers_mono (P Q : N -> Prop) v : (forall x, P x -> Q x) -> covers v P -> covers v Q.
Proof. intros H Hv w j i x Hw Hx Hi. apply H. eapply Hv; eauto. Qed.

Lemma tfind_tjoin (a b : vclock) : forall i, tfind i (tjoin a b) = omax (tfind i a) (tfind i b).
Proof.
  revert b. induction a as [|l1 IH1 o1 r1 IH2]; intros b i.
  - simpl. rewrite tfind_leaf. destruct (tfind i b); reflexivity.
  - destruct b as [|l2 o2 r2].
    + simpl. rewrite tfind_leaf. destruct (tfind i (Node l1 o1 r1)); reflexivity.
    + destruct i; simpl; auto.
Qed.

Lemma covers_join a b P : covers a P -> covers b P -> covers (tjoin a b) P.
Proof.
  intros Ha Hb w j i x Hw Hx Hi. rewrite tfind_tjoin in Hw.
  destruct (tfind (nkey w) a) as [ja|] eqn:Ea; destruct (tfind (nkey w) b) as [jb|] eqn:Eb;
    simpl in Hw; inversion Hw; subst.
  - destruct (N.max_spec ja jb) as [[_ E]|[_ E]]; rewrite E in Hi.
    + eapply Hb; eauto.
    + eapply Ha; eauto.
  - eapply Ha; eauto.
  - eapply Hb; eauto.
Qed.

Lemma covers_bump v w i P : covers v P ->
  (forall i' x, nth_error (nth (N.to_nat w) qs []) (N.to_nat i') = Some x -> i' <= i -> P x) ->
  covers (bump v w i) P.
Proof.
  intros Hv Hw w' j i' x Hf Hx Hi. unfold bump in Hf.
  destruct (N.eq_dec w' w) as [->|Hne].
  - rewrite find_add_eq in Hf. inversion Hf; subst j.
    destruct (tfind (nkey w) v) as [j0|] eqn:E.
    + destruct (N.max_spec i j0) as [[_ M]|[_ M]]; rewrite M in Hi.
      * eapply Hv; eauto.
      * eapply Hw; eauto.
    + eapply Hw; eauto.
  - rewrite find_add_neq in Hf by exact Hne. eapply Hv; eauto.
Qed.

(** Clock [v] of task [t]: every task it covers is [t] or happens before it. *)
Definition tgood (t : N) (v : vclock) : Prop := covers v (fun x => x = t \/ hb p x t).

(** Clock [v] of counter [c]: every task it covers happens before [c]'s waiters. *)
Definition cgood (c : N) (v : vclock) : Prop :=
  covers v (fun x => forall t', In c (waits_of p t') -> hb p x t').

Definition state_good (s : sstate) : Prop :=
  (forall c v, tfind (nkey c) (ss_cv s) = Some v -> cgood c v) /\
  (forall w a v, tfind (nkey w) (ss_wv s) = Some (a, v) -> tgood a v).

Lemma get_cgood' cv c : (forall c v, tfind (nkey c) cv = Some v -> cgood c v) ->
  cgood c (get cv Leaf c).
Proof.
  intros Hc. unfold get. destruct (tfind (nkey c) cv) as [v|] eqn:E.
  - exact (Hc c v E).
  - apply covers_leaf.
Qed.

Lemma get_cgood s c : state_good s -> cgood c (get (ss_cv s) Leaf c).
Proof. intros [Hc _]. apply get_cgood', Hc. Qed.

Lemma hbq_sound t v u : tgood t v -> hbq pm v u = true -> u = t \/ hb p u t.
Proof.
  unfold hbq, hbq_at. intros Hv H.
  destruct (tfind (nkey u) pm) as [[w i]|] eqn:Ep; [|discriminate].
  destruct (tfind (nkey w) v) as [j|] eqn:Ej; [|discriminate].
  apply N.leb_le in H. apply (pos_map_ok qs) in Ep.
  eapply Hv; eauto.
Qed.

Lemma queue_hb u t w iu it :
  nth_error (nth (N.to_nat w) qs []) (N.to_nat iu) = Some u ->
  nth_error (nth (N.to_nat w) qs []) (N.to_nat it) = Some t -> iu < it -> hb p u t.
Proof.
  intros Hu Ht Hi. apply t_step. right.
  exists (N.to_nat w), (N.to_nat iu), (N.to_nat it). unfold queue. repeat split; auto. lia.
Qed.

Lemma fold_join_covers cv P (l : list N) : forall v,
  covers v P -> (forall c, In c l -> covers (get cv Leaf c) P) ->
  covers (fold_left (fun v c => tjoin v (get cv Leaf c)) l v) P.
Proof.
  induction l as [|c l IH]; intros v Hv Hl; simpl; auto.
  apply IH; [apply covers_join; [exact Hv | apply Hl; left; reflexivity]|].
  intros c' Hc'. apply Hl. right. exact Hc'.
Qed.

Lemma clock_good s t : state_good s -> tgood t (clock_of wtm pm (ss_cv s) (ss_wv s) t).
Proof.
  intros Hs. unfold clock_of.
  assert (H0 : covers (fold_left (fun v c => tjoin v (get (ss_cv s) Leaf c)) (get wtm [] t) Leaf)
                 (fun x => hb p x t)).
  { apply fold_join_covers; [apply covers_leaf|]. intros c Hc.
    unfold wtm in Hc. rewrite get_index_map in Hc. fold (waits_of p t) in Hc.
    eapply covers_mono; [|apply (get_cgood s c Hs)]. intros x Hx. apply Hx, Hc. }
  destruct (tfind (nkey t) pm) as [[w i]|] eqn:Ep.
  - apply covers_bump.
    + destruct (tfind (nkey w) (ss_wv s)) as [[a va]|] eqn:Ew.
      * destruct (qbefore pm a t) eqn:Eq.
        -- apply covers_join.
           ++ eapply covers_mono; [|exact H0]. intros x Hx. right. exact Hx.
           ++ destruct Hs as [_ Hw]. pose proof (Hw w a va Ew) as Ha.
              assert (Hat : hb p a t) by (apply t_step; right; apply qbefore_spec, Eq).
              eapply covers_mono; [|exact Ha]. intros x [->|Hx]; right; auto.
              eapply t_trans; eauto.
        -- eapply covers_mono; [|exact H0]. intros x Hx. right. exact Hx.
      * eapply covers_mono; [|exact H0]. intros x Hx. right. exact Hx.
    + intros i' x Hx Hi. apply (pos_map_ok qs) in Ep.
      destruct (N.eq_dec i' i) as [->|Hne].
      * left. rewrite Hx in Ep. inversion Ep. reflexivity.
      * right. eapply queue_hb; [exact Hx | exact Ep | lia].
  - eapply covers_mono; [|exact H0]. intros x Hx. right. exact Hx.
Qed.

Lemma sig_clocks_good vt t : tgood t vt -> forall cs cv,
  (forall c v, tfind (nkey c) cv = Some v -> cgood c v) ->
  (forall c, In c cs -> In c (signals_of p t)) ->
  forall c v, tfind (nkey c) (sig_clocks vt cv cs) = Some v -> cgood c v.
Proof.
  intros Ht cs. induction cs as [|c0 cs IH]; intros cv Hcv Hcs; simpl; auto.
  apply IH; [|intros c Hc; apply Hcs; right; exact Hc].
  intros c v Hf. destruct (N.eq_dec c c0) as [->|Hne].
  - rewrite find_add_eq in Hf. inversion Hf; subst v. apply covers_join.
    + apply get_cgood', Hcv.
    + eapply covers_mono; [|exact Ht]. intros x Hx t' Hw.
      assert (Hg : hb p t t') by (apply t_step; left; exists c0; split; auto; apply Hcs; left; auto).
      destruct Hx as [->|Hx]; auto. eapply t_trans; eauto.
  - rewrite find_add_neq in Hf by exact Hne. apply Hcv, Hf.
Qed.

(** ** Frontier *)

Let key := key_of d.

(** What a frontier entry caches about its task: the lookups [check_entry] would make. *)
Let info (u : N) : tinfo := (u, get km 0 u, tfind (nkey u) pm).

Lemma srange_blk a x : srange_ok a = true -> acc_lo a <= x < acc_hi a -> blk x = blk (acc_lo a).
Proof.
  unfold srange_ok, blk. rewrite !N.shiftr_div_pow2. intros H Hx.
  apply andb_prop in H as [_ H]. apply N.eqb_eq in H.
  assert (Hb : 2 ^ 12 <> 0) by (cbv; discriminate).
  apply N.le_antisymm.
  - rewrite H. apply N.div_le_mono; [exact Hb | lia].
  - apply N.div_le_mono; [exact Hb | lia].
Qed.

Definition inr_ (x : N) (a : access) : Prop := acc_lo a <= x < acc_hi a.

Definition reach (u v : N) : Prop := u = v \/ (hb p u v /\ key u < key v).

Lemma reach_trans u v w : reach u v -> reach v w -> reach u w.
Proof.
  unfold reach. intros [->|[H1 K1]] [->|[H2 K2]]; auto.
  - right. split; [eapply t_trans; eauto | lia].
Qed.

Definition witness (fm : trie frontier) (x u : N) (ea : access) : Prop :=
  exists v fa, inr_ x fa /\ reach u v /\
    ((acc_write fa = true /\ In (info v, fa) (fst (get fm ([], []) (blk x)))) \/
     (acc_write ea = false /\ In (info v, fa) (snd (get fm ([], []) (blk x))))).

Definition finv (E : list (N * access)) (fm : trie frontier) : Prop :=
  forall u ea x, In (u, ea) E -> inr_ x ea -> witness fm x u ea.

Lemma check_entry_ok vt t a L : tgood t vt ->
  (forall f, In f L -> check_entry vt t (get km 0 t) a f = None) ->
  forall v fa x, In (info v, fa) L -> v <> t -> inr_ x a -> inr_ x fa ->
  (acc_write a = true \/ acc_write fa = true) -> reach v t.
Proof.
  intros Hvt H v fa x Hin Hne Ha Hf Hw.
  pose proof (H _ Hin) as Hc. unfold check_entry, info in Hc.
  destruct (N.eqb_spec v t) as [|_]; [contradiction|].
  assert (Ho : (overlaps a fa && (acc_write a || acc_write fa))%bool = true).
  { unfold overlaps, inr_ in *. apply andb_true_intro. split.
    - apply andb_true_intro. split; apply N.ltb_lt; lia.
    - apply orb_true_iff. exact Hw. }
  rewrite Ho in Hc. unfold km in Hc. rewrite !get_index_map in Hc. fold (key_of d v) (key_of d t) in Hc.
  cbv zeta in Hc.
  destruct (N.ltb_spec (key_of d v) (key_of d t)) as [Hlt|_].
  - destruct (hbq_at (tfind (nkey v) pm) vt) eqn:Eh; [|discriminate].
    destruct (hbq_sound t vt v Hvt Eh) as [->|Hh]; [contradiction|]. right. split; auto.
  - destruct (_ <? _); discriminate.
Qed.

Lemma trim_keeps a L v fa x : In (v, fa) L -> inr_ x fa -> ~ inr_ x a ->
  exists fa', In (v, fa') (trim a L) /\ inr_ x fa' /\ acc_write fa' = acc_write fa.
Proof.
  intros Hin Hx Hn. unfold trim. unfold inr_ in *.
  destruct (overlaps a fa) eqn:Eo.
  2: { exists fa. split; [|split; [exact Hx | reflexivity]].
       apply in_flat_map. exists (v, fa). split; auto. unfold pieces. rewrite Eo. left. reflexivity. }
  assert (Hc : x < acc_lo a \/ acc_hi a <= x) by lia.
  destruct Hc as [Hc|Hc].
  - exists (acc_lo fa, acc_lo a, acc_write fa).
    split; [|split; [unfold acc_lo, acc_hi, acc_write in *; simpl; lia | reflexivity]].
    apply in_flat_map. exists (v, fa). split; auto. unfold pieces. rewrite Eo.
    destruct (N.ltb_spec (acc_lo fa) (acc_lo a)) as [_|]; [|lia].
    apply in_or_app. left. left. reflexivity.
  - exists (acc_hi a, acc_hi fa, acc_write fa).
    split; [|split; [unfold acc_lo, acc_hi, acc_write in *; simpl; lia | reflexivity]].
    apply in_flat_map. exists (v, fa). split; auto. unfold pieces. rewrite Eo.
    destruct (N.ltb_spec (acc_hi a) (acc_hi fa)) as [_|]; [|lia].
    apply in_or_app. right. left. reflexivity.
Qed.

Lemma classic_inr x a : inr_ x a \/ ~ inr_ x a.
Proof.
  unfold inr_. destruct (N.le_gt_cases (acc_lo a) x); destruct (N.lt_ge_cases x (acc_hi a));
    [left; lia | right; lia | right; lia | right; lia].
Qed.

(** One access [a] of task [t]. *)
Lemma sweep_one vt t a E fm :
  srange_ok a = true -> tgood t vt -> finv E fm ->
  let k := blk (acc_lo a) in
  let fr := get fm ([], []) k in
  (forall f, In f (fst fr) -> check_entry vt t (get km 0 t) a f = None) ->
  (if acc_write a then (forall f, In f (snd fr) -> check_entry vt t (get km 0 t) a f = None)
   else True) ->
  (forall u ea x, In (u, ea) E -> u <> t -> inr_ x ea -> inr_ x a ->
     (acc_write ea = true \/ acc_write a = true) -> reach u t) /\
  finv (E ++ [(t, a)])
    (tadd (nkey k) (if acc_write a then ((info t, a) :: trim a (fst fr), trim a (snd fr))
                    else (fst fr, (info t, a) :: snd fr)) fm).
Proof.
  intros Hr Hvt Hinv k fr Hw Hrd.
  assert (Hblk : forall x, inr_ x a -> blk x = k).
  { intros x Hx. unfold k. eapply srange_blk; eauto. }
  split.
  - intros u ea x Hin Hne Hea Ha Hc.
    destruct (Hinv u ea x Hin Hea) as [v [fa [Hfa [Huv Hcase]]]].
    rewrite (Hblk x Ha) in Hcase. fold fr in Hcase.
    destruct (N.eq_dec v t) as [->|Hvt'].
    + exact Huv.
    + eapply reach_trans; [exact Huv|]. destruct Hcase as [[Hfw Hi]|[Hre Hi]].
      * eapply check_entry_ok; eauto.
      * destruct Hc as [Hc|Hc]; [congruence|]. rewrite Hc in Hrd.
        exact (check_entry_ok vt t a _ Hvt Hrd v fa x Hi Hvt' Ha Hfa (or_introl Hc)).
  - intros u ea x Hin Hea. apply in_app_or in Hin.
    destruct (N.eq_dec (blk x) k) as [Ek|Nk].
    + unfold witness. rewrite Ek, get_tadd_eq.
      destruct Hin as [Hin|[He|[]]].
      * destruct (Hinv u ea x Hin Hea) as [v [fa [Hfa [Huv Hcase]]]].
        rewrite Ek in Hcase. fold fr in Hcase.
        destruct (acc_write a) eqn:Ewa.
        -- destruct (classic_inr x a) as [Hxa|Hxa].
           ++ exists t, a. split; [exact Hxa|]. split.
              ** eapply reach_trans; [exact Huv|].
                 destruct (N.eq_dec v t) as [->|Hne]; [left; reflexivity|].
                 destruct Hcase as [[Hfw Hi]|[Hre Hi]].
                 --- exact (check_entry_ok vt t a _ Hvt Hw v fa x Hi Hne Hxa Hfa (or_introl Ewa)).
                 --- exact (check_entry_ok vt t a _ Hvt Hrd v fa x Hi Hne Hxa Hfa (or_introl Ewa)).
              ** left. simpl. split; auto.
           ++ destruct Hcase as [[Hfw Hi]|[Hre Hi]].
              ** destruct (trim_keeps a _ (info v) fa x Hi Hfa Hxa) as [fa' [Hi' [Hx' Hw']]].
                 exists v, fa'. split; [exact Hx'|]. split; [exact Huv|].
                 left. split; [congruence|]. simpl. right. exact Hi'.
              ** destruct (trim_keeps a _ (info v) fa x Hi Hfa Hxa) as [fa' [Hi' [Hx' Hw']]].
                 exists v, fa'. split; [exact Hx'|]. split; [exact Huv|].
                 right. split; [exact Hre|]. simpl. exact Hi'.
        -- exists v, fa. split; [exact Hfa|]. split; [exact Huv|].
           destruct Hcase as [[H1 H2]|[H1 H2]].
           ++ left. split; [exact H1|]. exact H2.
           ++ right. split; [exact H1|]. simpl. right. exact H2.
      * inversion He; subst u ea. exists t, a. split; [exact Hea|]. split; [left; reflexivity|].
        destruct (acc_write a) eqn:Ewa; [left | right]; simpl; split; auto.
    + unfold witness. rewrite get_tadd_neq by exact Nk.
      destruct Hin as [Hin|[He|[]]].
      * apply Hinv; auto.
      * inversion He; subst u ea. exfalso. apply Nk, Hblk, Hea.
Qed.

Lemma scan_ok {A E} (f : A -> option E) l : forall n m, scan f l n = inr m ->
  forall x, In x l -> f x = None.
Proof.
  induction l as [|y l IH]; intros n m H x Hx; [destruct Hx|]. simpl in H.
  destruct (f y) eqn:Ef; [discriminate|]. destruct Hx as [<-|Hx]; [exact Ef|]. eapply IH; eauto.
Qed.

(** All accesses of task [t]. *)
Lemma sweep_accs_ok vt t : tgood t vt -> forall l E fm fm' n n',
  (forall a, In a l -> srange_ok a = true) -> finv E fm ->
  sweep_accs vt t (get km 0 t) (tfind (nkey t) pm) l fm n = inr (fm', n') ->
  finv (E ++ map (pair t) l) fm' /\
  (forall a, In a l -> forall u ea x, In (u, ea) E -> u <> t -> inr_ x ea -> inr_ x a ->
     (acc_write ea = true \/ acc_write a = true) -> reach u t).
Proof.
  intros Hvt l. induction l as [|a l IH]; intros E fm fm' n n' Hr Hinv H; simpl in H.
  - inversion H; subst. rewrite app_nil_r. split; [exact Hinv | intros a []].
  - destruct (scan (check_entry vt t (get km 0 t) a) (fst (get fm ([], []) (blk (acc_lo a)))) n)
      as [e|n1] eqn:E1; [discriminate|].
    destruct (if acc_write a then
                scan (check_entry vt t (get km 0 t) a) (snd (get fm ([], []) (blk (acc_lo a)))) n1
              else inr n1) as [e|n2] eqn:E2; [discriminate|].
    assert (Hrd : if acc_write a then
                    (forall f, In f (snd (get fm ([], []) (blk (acc_lo a)))) ->
                       check_entry vt t (get km 0 t) a f = None)
                  else True).
    { revert E2. destruct (acc_write a); intros E2; [eapply scan_ok; exact E2 | exact I]. }
    destruct (sweep_one vt t a E fm (Hr a (or_introl eq_refl)) Hvt Hinv (scan_ok _ _ _ _ E1) Hrd)
      as [G1 I1].
    destruct (IH (E ++ [(t, a)]) _ fm' _ _ (fun a' Ha' => Hr a' (or_intror Ha')) I1 H) as [I2 G2].
    split.
    + rewrite <- app_assoc in I2. exact I2.
    + intros a' [<-|Ha'] u ea x Hin; [apply G1; exact Hin|].
      apply G2; [exact Ha'|]. apply in_or_app. left. exact Hin.
Qed.

Definition events (ts : list N) : list (N * access) := flat_map (fun u => map (pair u) (acc_of d u)) ts.

Definition ord (ts : list N) : Prop :=
  forall u t, In u ts -> In t ts -> conflict d u t ->
  (hb p u t /\ key u < key t) \/ (hb p t u /\ key t < key u).

Lemma conflict_sym u t : conflict d u t -> conflict d t u.
Proof.
  intros [Hne [a [b [Ha [Hb [Hw Ho]]]]]]. split; [auto|].
  exists b, a. split; [exact Hb|]. split; [exact Ha|]. split; [tauto|]. apply overlap_sym, Ho.
Qed.

Lemma sweep_tasks_ok : (forall t a, In a (acc_of d t) -> srange_ok a = true) ->
  forall order done s n m, state_good s -> finv (events done) (ss_front s) -> ord done ->
  sweep_tasks km pm wtm sgm accm order s n = inr m -> ord (done ++ order).
Proof.
  intros Hr order. induction order as [|t order IH]; intros done s n m Hs Hinv Hord H; simpl in H.
  - rewrite app_nil_r. exact Hord.
  - destruct (sweep_accs (clock_of wtm pm (ss_cv s) (ss_wv s) t) t (get km 0 t)
                (tfind (nkey t) pm) (get accm [] t) (ss_front s) n) as [e|[fm n']] eqn:Es; [discriminate|].
    pose proof (clock_good s t Hs) as Hvt.
    unfold accm in Es. rewrite get_index_map in Es. fold (acc_of d t) in Es.
    destruct (sweep_accs_ok _ t Hvt (acc_of d t) (events done) (ss_front s) fm n n' (Hr t) Hinv Es)
      as [Hinv' Hg].
    assert (Hnew : forall u, In u done -> conflict d u t -> hb p u t /\ key u < key t).
    { intros u Hu [Hne [a [b [Ha [Hb' [Hw [x [Hxa Hxb]]]]]]]].
      assert (Hin : In (u, a) (events done)).
      { unfold events. apply in_flat_map. exists u. split; [exact Hu|]. apply in_map, Ha. }
      destruct (Hg b Hb' u a x Hin Hne Hxa Hxb Hw) as [->|Hk]; [contradiction | exact Hk]. }
    replace (done ++ t :: order) with ((done ++ [t]) ++ order) by (rewrite <- app_assoc; reflexivity).
    eapply IH; [| | | exact H].
    + split.
      * simpl. apply (sig_clocks_good _ t Hvt); [apply Hs|].
        intros c Hc. unfold sgm in Hc. rewrite get_index_map in Hc. exact Hc.
      * simpl. intros w a v Hf. destruct (tfind (nkey t) pm) as [[w0 i0]|] eqn:Ep.
        -- destruct (N.eq_dec w w0) as [->|Hne].
           ++ rewrite find_add_eq in Hf. inversion Hf; subst. exact Hvt.
           ++ rewrite find_add_neq in Hf by exact Hne. destruct Hs as [_ Hw]. eapply Hw; eauto.
        -- destruct Hs as [_ Hw]. eapply Hw; eauto.
    + simpl. unfold events. rewrite flat_map_app. simpl. rewrite app_nil_r. exact Hinv'.
    + intros u t' Hu Ht' Hc. apply in_app_or in Hu. apply in_app_or in Ht'.
      destruct Hu as [Hu|[<-|[]]]; destruct Ht' as [Ht'|[<-|[]]].
      * apply Hord; auto.
      * left. apply Hnew; auto.
      * right. apply Hnew; [exact Ht' | apply conflict_sym, Hc].
      * destruct Hc as [Hne _]. contradiction.
Qed.

End Sweep.

Lemma order_set_in order : forall m t,
  tfind (nkey t) (fold_left (fun m t => tadd (nkey t) tt m) order m) <> None ->
  In t order \/ tfind (nkey t) m <> None.
Proof.
  induction order as [|t0 order IH]; intros m t H; simpl in H; [right; exact H|].
  destruct (IH _ _ H) as [Hi|Hf]; [left; right; exact Hi|].
  destruct (N.eq_dec t t0) as [->|Hne]; [left; left; reflexivity|].
  right. rewrite find_add_neq in Hf by exact Hne. exact Hf.
Qed.

Lemma check_sranges_ok d t a : check_sranges d = None -> In a (acc_of d t) -> srange_ok a = true.
Proof.
  intros H Ha. apply acc_of_nth in Ha as [l [Hl Ha]].
  pose proof (find_errN_none _ _ 0 H _ _ Hl) as H1. simpl in H1.
  apply In_nth_error in Ha as [k Hk].
  pose proof (find_errN_none _ _ 0 H1 _ _ Hk) as H2. simpl in H2.
  destruct (srange_ok _); [reflexivity | discriminate].
Qed.

Lemma check_missing_ok d order t a :
  check_missing d order = None -> In a (acc_of d t) -> In t order.
Proof.
  intros H Ha. apply acc_of_nth in Ha as [l [Hl _]].
  pose proof (find_errN_none _ _ 0 H _ _ Hl) as H1. simpl in H1. rewrite N2Nat.id in H1.
  destruct (tfind (nkey t) (order_set order)) eqn:E; [|discriminate].
  destruct (order_set_in order Leaf t) as [Hi|Hf]; [unfold order_set in E; congruence | exact Hi |].
  rewrite tfind_leaf in Hf. contradiction.
Qed.

(** The sweep decides what [check_dataflow_sound] gives for the pairwise checker. *)
Theorem check_sweep_sound p d order :
  check_sweep p d order = None -> dataflow_hypotheses p d.
Proof.
  unfold check_sweep. destruct (sweep_count p d order) as [e|m] eqn:H; [discriminate|]. intros _.
  unfold sweep_count in H.
  destruct (negb _) eqn:E1; [discriminate|].
  destruct (check_sranges d) eqn:Hr; [discriminate|].
  destruct (check_missing d order) eqn:Hm; [discriminate|].
  pose proof (sweep_tasks_ok p d (fun t a Ha => check_sranges_ok d t a Hr Ha) order []
    (mk_sstate Leaf Leaf Leaf) 0 m) as S.
  assert (Ho : ord p d order).
  { apply S; [| | | exact H].
    - split; simpl; intros; rewrite tfind_leaf in *; discriminate.
    - intros u ea x [].
    - intros u t []. }
  assert (Hc : forall u t, conflict d u t ->
    (hb p u t /\ key_of d u < key_of d t) \/ (hb p t u /\ key_of d t < key_of d u)).
  { intros u t Hut. pose proof Hut as [_ [a [b [Ha [Hb' _]]]]].
    apply Ho; [eapply check_missing_ok; eauto | eapply check_missing_ok; eauto | exact Hut]. }
  split.
  - intros u t Hut. destruct (Hc u t Hut) as [[_ K]|[_ K]]; lia.
  - intros u t Hut Hk. destruct (Hc u t Hut) as [[Hh _]|[_ K]]; [exact Hh | lia].
Qed.

(** Checkpoint D by the sweep: the conclusions of [checkpoint_d_flow_sound]. *)
Theorem checkpoint_d_sweep_sound p sc wpg d order :
  check_checkpoint_d_sweep p sc wpg d order = Accept ->
  d_protocol_sound p sc wpg /\ counter_hypotheses p /\ scopes_legal p sc wpg /\
  dataflow_hypotheses p d /\ dataflow_respected p d.
Proof.
  unfold check_checkpoint_d_sweep. intros H.
  destruct (check_checkpoint_d p sc wpg) eqn:E; [|discriminate].
  destruct (check_sweep p d order) eqn:Ef; [discriminate|].
  destruct (checkpoint_d_sound p sc wpg E) as [[Hh _] Hs].
  pose proof (check_sweep_sound p d order Ef) as Hd.
  unfold d_protocol_sound.
  split; [exact E|]. split; [exact Hh|]. split; [exact Hs|]. split; [exact Hd|].
  apply dataflow_safety; auto.
Qed.

(** The function the oracle runs gives [check_checkpoint_d_sweep]'s verdict. *)
Theorem checkpoint_d_sweep_counted_verdict p sc wpg d order :
  fst (check_checkpoint_d_sweep_counted p sc wpg d order) = check_checkpoint_d_sweep p sc wpg d order.
Proof.
  unfold check_checkpoint_d_sweep_counted, check_checkpoint_d_sweep, check_sweep.
  destruct (check_checkpoint_d p sc wpg); [|reflexivity].
  destruct (sweep_count p d order); reflexivity.
Qed.
