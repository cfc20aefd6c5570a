(** * Tasks partition the tiles, extents are the tensors' shapes, packets
    say what their op is (checkpoint B, continued).  Proofs are in
    [Partitionproof.v]; the top theorem of B, [Tilesproof.checkpoint_b_sound],
    has these as a conjunct.

    [Tiles.v] checks that an op's tile steps cover its index space.  That is
    only worth something if (1) the index space is the op's real one — each
    axis extent is what the op's tensors' shapes say — and (2) the tiles are
    what runs: the plan's tasks, read from the plan file's packets, run every
    tile of every op exactly once.  Here, per op:

    - the op's kind has a shape rule, and the op table's opcode is the kind's
      (the fused kinds of [kernels/fused.h] too: add_rmsnorm, linear_glu,
      linear_qkv, their packets carrying the opcode of their main canonical op);
    - [expected_extents]: the extents the kind's rule computes from the
      shapes of the op's input and output tensors equal the axes' extents;
    - the compute tasks' unit ranges [start, start+count) partition the op's
      tiles [0, prod steps) (tile [u] is row-major over the axes, last axis
      fastest); the merge tasks' ranges partition its merge units
      [0, merge_units) (the output blocks of a split reduction; none for an
      op that is not split); a load task's range lies within the tiles;
    - each task packet's opcode is its op's (merges: the kind's merge opcode
      or [allreduce]; loads: [load]), and its [MASKED] flag is set exactly
      when one of its tiles overhangs an extent ([tile_masked]); merges are
      never masked and loads never accumulate.

    A task is classified by its packet as the runtime does: opcode [load] is
    a load; else flag [ACCUMULATE] is a merge; else a compute task.

    The payload lists each op's tasks sorted by their start (the producer's
    job, not trusted: a list out of order is rejected, never accepted
    wrongly).  The check is linear in the tasks, plus the tiles of the tasks
    whose flag says "not masked" (a masked one stops at its first masked
    tile).  Everything extracted is binary ([N], [positive]). *)
From Coq Require Import NArith List Bool.
From Plow Require Import Loc Tiles.
Import ListNotations.
Local Open Scope N_scope.

(** ** Data *)

Inductive op_kind :=
| K_embedding | K_rmsnorm | K_linear | K_rope | K_attention
| K_gated_mlp | K_residual_add | K_lm_head | K_sample
| K_router | K_expert_linear
| K_ssm_conv | K_ssm_scan | K_ssm_norm
| K_kda  (* Kimi-Linear (plow/graph/kda.py, kernels/kda.h) *)
| K_add_rmsnorm | K_linear_glu | K_linear_qkv  (* fused (issue 15, kernels/fused.h) *)
| K_allreduce  (* tensor parallel (plow/graph/shard.py, kernels/collective.h) *)
| K_other.

