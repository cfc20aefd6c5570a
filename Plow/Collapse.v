(** * The collapse theorem (C7), its executable corollary (C8), and a witness (C9).

    Model: a chain of counter-gated stages [0 .. L] (so [m = L + 1] stages)
    of [n] slices each.  Slice [(i, j)] costs [c i j] and starts as soon as
    its gate opens; stage 0's slice [j] arrives at [a j].  The gate of slice
    [(i+1, j)] waits for the stage-[i] slices [P i j]: coarse gates take all
    of stage [i] ([coarse n]), fine gates any nonempty subset.  A final
    barrier waits for the last stage.

    Faithfulness condition (documented in docs/theorems.md): every stage-[i]
    slice ([i < L]) is waited on by at least one stage-[i+1] slice
    ([gates_cover]) — every slice's output is consumed, as in a plan where
    every packet has a consumer.  Without it the theorem is false: a stage-0
    straggler nobody waits on never reaches the barrier.  Coarse gates
    satisfy it.

    C7: if every consumer stage's slices cost the same, the barrier opens at
    [max_j finish 0 j + Σ_{i=1..L} c i], whatever the fine gates [P] are;
    when stage 0 is uniform too this is [max_j a j + Σ_{i=0..L} c i].
    Times are [nat] in this propositional model; the executable decision
    (C8) reads binary costs ([N]). *)
From Coq Require Import List Arith NArith Bool Lia.
Import ListNotations.

Definition maxl (l : list nat) : nat := fold_right Nat.max 0 l.

