(** * Checkpoint A, design: a checker that an op table is the canonical
    graph transformed by instances of proved rules.

    The program model: a straight-line op table over tensor ids ([N]).  An
    activation environment maps ids to rows ([Rewrites.row]); weights live in
    a separate environment of matrices (a vector weight is row 0 of its
    matrix), the same for both tables.  Canonical instructions are plow's
    ops ([IAdd], [INorm], [ILinear], [IGlu]); fused instructions are the
    kernel forms of [Rewrites.v] for the rules the searched extraction uses
    on a decoder ([IAddNorm] R1, [ILinearQKV] R4: the concatenated q/k/v
    projection, reading [cat3 Wq Wk Wv], [INormResidual] R12, [ILinearResidual] R10,
    [INormLinear] R11, [ILinearGluI] R2+R3 with R13: the interleaved gate/up
    linear with the glu in its epilogue, reading [interleave Wg Wu], [IGenNorm] R18: a
    generic op — the embedding gather — and the full-width norm of what it wrote, in one
    instruction writing both).

    The producer (the Python compiler) supplies the blocks: each is a rule,
    the canonical instructions it covers, and the fused instruction.  The
    checker [check_table] accepts when
    - the canonical table is the concatenation of the blocks' canonical
      instructions, and the fused table is the list of their fused ones;
    - every block is an instance of its rule ([match_block]: the ops, the
      operands and the side conditions: the intermediate is neither an
      operand read after it is written nor an output id);
    - no instruction reads an intermediate that an earlier block fused away
      (dead after), and no program output is such an intermediate.
    On failure it names the block (its index) and what is wrong.
    [Rewritescheckproof.v] proves it sound: accepted tables compute the same
    value at every program output, for every environment.

    Checkpoint A (wired into the oracle, [oracle/ckpt_rewrites.ml]): every op
    kind of every family's op table is an instruction.  Those the rules
    rewrite are the specific ones above; every other op is a generic
    [IGen k a d xs]: its kind id [k], its attributes' id [a] (the oracle
    interns the kind and the canonical JSON of the attributes, so equal ids
    are equal values), its output [d] and its operands [xs] in order
    (activations and weights by name; an op's semantics may read an operand
    as a row of the activation environment or as a weight matrix).  A
    pass-through block ([RNone]) accepts exactly the canonical instruction,
    so op kind, attributes, operand order and the weights read are compared
    exactly. *)
From Coq Require Import NArith List Bool.
From Plow Require Import Loc Rewrites.
Import ListNotations.
Local Open Scope N_scope.

Inductive rule_id : Type := RNone | R1 | R4 | R10 | R11 | R12 | R23 | R18.

Inductive instr : Type :=
| IAdd (d a b : N)
| INorm (d x w n q : N)
| ILinear (d x W k m : N)
| IGlu (d g u a : N)
| IAddNorm (t d a b w n q : N)
| INormResidual (d r y w n q : N)
| ILinearResidual (d x W k m r : N)
| INormLinear (d x w n q W k m : N)
| ILinearGluI (d x Wg Wu k m a : N)
| ILinearQKV (dq dk dv x Wq Wk Wv k nq nk nv : N)
| IGen (k a d : N) (xs : list N)
(** R18: a generic op (the embedding gather) writing [t], and the full-width norm of [t]
    written to [d], in one instruction writing both. *)
| IGenNorm (k a t : N) (xs : list N) (d w n q : N).

Fixpoint nlist_eqb (l m : list N) : bool :=
  match l, m with
  | [], [] => true
  | x :: l', y :: m' => (x =? y) && nlist_eqb l' m'
  | _, _ => false
  end.

