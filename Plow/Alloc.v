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
From Plow Require Counters Dataflow Flowsweep.
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
| Overlap (i lo_i hi_i j lo_j hi_j s_lo s_hi : N)
(** buffers [i] and [j] share bytes, [i]'s live range ends before [j]'s
    starts, but task [u] (an accessor of [i]) does not happen before task [t]
    (an accessor of [j]) by the counter protocol. *)
| Unordered (i u j t : N)
(** buffer [i] has tasks and bytes but an empty live range. *)
| Unlive (i : N).

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

(** * Concurrent sharing (F3): shared bytes only between ordered buffers

    Live ranges are program steps (op positions), but tasks run concurrently:
    two buffers that share bytes at different steps are safe only when every
    task that touches the earlier one happens before every task that touches
    the later one, by the counter protocol's happens-before ([Dataflow.hb]:
    gates and queue order, transitively) that checkpoint D certifies for the
    same plan.  The payload gives, per buffer, the tasks that read or write it
    (derived from the packets' op indices and the op table's operands) and the
    counter plan and sweep order as checkpoint D's payload has them. *)

Definition cplan := Counters.cplan.

(** Every task touching the earlier of two byte-sharing buffers happens before
    (or is) every task touching the later one.  [accs]: per buffer (same
    positions as [bufs]), its accessor tasks. *)
Definition shared_ordered (p : cplan) (bufs : list buffer) (accs : list (list N)) : Prop :=
  forall i j bi bj, i <> j ->
    nth_error bufs i = Some bi -> nth_error bufs j = Some bj ->
    b_last bi <= b_first bj -> (exists a, holds bi a /\ holds bj a) ->
    forall u t, In u (nth i accs []) -> In t (nth j accs []) ->
    u = t \/ Dataflow.hb p u t.

Definition vclock := Flowsweep.vclock.
Definition ctrie := Counters.trie.

(** The vector clock of every task, by one pass over [order] (an untrusted
    witness; D's sweep order): [Flowsweep.clock_of] joins the clocks of the
    counters a task waits on and of its worker's previous task.  Any order is
    sound; a task swept before its predecessors only gets a smaller clock. *)
Fixpoint task_clocks (wtm sgm : ctrie (list N)) (pm : ctrie (N * N)) (order : list N)
  (cv : ctrie vclock) (wv : ctrie (N * vclock)) (m : ctrie vclock) : ctrie vclock :=
  match order with
  | [] => m
  | t :: order' =>
      let vt := Flowsweep.clock_of wtm pm cv wv t in
      let wv' := match Counters.tfind (Counters.nkey t) pm with
                 | Some (w, _) => Counters.tadd (Counters.nkey w) (t, vt) wv
                 | None => wv
                 end in
      task_clocks wtm sgm pm order' (Flowsweep.sig_clocks vt cv (Counters.get sgm [] t)) wv'
        (Counters.tadd (Counters.nkey t) vt m)
  end.

Definition omin (a b : option N) : option N :=
  match a, b with Some x, Some y => Some (N.min x y) | _, _ => None end.

(** Pointwise minimum of two clocks (an entry only where both have one). *)
Fixpoint tmeet (a b : vclock) : vclock :=
  match a, b with
  | Counters.Node l1 o1 r1, Counters.Node l2 o2 r2 =>
      Counters.Node (tmeet l1 l2) (omin o1 o2) (tmeet r1 r2)
  | _, _ => Counters.Leaf
  end.

Definition clock (cm : ctrie vclock) (t : N) : vclock := Counters.get cm Counters.Leaf t.

(** The meet of the clocks of [ts]; [None] when [ts] is empty. *)
Fixpoint meet_clocks (cm : ctrie vclock) (ts : list N) : option vclock :=
  match ts with
  | [] => None
  | t :: ts' =>
      Some (match meet_clocks cm ts' with
            | None => clock cm t
            | Some m => tmeet (clock cm t) m
            end)
  end.

(** The first of [us] that the meet [mv] does not cover. *)
Definition first_unordered (pm : ctrie (N * N)) (mv : option vclock) (us : list N)
  : option N :=
  match mv with
  | None => None
  | Some m => find (fun u => negb (Flowsweep.hbq pm m u)) us
  end.

(** For the error: a task of [ts] whose clock does not cover [u]. *)
Definition witness (pm : ctrie (N * N)) (cm : ctrie vclock) (u : N) (ts : list N) : N :=
  match find (fun t => negb (Flowsweep.hbq pm (clock cm t) u)) ts with
  | Some t => t
  | None => u
  end.

(** Per worker, the highest queue position of a task of [us] ([None]: a task
    of [us] is in no queue). *)
Fixpoint join_pos (pm : ctrie (N * N)) (us : list N) (v : vclock) : option vclock :=
  match us with
  | [] => Some v
  | u :: us' =>
      match Counters.tfind (Counters.nkey u) pm with
      | Some (w, i) => join_pos pm us' (Flowsweep.bump v w i)
      | None => None
      end
  end.

Definition ole (a b : option N) : bool :=
  match a, b with
  | None, _ => true
  | Some x, Some y => x <=? y
  | Some _, None => false
  end.

(** Every entry of [a] is at most [b]'s entry for the same worker (one walk of
    both tries). *)
Fixpoint tle (a b : vclock) : bool :=
  match a with
  | Counters.Leaf => true
  | Counters.Node l1 o1 r1 =>
      match b with
      | Counters.Leaf => ole o1 None && tle l1 Counters.Leaf && tle r1 Counters.Leaf
      | Counters.Node l2 o2 r2 => ole o1 o2 && tle l1 l2 && tle r1 r2
      end
  end.