Fixpoint finish (a : nat -> nat) (c : nat -> nat -> nat) (P : nat -> nat -> list nat)
         (i j : nat) : nat :=
  match i with
  | 0 => a j + c 0 j
  | S i' => maxl (map (finish a c P i') (P i' j)) + c i j
  end.

(** The barrier after stage [L] opens when the last slice of stage [L] finishes. *)
Definition barrier (n : nat) (a : nat -> nat) (c : nat -> nat -> nat)
           (P : nat -> nat -> list nat) (L : nat) : nat :=
  maxl (map (finish a c P L) (seq 0 n)).

Definition coarse (n : nat) : nat -> nat -> list nat := fun _ _ => seq 0 n.

(** Each gate waits on a nonempty set of existing slices. *)
Definition gates_valid (n L : nat) (P : nat -> nat -> list nat) : Prop :=
  forall i j, i < L -> j < n -> P i j <> [] /\ (forall k, In k (P i j) -> k < n).

(** Every slice of a non-last stage is waited on by some slice of the next stage. *)
Definition gates_cover (n L : nat) (P : nat -> nat -> list nat) : Prop :=
  forall i k, i < L -> k < n -> exists j, j < n /\ In k (P i j).

(** Consumer stages [1 .. L] have equal slice costs. *)
Definition consumers_uniform (n L : nat) (c : nat -> nat -> nat) : Prop :=
  forall i j, 1 <= i <= L -> j < n -> c i j = c i 0.

(** Σ_{i=1..L} c i 0 *)
Fixpoint work (c : nat -> nat -> nat) (L : nat) : nat :=
  match L with 0 => 0 | S L' => work c L' + c L 0 end.

(** ** Lemmas on [maxl] *)

Lemma maxl_ge x l : In x l -> x <= maxl l.
Proof. induction l as [|y l IH]; simpl; [tauto|]. intros [->|H]; [lia | specialize (IH H); lia]. Qed.

Lemma maxl_le b l : (forall x, In x l -> x <= b) -> maxl l <= b.
Proof.
  induction l as [|y l IH]; simpl; intros H; [lia|].
  apply Nat.max_lub; [apply H; auto | apply IH; auto].
Qed.

Lemma maxl_attained l : l <> [] -> In (maxl l) l.
Proof.
  induction l as [|y l IH]; simpl; intros Hne; [congruence|].
  destruct l as [|z l]; simpl in *.
  - left. lia.
  - destruct (Nat.max_spec y (Nat.max z (maxl l))) as [[_ E]|[_ E]]; rewrite E; auto.
    right. apply IH. congruence.
Qed.

Lemma maxl_map_add {A} (f : A -> nat) d l :
  l <> [] -> maxl (map (fun x => f x + d) l) = maxl (map f l) + d.
Proof.
  induction l as [|y l IH]; simpl; intros Hne; [congruence|].
  destruct l as [|z l]; simpl in *; [lia|].
  rewrite IH by congruence. simpl. lia.
Qed.

(** ** C7 *)

Section Collapse.
Variables (n L : nat) (a : nat -> nat) (c : nat -> nat -> nat) (P : nat -> nat -> list nat).
Hypothesis Hn : 0 < n.
Hypothesis Hvalid : gates_valid n L P.
Hypothesis Hcover : gates_cover n L P.
Hypothesis Huni : consumers_uniform n L c.

Let A0 := maxl (map (fun j => a j + c 0 j) (seq 0 n)).

Lemma finish_upper : forall i, i <= L -> forall j, j < n -> finish a c P i j <= A0 + work c i.
Proof.
  induction i as [|i IH]; intros Hi j Hj; simpl.
  - unfold A0. rewrite Nat.add_0_r. apply maxl_ge. apply in_map_iff. exists j.
    split; auto. apply in_seq. lia.
  - rewrite (Huni (S i) j) by lia.
    assert (maxl (map (finish a c P i) (P i j)) <= A0 + work c i); [|lia].
    apply maxl_le. intros x Hx. apply in_map_iff in Hx as [k [<- Hk]].
    apply IH; [lia|]. apply (proj2 (Hvalid i j ltac:(lia) Hj)). exact Hk.
Qed.

Lemma finish_lower : forall i, i <= L -> exists k, k < n /\ A0 + work c i <= finish a c P i k.
Proof.
  induction i as [|i IH]; intros Hi.
  - assert (Hne : map (fun j => a j + c 0 j) (seq 0 n) <> []).
    { destruct n; [lia|]. simpl. congruence. }
    apply maxl_attained in Hne. apply in_map_iff in Hne as [k [E Hk]].
    apply in_seq in Hk. exists k. split; [lia|]. simpl. unfold A0. lia.
  - destruct (IH ltac:(lia)) as [k [Hk Hle]].
    destruct (Hcover i k ltac:(lia) Hk) as [j [Hj Hin]].
    exists j. split; auto. simpl.
    rewrite (Huni (S i) j) by lia.
    assert (finish a c P i k <= maxl (map (finish a c P i) (P i j))); [|lia].
    apply maxl_ge, in_map; auto.
Qed.

(** The barrier opens at the latest stage-0 finish plus the consumer stages'
    work — an expression in which the gates [P] do not occur. *)
Theorem collapse : barrier n a c P L = A0 + work c L.
Proof.
  apply Nat.le_antisymm.
  - apply maxl_le. intros x Hx. apply in_map_iff in Hx as [j [<- Hj]].
    apply in_seq in Hj. apply finish_upper; lia.
  - destruct (finish_lower L (le_n L)) as [k [Hk Hle]].
    etransitivity; [exact Hle|]. apply maxl_ge, in_map, in_seq. lia.
Qed.

End Collapse.

Lemma coarse_valid n L : 0 < n -> gates_valid n L (coarse n).
Proof.
  intros Hn i j _ _. unfold coarse. split.
  - destruct n; [lia|]. simpl. congruence.
  - intros k Hk. apply in_seq in Hk. lia.
Qed.

Lemma coarse_cover n L : gates_cover n L (coarse n).
Proof. intros i k _ Hk. exists k. split; auto. unfold coarse. apply in_seq. lia. Qed.

(** C7 as stated in the catalogue: every stage uniform ([c i j = c i 0] for
    all stages, stage 0 included): the barrier opens at [max a + Σ_{i=0..L} c i],
    for every valid, covering choice of fine gates — the same instant as the
    coarse gates, so fine gates cannot finish earlier. *)
Theorem collapse_theorem n L a c P :
  0 < n -> gates_valid n L P -> gates_cover n L P ->
  (forall i j, i <= L -> j < n -> c i j = c i 0) ->
  barrier n a c P L = maxl (map a (seq 0 n)) + (c 0 0 + work c L).
Proof.
  intros Hn Hv Hc Hu. rewrite collapse; auto.
  - rewrite (map_ext_in _ (fun j => a j + c 0 0)).
    + rewrite maxl_map_add; [lia|]. destruct n; [lia|]. simpl. congruence.
    + intros j Hj. apply in_seq in Hj. rewrite Hu by lia. reflexivity.
  - intros i j Hi Hj. apply Hu; lia.
Qed.

Corollary fine_gates_not_earlier n L a c P :
  0 < n -> gates_valid n L P -> gates_cover n L P -> consumers_uniform n L c ->
  barrier n a c P L = barrier n a c (coarse n) L.
Proof.
  intros Hn Hv Hc Hu. rewrite !collapse; auto using coarse_valid, coarse_cover.
Qed.

(** ** C8: the executable decision *)

(** Does this edge's consumer stage give its slices unequal costs? *)
Definition slices_unequal (costs : list N) : bool :=
  match costs with
  | [] => false
  | x :: rest => existsb (fun y => negb (N.eqb x y)) rest
  end.

(** The chain's decision: coarse counters suffice when no consumer stage
    (stages 1..L of the cost table, one list of slice costs per stage) has
    unequal slice costs. *)
Definition coarse_suffices (costs : list (list N)) : bool :=
  forallb (fun cs => negb (slices_unequal cs)) (tl costs).

(** The cost model read from the table. *)
Definition cost_of (costs : list (list N)) (i j : nat) : nat :=
  N.to_nat (nth j (nth i costs []) 0%N).

Lemma slices_unequal_false cs :
  slices_unequal cs = false -> forall j, j < length cs -> nth j cs 0%N = nth 0 cs 0%N.
Proof.
  destruct cs as [|x rest]; simpl; intros H j Hj; [lia|].
  destruct j as [|j]; auto.
  assert (Hall : forall y, In y rest -> negb (N.eqb x y) = false).
  { intros y Hy. destruct (negb (N.eqb x y)) eqn:E; auto.
    assert (existsb (fun y => negb (N.eqb x y)) rest = true) by (apply existsb_exists; eauto).
    congruence. }
  assert (Hin : In (nth j rest 0%N) rest) by (apply nth_In; lia).
  specialize (Hall _ Hin). apply negb_false_iff, N.eqb_eq in Hall. auto.
Qed.

(** C8: when the decision says no (every consumer stage has equal slice
    costs), coarse counters are optimal: every valid covering choice of fine
    gates opens the barrier at the same instant as the coarse gates. *)
Theorem coarse_optimal_if_equal (costs : list (list N)) n L a P :
  coarse_suffices costs = true ->
  (forall i, 1 <= i <= L -> length (nth i costs []) = n) ->
  0 < n -> gates_valid n L P -> gates_cover n L P ->
  barrier n a (cost_of costs) P L = barrier n a (cost_of costs) (coarse n) L.
Proof.
  intros Hdec Hlen Hn Hv Hc. apply fine_gates_not_earlier; auto.
  intros i j Hi Hj. unfold cost_of. f_equal.
  unfold coarse_suffices in Hdec. rewrite forallb_forall in Hdec.
  assert (Hin : In (nth i costs []) (tl costs)).
  { destruct costs as [|c0 rest]; simpl.
    - simpl in Hlen. specialize (Hlen i Hi). destruct i; simpl in Hlen; lia.
    - destruct i as [|i]; [lia|]. simpl. apply nth_In.
      specialize (Hlen (S i) Hi). simpl in Hlen.
      destruct (Nat.lt_ge_cases i (length rest)); auto.
      rewrite nth_overflow in Hlen by auto. simpl in Hlen. lia. }
  specialize (Hdec _ Hin). apply negb_true_iff in Hdec.
  apply slices_unequal_false; auto. rewrite Hlen; auto.
Qed.

(** ** C9: the smallest witness that fine gates can win *)

(** 2 stages × 2 slices, both arriving at 0; stage 0 costs (1, 10), stage 1
    costs (10, 1).  Fine gates: slice (1, j) waits only for slice (0, j). *)
Definition c9_costs : list (list N) := [[1; 10]; [10; 1]]%N.
Definition c9_arrival : nat -> nat := fun _ => 0.
Definition c9_fine : nat -> nat -> list nat := fun _ j => [j].

Lemma c9_fine_valid : gates_valid 2 1 c9_fine.
Proof. intros i j _ Hj. unfold c9_fine. split; [congruence|]. intros k [<-|[]]. exact Hj. Qed.

Lemma c9_fine_cover : gates_cover 2 1 c9_fine.
Proof. intros i k _ Hk. exists k. split; [exact Hk | left; reflexivity]. Qed.

Lemma c9_decision_says_unequal : coarse_suffices c9_costs = false.
Proof. vm_compute. reflexivity. Qed.

Theorem c9_fine_strictly_earlier :
  barrier 2 c9_arrival (cost_of c9_costs) c9_fine 1 = 11 /\
  barrier 2 c9_arrival (cost_of c9_costs) (coarse 2) 1 = 20 /\
  barrier 2 c9_arrival (cost_of c9_costs) c9_fine 1
    < barrier 2 c9_arrival (cost_of c9_costs) (coarse 2) 1.
Proof. vm_compute. split; [reflexivity | split; [reflexivity | repeat constructor]]. Qed.
