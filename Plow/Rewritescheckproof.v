(** * Checkpoint A's checker is sound (A1, for the rules it covers).

    [check_table_sound]: when [check_table] accepts, the fused table and the
    canonical table compute the same row at every program output, for every
    activation and weight environment.  The one hypothesis on the scalar
    parameters is that the inverse RMS of a row depends on its elements only
    ([rms_ext]) — true of any function that reads the row — which lets the
    proof work with pointwise equality and no functional extensionality.

    Proof: an invariant over the blocks — the two environments agree
    (pointwise) at every id except the intermediates fused away so far; a
    block reads no such id (checked), so its canonical instructions see the
    same inputs as its fused instruction, and the rule's lemma of
    [Rewritesproof.v] gives the same outputs; ids the block does not write
    keep their agreement.

    [checkpoint_a_sound] (checkpoint A): the same for the oracle's entry
    point [check_checkpoint_a], for every semantics of the generic ops that
    reads its operands' values only ([gen_ext]); and when every block is a
    pass-through ([RNone]: a bundle without applied rewrites) the accepted
    op table is the canonical table, instruction for instruction — same
    kinds, attribute ids, operands in order and weights. *)
From Coq Require Import Arith NArith List Bool Lia.
From Plow Require Import Loc Rewrites Rewritesproof Rewritescheck.
Import ListNotations.

Lemma nlist_eqb_true l m : nlist_eqb l m = true -> l = m.
Proof.
  revert m; induction l as [|x l IH]; destruct m; simpl; try discriminate; [reflexivity|].
  rewrite andb_true_iff. intros [H1 H2]. apply N.eqb_eq in H1. subst. f_equal. auto.
Qed.

Ltac split_eqb :=
  repeat match goal with
  | h : (_ && _)%bool = true |- _ => apply andb_true_iff in h; destruct h
  | h : (_ =? _)%N = true |- _ => apply N.eqb_eq in h; subst
  | h : nlist_eqb _ _ = true |- _ => apply nlist_eqb_true in h; subst
  end.

Lemma instr_eqb_true i j : instr_eqb i j = true -> i = j.
Proof. destruct i, j; simpl; try discriminate; intros H; split_eqb; reflexivity. Qed.

Lemma list_eqb_true l m : list_eqb l m = true -> l = m.
Proof.
  revert m; induction l as [|i l IH]; destruct m; simpl; try discriminate; [reflexivity|].
  rewrite andb_true_iff. intros [H1 H2]. apply instr_eqb_true in H1. subst. f_equal. auto.
Qed.

Lemma memb_in x l : memb x l = true <-> In x l.
Proof.
  unfold memb. rewrite existsb_exists. split.
  - intros [y [Hy E]]. apply N.eqb_eq in E. subst. exact Hy.
  - intros H. exists x. split; [exact H | apply N.eqb_refl].
Qed.

Lemma existsb_false_in {A : Type} (f : A -> bool) l x :
  existsb f l = false -> In x l -> f x = false.
Proof.
  intros H Hx. destruct (f x) eqn:E; [|reflexivity].
  assert (existsb f l = true) by (apply existsb_exists; exists x; tauto). congruence.
Qed.

Section Sound.
Variable R : csr.
Variable rms : N -> nat -> row R -> car R.
Variable act : N -> car R -> car R.
Variable gen : N -> N -> list (row R) -> list (mat R) -> row R.
Hypothesis rms_ext : forall q n x y, (forall i, x i = y i) -> rms q n x = rms q n y.
(** A generic op's value depends on its operands' values only. *)
Hypothesis gen_ext : forall k a xs ys ws,
  Forall2 (fun x y : row R => forall i, x i = y i) xs ys -> forall j, gen k a xs ws j = gen k a ys ws j.

Definition agree (D : list N) (e1 e2 : env R) : Prop :=
  forall y, ~ In y D -> forall i, e1 y i = e2 y i.

Local Notation ex := (run_table R rms act gen).
Local Notation exi := (run_op R rms act gen).

Lemma run_table_cons we e i p : ex we e (i :: p) = ex we (exi we e i) p.
Proof. reflexivity. Qed.

Lemma run_table_app we e p q : ex we e (p ++ q) = ex we (ex we e p) q.
Proof. unfold run_table. apply fold_left_app. Qed.