(** Every task of [x] (its positions [jx]) is covered by the meet [my] of the
    clocks of [y]'s tasks; [y] without tasks asks nothing. *)
Definition covered (jx : option vclock) (my : option vclock) : bool :=
  match my with
  | None => true
  | Some m => match jx with Some j => tle j m | None => false end
  end.

(** ** The sweep over time

    Comparing every two byte-sharing buffers costs the number of such pairs
    (a pool reused by every layer: the square of the layers).  Instead the
    buffers that have tasks and bytes are swept in order of their first live
    step, keeping a frontier: pieces [(buffer, lo, hi)] of the arena, each
    the last swept buffer on those bytes.  A buffer is compared only with the
    frontier pieces it overlaps and then replaces them on its bytes; an older
    buffer under those bytes is ordered before it through the piece that
    covered it (happens-before is transitive and every frontier buffer has a
    task).  Buffers live at a common step never share bytes
    ([check_alloc]), so a buffer that shares bytes with a later-starting one
    ends before that one starts. *)

(** Buffers (with their positions) by first live step. *)
Module FirstOrder <: Orders.TotalLeBool'.
  Definition t : Type := (N * buffer)%type.
  Definition leb (x y : t) : bool := b_first (snd x) <=? b_first (snd y).
  Infix "<=?" := leb (at level 70, no associativity).
  Lemma leb_total : forall x y, (x <=? y) = true \/ (y <=? x) = true.
  Proof.
    intros x y. unfold leb. destruct (N.leb_spec (b_first (snd x)) (b_first (snd y)));
      [left; reflexivity|right; apply N.leb_le; apply N.lt_le_incl; assumption].
  Qed.
End FirstOrder.

Module FirstSort := Mergesort.Sort FirstOrder.

(** A frontier piece: a buffer and bytes [[lo, hi)] of it. *)
Definition piece : Type := (N * N * N)%type.

Definition meets (lo hi a b : N) : bool := (a <? hi) && (lo <? b).

(** The parts of piece [f] outside [[lo, hi)]. *)
Definition outside (lo hi : N) (f : piece) : list piece :=
  let '(z, a, b) := f in
  if meets lo hi a b then
    (if a <? lo then [(z, a, lo)] else []) ++ (if hi <? b then [(z, hi, b)] else [])
  else [f].

Definition ftrim (lo hi : N) (fr : list piece) : list piece := flat_map (outside lo hi) fr.

(** The first frontier buffer overlapping [[lo, hi)] whose tasks the meet
    [my] does not cover. *)
Fixpoint fcheck (jm : ctrie (option vclock)) (my : option vclock) (lo hi : N)
  (fr : list piece) : option N :=
  match fr with
  | [] => None
  | (z, a, b) :: fr' =>
      if meets lo hi a b && negb (covered (Counters.get jm None z) my) then Some z
      else fcheck jm my lo hi fr'
  end.

(** Whether some frontier piece overlaps [[lo, hi)]. *)
Fixpoint fr_meets (lo hi : N) (fr : list piece) : bool :=
  match fr with
  | [] => false
  | (z, a, b) :: fr' => meets lo hi a b || fr_meets lo hi fr'
  end.

(** The sweep.  A buffer's meet of clocks is computed only when some frontier
    piece overlaps it (most buffers, weights and caches, overlap none). *)
Fixpoint fsweep (pm : ctrie (N * N)) (cm : ctrie vclock) (am : ctrie (list N))
  (jm : ctrie (option vclock)) (l : list (N * buffer)) (fr : list piece)
  : option alloc_error :=
  match l with
  | [] => None
  | (j, y) :: l' =>
      match (if fr_meets (b_offset y) (b_end y) fr
             then fcheck jm (meet_clocks cm (Counters.get am [] j)) (b_offset y) (b_end y) fr
             else None) with
      | Some z =>
          let u := match first_unordered pm (meet_clocks cm (Counters.get am [] j))
                           (Counters.get am [] z) with
                   | Some u => u
                   | None => z
                   end in
          Some (Unordered z u j (witness pm cm u (Counters.get am [] j)))
      | None => fsweep pm cm am jm l' ((j, b_offset y, b_end y) :: ftrim (b_offset y) (b_end y) fr)
      end
  end.

(** The buffers the rule is about: with a task and a byte. *)
Definition sharing_entries (am : ctrie (list N)) (bufs : list buffer) : list (N * buffer) :=
  filter (fun e => negb (match Counters.get am [] (fst e) with [] => true | _ => false end)
                   && (0 <? b_size (snd e)))
    (index_from 0 bufs).

Definition check_shared (bufs : list buffer) (p : cplan) (order : list N)
  (accs : list (list N)) : option alloc_error :=
  let pm := Counters.pos_map (Counters.cp_queues p) in
  let cm := task_clocks (Counters.index_map (Counters.cp_waits p))
              (Counters.index_map (Counters.cp_signals p)) pm order
              Counters.Leaf Counters.Leaf Counters.Leaf in
  let am := Counters.index_map accs in
  let jm := Counters.index_map (map (fun us => join_pos pm us Counters.Leaf) accs) in
  let es := sharing_entries am bufs in
  match find (fun e => b_last (snd e) <=? b_first (snd e)) es with
  | Some (i, _) => Some (Unlive i)
  | None => fsweep pm cm am jm (FirstSort.sort es) []
  end.

(** The checkpoint-F checker with the sharing rule: [check_alloc], then every
    two byte-sharing buffers ordered ([check_shared]). *)
Definition check_alloc_ordered (arena : N) (bufs : list buffer) (p : cplan) (order : list N)
  (accs : list (list N)) : verdict alloc_error :=
  match check_alloc arena bufs with
  | Reject e => Reject e
  | Accept => match check_shared bufs p order accs with None => Accept | Some e => Reject e end
  end.