Definition instr_eqb (i j : instr) : bool :=
  match i, j with
  | IAdd d a b, IAdd d' a' b' => (d =? d') && (a =? a') && (b =? b')
  | INorm d x w n q, INorm d' x' w' n' q' =>
      (d =? d') && (x =? x') && (w =? w') && (n =? n') && (q =? q')
  | ILinear d x W k m, ILinear d' x' W' k' m' =>
      (d =? d') && (x =? x') && (W =? W') && (k =? k') && (m =? m')
  | IGlu d g u a, IGlu d' g' u' a' => (d =? d') && (g =? g') && (u =? u') && (a =? a')
  | IAddNorm t d a b w n q, IAddNorm t' d' a' b' w' n' q' =>
      (t =? t') && (d =? d') && (a =? a') && (b =? b') && (w =? w') && (n =? n') && (q =? q')
  | INormResidual d r y w n q, INormResidual d' r' y' w' n' q' =>
      (d =? d') && (r =? r') && (y =? y') && (w =? w') && (n =? n') && (q =? q')
  | ILinearResidual d x W k m r, ILinearResidual d' x' W' k' m' r' =>
      (d =? d') && (x =? x') && (W =? W') && (k =? k') && (m =? m') && (r =? r')
  | INormLinear d x w n q W k m, INormLinear d' x' w' n' q' W' k' m' =>
      (d =? d') && (x =? x') && (w =? w') && (n =? n') && (q =? q') && (W =? W') && (k =? k')
      && (m =? m')
  | ILinearGluI d x Wg Wu k m a, ILinearGluI d' x' Wg' Wu' k' m' a' =>
      (d =? d') && (x =? x') && (Wg =? Wg') && (Wu =? Wu') && (k =? k') && (m =? m')
      && (a =? a')
  | ILinearQKV dq dk dv x Wq Wk Wv k nq nk nv, ILinearQKV dq' dk' dv' x' Wq' Wk' Wv' k' nq' nk' nv' =>
      (dq =? dq') && (dk =? dk') && (dv =? dv') && (x =? x') && (Wq =? Wq') && (Wk =? Wk')
      && (Wv =? Wv') && (k =? k') && (nq =? nq') && (nk =? nk') && (nv =? nv')
  | IGen k a d xs, IGen k' a' d' xs' => (k =? k') && (a =? a') && (d =? d') && nlist_eqb xs xs'
  | IGenNorm k a t xs d w n q, IGenNorm k' a' t' xs' d' w' n' q' =>
      (k =? k') && (a =? a') && (t =? t') && nlist_eqb xs xs' && (d =? d') && (w =? w')
      && (n =? n') && (q =? q')
  | _, _ => false
  end.

Fixpoint list_eqb (l m : list instr) : bool :=
  match l, m with
  | [], [] => true
  | i :: l', j :: m' => instr_eqb i j && list_eqb l' m'
  | _, _ => false
  end.

(** Activation ids an instruction reads. *)
Definition reads (i : instr) : list N :=
  match i with
  | IAdd _ a b => [a; b]
  | INorm _ x _ _ _ => [x]
  | ILinear _ x _ _ _ => [x]
  | IGlu _ g u _ => [g; u]
  | IAddNorm _ _ a b _ _ _ => [a; b]
  | INormResidual _ r y _ _ _ => [r; y]
  | ILinearResidual _ x _ _ _ r => [x; r]
  | INormLinear _ x _ _ _ _ _ _ => [x]
  | ILinearGluI _ x _ _ _ _ _ => [x]
  | ILinearQKV _ _ _ x _ _ _ _ _ _ _ => [x]
  | IGen _ _ _ xs => xs
  | IGenNorm _ _ _ xs _ _ _ _ => xs
  end.

Definition canonical (i : instr) : bool :=
  match i with
  | IAdd _ _ _ | INorm _ _ _ _ _ | ILinear _ _ _ _ _ | IGlu _ _ _ _ | IGen _ _ _ _ => true
  | _ => false
  end.

Definition memb (x : N) (l : list N) : bool := existsb (N.eqb x) l.

(** [match_block r cs f]: the block is an instance of rule [r]; returns the
    intermediates the fusion removes (dead after), or [None]. *)
Definition match_block (r : rule_id) (cs : list instr) (f : instr) : option (list N) :=
  match r, cs with
  | RNone, [c] => if canonical c && instr_eqb f c then Some [] else None
  | R1, [IAdd t a b; INorm d t' w n q] =>
      if (t' =? t) && negb (d =? t) && instr_eqb f (IAddNorm t d a b w n q) then Some []
      else None
  | R12, [INorm t y w n q; IAdd d r t'] =>
      if (t' =? t) && negb (r =? t) && negb (d =? t) && instr_eqb f (INormResidual d r y w n q)
      then Some [t] else None
  | R4, [ILinear dq x Wq k nq; ILinear dk x' Wk k' nk; ILinear dv x'' Wv k'' nv] =>
      if (x' =? x) && (x'' =? x) && (k' =? k) && (k'' =? k) && negb (dq =? x) && negb (dk =? x)
         && negb (dq =? dk) && negb (dq =? dv) && negb (dk =? dv)
         && instr_eqb f (ILinearQKV dq dk dv x Wq Wk Wv k nq nk nv)
      then Some [] else None
  | R10, [ILinear t x W k m; IAdd d r t'] =>
      if (t' =? t) && negb (r =? t) && negb (d =? t) && instr_eqb f (ILinearResidual d x W k m r)
      then Some [t] else None
  | R11, [INorm t x w n q; ILinear d t' W k m] =>
      if (t' =? t) && negb (d =? t) && instr_eqb f (INormLinear d x w n q W k m)
      then Some [t] else None
  | R23, [ILinear g x Wg k m; ILinear u x' Wu k' m'; IGlu d g' u' a] =>
      if (x' =? x) && (k' =? k) && (m' =? m) && (g' =? g) && (u' =? u) && negb (g =? x)
         && negb (g =? u) && negb (d =? g) && negb (d =? u)
         && instr_eqb f (ILinearGluI d x Wg Wu k m a)
      then Some [g; u] else None
  | R18, [IGen k a t xs; INorm d t' w n q] =>
      if (t' =? t) && negb (d =? t) && instr_eqb f (IGenNorm k a t xs d w n q) then Some []
      else None
  | _, _ => None
  end.

Record block := { b_rule : rule_id; b_canon : list instr; b_fused : instr }.

(** Verdicts are [Loc.verdict]: [Accept], or [Reject (block index, problem)]
    with problem codes: 1 the block is not an instance of its rule, 2 it reads
    a fused-away intermediate, 3 a program output is a fused-away
    intermediate (block index 0), 4 the tables are not the blocks'
    concatenation (block index 0). *)
Definition rverdict := verdict (N * N).

Fixpoint check_blocks (bs : list block) (dead : list N) (idx : N) : rverdict * list N :=
  match bs with
  | [] => (Accept, dead)
  | b :: bs' =>
      if existsb (fun x => memb x dead) (flat_map reads (b_canon b)) then (Reject (idx, 2), dead)
      else match match_block (b_rule b) (b_canon b) (b_fused b) with
           | None => (Reject (idx, 1), dead)
           | Some inter => check_blocks bs' (inter ++ dead) (N.succ idx)
           end
  end.

(** The blocks are checked first, so a mismatch is located at its block
    (a pass-through op that differs from its canonical op is code 1 at its
    block); then the tables are compared with the blocks' concatenation. *)
Definition check_table (canon fused : list instr) (bs : list block) (outputs : list N)
    : rverdict :=
  match check_blocks bs [] 0 with
  | (Accept, dead) =>
      if negb (list_eqb canon (flat_map b_canon bs) && list_eqb fused (map b_fused bs))
      then Reject (0, 4)
      else if existsb (fun o => memb o dead) outputs then Reject (0, 3) else Accept
  | (v, _) => v
  end.

(** Checkpoint A, the oracle's entry point. *)
Definition check_checkpoint_a := check_table.

(** ** Semantics *)
Section Exec.
Variable R : csr.
Variable rms : N -> nat -> row R -> car R.  (* attributes (eps, offset) -> inverse RMS *)
Variable act : N -> car R -> car R.  (* activation of the attributes' id *)
(** A generic op: kind id, attributes' id, each operand as a row of the
    activation environment and as a weight matrix. *)
Variable gen : N -> N -> list (row R) -> list (mat R) -> row R.
Definition env := N -> row R.
Definition wenv := N -> mat R.
Definition vec (we : wenv) (w : N) : row R := fun i => we w O i.
Definition upd (e : env) (d : N) (v : row R) : env := fun y => if y =? d then v else e y.
(** A linear's output is [m] wide: zero beyond (so the parts of a
    concatenated projection equal the separate projections everywhere). *)
Definition mask (m : N) (v : row R) : row R :=
  fun j => if Nat.ltb j (N.to_nat m) then v j else zero R.
Definition nob : row R := fun _ => zero R.

Definition run_op (we : wenv) (e : env) (i : instr) : env :=
  match i with
  | IAdd d a b => upd e d (add R (e a) (e b))
  | INorm d x w n q => upd e d (rmsnorm R (rms q) (N.to_nat n) (vec we w) (e x))
  | ILinear d x W k m => upd e d (mask m (linear R (N.to_nat k) (we W) nob (e x)))
  | IGlu d g u a => upd e d (glu R (act a) (e g) (e u))
  | IAddNorm t d a b w n q =>
      let p := add_rmsnorm R (rms q) (N.to_nat n) (vec we w) (e a) (e b) in
      upd (upd e t (fst p)) d (snd p)
  | INormResidual d r y w n q =>
      upd e d (rmsnorm_residual R (rms q) (N.to_nat n) (vec we w) (e r) (e y))
  | ILinearResidual d x W k m r =>
      upd e d (fun j => if Nat.ltb j (N.to_nat m)
                        then linear_residual R (N.to_nat k) (we W) nob (e x) (e r) j
                        else plus R (e r j) (zero R))
  | INormLinear d x w n q W k m =>
      upd e d (mask m (rmsnorm_linear R (rms q) (N.to_nat n) (vec we w) (N.to_nat k) (we W)
                 nob (e x)))
  | ILinearGluI d x Wg Wu k m a =>
      upd e d (fun j => if Nat.ltb j (N.to_nat m)
                        then linear_glu R (act a) (N.to_nat k) (interleave (we Wg) (we Wu)) nob
                               (e x) j
                        else times R (act a (zero R)) (zero R))
  | ILinearQKV dq dk dv x Wq Wk Wv k nq nk nv =>
      let q := N.to_nat nq in
      let y := linear R (N.to_nat k) (cat3 q (N.to_nat nk) (we Wq) (we Wk) (we Wv))
                 (cat3 q (N.to_nat nk) nob nob nob) (e x) in
      upd (upd (upd e dq (mask nq y)) dk (mask nk (part1 q y)))
        dv (mask nv (part2 q (N.to_nat nk) y))
  | IGen k a d xs => upd e d (gen k a (map e xs) (map we xs))
  | IGenNorm k a t xs d w n q =>
      let v := gen k a (map e xs) (map we xs) in
      upd (upd e t v) d (rmsnorm R (rms q) (N.to_nat n) (vec we w) v)
  end.

Definition run_table (we : wenv) (e : env) (p : list instr) : env :=
  fold_left (run_op we) p e.
End Exec.
