(** * Proofs for [Plow.Gated]: fine gates never open the two-stage barrier
    later than coarse ones, and exactly as early when [latest_gated] holds. *)
From Coq Require Import List Arith Bool Lia.
Import ListNotations.
From Plow Require Import Collapse Gated.

Lemma maxl_map_le {A} (g : A -> nat) (l : list A) b :
  (forall x, In x l -> g x <= b) -> maxl (map g l) <= b.
Proof.
  intros H. apply maxl_le. intros y Hy. apply in_map_iff in Hy as [x [<- Hx]]. auto.
Qed.

(** Fine gates never open the barrier later than coarse gates. *)
Theorem fine_barrier_le_coarse f c P :
  gates_in_range f c P -> fine_barrier f c P <= coarse_barrier f c.
Proof.
  intros [_ Hr]. unfold fine_barrier, coarse_barrier.
  apply maxl_map_le. intros [cj pj] Hin. simpl.
  pose proof (in_combine_l _ _ _ _ Hin) as Hc.
  pose proof (in_combine_r _ _ _ _ Hin) as Hp.
  assert (maxl (map (fun k => nth k f 0) pj) <= maxl f).
  { apply maxl_map_le. intros k Hk. apply maxl_ge, nth_In. exact (Hr pj k Hp Hk). }
  assert (cj <= maxl c) by (apply maxl_ge; exact Hc).
  lia.
Qed.

(** C7r: when a costliest consumer waits on a latest producer, fine gates open
    the barrier at the same instant as coarse gates. *)
Theorem latest_gated_sound f c P :
  gates_in_range f c P -> latest_gated f c P = true ->
  fine_barrier f c P = coarse_barrier f c.
Proof.
  intros Hg Hl. apply Nat.le_antisymm; [apply fine_barrier_le_coarse; exact Hg|].
  unfold latest_gated in Hl. apply existsb_exists in Hl as [[cj pj] [Hin Hx]].
  simpl in Hx. apply andb_true_iff in Hx as [Hc Hk].
  apply Nat.eqb_eq in Hc. apply existsb_exists in Hk as [k [Hk Hf]].
  apply Nat.eqb_eq in Hf.
  unfold fine_barrier, coarse_barrier.
  transitivity (maxl (map (fun k => nth k f 0) pj) + cj).
  - assert (nth k f 0 <= maxl (map (fun k => nth k f 0) pj)).
    { apply maxl_ge. apply in_map_iff. exists k. auto. }
    lia.
  - apply maxl_ge. apply in_map_iff. exists (cj, pj). auto.
Qed.

(** ** C7r for every routing, on the structured model *)

Lemma nth_map_lt {A B} (g : A -> B) (l : list A) d d' j :
  j < length l -> nth j (map g l) d' = g (nth j l d).