Lemma upd_eq (e : env R) d v i : upd R e d v d i = v i.
Proof. unfold upd. rewrite N.eqb_refl. reflexivity. Qed.

Lemma upd_ne (e : env R) d v y i : y <> d -> upd R e d v y i = e y i.
Proof. intros H. unfold upd. apply N.eqb_neq in H. rewrite H. reflexivity. Qed.

Lemma upd_ne_row (e : env R) d v y : y <> d -> upd R e d v y = e y.
Proof. intros H. unfold upd. apply N.eqb_neq in H. rewrite H. reflexivity. Qed.

Lemma upd_eq_row (e : env R) d v : upd R e d v d = v.
Proof. unfold upd. rewrite N.eqb_refl. reflexivity. Qed.

Ltac upd_simpl :=
  repeat match goal with
  | H : ?y <> ?d |- context [upd _ ?e ?d ?v ?y] => rewrite (upd_ne_row e d v y H)
  | |- context [upd _ ?e ?d ?v ?d] => rewrite (upd_eq_row e d v)
  | H : ?y <> ?d |- context [upd _ ?e ?d ?v ?y ?j] => rewrite (upd_ne e d v y j H)
  | |- context [upd _ ?e ?d ?v ?d ?j] => rewrite (upd_eq e d v j)
  end.

(** Values of the ops from pointwise-equal inputs are pointwise equal. *)
Lemma rmsnorm_ext q n w x1 x2 :
  (forall i, x1 i = x2 i) -> forall i, rmsnorm R (rms q) n w x1 i = rmsnorm R (rms q) n w x2 i.
Proof. intros H i. unfold rmsnorm. rewrite H, (rms_ext q n x1 x2 H). reflexivity. Qed.

Lemma dot_ext k w x1 x2 : (forall i, x1 i = x2 i) -> dot R k w x1 = dot R k w x2.
Proof. intros H. unfold dot. apply sum_ext. intros i _. rewrite H. reflexivity. Qed.

Lemma linear_ext k W b x1 x2 :
  (forall i, x1 i = x2 i) -> forall j, linear R k W b x1 j = linear R k W b x2 j.
Proof. intros H j. unfold linear. rewrite (dot_ext k (W j) x1 x2 H). reflexivity. Qed.

Lemma mask_ext m (v1 v2 : row R) :
  (forall j, v1 j = v2 j) -> forall j, mask R m v1 j = mask R m v2 j.
Proof. intros H j. unfold mask. destruct (Nat.ltb j (N.to_nat m)); [apply H | reflexivity]. Qed.

Lemma agree_in D e1 e2 x : agree D e1 e2 -> ~ In x D -> forall j, e1 x j = e2 x j.
Proof. intros H Hx j. exact (H x Hx j). Qed.

Lemma add_ext (a1 a2 b1 b2 : row R) :
  (forall j, a1 j = a2 j) -> (forall j, b1 j = b2 j) -> forall j, add R a1 b1 j = add R a2 b2 j.
Proof. intros Ha Hb j. unfold add. rewrite Ha, Hb. reflexivity. Qed.

