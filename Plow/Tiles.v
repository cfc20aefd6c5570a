(** * Tiles and cost (checkpoint B): the model, the specifications, and the
    executable checker [check_tiling_plan].  Proofs are in [Tilesproof.v].

    Model.  An op has an index space: a list of axes, axis [j] with extent
    [N_j] (the true size).  A tiling gives each axis a tile size [t_j] and a
    step count [s_j]; step [k < s_j] covers the indices [k*t_j .. k*t_j+t_j-1]
    of that axis, masked at the extent (indices [>= N_j] are padding: the
    hardware may compute them, but they are never written).  A tile of the op
    is one step per axis (a tuple of step numbers).

    The cost side: an op performs [flops_per_point] operations per point of
    its index space (e.g. 2 for a matmul multiply-add over (m, n, k)).  Its
    arithmetic is [flops_per_point * prod N_j]; its padded work (what the
    tiles compute, masked lanes included) is [flops_per_point * prod (s_j*t_j)].
    The tiler charges each op a cost; the charge must cover the padded work.

    The plan side: a target has a memory bandwidth (bytes/s) and a peak
    arithmetic rate (flop/s); the plan has a time budget in ns and moves
    [bytes] per op.  All comparisons are cross-multiplied in N (no division):
    "time [T] ns suffices for [B] bytes" is [B * 10^9 <= T * bandwidth].

    Everything extracted uses [N]; [nat] appears only in propositions. *)
From Coq Require Import NArith List Bool.
From Plow Require Import Loc.
Import ListNotations.
Local Open Scope N_scope.

(** ** Data *)

Record axis := mk_axis {
  ax_extent : N;   (** true size of the axis *)
  ax_tile : N;     (** tile size along the axis *)
  ax_steps : N     (** number of tile steps along the axis *)
}.

