(** * Fusion rewrites (checkpoint A): a tensor semantics and the fused ops.

    The e-graph stage ([plow/egraph/]) rewrites the operator graph with the
    rules R1–R19; this file gives the meaning of both sides, and
    [Rewritesproof.v] proves each rule an equality (plus E1–E4, the
    equalities the fused kernels rely on).

    Tensors are functions over index spaces into a commutative semiring [K]
    (a record [csr] below, its laws fields of the record).  Every rule here
    is row-wise or head-wise (the token axis is mapped over unchanged), so a
    tensor is a row [nat -> K] (feature index to value), a weight matrix
    [nat -> row] (output row to input row), a key-value cache [nat -> row]
    (position to row).  Equality is pointwise ([forall i, l i = r i]), so no
    proof needs functional extensionality.

    Reductions are [sum n f = f 0 + ... + f (n-1)].  The non-polynomial
    scalar functions of a transformer (the inverse RMS of a row, the
    activation, rope's rotation, the attention's softmax-weighted sum, the
    layer norm, the argmax) are parameters: a rule holds for *every* choice
    of them, which is what "the fused kernel computes the same function"
    needs — the kernel applies the same scalar function, at a different
    place in the loop nest.

    Each fused op is defined in its kernel form (the loop the fused tile
    runs: an epilogue on the accumulator, a prologue on the loaded row, one
    read of a re-laid-out weight), not as the composition it replaces; the
    rule is the statement that the two agree.

    Floating point: [fsum] is the same reduction over an operation with no
    laws; the split-reduction equality (E3) holds for it under the explicit
    hypothesis that the operation reassociates (and has the zero as a
    two-sided unit) — the assumption a plan makes when it splits a
    reduction across workers, stated rather than hidden. *)
From Coq Require Import Arith Bool Lia List.
Import ListNotations.

(** ** Commutative semirings *)
Record csr := {
  car : Type;
  zero : car;
  one : car;
  plus : car -> car -> car;
  times : car -> car -> car;
  plus_assoc : forall a b c, plus a (plus b c) = plus (plus a b) c;
  plus_comm : forall a b, plus a b = plus b a;
  plus_zero_l : forall a, plus zero a = a;
  times_assoc : forall a b c, times a (times b c) = times (times a b) c;
  times_comm : forall a b, times a b = times b a;
  times_one_l : forall a, times one a = a;
  times_zero_l : forall a, times zero a = zero;
  times_plus_l : forall a b c, times (plus a b) c = plus (times a c) (times b c)
}.

Section Semantics.
Variable R : csr.
Local Notation K := (car R).
Local Infix "+." := (plus R) (at level 50, left associativity).
Local Infix "*." := (times R) (at level 40, left associativity).

Definition row := nat -> K.
Definition mat := nat -> row.

(** Σ_{i<n} f i *)
Fixpoint sum (n : nat) (f : nat -> K) : K :=
  match n with
  | O => zero R
  | S n' => sum n' f +. f n'
  end.

Definition dot (k : nat) (w x : row) : K := sum k (fun i => w i *. x i).

(** ** Canonical ops (what the lowering writes) *)
Definition add (a b : row) : row := fun i => a i +. b i.
Definition mul (a b : row) : row := fun i => a i *. b i.
Definition act_map (act : K -> K) (x : row) : row := fun i => act (x i).
(** [linear k W b x] for a [k]-wide input: y_j = Σ_i W_j,i x_i + b_j. *)
Definition linear (k : nat) (W : mat) (b x : row) : row :=
  fun j => dot k (W j) x +. b j.