(** One task, as its task packet says: [pt_id] its index in the plan
    (for reasons), the unit range [pt_start, pt_start + pt_count), the
    packet's opcode and flags. *)
Record ptask := mk_ptask {
  pt_id : N; pt_start : N; pt_count : N; pt_opcode : N; pt_flags : N
}.

(** What B needs of one op beyond its tiling: kind and opcode (op table),
    the shapes of its input and output tensors in operand order, the
    attributes the shape rules read ([group] 0: none), the merge units of a
    split reduction (0 when not split), and its tasks. *)
Record opx := mk_opx {
  ox_kind : op_kind;
  ox_opcode : N;
  ox_ins : list (list N);
  ox_outs : list (list N);
  ox_heads : N;
  ox_head_dim : N;
  ox_group : N;
  ox_window : option N;
  ox_merge_units : N;
  ox_tasks : list ptask
}.

(** ** Opcodes (docs/wire.md) *)

Definition opcode_load : N := 1.
Definition opcode_attention_merge : N := 7.
Definition opcode_allreduce : N := 15.

Definition opcode_of_kind (k : op_kind) : option N :=
  match k with
  | K_embedding => Some 2 | K_rmsnorm => Some 3 | K_linear => Some 4
  | K_rope => Some 5 | K_attention => Some 6 | K_gated_mlp => Some 8
  | K_residual_add => Some 10 | K_lm_head => Some 11 | K_sample => Some 12
  | K_router => Some 13 | K_expert_linear => Some 14
  | K_ssm_conv => Some 16 | K_ssm_scan => Some 17 | K_ssm_norm => Some 18
  | K_kda => Some 19
  | K_add_rmsnorm => Some 3 | K_linear_glu => Some 8 | K_linear_qkv => Some 4
  | K_allreduce => Some opcode_allreduce
  | K_other => None
  end.

(** A merge packet computes the kind's opcode, attention's own merge, or an
    allreduce (tensor parallel). *)
Definition merge_opcode_ok (k : op_kind) (code c : N) : bool :=
  (c =? (match k with K_attention => opcode_attention_merge | _ => code end))
  || (c =? opcode_allreduce).

Definition flag_masked (fl : N) : bool := N.testbit fl 0.
Definition flag_accumulate (fl : N) : bool := N.testbit fl 4.

Inductive tclass := TC_compute | TC_merge | TC_load.

Definition classify (t : ptask) : tclass :=
  if pt_opcode t =? opcode_load then TC_load
  else if flag_accumulate (pt_flags t) then TC_merge else TC_compute.

Definition is_compute (t : ptask) : bool :=
  match classify t with TC_compute => true | _ => false end.
Definition is_merge (t : ptask) : bool :=
  match classify t with TC_merge => true | _ => false end.

(** ** Shape rules: which tensor dims each axis extent is *)

Definition numel (s : list N) : N := prodN s.
Definition last_dim (s : list N) : N := last s 1.

(** The extents of the op's axes, from the shapes of its first input [x],
    its other inputs and its first output [o] (docs/oracle.md, "Checkpoint
    B"); [None] when the shapes do not fit the kind:

    - linear, lm_head: weight [[n; k]], axes [m; n; k] with
      [m = numel x / k], [m * k = numel x], [last x = k], [numel o = m * n];
    - attention: [x] = q [[b; t; ...]], input 3 the key cache
      [[_; _; ctx; _]], axes [rows; s; d] with [rows = b * t * heads],
      [d = head_dim], [s = ctx] (a sliding window [w]: [min ctx (w + t - 1)]),
      [numel q = numel o = rows * d];
    - embedding: table [[_; c]], axes [numel ids; c], [numel o = numel ids * c];
    - rmsnorm: [c] = the group when set, else [last x]; axes [numel x / c; c],
      divisible, [numel o = numel x];
    - rope, gated_mlp, residual_add: [c = last x], axes [numel x / c; c],
      divisible, [numel o = numel x];
    - sample: logits [[b; ...]] (at least 2-d), axes [b; last x], [numel o = b];
    - router: as rope ([c = last x], axes [numel x / c; c]);
    - expert_linear: input 1 the router weights [r] with [m * e = numel r], input 2
      the stacked experts [[e; wn; k]], [numel x = m * last x]; gate_up ([last x = k],
      [wn = 2 h], [numel o = m * e * h]): axes [m; e * h; k]; down ([last x = e * k],
      [numel o = m * wn]): axes [m; wn; e * k];
    - ssm_conv (Mamba-2): [o = [b; t; c]], [x = [b; t; _]]: axes [b; c] (every token of a
      batch row in its tile);
    - ssm_scan, kda (Kimi-Linear): [o = [b; t; heads * head_dim]], [x = [b; t; _]]:
      axes [b; heads];
    - ssm_norm: [c = last o], the group [g > 0] divides [c], [numel o = numel x]:
      axes [numel x / c; c / g];
    - add_rmsnorm (R1: inputs a, b, the norm weight w; outputs the sum s, the norm):
      [c = last a], axes [numel a / c; c], divisible; b, s and the norm have [a]'s
      rows x cols ([numel = numel a], [last = c]), [numel w = c], no group;
    - linear_glu (R2+R3+R13): the interleaved weight [[2 n; k]] (rows 2i, 2i + 1 are
      column i's gate and up), axes [m; n; k] with [m * k = numel x], [last x = k],
      [numel o = m * n], [last o = n];
    - allreduce (tensor parallel): every input (one partial per device) and the
      output have [x]'s rows x cols ([numel = numel x], [last = c = last x]): axes
      [numel x / c; c], divisible;
    - linear_qkv (R4): the weight cat3(Wq, Wk, Wv) [[n; k]], outputs q, k, v each
      [m] rows of its last dim, the last dims summing to [n]: axes [m; n; k] with
      [m * k = numel x], [last x = k].

    The fused matmuls may split [k] like a linear: their k tiles write partials and
    their merge tasks carry the op's opcode ([merge_opcode_ok]). *)
Definition expected_extents (x : opx) : option (list N) :=
  match ox_ins x, ox_outs x with
  | xs :: rest, o :: _ =>
      match ox_kind x with
      | K_linear | K_lm_head =>
          match rest with
          | [n; k] :: _ =>
              let m := numel xs / k in
              if (m * k =? numel xs) && (last_dim xs =? k) && (numel o =? m * n)
              then Some [m; n; k] else None
          | _ => None
          end
      | K_attention =>
          match xs, rest with
          | b :: t :: _, _ :: _ :: [_; _; ctx; _] :: _ =>
              let rows := b * t * ox_heads x in
              let d := ox_head_dim x in
              let s := match ox_window x with
                       | None => ctx
                       | Some w => N.min ctx (w + t - 1)
                       end in
              if (numel xs =? rows * d) && (numel o =? rows * d)
              then Some [rows; s; d] else None
          | _, _ => None
          end
      | K_embedding =>
          match rest with
          | [_; c] :: _ =>
              if numel o =? numel xs * c then Some [numel xs; c] else None
          | _ => None
          end
      | K_rmsnorm =>
          let c := if ox_group x =? 0 then last_dim xs else ox_group x in
          let r := numel xs / c in
          if (r * c =? numel xs) && (numel o =? numel xs) then Some [r; c] else None
      | K_rope | K_gated_mlp | K_residual_add =>
          let c := last_dim xs in
          let r := numel xs / c in
          if (r * c =? numel xs) && (numel o =? numel xs) then Some [r; c] else None
      | K_sample =>
          match xs with
          | b :: _ :: _ => if numel o =? b then Some [b; last_dim xs] else None
          | _ => None
          end
      | K_router =>
          let c := last_dim xs in
          let r := numel xs / c in
          if (r * c =? numel xs) && (numel o =? numel xs) then Some [r; c] else None
      | K_expert_linear =>
          match rest with
          | rt :: [e; wn; k] :: _ =>
              let m := numel rt / e in
              let h := wn / 2 in
              let rows_ok := (m * e =? numel rt) && (numel xs =? m * last_dim xs) in
              if rows_ok && (last_dim xs =? k) && (h * 2 =? wn) && (numel o =? m * (e * h))
              then Some [m; e * h; k]
              else if rows_ok && (last_dim xs =? e * k) && (numel o =? m * wn)
              then Some [m; wn; e * k] else None
          | _ => None
          end
      | K_ssm_conv =>
          match xs, o with
          | b' :: t' :: _, [b; t; c] =>
              if (b' =? b) && (t' =? t) then Some [b; c] else None
          | _, _ => None
          end
      | K_ssm_scan | K_kda =>
          match xs, o with
          | b' :: t' :: _, [b; t; w] =>
              if (b' =? b) && (t' =? t) && (ox_heads x * ox_head_dim x =? w)
              then Some [b; ox_heads x] else None
          | _, _ => None
          end
      | K_ssm_norm =>
          let c := last_dim o in
          let g := ox_group x in
          if negb (g =? 0) && (c / g * g =? c) && (numel o =? numel xs)
             && (numel xs / c * c =? numel xs)
          then Some [numel xs / c; c / g] else None
      | K_add_rmsnorm =>
          match rest, ox_outs x with
          | bs :: ws :: _, [s; nr] =>
              let c := last_dim xs in
              let r := numel xs / c in
              let same t := (numel t =? numel xs) && (last_dim t =? c) in
              if (r * c =? numel xs) && same bs && same s && same nr && (numel ws =? c)
                 && (ox_group x =? 0)
              then Some [r; c] else None
          | _, _ => None
          end
      | K_linear_glu =>
          match rest with
          | [wn; k] :: _ =>
              let n := wn / 2 in
              let m := numel xs / k in
              if (n * 2 =? wn) && (m * k =? numel xs) && (last_dim xs =? k)
                 && (numel o =? m * n) && (last_dim o =? n)
              then Some [m; n; k] else None
          | _ => None
          end
      | K_linear_qkv =>
          match rest, ox_outs x with
          | [n; k] :: _, [q; kk; v] =>
              let m := numel xs / k in
              let rows_of t := numel t =? m * last_dim t in
              if (m * k =? numel xs) && (last_dim xs =? k)
                 && (last_dim q + last_dim kk + last_dim v =? n)
                 && rows_of q && rows_of kk && rows_of v
              then Some [m; n; k] else None
          | _, _ => None
          end
      | K_allreduce =>
          let c := last_dim xs in
          let r := numel xs / c in
          let same t := (numel t =? numel xs) && (last_dim t =? c) in
          if (r * c =? numel xs) && forallb same rest && (numel o =? numel xs)
             && (last_dim o =? c)
          then Some [r; c] else None
      | K_other => None
      end
  | _, _ => None
  end.

(** ** Masked tiles *)

(** Step [k] of axis [a] overhangs the extent. *)
Definition masked_step (a : axis) (k : N) : bool := ax_extent a <? (k + 1) * ax_tile a.

(** Tile [u] decoded row-major, last axis first ([axes_rev] = the axes
    reversed): its step on the last axis is [u mod steps], the rest is
    [u / steps] on the other axes. *)
Fixpoint masked_digits (axes_rev : list axis) (u : N) : bool :=
  match axes_rev with
  | [] => false
  | a :: r => masked_step a (u mod ax_steps a) || masked_digits r (u / ax_steps a)
  end.

Definition tile_masked (axes : list axis) (u : N) : bool := masked_digits (rev axes) u.

(** [f] holds for some [u] in [a, a + p): binary recursion on [p]. *)
Fixpoint any_pos (f : N -> bool) (a : N) (p : positive) : bool :=
  match p with
  | xH => f a
  | xO q => any_pos f a q || any_pos f (a + Npos q) q
  | xI q => f a || any_pos f (a + 1) q || any_pos f (a + 1 + Npos q) q
  end.

Definition any_in (f : N -> bool) (a n : N) : bool :=
  match n with N0 => false | Npos p => any_pos f a p end.

(** ** Specifications *)

Definition covers (t : ptask) (u : N) : Prop :=
  pt_start t <= u < pt_start t + pt_count t.

(** The tasks' ranges partition the units [0, lim): every task is nonempty
    and within [lim], and every unit is run by exactly one task (one
    position of the list). *)
Definition partitions (lim : N) (ts : list ptask) : Prop :=
  (forall t, In t ts -> 0 < pt_count t /\ pt_start t + pt_count t <= lim) /\
  (forall u, u < lim ->
     exists i t, nth_error ts i = Some t /\ covers t u /\
       forall j t', nth_error ts j = Some t' -> covers t' u -> j = i).

Definition overhangs (axes : list axis) (t : ptask) : Prop :=
  exists u, covers t u /\ tile_masked axes u = true.

Definition tiles_of (o : op) : N := prodN (map ax_steps (op_axes o)).

(** What one accepted op satisfies. *)
Definition task_ok (o : op) (x : opx) (t : ptask) : Prop :=
  match classify t with
  | TC_compute =>
      pt_opcode t = ox_opcode x /\
      (flag_masked (pt_flags t) = true <-> overhangs (op_axes o) t)
  | TC_load =>
      0 < pt_count t /\ pt_start t + pt_count t <= tiles_of o /\
      flag_accumulate (pt_flags t) = false /\
      (flag_masked (pt_flags t) = true <-> overhangs (op_axes o) t)
  | TC_merge =>
      merge_opcode_ok (ox_kind x) (ox_opcode x) (pt_opcode t) = true /\
      flag_masked (pt_flags t) = false
  end.

Definition op_tasks_ok (o : op) (x : opx) : Prop :=
  opcode_of_kind (ox_kind x) = Some (ox_opcode x) /\
  expected_extents x = Some (map ax_extent (op_axes o)) /\
  partitions (tiles_of o) (filter is_compute (ox_tasks x)) /\
  partitions (ox_merge_units x) (filter is_merge (ox_tasks x)) /\
  Forall (task_ok o x) (ox_tasks x).

(** ** The executable checker *)

Fixpoint first_some {A : Type} (f : A -> option tile_error) (l : list A)
  : option tile_error :=
  match l with
  | [] => None
  | x :: r => match f x with Some e => Some e | None => first_some f r end
  end.

Definition count_n {A : Type} (l : list A) : N := fold_left (fun n _ => N.succ n) l 0.

(** Axis extents against the rule's ([ai] counts the axes). *)
Fixpoint check_extents (oi ai : N) (l : list axis) (es : list N) : option tile_error :=
  match l, es with
  | [], [] => None
  | a :: l', e :: es' =>
      if ax_extent a =? e then check_extents oi (N.succ ai) l' es'
      else Some (E_extent oi ai (ax_extent a) e)
  | _, _ => None  (* lengths are compared before *)
  end.

(** The ranges, in list order, are consecutive from [next] and end at [lim]. *)
Fixpoint chain (oi cls lim next : N) (ts : list ptask) : option tile_error :=
  match ts with
  | [] => if next <? lim then Some (E_units_uncovered oi cls next lim) else None
  | t :: r =>
      let s := pt_start t in
      let c := pt_count t in
      if c =? 0 then Some (E_task_empty oi (pt_id t))
      else if lim <? s + c then Some (E_task_range oi cls (pt_id t) s c lim)
      else if s <? next then Some (E_task_overlap oi cls (pt_id t) s next)
      else if next <? s then Some (E_task_gap oi cls (pt_id t) s next)
      else chain oi cls lim (s + c) r
  end.

(** One task's packet: opcode, flags, and a load's range. *)
Definition check_task (ar : list axis) (k : op_kind) (code oi tiles : N) (t : ptask)
  : option tile_error :=
  let fl := pt_flags t in
  match classify t with
  | TC_compute =>
      if negb (pt_opcode t =? code) then Some (E_task_opcode oi (pt_id t) (pt_opcode t) code)
      else
        let hang := any_in (masked_digits ar) (pt_start t) (pt_count t) in
        if negb (Bool.eqb (flag_masked fl) hang)
        then Some (E_task_masked oi (pt_id t) (flag_masked fl) hang)
        else None
  | TC_load =>
      if pt_count t =? 0 then Some (E_task_empty oi (pt_id t))
      else if tiles <? pt_start t + pt_count t
      then Some (E_task_range oi 2 (pt_id t) (pt_start t) (pt_count t) tiles)
      else if flag_accumulate fl then Some (E_task_accumulate oi (pt_id t))
      else
        let hang := any_in (masked_digits ar) (pt_start t) (pt_count t) in
        if negb (Bool.eqb (flag_masked fl) hang)
        then Some (E_task_masked oi (pt_id t) (flag_masked fl) hang)
        else None
  | TC_merge =>
      if negb (merge_opcode_ok k code (pt_opcode t))
      then Some (E_task_opcode oi (pt_id t) (pt_opcode t)
                   (match k with K_attention => opcode_attention_merge | _ => code end))
      else if flag_masked fl then Some (E_task_masked oi (pt_id t) true false)
      else None
  end.

Definition check_opx (oi : N) (o : op) (x : opx) : option tile_error :=
  match opcode_of_kind (ox_kind x) with
  | None => Some (E_kind_unknown oi)
  | Some code =>
      if negb (ox_opcode x =? code) then Some (E_op_opcode oi (ox_opcode x) code) else
      match expected_extents x with
      | None => Some (E_shapes oi)
      | Some es =>
          let axes := op_axes o in
          if negb (count_n axes =? count_n es)
          then Some (E_axes_count oi (count_n axes) (count_n es)) else
          match check_extents oi 0 axes es with
          | Some e => Some e
          | None =>
              let tiles := tiles_of o in
              let ts := ox_tasks x in
              match chain oi 0 tiles 0 (filter is_compute ts) with
              | Some e => Some e
              | None =>
                  match chain oi 1 (ox_merge_units x) 0 (filter is_merge ts) with
                  | Some e => Some e
                  | None => first_some (check_task (rev axes) (ox_kind x) code oi tiles) ts
                  end
              end
          end
      end
  end.

Fixpoint check_opxs (oi : N) (os : list op) (xs : list opx) : option tile_error :=
  match os, xs with
  | o :: os', x :: xs' =>
      match check_opx oi o x with Some e => Some e | None => check_opxs (N.succ oi) os' xs' end
  | _, _ => None
  end.

(** The task and shape checks of a plan: one entry of [xs] per op. *)
Definition check_plan_tasks (p : plan) (xs : list opx) : verdict tile_error :=
  let no := count_n (pl_ops p) in
  let nx := count_n xs in
  if negb (no =? nx) then Reject (E_tasks_count no nx)
  else match check_opxs 0 (pl_ops p) xs with None => Accept | Some e => Reject e end.

(** Checkpoint B: the tiling of [Tiles.v], then (when the payload lists the
    tasks) the checks above.  The payload built from a bundle ([plow
    verify]) always lists them; a tiling checked before scheduling has none. *)
Definition check_checkpoint_b (p : plan) (xs : option (list opx)) : verdict tile_error :=
  match check_tiling_plan p with
  | Reject e => Reject e
  | Accept => match xs with None => Accept | Some l => check_plan_tasks p l end
  end.