Record op := mk_op {
  op_axes : list axis;
  op_fpp : N;      (** arithmetic per point of the index space *)
  op_flops : N;    (** declared arithmetic on the true extents *)
  op_charged : N;  (** cost the tiler charged for this op's tiling *)
  op_bytes : N     (** bytes this op moves to/from device memory *)
}.

Record target := mk_target {
  tg_bandwidth : N;  (** memory bandwidth, bytes per second *)
  tg_peak : N;       (** peak arithmetic, flop per second (all workers) *)
  tg_min_tile : N    (** minimum tile size on any axis *)
}.

Record plan := mk_plan {
  pl_ops : list op;
  pl_target : target;
  pl_budget_ns : N;       (** time budget for one step of the plan, ns *)
  pl_weight_bytes : N     (** weight bytes the step must read (0: none claimed) *)
}.

Definition ns_per_s : N := 1000000000.

(** ** Specifications (T1) *)

(** Step [k] of tile size [t] covers index [i]. *)
Definition step_covers (t k i : N) : Prop := k * t <= i < k * t + t.

(** Every index below the extent is covered by some step. *)
Definition axis_covered (a : axis) : Prop :=
  forall i, i < ax_extent a ->
  exists k, k < ax_steps a /\ step_covers (ax_tile a) k i.

(** No step lies wholly in the padding (each step covers a true index). *)
Definition axis_no_empty_step (a : axis) : Prop :=
  forall k, k < ax_steps a -> k * ax_tile a < ax_extent a.

(** The full specification of a legal tiling of one axis. *)
Definition axis_ok (min : N) (a : axis) : Prop :=
  0 < ax_tile a /\ min <= ax_tile a /\ axis_covered a /\ axis_no_empty_step a.

(** The width of step [k] once masked at the extent. *)
Definition masked_width (t e k : N) : N := N.min t (e - k * t).

(** Sum of the masked widths of steps [0 .. n-1] (a specification device). *)
Fixpoint sum_masked (t e : N) (n : nat) : N :=
  match n with
  | O => 0
  | S n' => sum_masked t e n' + masked_width t e (N.of_nat n')
  end.

(** Multi-axis index spaces: a point is one index per axis, a tile is one
    step number per axis. *)
Fixpoint in_space (axes : list axis) (idx : list N) : Prop :=
  match axes, idx with
  | [], [] => True
  | a :: r, i :: is => i < ax_extent a /\ in_space r is
  | _, _ => False
  end.

Fixpoint tile_covers (axes : list axis) (ks idx : list N) : Prop :=
  match axes, ks, idx with
  | [], [], [] => True
  | a :: r, k :: ks', i :: is =>
      k < ax_steps a /\ step_covers (ax_tile a) k i /\ tile_covers r ks' is
  | _, _, _ => False
  end.

(** T1 for an op: every point of the index space is covered by a tile. *)
Definition op_covered (axes : list axis) : Prop :=
  forall idx, in_space axes idx -> exists ks, tile_covers axes ks idx.

(** ** Cost (T3) *)

Fixpoint prodN (l : list N) : N :=
  match l with [] => 1 | x :: r => x * prodN r end.

Definition sumN (l : list N) : N := fold_right N.add 0 l.

Definition padded_extent (a : axis) : N := ax_steps a * ax_tile a.

(** Arithmetic on the true extents. *)
Definition arithmetic (o : op) : N := op_fpp o * prodN (map ax_extent (op_axes o)).

(** Work of the padded tiles (masked lanes included). *)
Definition padded_work (o : op) : N := op_fpp o * prodN (map padded_extent (op_axes o)).

Definition plan_bytes (p : plan) : N := sumN (map op_bytes (pl_ops p)).
Definition plan_flops (p : plan) : N := sumN (map op_flops (pl_ops p)).

(** ** Errors: every one names its location (op index, axis index). *)
Inductive tile_error :=
| E_zero_tile (op ax : N)
| E_below_min (op ax tile min : N)
| E_hole (op ax covered extent : N)          (** steps cover [0 .. covered) only *)
| E_empty_step (op ax step start extent : N) (** step starts at/after the extent *)
| E_flops_mismatch (op declared expected : N)
| E_charged_below_arith (op charged arith : N)
| E_charged_below_padded (op charged padded : N)
| E_weights_undercounted (bytes weight_bytes : N)
| E_bandwidth (dominant_op bytes : N)        (** bytes * 10^9 > budget * bandwidth *)
| E_compute (dominant_op flops : N)          (** flops * 10^9 > budget * peak *)
(** The task and shape checks of [Partition.v] (class: 0 tiles of compute
    tasks, 1 merge units of merge tasks, 2 tiles of load tasks). *)
| E_tasks_count (ops lists : N)              (** one task list per op expected *)
| E_kind_unknown (op : N)                    (** no shape rule for the op's kind *)
| E_op_opcode (op actual expected : N)       (** the op table's opcode is not its kind's *)
| E_shapes (op : N)                          (** the tensors' shapes do not fit the kind *)
| E_axes_count (op actual expected : N)
| E_extent (op ax actual expected : N)       (** extent is not the tensors' size *)
| E_task_empty (op task : N)
| E_task_range (op cls task start count limit : N)  (** ends past the unit space *)
| E_task_overlap (op cls task start prev_end : N)   (** a unit run twice *)
| E_task_gap (op cls task start prev_end : N)       (** units [prev_end, start) run by none *)
| E_units_uncovered (op cls covered limit : N)      (** units [covered, limit) run by none *)
| E_task_opcode (op task actual expected : N)
| E_task_masked (op task : N) (flagged overhangs : bool)
| E_task_accumulate (op task : N).           (** ACCUMULATE on a load *)

(** ** The executable checker *)

Definition check_axis (min oi ai : N) (a : axis) : verdict tile_error :=
  let t := ax_tile a in
  let s := ax_steps a in
  let e := ax_extent a in
  if t =? 0 then Reject (E_zero_tile oi ai)
  else if t <? min then Reject (E_below_min oi ai t min)
  else if s * t <? e then Reject (E_hole oi ai (s * t) e)
  else if (0 <? s) && (e <=? (s - 1) * t) then Reject (E_empty_step oi ai (s - 1) ((s - 1) * t) e)
  else Accept.

Fixpoint check_axes (min oi ai : N) (l : list axis) : verdict tile_error :=
  match l with
  | [] => Accept
  | a :: r =>
      match check_axis min oi ai a with
      | Accept => check_axes min oi (N.succ ai) r
      | Reject e => Reject e
      end
  end.

Definition check_op (min oi : N) (o : op) : verdict tile_error :=
  match check_axes min oi 0 (op_axes o) with
  | Reject e => Reject e
  | Accept =>
      let ar := arithmetic o in
      let pw := padded_work o in
      if negb (op_flops o =? ar) then Reject (E_flops_mismatch oi (op_flops o) ar)
      else if op_charged o <? ar then Reject (E_charged_below_arith oi (op_charged o) ar)
      else if op_charged o <? pw then Reject (E_charged_below_padded oi (op_charged o) pw)
      else Accept
  end.

Fixpoint check_ops (min oi : N) (l : list op) : verdict tile_error :=
  match l with
  | [] => Accept
  | o :: r =>
      match check_op min oi o with
      | Accept => check_ops min (N.succ oi) r
      | Reject e => Reject e
      end
  end.

(** Index of the first op maximising [f] (0 for an empty list): used only
    to name the dominating op in a reason. *)
Fixpoint argmax_from (f : op -> N) (i best : N) (bv : N) (l : list op) : N :=
  match l with
  | [] => best
  | o :: r => if bv <? f o then argmax_from f (N.succ i) i (f o) r
              else argmax_from f (N.succ i) best bv r
  end.
Definition argmax (f : op -> N) (l : list op) : N := argmax_from f 0 0 0 l.

(** T5: the plan-level bounds, cross-multiplied. *)
Definition check_bounds (p : plan) : verdict tile_error :=
  let tg := pl_target p in
  let b := plan_bytes p in
  let f := plan_flops p in
  if b <? pl_weight_bytes p then Reject (E_weights_undercounted b (pl_weight_bytes p))
  else if pl_budget_ns p * tg_bandwidth tg <? b * ns_per_s
  then Reject (E_bandwidth (argmax op_bytes (pl_ops p)) b)
  else if pl_budget_ns p * tg_peak tg <? f * ns_per_s
  then Reject (E_compute (argmax op_flops (pl_ops p)) f)
  else Accept.

(** Checkpoint B: coverage of every axis of every op, cost >= arithmetic,
    and the plan within the bandwidth and compute bounds. *)
Definition check_tiling_plan (p : plan) : verdict tile_error :=
  match check_ops (tg_min_tile (pl_target p)) 0 (pl_ops p) with
  | Accept => check_bounds p
  | Reject e => Reject e
  end.