(** ** Each rule's block, with the side conditions the checker tests *)
Lemma none_sound we e1 e2 D c :
  canonical c = true -> agree D e1 e2 -> (forall x, In x (reads c) -> ~ In x D) ->
  agree D (ex we e1 [c]) (ex we e2 [c]).
Proof.
  intros Hc Ha Hr y Hy i. unfold run_table. simpl.
  destruct c; simpl in Hc, Hr |- *; try discriminate;
    (destruct (N.eqb_spec y d) as [->|Hne];
     [upd_simpl | upd_simpl; apply Ha; exact Hy]).
  - apply add_ext; apply Ha, Hr; simpl; tauto.
  - apply rmsnorm_ext. apply Ha, Hr. simpl. tauto.
  - apply mask_ext, linear_ext. apply Ha, Hr. simpl. tauto.
  - unfold glu. rewrite (Ha g), (Ha u); try reflexivity; apply Hr; simpl; tauto.
  - apply gen_ext. clear -Ha Hr. induction xs as [|x xs IH]; simpl; constructor.
    + apply Ha, Hr. simpl. tauto.
    + apply IH. intros z Hz. apply Hr. simpl. tauto.
Qed.

Lemma r1_block_sound we e1 e2 D t a b d w n q :
  d <> t -> agree D e1 e2 -> ~ In a D -> ~ In b D ->
  agree D (ex we e1 [IAdd t a b; INorm d t w n q]) (ex we e2 [IAddNorm t d a b w n q]).
Proof.
  intros Hdt Ha HaD HbD y Hy i. unfold run_table. simpl.
  assert (Hab : forall j, add R (e1 a) (e1 b) j = add R (e2 a) (e2 b) j)
    by (apply add_ext; apply Ha; assumption).
  destruct (N.eqb_spec y d) as [->|Hd].
  - upd_simpl.
    transitivity (rmsnorm R (rms q) (N.to_nat n) (vec R we w) (add R (e2 a) (e2 b)) i).
    + apply rmsnorm_ext. intros j. upd_simpl. apply Hab.
    + reflexivity.
  - upd_simpl.
    destruct (N.eqb_spec y t) as [->|Ht].
    + upd_simpl. apply Hab.
    + upd_simpl. apply Ha. exact Hy.
Qed.

Lemma r12_block_sound we e1 e2 D t y0 w n q d r :
  r <> t -> d <> t -> agree D e1 e2 -> ~ In y0 D -> ~ In r D ->
  agree (t :: D) (ex we e1 [INorm t y0 w n q; IAdd d r t])
    (ex we e2 [INormResidual d r y0 w n q]).
Proof.
  intros Hrt Hdt Ha HyD HrD y Hy i. unfold run_table. simpl.
  assert (HD : ~ In y D) by (intros C; apply Hy; right; exact C).
  assert (Hyt : y <> t) by (intros ->; apply Hy; left; reflexivity).
  destruct (N.eqb_spec y d) as [->|Hd].
  - upd_simpl. rewrite <- rmsnorm_residual_sound. unfold add.
    upd_simpl.
    rewrite (Ha r HrD). rewrite (rmsnorm_ext _ _ _ (e1 y0) (e2 y0) (Ha y0 HyD)). reflexivity.
  - upd_simpl. apply Ha. exact HD.
Qed.

Lemma r10_block_sound we e1 e2 D t x W k m d r :
  r <> t -> d <> t -> agree D e1 e2 -> ~ In x D -> ~ In r D ->
  agree (t :: D) (ex we e1 [ILinear t x W k m; IAdd d r t])
    (ex we e2 [ILinearResidual d x W k m r]).
Proof.
  intros Hrt Hdt Ha HxD HrD y Hy i. unfold run_table. simpl.
  assert (HD : ~ In y D) by (intros C; apply Hy; right; exact C).
  assert (Hyt : y <> t) by (intros ->; apply Hy; left; reflexivity).
  destruct (N.eqb_spec y d) as [->|Hd].
  - upd_simpl. unfold add, mask. rewrite (Ha r HrD).
    destruct (Nat.ltb i (N.to_nat m)); [|reflexivity].
    rewrite <- linear_residual_sound. unfold add.
    rewrite (linear_ext _ _ _ (e1 x) (e2 x) (Ha x HxD)). reflexivity.
  - upd_simpl. apply Ha. exact HD.
Qed.

Lemma r11_block_sound we e1 e2 D t x w n q d W k m :
  d <> t -> agree D e1 e2 -> ~ In x D ->
  agree (t :: D) (ex we e1 [INorm t x w n q; ILinear d t W k m])
    (ex we e2 [INormLinear d x w n q W k m]).
Proof.
  intros Hdt Ha HxD y Hy i. unfold run_table. simpl.
  assert (HD : ~ In y D) by (intros C; apply Hy; right; exact C).
  assert (Hyt : y <> t) by (intros ->; apply Hy; left; reflexivity).
  destruct (N.eqb_spec y d) as [->|Hd].
  - upd_simpl. apply mask_ext. intros j. rewrite <- rmsnorm_linear_sound.
    apply linear_ext. intros l. upd_simpl. apply rmsnorm_ext. exact (Ha x HxD).
  - upd_simpl. apply Ha. exact HD.
Qed.

Lemma r23_block_sound we e1 e2 D g x Wg k m u Wu d a :
  g <> x -> g <> u -> d <> g -> d <> u -> agree D e1 e2 -> ~ In x D ->
  agree (g :: u :: D) (ex we e1 [ILinear g x Wg k m; ILinear u x Wu k m; IGlu d g u a])
    (ex we e2 [ILinearGluI d x Wg Wu k m a]).
Proof.
  intros Hgx Hgu Hdg Hdu Ha HxD y Hy i. unfold run_table. simpl.
  assert (HD : ~ In y D) by (intros C; apply Hy; right; right; exact C).
  assert (Hyg : y <> g) by (intros ->; apply Hy; left; reflexivity).
  assert (Hyu : y <> u) by (intros ->; apply Hy; right; left; reflexivity).
  destruct (N.eqb_spec y d) as [->|Hd].
  - assert (Hxg : x <> g) by congruence.
    unfold glu. upd_simpl. unfold mask.
    destruct (Nat.ltb i (N.to_nat m)); [|reflexivity].
    rewrite (linear_ext _ _ _ (e1 x) (e2 x) (Ha x HxD)).
    rewrite (linear_ext _ _ _ (e1 x) (e2 x) (Ha x HxD)).
    change (glu R (act a) (linear R (N.to_nat k) (we Wg) (nob R) (e2 x))
              (linear R (N.to_nat k) (we Wu) (nob R) (e2 x)) i
            = linear_glu R (act a) (N.to_nat k) (interleave (we Wg) (we Wu)) (nob R) (e2 x) i).
    rewrite gate_up_interleave_sound, linear_glu_sound.
    unfold linear_glu. rewrite !interleave_even, !interleave_odd. reflexivity.
  - upd_simpl. apply Ha. exact HD.
Qed.

(** R4: the three masked projections are the masked parts of the
    concatenated one. *)
Lemma r4_block_sound we e1 e2 D dq dk dv x Wq Wk Wv k nq nk nv :
  dq <> x -> dk <> x -> dq <> dk -> dq <> dv -> dk <> dv -> agree D e1 e2 -> ~ In x D ->
  agree D (ex we e1 [ILinear dq x Wq k nq; ILinear dk x Wk k nk; ILinear dv x Wv k nv])
    (ex we e2 [ILinearQKV dq dk dv x Wq Wk Wv k nq nk nv]).
Proof.
  intros Hqx Hkx Hqk Hqv Hkv Ha HxD y Hy i. unfold run_table. simpl.
  assert (Hxq : x <> dq) by congruence. assert (Hxk : x <> dk) by congruence.
  assert (Hkq : dk <> dq) by congruence. assert (Hvq : dv <> dq) by congruence.
  assert (Hvk : dv <> dk) by congruence.
  pose proof (qkv_concat_sound R (N.to_nat nq) (N.to_nat nk) (N.to_nat k) (we Wq) (we Wk)
    (we Wv) (nob R) (nob R) (nob R) (e2 x)) as [Q [Kp V]].
  assert (Hx : forall j, e1 x j = e2 x j) by exact (Ha x HxD).
  destruct (N.eqb_spec y dv) as [->|Hdv]; [|destruct (N.eqb_spec y dk) as [->|Hdk];
    [|destruct (N.eqb_spec y dq) as [->|Hdq]]]; upd_simpl; unfold mask.
  - destruct (Nat.ltb i (N.to_nat nv)); [|reflexivity].
    rewrite (linear_ext _ _ _ (e1 x) (e2 x) Hx). symmetry. apply V.
  - destruct (Nat.ltb i (N.to_nat nk)) eqn:E; [apply Nat.ltb_lt in E|reflexivity].
    rewrite (linear_ext _ _ _ (e1 x) (e2 x) Hx). symmetry. apply Kp. assumption.
  - destruct (Nat.ltb i (N.to_nat nq)) eqn:E; [apply Nat.ltb_lt in E|reflexivity].
    rewrite (linear_ext _ _ _ (e1 x) (e2 x) Hx). symmetry. apply Q. assumption.
  - apply Ha. exact Hy.
Qed.

Lemma r18_block_sound we e1 e2 D k a t xs d w n q :
  d <> t -> agree D e1 e2 -> (forall x, In x xs -> ~ In x D) ->
  agree D (ex we e1 [IGen k a t xs; INorm d t w n q]) (ex we e2 [IGenNorm k a t xs d w n q]).
Proof.
  intros Hdt Ha Hr y Hy i. unfold run_table. simpl.
  assert (Hg : forall j, gen k a (map e1 xs) (map we xs) j = gen k a (map e2 xs) (map we xs) j).
  { apply gen_ext. clear -Ha Hr. induction xs as [|x xs IH]; simpl; constructor.
    + apply Ha, Hr. simpl. tauto.
    + apply IH. intros z Hz. apply Hr. simpl. tauto. }
  destruct (N.eqb_spec y d) as [->|Hd].
  - upd_simpl. apply rmsnorm_ext. intros j. upd_simpl. apply Hg.
  - upd_simpl.
    destruct (N.eqb_spec y t) as [->|Ht].
    + upd_simpl. apply Hg.
    + upd_simpl. apply Ha. exact Hy.
Qed.

(** ** A block that [match_block] accepts keeps the invariant. *)
Lemma block_sound r cs f inter we e1 e2 D :
  match_block r cs f = Some inter ->
  agree D e1 e2 ->
  (forall x, In x (flat_map reads cs) -> ~ In x D) ->
  agree (inter ++ D) (ex we e1 cs) (ex we e2 [f]).
Proof.
  intros Hm Ha Hr.
  destruct r; destruct cs as [|c1 [|c2 [|c3 [|c4 cs]]]]; simpl in Hm; try discriminate;
    repeat match type of Hm with
    | (if ?b then _ else _) = _ => destruct b eqn:?; [|discriminate]
    | match ?c with _ => _ end = _ =>
        lazymatch type of c with instr => destruct c; try discriminate end
    end;
    injection Hm as <-;
    repeat match goal with
    | h : (_ && _)%bool = true |- _ => apply andb_true_iff in h; destruct h
    | h : negb _ = true |- _ => apply negb_true_iff in h
    | h : (_ =? _)%N = true |- _ => apply N.eqb_eq in h; subst
    | h : (_ =? _)%N = false |- _ => apply N.eqb_neq in h
    | h : instr_eqb _ _ = true |- _ => apply instr_eqb_true in h; subst
    end;
    simpl in Hr |- *.
  - apply none_sound; try assumption. intros x Hx. apply Hr. rewrite app_nil_r. exact Hx.
  - apply r1_block_sound; try assumption; apply Hr; tauto.
  - apply r4_block_sound; try assumption; apply Hr; tauto.
  - apply r10_block_sound; try assumption; apply Hr; tauto.
  - apply r11_block_sound; try assumption; apply Hr; tauto.
  - apply r12_block_sound; try assumption; apply Hr; tauto.
  - apply r23_block_sound; try assumption; apply Hr; tauto.
  - apply r18_block_sound; try assumption.
    intros x Hx. apply Hr. apply in_or_app. left. exact Hx.
Qed.

Lemma check_blocks_sound bs dead idx dead' we e1 e2 :
  check_blocks bs dead idx = (Accept, dead') ->
  agree dead e1 e2 ->
  agree dead' (ex we e1 (flat_map b_canon bs)) (ex we e2 (map b_fused bs)).
Proof.
  revert dead idx e1 e2; induction bs as [|b bs IH]; intros dead idx e1 e2 Hc Ha; simpl in Hc.
  - injection Hc as <-. exact Ha.
  - destruct (existsb _ _) eqn:Er; [discriminate|].
    destruct (match_block _ _ _) as [inter|] eqn:Em; [|discriminate].
    change (flat_map b_canon (b :: bs)) with (b_canon b ++ flat_map b_canon bs).
    change (map b_fused (b :: bs)) with (b_fused b :: map b_fused bs).
    rewrite run_table_app, run_table_cons.
    apply (IH _ _ _ _ Hc).
    change (exi we e2 (b_fused b)) with (ex we e2 [b_fused b]).
    apply (block_sound (b_rule b) _ _ _ _ _ _ _ Em Ha).
    intros x Hx Hd. pose proof (existsb_false_in _ _ x Er Hx) as Ex.
    rewrite <- memb_in in Hd. simpl in Ex. congruence.
Qed.
End Sound.

(** A1 for the covered rules: an accepted op table computes, at every
    program output, the row the canonical table computes. *)
Theorem check_table_sound (R : csr) rms act gen canon fused bs outputs :
  (forall q n x y, (forall i, x i = y i) -> rms q n x = rms q n y) ->
  (forall k a xs ys ws, Forall2 (fun x y : row R => forall i, x i = y i) xs ys ->
     forall j, gen k a xs ws j = gen k a ys ws j) ->
  check_table canon fused bs outputs = Accept ->
  forall we e o, In o outputs ->
  forall i, run_table R rms act gen we e canon o i = run_table R rms act gen we e fused o i.
Proof.
  intros Hrms Hgen Hc we e o Ho i. unfold check_table in Hc.
  destruct (check_blocks bs [] 0) as [v dead] eqn:Eb. destruct v; [|discriminate].
  destruct (list_eqb canon _ && list_eqb fused _) eqn:El; simpl in Hc; [|discriminate].
  apply andb_true_iff in El. destruct El as [E1 E2].
  apply list_eqb_true in E1. apply list_eqb_true in E2. subst.
  destruct (existsb _ outputs) eqn:Eo; [discriminate|].
  apply (check_blocks_sound R rms act gen Hrms Hgen bs [] 0 dead we e e Eb);
    [intros y _ j; reflexivity|].
  intros Hd. pose proof (existsb_false_in _ _ o Eo Ho) as Ex.
  rewrite <- memb_in in Hd. simpl in Ex. congruence.
Qed.

(** Pass-through blocks: the fused instruction is the canonical one. *)
Lemma check_blocks_none bs dead idx dead' :
  check_blocks bs dead idx = (Accept, dead') ->
  Forall (fun b => b_rule b = RNone) bs -> map b_fused bs = flat_map b_canon bs.
Proof.
  revert dead idx; induction bs as [|b bs IH]; intros dead idx Hc Hn; simpl in Hc |- *;
    [reflexivity|].
  inversion Hn as [|? ? Hb Hbs]; subst.
  destruct (existsb _ _); [discriminate|].
  destruct (match_block _ _ _) as [inter|] eqn:Em; [|discriminate].
  rewrite Hb in Em. destruct b as [r cs f]; simpl in *.
  destruct cs as [|c [|c' cs]]; simpl in Em; try discriminate.
  destruct (canonical c && instr_eqb f c) eqn:E; [|discriminate].
  apply andb_true_iff in E. destruct E as [_ E]. apply instr_eqb_true in E. subst.
  simpl. f_equal. exact (IH _ _ Hc Hbs).
Qed.

(** Checkpoint A: what an accepted payload guarantees.  (1) The bundle's op
    table computes the canonical table's row at every program output, for
    every semiring, activation and weight environment, every inverse-RMS
    function and every generic-op semantics that read their operands' values
    only, and every activation.  (2) With no applied rewrites (every block a
    pass-through) it is the canonical table itself. *)
Theorem checkpoint_a_sound canon fused bs outputs :
  check_checkpoint_a canon fused bs outputs = Accept ->
  (forall (R : csr) rms act gen,
     (forall q n x y, (forall i, x i = y i) -> rms q n x = rms q n y) ->
     (forall k a xs ys ws, Forall2 (fun x y : row R => forall i, x i = y i) xs ys ->
        forall j, gen k a xs ws j = gen k a ys ws j) ->
     forall we e o, In o outputs ->
     forall i, run_table R rms act gen we e canon o i = run_table R rms act gen we e fused o i)
  /\ (Forall (fun b => b_rule b = RNone) bs -> fused = canon).
Proof.
  intros Hc. split.
  - intros R rms act gen Hrms Hgen. exact (check_table_sound R rms act gen canon fused bs outputs
      Hrms Hgen Hc).
  - intros Hn. unfold check_checkpoint_a, check_table in Hc.
    destruct (check_blocks bs [] 0) as [v dead] eqn:Eb. destruct v; [|discriminate].
    destruct (list_eqb canon _ && list_eqb fused _) eqn:El; simpl in Hc; [|discriminate].
    apply andb_true_iff in El. destruct El as [E1 E2].
    apply list_eqb_true in E1. apply list_eqb_true in E2. subst.
    exact (check_blocks_none bs [] 0 dead Eb Hn).
Qed.

Local Open Scope N_scope.

(** ** The checker's verdicts on small tables (ids: 0, 1 inputs; 10 a norm
    weight; 30, 31 norm attributes; 20, 21 projection weights). *)
Definition r1_block (f : instr) : block :=
  {| b_rule := R1; b_canon := [IAdd 2 0 1; INorm 3 2 10 8 30]; b_fused := f |}.

Definition r12_canon : list instr := [INorm 5 4 10 8 30; IAdd 6 0 5].
Definition r12_block : block :=
  {| b_rule := R12; b_canon := r12_canon; b_fused := INormResidual 6 0 4 10 8 30 |}.

Example check_accepts_add_rmsnorm :
  check_table [IAdd 2 0 1; INorm 3 2 10 8 30] [IAddNorm 2 3 0 1 10 8 30]
    [r1_block (IAddNorm 2 3 0 1 10 8 30)] [2; 3] = Accept.
Proof. reflexivity. Qed.

Example check_rejects_swapped_operands :
  check_table [IAdd 2 0 1; INorm 3 2 10 8 30] [IAddNorm 2 3 1 0 10 8 30]
    [r1_block (IAddNorm 2 3 1 0 10 8 30)] [2; 3] = Reject (0, 1).
Proof. reflexivity. Qed.

Example check_rejects_an_edited_epsilon :
  check_table [IAdd 2 0 1; INorm 3 2 10 8 30] [IAddNorm 2 3 0 1 10 8 31]
    [r1_block (IAddNorm 2 3 0 1 10 8 31)] [2; 3] = Reject (0, 1).
Proof. reflexivity. Qed.

Example check_rejects_a_residual_fused_into_the_wrong_norm :
  check_table r12_canon [INormResidual 6 0 9 10 8 30]
    [{| b_rule := R12; b_canon := r12_canon; b_fused := INormResidual 6 0 9 10 8 30 |}]
    [6] = Reject (0, 1).
Proof. reflexivity. Qed.

Example check_rejects_another_norm_weight :
  check_table [IAdd 2 0 1; INorm 3 2 10 8 30] [IAddNorm 2 3 0 1 11 8 30]
    [r1_block (IAddNorm 2 3 0 1 11 8 30)] [2; 3] = Reject (0, 1).
Proof. reflexivity. Qed.

Example check_rejects_a_read_of_a_fused_away_value :
  check_table (r12_canon ++ [IAdd 7 5 6]) [INormResidual 6 0 4 10 8 30; IAdd 7 5 6]
    [r12_block; {| b_rule := RNone; b_canon := [IAdd 7 5 6]; b_fused := IAdd 7 5 6 |}]
    [7] = Reject (1, 2).
Proof. reflexivity. Qed.

Example check_rejects_a_fused_away_output :
  check_table r12_canon [INormResidual 6 0 4 10 8 30] [r12_block] [5] = Reject (0, 3).
Proof. reflexivity. Qed.

Example check_accepts_gate_up_glu :
  check_table [ILinear 2 0 20 8 16; ILinear 3 0 21 8 16; IGlu 4 2 3 40] [ILinearGluI 4 0 20 21 8 16 40]
    [{| b_rule := R23; b_canon := [ILinear 2 0 20 8 16; ILinear 3 0 21 8 16; IGlu 4 2 3 40];
        b_fused := ILinearGluI 4 0 20 21 8 16 40 |}] [4] = Accept.
Proof. reflexivity. Qed.

Example check_rejects_swapped_gate_and_up :
  check_table [ILinear 2 0 20 8 16; ILinear 3 0 21 8 16; IGlu 4 2 3 40] [ILinearGluI 4 0 21 20 8 16 40]
    [{| b_rule := R23; b_canon := [ILinear 2 0 20 8 16; ILinear 3 0 21 8 16; IGlu 4 2 3 40];
        b_fused := ILinearGluI 4 0 21 20 8 16 40 |}] [4] = Reject (0, 1).
Proof. reflexivity. Qed.

Definition qkv_canon : list instr :=
  [ILinear 2 0 20 8 16; ILinear 3 0 21 8 4; ILinear 4 0 22 8 4].

Example check_accepts_qkv_concat :
  check_table qkv_canon [ILinearQKV 2 3 4 0 20 21 22 8 16 4 4]
    [{| b_rule := R4; b_canon := qkv_canon; b_fused := ILinearQKV 2 3 4 0 20 21 22 8 16 4 4 |}]
    [2; 3; 4] = Accept.
Proof. reflexivity. Qed.

Example check_rejects_a_wrong_concatenation_order :
  check_table qkv_canon [ILinearQKV 2 3 4 0 21 20 22 8 16 4 4]
    [{| b_rule := R4; b_canon := qkv_canon; b_fused := ILinearQKV 2 3 4 0 21 20 22 8 16 4 4 |}]
    [2; 3; 4] = Reject (0, 1).
Proof. reflexivity. Qed.


(** Pass-through of the generic ops (kind 50 attention, attributes 60 or 61;
    ids 0-3 activations, 70 a cache weight). *)
Definition pass (i : instr) : block := {| b_rule := RNone; b_canon := [i]; b_fused := i |}.
Definition gen_canon : list instr := [IGen 50 60 5 [0; 1; 2; 70]; IAdd 6 5 3].

Example check_accepts_the_canonical_table :
  check_checkpoint_a gen_canon gen_canon (map pass gen_canon) [6] = Accept.
Proof. reflexivity. Qed.

Example check_rejects_an_edited_attribute :
  check_checkpoint_a gen_canon [IGen 50 61 5 [0; 1; 2; 70]; IAdd 6 5 3]
    [{| b_rule := RNone; b_canon := [IGen 50 60 5 [0; 1; 2; 70]];
        b_fused := IGen 50 61 5 [0; 1; 2; 70] |}; pass (IAdd 6 5 3)] [6] = Reject (0, 1).
Proof. reflexivity. Qed.

Example check_rejects_swapped_attention_operands :
  check_checkpoint_a gen_canon [IGen 50 60 5 [1; 0; 2; 70]; IAdd 6 5 3]
    [{| b_rule := RNone; b_canon := [IGen 50 60 5 [0; 1; 2; 70]];
        b_fused := IGen 50 60 5 [1; 0; 2; 70] |}; pass (IAdd 6 5 3)] [6] = Reject (0, 1).
Proof. reflexivity. Qed.

Example check_rejects_another_weight :
  check_checkpoint_a [ILinear 2 0 20 8 16] [ILinear 2 0 21 8 16]
    [{| b_rule := RNone; b_canon := [ILinear 2 0 20 8 16]; b_fused := ILinear 2 0 21 8 16 |}]
    [2] = Reject (0, 1).
Proof. reflexivity. Qed.

Example check_rejects_another_kind :
  check_checkpoint_a gen_canon [IGen 50 60 5 [0; 1; 2; 70]; IGen 51 62 6 [5; 3]]
    [pass (IGen 50 60 5 [0; 1; 2; 70]);
     {| b_rule := RNone; b_canon := [IAdd 6 5 3]; b_fused := IGen 51 62 6 [5; 3] |}] [6]
  = Reject (1, 1).
Proof. reflexivity. Qed.

(** R18: the embedding (a generic op: kind 50, attributes 60, ids 0 and table 70) and the
    first norm (weight 10, attributes 30) of its rows as one instruction writing both. *)
Definition r18_block (f : instr) : block :=
  {| b_rule := R18; b_canon := [IGen 50 60 2 [0; 70]; INorm 3 2 10 8 30]; b_fused := f |}.

Example check_accepts_embedding_rmsnorm :
  check_checkpoint_a [IGen 50 60 2 [0; 70]; INorm 3 2 10 8 30]
    [IGenNorm 50 60 2 [0; 70] 3 10 8 30] [r18_block (IGenNorm 50 60 2 [0; 70] 3 10 8 30)]
    [2; 3] = Accept.
Proof. reflexivity. Qed.

Example check_rejects_embedding_rmsnorm_edited_epsilon :
  check_checkpoint_a [IGen 50 60 2 [0; 70]; INorm 3 2 10 8 30]
    [IGenNorm 50 60 2 [0; 70] 3 10 8 31] [r18_block (IGenNorm 50 60 2 [0; 70] 3 10 8 31)]
    [2; 3] = Reject (0, 1).
Proof. reflexivity. Qed.

Example check_rejects_embedding_rmsnorm_another_table :
  check_checkpoint_a [IGen 50 60 2 [0; 70]; INorm 3 2 10 8 30]
    [IGenNorm 50 60 2 [0; 71] 3 10 8 30] [r18_block (IGenNorm 50 60 2 [0; 71] 3 10 8 30)]
    [2; 3] = Reject (0, 1).
Proof. reflexivity. Qed.
