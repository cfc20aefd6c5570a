(** * The fusion rules R1–R19 and E1–E4 are equalities (checkpoint A).

    Each [*_sound] lemma states that a rule's left side (the canonical
    composition, [Rewrites.v]'s canonical ops) and right side (the fused op,
    in its kernel form) denote the same tensor function, pointwise, for every
    commutative semiring and every choice of the scalar parameters (inverse
    RMS, activation, rope rotation, attention core, layer norm, argmax).
    The side condition a rule carries in the e-graph stage appears here as a
    hypothesis or as the index range of the statement: R4's parts are the
    row ranges of the concatenation, R8 needs the attention core to read
    positions [<= p] only (causality), E1 speaks of addresses outside the
    dead input, E3's float reading assumes reassociation.

    The lemma names match [plow/egraph/rules.py]'s catalogue and
    docs/egraph.md. *)
From Coq Require Import Arith Lia List Bool Ring.
From Plow Require Import Rewrites.
Import ListNotations.

Section Proofs.
Variable R : csr.
Local Notation K := (car R).
Local Infix "+." := (plus R) (at level 50, left associativity).
Local Infix "*." := (times R) (at level 40, left associativity).

Lemma csr_semi_ring : semi_ring_theory (zero R) (one R) (plus R) (times R) eq.
Proof.
  constructor.
  - exact (plus_zero_l R).
  - exact (plus_comm R).
  - exact (plus_assoc R).
  - exact (times_one_l R).
  - exact (times_zero_l R).
  - exact (times_comm R).
  - exact (times_assoc R).
  - exact (times_plus_l R).
Qed.
Add Ring csr_ring : csr_semi_ring.

(** ** Sums *)
Lemma sum_ext n (f g : nat -> K) :
  (forall i, i < n -> f i = g i) -> sum R n f = sum R n g.
Proof.
  induction n as [|n IH]; intros H; simpl; [reflexivity|].
  rewrite IH by (intros; apply H; lia). rewrite (H n) by lia. reflexivity.
Qed.

Lemma sum_scale n (c : K) (f : nat -> K) :
  sum R n (fun i => c *. f i) = c *. sum R n f.
Proof. induction n as [|n IH]; simpl; [ring|]. rewrite IH. ring. Qed.

Lemma sum_add_split n m (f : nat -> K) :
  sum R (n + m) f = sum R n f +. sum R m (fun i => f (n + i)).
Proof.
  induction m as [|m IH]; simpl.
  - rewrite Nat.add_0_r. ring.
  - rewrite Nat.add_succ_r. simpl. rewrite IH. ring.
Qed.

(** ** E3: split reduction + merge = full reduction, exact over [K]. *)
Lemma split_reduction_sound chunks base (f : nat -> K) :
  split_sum R chunks base f = sum R (total chunks) (fun i => f (base + i)).
Proof.
  revert base; induction chunks as [|c cs IH]; intros base; simpl; [reflexivity|].
  rewrite IH, sum_add_split. f_equal.
  apply sum_ext; intros i _. f_equal. lia.
Qed.

(** ** E4: the interleaved layout de-interleaves to the original. *)
Lemma even_double j : Nat.even (2 * j) = true.
Proof. apply Nat.even_spec. exists j. reflexivity. Qed.

Lemma even_succ_double j : Nat.even (S (2 * j)) = false.
Proof.
  destruct (Nat.even (S (2 * j))) eqn:E; [|reflexivity].
  apply Nat.even_spec in E. destruct E as [m Hm]. lia.
Qed.

Lemma interleave_even {A : Type} (g u : nat -> A) j : interleave g u (2 * j) = g j.
Proof. unfold interleave. rewrite even_double, Nat.div2_double. reflexivity. Qed.

Lemma interleave_odd {A : Type} (g u : nat -> A) j : interleave g u (S (2 * j)) = u j.
Proof. unfold interleave. rewrite even_succ_double, Nat.div2_succ_double. reflexivity. Qed.