Proof.
  intros H. rewrite nth_indep with (d' := g d) by (rewrite map_length; exact H).
  apply map_nth.
Qed.

Lemma nth_combine_in {A B} (l : list A) (m : list B) j da db :
  length l = length m -> j < length l -> In (nth j l da, nth j m db) (combine l m).
Proof.
  intros Hl Hj. rewrite <- combine_nth by exact Hl. apply nth_In.
  rewrite combine_length. lia.
Qed.

Lemma filter_nonempty {A} (b : A -> bool) l :
  0 < length (filter b l) -> exists a, In a l /\ b a = true.
Proof.
  destruct (filter b l) as [|a r] eqn:E; simpl; [lia|]. intros _.
  assert (Ha : In a (filter b l)) by (rewrite E; left; reflexivity).
  apply filter_In in Ha. exact (ex_intro _ a Ha).
Qed.

Lemma filter_in_pos {A} (b : A -> bool) l a :
  In a l -> b a = true -> 0 < length (filter b l).
Proof.
  intros Hin Hb. destruct (filter b l) eqn:E; simpl; [|lia].
  assert (In a (filter b l)) by (apply filter_In; auto). rewrite E in H. contradiction.
Qed.

(** C7r for every routing: where [coupled_ok] holds, in every busy set [b] a
    costliest consumer slice waits on a latest producer slice, so fine gates
    open C7's two-stage barrier exactly when coarse gates do. *)
Theorem coupled_c7r_all_routings keys lo hi clo cw atoms P :
  coupled_ok keys hi cw atoms P = true ->
  forall b : nat -> bool,
    let f := map (producer_cost b lo hi) keys in
    let c := map (consumer_cost b clo cw) atoms in
    latest_gated f c P = true /\ fine_barrier f c P = coarse_barrier f c.
Proof.
  intros Hok b f c.
  unfold coupled_ok in Hok.
  apply andb_true_iff in Hok as [Hok Hcase].
  apply andb_true_iff in Hok as [Hok Hgates].
  apply andb_true_iff in Hok as [Hne Hlen].
  apply Nat.ltb_lt in Hne. apply Nat.eqb_eq in Hlen.
  rewrite forallb_forall in Hgates.
  assert (Hrange : gates_in_range f c P).
  { split; [unfold c; rewrite map_length; exact Hlen|].
    intros p k Hp Hk. specialize (Hgates p Hp). apply andb_true_iff in Hgates as [_ Hg].
    rewrite forallb_forall in Hg. specialize (Hg k Hk). apply Nat.ltb_lt in Hg.
    unfold f. rewrite map_length. exact Hg. }
  assert (Hlat : latest_gated f c P = true).
  { (* a costliest consumer slice j *)
    assert (Hcne : c <> []) by (unfold c; destruct atoms; simpl in *; [lia|discriminate]).
    apply maxl_attained, In_nth with (d := 0) in Hcne as [j [Hj Hcj]].
    assert (Hjl : j < length atoms) by (unfold c in Hj; rewrite map_length in Hj; exact Hj).
    assert (HjP : j < length P) by lia.
    pose proof (Hgates (nth j P []) (nth_In _ _ HjP)) as Hgj.
    apply andb_true_iff in Hgj as [Hpne Hpr]. apply Nat.ltb_lt in Hpne.
    rewrite forallb_forall in Hpr.
    (* the latest producer finish is [lo + hi] or [lo] *)
    assert (Hfk : forall k, k < length keys -> nth k f 0 = producer_cost b lo hi (nth k keys 0)).
    { intros k Hk. unfold f. apply nth_map_lt. exact Hk. }
    assert (Hfle : maxl f <= lo + hi).
    { apply maxl_le. intros x Hx. unfold f in Hx. apply in_map_iff in Hx as [e [<- _]].
      unfold producer_cost. destruct (b e); lia. }
    assert (Hfge : forall k, In k (nth j P []) -> lo <= nth k f 0).
    { intros k Hk. pose proof (Hpr k Hk) as Hkr. apply Nat.ltb_lt in Hkr.
      rewrite Hfk by exact Hkr. unfold producer_cost. lia. }
    assert (Hwit : forall k, In k (nth j P []) -> nth k f 0 = maxl f ->
                   latest_gated f c P = true).
    { intros k Hk Heq. unfold latest_gated. apply existsb_exists.
      exists (nth j c 0, nth j P []). split.
      - apply nth_combine_in; [unfold c; rewrite map_length; lia | exact Hj].
      - simpl. rewrite Hcj, Nat.eqb_refl. simpl. apply existsb_exists.
        exists k. split; [exact Hk | apply Nat.eqb_eq; exact Heq]. }
    destruct (existsb (fun k => b (nth k keys 0)) (seq 0 (length keys))) eqn:Hbusy.
    2:{ (* no producer is busy: every producer finishes at [lo] *)
      assert (Hflo : maxl f <= lo).
      { apply maxl_le. intros x Hx. unfold f in Hx. apply in_map_iff in Hx as [e [<- He]].
        apply In_nth with (d := 0) in He as [k [Hk <-]].
        unfold producer_cost.
        destruct (b (nth k keys 0)) eqn:Hb; [|lia].
        assert (existsb (fun k => b (nth k keys 0)) (seq 0 (length keys)) = true)
          by (apply existsb_exists; exists k; rewrite in_seq; split; [lia | exact Hb]).
        congruence. }
      destruct (nth j P []) as [|k r] eqn:Epj; simpl in Hpne; [lia|].
      apply (Hwit k); [left; reflexivity|].
      pose proof (Hfge k (or_introl eq_refl)).
      pose proof (Hrange) as [_ Hr].
      assert (k < length f) by (apply (Hr (k :: r)); [rewrite <- Epj; apply nth_In; lia | left; auto]).
      pose proof (maxl_ge (nth k f 0) f (nth_In _ _ H0)). lia. }
    apply existsb_exists in Hbusy as [k0 [Hk0 Hb0]]. apply in_seq in Hk0.
    destruct (Nat.eqb_spec hi 0) as [Hh0|Hh0].
    + (* [hi = 0]: every producer finishes at [lo] *)
      destruct (nth j P []) as [|k r] eqn:Epj; simpl in Hpne; [lia|].
      apply (Hwit k); [left; reflexivity|].
      pose proof (Hfge k (or_introl eq_refl)).
      pose proof (Hrange) as [_ Hr].
      assert (k < length f) by (apply (Hr (k :: r)); [rewrite <- Epj; apply nth_In; lia | left; auto]).
      pose proof (maxl_ge (nth k f 0) f (nth_In _ _ H0)). lia.
    + simpl in Hcase. apply andb_true_iff in Hcase as [Hcase Hcov].
      apply andb_true_iff in Hcase as [Hcw Hkeys]. apply Nat.ltb_lt in Hcw.
      rewrite forallb_forall in Hkeys, Hcov.
      (* producer [k0] is busy: the latest finish is [lo + hi] *)
      assert (Hfmax : maxl f = lo + hi).
      { apply Nat.le_antisymm; [exact Hfle|].
        assert (nth k0 f 0 = lo + hi) by (rewrite Hfk by lia; unfold producer_cost; rewrite Hb0; lia).
        rewrite <- H. apply maxl_ge, nth_In. unfold f. rewrite map_length. lia. }
      (* its key is the atom of some consumer, which then costs more than [clo] *)
      pose proof (Hkeys (nth k0 keys 0) (nth_In _ _ (proj2 Hk0))) as Hk.
      apply existsb_exists in Hk as [l [Hl Hel]].
      apply existsb_exists in Hel as [a [Ha Hea]]. apply Nat.eqb_eq in Hea. subst a.
      assert (Hcl : clo + cw <= maxl c).
      { transitivity (consumer_cost b clo cw l).
        - unfold consumer_cost. pose proof (filter_in_pos b l _ Ha Hb0). nia.
        - apply maxl_ge. unfold c. apply in_map. exact Hl. }
      (* so the costliest consumer [j] has a busy tile *)
      assert (Hcj' : nth j c 0 = consumer_cost b clo cw (nth j atoms [])) by
        (unfold c; apply nth_map_lt; exact Hjl).
      assert (Hpos : 0 < length (filter b (nth j atoms []))).
      { destruct (length (filter b (nth j atoms []))) eqn:E; [|lia].
        unfold consumer_cost in Hcj'. rewrite E in Hcj'. lia. }
      apply filter_nonempty in Hpos as [a [Ha' Hba]].
      (* whose atom is the key of a producer in [j]'s gate: a busy, latest one *)
      pose proof (Hcov _ (nth_combine_in atoms P j [] [] (eq_sym Hlen) Hjl)) as Hc.
      simpl in Hc. rewrite forallb_forall in Hc. specialize (Hc a Ha').
      apply existsb_exists in Hc as [k [Hk Hka]]. apply Nat.eqb_eq in Hka.
      apply (Hwit k Hk). rewrite Hfmax.
      pose proof (Hgates (nth j P []) (nth_In _ _ HjP)) as Hg. apply andb_true_iff in Hg as [_ Hg].
      rewrite forallb_forall in Hg. specialize (Hg k Hk). apply Nat.ltb_lt in Hg.
      rewrite Hfk by exact Hg. unfold producer_cost. rewrite Hka, Hba. reflexivity. }
  split; [exact Hlat | apply latest_gated_sound; assumption].
Qed.

(** The converse of [latest_gated_sound] (gates non-empty): fine gates open the
    barrier exactly when coarse ones do only if [latest_gated] holds.  So
    [latest_gated] is C7r itself, per cost table, not only a sufficient test. *)
Theorem latest_gated_complete f c P :
  gates_in_range f c P -> c <> [] -> (forall p, In p P -> p <> []) ->
  fine_barrier f c P = coarse_barrier f c -> latest_gated f c P = true.
Proof.
  intros [Hlen Hr] Hc Hne Heq. unfold fine_barrier, coarse_barrier in Heq.
  set (g := fun cp : nat * list nat => maxl (map (fun k => nth k f 0) (snd cp)) + fst cp) in Heq.
  assert (Hcomb : combine c P <> []).
  { destruct c as [|c0 cs]; [congruence|]. destruct P as [|p0 ps]; simpl in Hlen; [lia|].
    discriminate. }
  assert (Hm : map g (combine c P) <> []) by (destruct (combine c P); [congruence|discriminate]).
  apply maxl_attained in Hm. apply in_map_iff in Hm as [[cj pj] [Hg Hin]].
  rewrite Heq in Hg. unfold g in Hg. simpl in Hg.
  pose proof (in_combine_l _ _ _ _ Hin) as Hcj.
  pose proof (in_combine_r _ _ _ _ Hin) as Hpj.
  assert (Hle : maxl (map (fun k => nth k f 0) pj) <= maxl f).
  { apply maxl_map_le. intros k Hk. apply maxl_ge, nth_In. exact (Hr pj k Hpj Hk). }
  assert (cj <= maxl c) by (apply maxl_ge; exact Hcj).
  assert (Hf : maxl (map (fun k => nth k f 0) pj) = maxl f) by lia.
  assert (Hcm : cj = maxl c) by lia.
  unfold latest_gated. apply existsb_exists. exists (cj, pj). split; [exact Hin|].
  simpl. rewrite Hcm, Nat.eqb_refl. simpl.
  assert (Hpm : map (fun k => nth k f 0) pj <> []).
  { destruct pj; [exfalso; exact (Hne [] Hpj eq_refl) | discriminate]. }
  apply maxl_attained in Hpm. rewrite Hf in Hpm. apply in_map_iff in Hpm as [k [Hk Hkin]].
  apply existsb_exists. exists k. split; [exact Hkin | apply Nat.eqb_eq; exact Hk].
Qed.
