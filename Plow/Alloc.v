(** Allocation (checkpoint F): every tensor of a plan lives at an offset in
    one arena.  The check: every buffer is in bounds and aligned, and two
    buffers that are live at the same program step occupy disjoint bytes.

    A buffer occupies bytes [\[b_offset, b_offset + b_size)] and is live
    during program steps [\[b_first, b_last)].  Both are half-open, so a
    zero-size buffer holds no byte and an empty live range is never live.

    The pair check sorts the buffers by offset and compares each buffer only
    with the following ones that start before it ends: O(n log n) plus the
    number of pairs whose address ranges intersect (buffers reusing the same
    bytes at different steps), on binary numbers.  A pair is compared with
    two interval tests (max of starts < min of ends), which decide exactly
    whether the two buffers share a live step and a byte
    ([Allocproof.conflict_spec]). *)
From Coq Require Import NArith List Bool Orders Mergesort.
From Plow Require Import Loc.
Import ListNotations.
Local Open Scope N_scope.

Record buffer : Type := mk_buffer {
  b_offset : N;
  b_size : N;
  b_align : N;
  b_first : N;   (** first live step *)
  b_last : N     (** first step after the live range *)
}.

Definition b_end (b : buffer) : N := b_offset b + b_size b.

(** * Specification *)

(** Byte [a] belongs to [b]. *)
Definition holds (b : buffer) (a : N) : Prop := b_offset b <= a < b_end b.

(** [b] is live at step [s]. *)
Definition live (b : buffer) (s : N) : Prop := b_first b <= s < b_last b.

Definition in_bounds (arena : N) (b : buffer) : Prop := b_end b <= arena.

Definition aligned (b : buffer) : Prop :=
  0 < b_align b /\ b_offset b mod b_align b = 0.

(** F1's hypothesis: the allocation is safe.  Buffers are identified by their
    position in the list. *)
Definition alloc_safe (arena : N) (bufs : list buffer) : Prop :=
  (forall i b, nth_error bufs i = Some b -> in_bounds arena b /\ aligned b) /\
  (forall i j bi bj, i <> j ->
     nth_error bufs i = Some bi -> nth_error bufs j = Some bj ->
     forall s, live bi s -> live bj s ->
     forall a, ~ (holds bi a /\ holds bj a)).

(** * Executable check *)

(** Errors; buffers are positions in the payload's list. *)
Inductive alloc_error : Type :=
| Zero_align (buf : N)
| Misaligned (buf offset align : N)
| Past_end (buf buf_end arena : N)
(** buffers [i] and [j] hold bytes [\[lo_i, hi_i)] and [\[lo_j, hi_j)]
    that intersect, and are both live on steps [\[s_lo, s_hi)] (nonempty). *)
| Overlap (i lo_i hi_i j lo_j hi_j s_lo s_hi : N).

(** Both buffers live at a common step, and they share a byte. *)
Definition conflict (x y : buffer) : bool :=
  (N.max (b_first x) (b_first y) <? N.min (b_last x) (b_last y)) &&
  (N.max (b_offset x) (b_offset y) <? N.min (b_end x) (b_end y)).

Definition check_one (arena i : N) (b : buffer) : verdict alloc_error :=
  if b_align b =? 0 then Reject (Zero_align i)
  else if negb (b_offset b mod b_align b =? 0)
  then Reject (Misaligned i (b_offset b) (b_align b))
  else if arena <? b_end b then Reject (Past_end i (b_end b) arena)
  else Accept.

Fixpoint check_each (arena i : N) (bufs : list buffer) : verdict alloc_error :=
  match bufs with
  | [] => Accept
  | b :: rest =>
      match check_one arena i b with
      | Accept => check_each arena (N.succ i) rest
      | Reject e => Reject e
      end
  end.

(** Buffers paired with their positions, sorted by offset (stable merge sort
    of the standard library). *)
Module OffsetOrder <: Orders.TotalLeBool'.
  Definition t : Type := (N * buffer)%type.
  Definition leb (x y : t) : bool := b_offset (snd x) <=? b_offset (snd y).
  Infix "<=?" := leb (at level 70, no associativity).
  Lemma leb_total : forall x y, (x <=? y) = true \/ (y <=? x) = true.
  Proof.
    intros x y. unfold leb. destruct (N.leb_spec (b_offset (snd x)) (b_offset (snd y)));
      [left; reflexivity|right; apply N.leb_le; apply N.lt_le_incl; assumption].
  Qed.
End OffsetOrder.

Module OffsetSort := Mergesort.Sort OffsetOrder.

Fixpoint index_from (i : N) (bufs : list buffer) : list (N * buffer) :=
  match bufs with
  | [] => []
  | b :: rest => (i, b) :: index_from (N.succ i) rest
  end.

(** Buffer [x] (position [i]) against the buffers after it in offset order:
    the scan stops at the first one that starts at or after [x]'s end, since
    every later one starts there or later too. *)
Fixpoint scan (i : N) (x : buffer) (rest : list (N * buffer)) : verdict alloc_error :=
  match rest with
  | [] => Accept
  | (j, y) :: rest' =>
      if b_end x <=? b_offset y then Accept
      else if conflict x y
      then Reject (Overlap i (b_offset x) (b_end x) j (b_offset y) (b_end y)
                     (N.max (b_first x) (b_first y)) (N.min (b_last x) (b_last y)))
      else scan i x rest'
  end.

Fixpoint sweep (sorted : list (N * buffer)) : verdict alloc_error :=
  match sorted with
  | [] => Accept
  | (i, x) :: rest =>
      match scan i x rest with
      | Accept => sweep rest
      | Reject e => Reject e
      end
  end.

(** Every pair of buffers: sort by offset, then sweep.  O(n log n) plus the
    number of pairs whose address ranges intersect. *)
Definition check_pairs (bufs : list buffer) : verdict alloc_error :=
  sweep (OffsetSort.sort (index_from 0 bufs)).

(** The checkpoint-F checker: first each buffer on its own (alignment, then
    bounds), then every pair. *)
Definition check_alloc (arena : N) (bufs : list buffer) : verdict alloc_error :=
  match check_each arena 0 bufs with
  | Accept => check_pairs bufs
  | Reject e => Reject e
  end.