Lemma deinterleave_interleave {A : Type} (g u : nat -> A) j :
  fst (deinterleave (interleave g u)) j = g j /\ snd (deinterleave (interleave g u)) j = u j.
Proof. simpl. split; [apply interleave_even | apply interleave_odd]. Qed.

(** ** Concatenated rows *)
Lemma cat3_l {A : Type} nq nk (a b c : nat -> A) j : j < nq -> cat3 nq nk a b c j = a j.
Proof. intros H. unfold cat3. apply Nat.ltb_lt in H. rewrite H. reflexivity. Qed.

Lemma cat3_m {A : Type} nq nk (a b c : nat -> A) j :
  j < nk -> cat3 nq nk a b c (nq + j) = b j.
Proof.
  intros H. unfold cat3.
  replace (nq + j <? nq) with false by (symmetry; apply Nat.ltb_ge; lia).
  replace (nq + j <? nq + nk) with true by (symmetry; apply Nat.ltb_lt; lia).
  f_equal. lia.
Qed.

Lemma cat3_r {A : Type} nq nk (a b c : nat -> A) j : cat3 nq nk a b c (nq + nk + j) = c j.
Proof.
  unfold cat3.
  replace (nq + nk + j <? nq) with false by (symmetry; apply Nat.ltb_ge; lia).
  replace (nq + nk + j <? nq + nk) with false by (symmetry; apply Nat.ltb_ge; lia).
  f_equal. lia.
Qed.

(** ** The rules *)
Section Rules.
Variable rms : nat -> row R -> K.
Variable act : K -> K.
Variable rot : nat -> K -> K -> K.
Variable partner : nat -> nat.
Variable core : row R -> mat R -> mat R -> nat -> row R.
Variable cap : K -> K.
Variable amax : row R -> nat.

(** R1 *)
Lemma add_rmsnorm_sound n w a b i :
  fst (add_rmsnorm R rms n w a b) i = add R a b i
  /\ snd (add_rmsnorm R rms n w a b) i = rmsnorm R rms n w (add R a b) i.
Proof. split; reflexivity. Qed.