(** RMS norm over the first [n] features: [rms n x] is the scale
    1/sqrt(mean(x²) + eps) (a parameter); [w] includes Gemma's offset. *)
Definition rmsnorm (rms : nat -> row -> K) (n : nat) (w x : row) : row :=
  fun i => x i *. rms n x *. w i.
(** Per-head norm with group [g]: feature [i] is in head [i / g]. *)
Definition head_rmsnorm (rms : nat -> row -> K) (g : nat) (w x : row) : row :=
  fun i => x i *. rms g (fun t => x (g * (i / g) + t)) *. w (i mod g).
(** Rope: feature [i] is rotated with its partner [partner i] by [rot i]
    (the cos/sin of its position and frequency). *)
Definition rope (rot : nat -> K -> K -> K) (partner : nat -> nat) (x : row) : row :=
  fun i => rot i (x i) (x (partner i)).
(** Cache write of the row [x] at position [p]. *)
Definition kv_write (c : mat) (p : nat) (x : row) : mat :=
  fun t => if t =? p then x else c t.
(** Attention of [q] over the keys/values at positions [0..p]; [core] is the
    softmax-weighted sum (a parameter). *)
Definition attend (core : row -> mat -> mat -> nat -> row)
    (q : row) (kc vc : mat) (p : nat) : row := core q kc vc p.
Definition embedding (table : mat) (id : nat) : row := table id.
Definition lm_head (k : nat) (cap : K -> K) (W : mat) (x : row) : row :=
  fun j => cap (dot k (W j) x).
Definition sample_greedy (amax : row -> nat) (logits : row) : nat := amax logits.

(** ** Layouts and views *)
(** Rows of three matrices stacked: [nq] rows of [A], [nk] of [B], then [C]. *)
Definition cat3 {A : Type} (nq nk : nat) (a b c : nat -> A) : nat -> A :=
  fun j => if j <? nq then a j else if j <? nq + nk then b (j - nq) else c (j - nq - nk).
Definition part1 {A : Type} (nq : nat) (y : nat -> A) : nat -> A := fun j => y (nq + j).
Definition part2 {A : Type} (nq nk : nat) (y : nat -> A) : nat -> A :=
  fun j => y (nq + nk + j).
(** Interleaved gate/up rows: row 2i is gate row i, row 2i+1 is up row i. *)
Definition interleave {A : Type} (g u : nat -> A) : nat -> A :=
  fun j => if Nat.even j then g (Nat.div2 j) else u (Nat.div2 j).
Definition deinterleave {A : Type} (y : nat -> A) : (nat -> A) * (nat -> A) :=
  (fun j => y (2 * j), fun j => y (S (2 * j))).

(** ** Fused ops, in kernel form *)
(** R1: one pass writes the sum and its norm. *)
Definition add_rmsnorm (rms : nat -> row -> K) (n : nat) (w a b : row) : row * row :=
  (fun i => a i +. b i, fun i => (a i +. b i) *. rms n (fun t => a t +. b t) *. w i).
(** R13: the gated-MLP op. *)
Definition glu (act : K -> K) (g u : row) : row := fun j => act (g j) *. u j.
(** R2: the glu over an interleaved row. *)
Definition glu_interleaved (act : K -> K) (y : row) : row :=
  fun j => act (y (2 * j)) *. y (S (2 * j)).
(** R3: the interleaved linear with the glu in its epilogue: output [j]
    reads weight rows [2j] and [2j+1]. *)
Definition linear_glu (act : K -> K) (k : nat) (W : mat) (b x : row) : row :=
  fun j => act (dot k (W (2 * j)) x +. b (2 * j)) *. (dot k (W (S (2 * j))) x +. b (S (2 * j))).
(** R5: the projection with rope in its epilogue. *)
Definition linear_rope (rot : nat -> K -> K -> K) (partner : nat -> nat)
    (k : nat) (W : mat) (b x : row) : row :=
  fun j => rot j (dot k (W j) x +. b j) (dot k (W (partner j)) x +. b (partner j)).
(** R6: per-head norm and rope in one pass over each head. *)
Definition rmsnorm_rope (rms : nat -> row -> K) (g : nat) (w : row)
    (rot : nat -> K -> K -> K) (partner : nat -> nat) (x : row) : row :=
  fun i =>
    let n j := x j *. rms g (fun t => x (g * (j / g) + t)) *. w (j mod g) in
    rot i (n i) (n (partner i)).
(** R7: the lm_head writes the logits and their argmax. *)
Definition lm_head_argmax (k : nat) (cap : K -> K) (amax : row -> nat) (W : mat) (x : row)
    : row * nat :=
  (fun j => cap (dot k (W j) x), amax (fun j => cap (dot k (W j) x))).
(** R8: plow's attention op: the new key/value are read from the op's
    inputs at position [p], the cache below [p]; the cache write happens in
    the same op. *)
Definition attention (core : row -> mat -> mat -> nat -> row)
    (q k v : row) (kc vc : mat) (p : nat) : row :=
  core q (fun t => if t <? p then kc t else k) (fun t => if t <? p then vc t else v) p.
(** R9: rope of q and k applied as they are loaded. *)
Definition attention_rope (core : row -> mat -> mat -> nat -> row)
    (rot : nat -> K -> K -> K) (partner : nat -> nat)
    (q k v : row) (kc vc : mat) (p : nat) : row :=
  core (fun i => rot i (q i) (q (partner i)))
    (fun t => if t <? p then kc t else fun i => rot i (k i) (k (partner i)))
    (fun t => if t <? p then vc t else v) p.
(** R10: the accumulator starts from the residual and the bias. *)
Definition linear_residual (k : nat) (W : mat) (b x r : row) : row :=
  fun j => (r j +. b j) +. dot k (W j) x.
(** R11: the norm's scale is applied once to the accumulator; the weight
    is folded into the loaded row. *)
Definition rmsnorm_linear (rms : nat -> row -> K) (n : nat) (nw : row)
    (k : nat) (W : mat) (b x : row) : row :=
  fun j => rms n x *. sum k (fun i => W j i *. (x i *. nw i)) +. b j.
(** R12: post-norm and residual add in one pass. *)
Definition rmsnorm_residual (rms : nat -> row -> K) (n : nat) (w r y : row) : row :=
  fun i => r i +. y i *. rms n y *. w i.
(** R14: gated residual. *)
Definition gated_residual (x g y : row) : row := fun i => x i +. g i *. y i.
(** R15: adaptive layer-norm modulation, [ln x * (1 + s) + t] as
    [ln x + ln x * s + t]. *)
Definition adaln_modulate (ln : row -> row) (s t x : row) : row :=
  fun i => (ln x i +. ln x i *. s i) +. t i.
(** R16: group norm (a parameter) with the activation in its epilogue. *)
Definition groupnorm_act (gn : row -> row) (act : K -> K) (x : row) : row :=
  fun i => act (gn x i).
(** R17: activation in the projection's epilogue. *)
Definition linear_act (act : K -> K) (k : nat) (W : mat) (b x : row) : row :=
  fun j => act (dot k (W j) x +. b j).
(** R18: the gather and the first norm of the embedding row. *)
Definition embedding_rmsnorm (rms : nat -> row -> K) (n : nat) (w : row) (table : mat)
    (id : nat) : row * row :=
  (table id, fun i => table id i *. rms n (table id) *. w i).
(** R19: the final norm in the lm_head's prologue. *)
Definition rmsnorm_lm_head (rms : nat -> row -> K) (n : nat) (nw : row)
    (k : nat) (cap : K -> K) (W : mat) (x : row) : row :=
  fun j => cap (rms n x *. sum k (fun i => W j i *. (x i *. nw i))).

(** ** E1: in-place writes.  Memory is [nat -> K]; an elementwise op [f]
    over [n] elements reads [ib..ib+n) and writes either a fresh range
    [ob..ob+n) or the input range itself. *)
Definition update (m : nat -> K) (base n : nat) (v : nat -> K) : nat -> K :=
  fun a => if (base <=? a) && (a <? base + n) then v (a - base) else m a.
Definition out_of_place (f : K -> K) (m : nat -> K) (ib ob n : nat) : nat -> K :=
  update m ob n (fun i => f (m (ib + i))).
Definition in_place (f : K -> K) (m : nat -> K) (ib n : nat) : nat -> K :=
  update m ib n (fun i => f (m (ib + i))).

(** ** E2: a materialised buffer ([n] elements written, then read). *)
Definition materialize (n : nat) (f : nat -> K) : list K := map f (seq 0 n).
Definition read (buf : list K) (i : nat) : K := nth i buf (zero R).

(** ** E3: a reduction split into consecutive chunks of the given lengths,
    each reduced by one worker, the partial sums merged in order. *)
Fixpoint split_sum (chunks : list nat) (base : nat) (f : nat -> K) : K :=
  match chunks with
  | [] => zero R
  | c :: cs => sum c (fun i => f (base + i)) +. split_sum cs (base + c) f
  end.
Definition total (chunks : list nat) : nat := fold_right Nat.add 0 chunks.

End Semantics.

(** ** The floating-point reading of a reduction: an operation with no laws. *)
Section Float.
Variable F : Type.
Variable fzero : F.
Variable fadd : F -> F -> F.
Fixpoint fsum (n : nat) (f : nat -> F) : F :=
  match n with
  | O => fzero
  | S n' => fadd (fsum n' f) (f n')
  end.
Fixpoint split_fsum (chunks : list nat) (base : nat) (f : nat -> F) : F :=
  match chunks with
  | [] => fzero
  | c :: cs => fadd (fsum c (fun i => f (base + i))) (split_fsum cs (base + c) f)
  end.
End Float.