(** R2 (with E4's layout) *)
Lemma gate_up_interleave_sound k Wg Wu bg bu x j :
  glu R act (linear R k Wg bg x) (linear R k Wu bu x) j
  = glu_interleaved R act (linear R k (interleave Wg Wu) (interleave bg bu) x) j.
Proof.
  unfold glu, glu_interleaved, linear.
  rewrite !interleave_even, !interleave_odd. reflexivity.
Qed.

(** R3 *)
Lemma linear_glu_sound k W b x j :
  glu_interleaved R act (linear R k W b x) j = linear_glu R act k W b x j.
Proof. reflexivity. Qed.

(** R4: the three parts of the concatenated projection. *)
Lemma qkv_concat_sound nq nk k Wq Wk Wv bq bk bv x :
  (forall j, j < nq ->
     linear R k (cat3 nq nk Wq Wk Wv) (cat3 nq nk bq bk bv) x j = linear R k Wq bq x j)
  /\ (forall j, j < nk ->
     part1 nq (linear R k (cat3 nq nk Wq Wk Wv) (cat3 nq nk bq bk bv) x) j
     = linear R k Wk bk x j)
  /\ (forall j,
     part2 nq nk (linear R k (cat3 nq nk Wq Wk Wv) (cat3 nq nk bq bk bv) x) j
     = linear R k Wv bv x j).
Proof.
  unfold part1, part2, linear. split; [|split]; intros j; intros.
  - rewrite !cat3_l by assumption. reflexivity.
  - rewrite !cat3_m by assumption. reflexivity.
  - rewrite !cat3_r. reflexivity.
Qed.

(** R5 *)
Lemma linear_rope_sound k W b x j :
  rope R rot partner (linear R k W b x) j = linear_rope R rot partner k W b x j.
Proof. reflexivity. Qed.

(** R6 *)
Lemma rmsnorm_rope_sound g w x i :
  rope R rot partner (head_rmsnorm R rms g w x) i = rmsnorm_rope R rms g w rot partner x i.
Proof. reflexivity. Qed.

(** R7 *)
Lemma lm_head_argmax_sound k W x :
  (forall j, fst (lm_head_argmax R k cap amax W x) j = lm_head R k cap W x j)
  /\ snd (lm_head_argmax R k cap amax W x) = sample_greedy R amax (lm_head R k cap W x).
Proof. split; reflexivity. Qed.

(** R8: needs the core to read positions [<= p] only. *)
Definition causal : Prop :=
  forall q K1 K2 V1 V2 p,
    (forall t i, t <= p -> K1 t i = K2 t i) ->
    (forall t i, t <= p -> V1 t i = V2 t i) ->
    forall i, core q K1 V1 p i = core q K2 V2 p i.

Lemma attention_cache_write_sound q k v kc vc p :
  causal ->
  forall i,
    attend R core q (kv_write R kc p k) (kv_write R vc p v) p i
    = attention R core q k v kc vc p i.
Proof.
  intros Hc i. unfold attend, attention. apply Hc; intros t j Ht; unfold kv_write;
    destruct (Nat.eqb_spec t p); destruct (Nat.ltb_spec t p); subst;
    solve [reflexivity | lia].
Qed.

(** R9 *)
Lemma attention_rope_sound q k v kc vc p i :
  attention R core (rope R rot partner q) (rope R rot partner k) v kc vc p i
  = attention_rope R core rot partner q k v kc vc p i.
Proof. reflexivity. Qed.

(** R10 *)
Lemma linear_residual_sound k W b x r j :
  add R r (linear R k W b x) j = linear_residual R k W b x r j.
Proof. unfold add, linear, linear_residual. ring. Qed.

Lemma dot_rmsnorm n nw k (w x : row R) :
  dot R k w (rmsnorm R rms n nw x) = rms n x *. sum R k (fun i => w i *. (x i *. nw i)).
Proof.
  unfold dot, rmsnorm. rewrite <- sum_scale.
  apply sum_ext; intros i _. ring.
Qed.

(** R11 *)
Lemma rmsnorm_linear_sound n nw k W b x j :
  linear R k W b (rmsnorm R rms n nw x) j = rmsnorm_linear R rms n nw k W b x j.
Proof. unfold linear, rmsnorm_linear. rewrite dot_rmsnorm. reflexivity. Qed.

(** R12 *)
Lemma rmsnorm_residual_sound n w r y i :
  add R r (rmsnorm R rms n w y) i = rmsnorm_residual R rms n w r y i.
Proof. reflexivity. Qed.

(** R13 *)
Lemma glu_sound g u j : mul R (act_map R act g) u j = glu R act g u j.
Proof. reflexivity. Qed.

(** R14 *)
Lemma gated_residual_sound x g y i : add R x (mul R g y) i = gated_residual R x g y i.
Proof. reflexivity. Qed.

(** R15 *)
Lemma adaln_modulate_sound (ln : row R -> row R) s t x i :
  add R (mul R (ln x) (fun j => one R +. s j)) t i = adaln_modulate R ln s t x i.
Proof. unfold add, mul, adaln_modulate. ring. Qed.

(** R16 *)
Lemma groupnorm_act_sound (gn : row R -> row R) x i :
  act_map R act (gn x) i = groupnorm_act R gn act x i.
Proof. reflexivity. Qed.

(** R17 *)
Lemma linear_act_sound k W b x j :
  act_map R act (linear R k W b x) j = linear_act R act k W b x j.
Proof. reflexivity. Qed.

(** R18 *)
Lemma embedding_rmsnorm_sound n w table id i :
  fst (embedding_rmsnorm R rms n w table id) i = embedding R table id i
  /\ snd (embedding_rmsnorm R rms n w table id) i
     = rmsnorm R rms n w (embedding R table id) i.
Proof. split; reflexivity. Qed.

(** R19 *)
Lemma rmsnorm_lm_head_sound n nw k W x j :
  lm_head R k cap W (rmsnorm R rms n nw x) j = rmsnorm_lm_head R rms n nw k cap W x j.
Proof. unfold lm_head, rmsnorm_lm_head. rewrite dot_rmsnorm. reflexivity. Qed.

End Rules.

(** ** E1: writing in place.  The consumer reads the result where each
    version put it; every address outside the (dead) input range and the
    fresh output range holds the same value in both memories. *)
Lemma in_place_sound (f : K -> K) m ib ob n :
  (forall i, i < n -> in_place R f m ib n (ib + i) = out_of_place R f m ib ob n (ob + i))
  /\ (forall a, (a < ib \/ ib + n <= a) -> (a < ob \/ ob + n <= a) ->
        in_place R f m ib n a = out_of_place R f m ib ob n a).
Proof.
  unfold in_place, out_of_place, update. split.
  - intros i Hi.
    replace ((ib <=? ib + i) && (ib + i <? ib + n)) with true
      by (symmetry; apply andb_true_iff; split; [apply Nat.leb_le | apply Nat.ltb_lt]; lia).
    replace ((ob <=? ob + i) && (ob + i <? ob + n)) with true
      by (symmetry; apply andb_true_iff; split; [apply Nat.leb_le | apply Nat.ltb_lt]; lia).
    replace (ib + i - ib) with i by lia. replace (ob + i - ob) with i by lia. reflexivity.
  - intros a Hi Ho.
    replace ((ib <=? a) && (a <? ib + n)) with false
      by (symmetry; apply andb_false_iff; destruct Hi;
          [left; apply Nat.leb_gt | right; apply Nat.ltb_ge]; lia).
    replace ((ob <=? a) && (a <? ob + n)) with false
      by (symmetry; apply andb_false_iff; destruct Ho;
          [left; apply Nat.leb_gt | right; apply Nat.ltb_ge]; lia).
    reflexivity.
Qed.

(** ** E2: streaming a value equals materialising it. *)
Lemma stream_materialize_sound n (f : nat -> K) i :
  i < n -> read R (materialize R n f) i = f i.
Proof.
  intros Hi. unfold read, materialize.
  rewrite (nth_indep _ (zero R) (f 0)) by (rewrite map_length, seq_length; lia).
  rewrite map_nth, seq_nth by lia. reflexivity.
Qed.

End Proofs.

(** ** E3, floating-point reading: exact under the reassociation
    assumption (and the zero a two-sided unit). *)
Section FloatProofs.
Variable F : Type.
Variable fzero : F.
Variable fadd : F -> F -> F.
Hypothesis fadd_reassoc : forall a b c, fadd a (fadd b c) = fadd (fadd a b) c.
Hypothesis fadd_zero_l : forall a, fadd fzero a = a.
Hypothesis fadd_zero_r : forall a, fadd a fzero = a.

Lemma fsum_ext n (f g : nat -> F) :
  (forall i, i < n -> f i = g i) -> fsum F fzero fadd n f = fsum F fzero fadd n g.
Proof.
  induction n as [|n IH]; intros H; simpl; [reflexivity|].
  rewrite IH by (intros; apply H; lia). rewrite (H n) by lia. reflexivity.
Qed.

Lemma fsum_add_split n m (f : nat -> F) :
  fsum F fzero fadd (n + m) f
  = fadd (fsum F fzero fadd n f) (fsum F fzero fadd m (fun i => f (n + i))).
Proof.
  induction m as [|m IH]; simpl.
  - rewrite Nat.add_0_r, fadd_zero_r. reflexivity.
  - rewrite Nat.add_succ_r. simpl. rewrite IH, fadd_reassoc. reflexivity.
Qed.

Lemma split_reduction_float_sound chunks base (f : nat -> F) :
  split_fsum F fzero fadd chunks base f
  = fsum F fzero fadd (total chunks) (fun i => f (base + i)).
Proof.
  revert base; induction chunks as [|c cs IH]; intros base; simpl; [reflexivity|].
  rewrite IH, fsum_add_split. f_equal.
  apply fsum_ext; intros i _. f_equal. lia.
Qed.
End FloatProofs.
