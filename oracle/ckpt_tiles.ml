(* Checkpoint B: tile coverage, charged cost >= arithmetic, plan within the
   bandwidth and compute bounds.
   Payload (plow/oracle/payloads/tiles.py, docs/oracle.md "Checkpoint B"):
     { "target": { "name": str, "bandwidth_bytes_per_s": int, "peak_flops_per_s": int,
                   "min_tile": int },
       "budget_ns": int, "weight_bytes": int,
       "ops": [ { "name": str, "kind": str,
                  "axes": [ {"name": str, "extent": int, "tile": int, "steps": int} ],
                  "flops_per_point": int, "flops": int, "charged_cost": int, "bytes": int,
                  "plan": null | { "opcode": int, "inputs": [[int]], "outputs": [[int]],
                                   "heads": int, "head_dim": int, "group": int,
                                   "window": null | int, "merge_units": int,
                                   "tasks": [ {"task": int, "name": str, "start": int,
                                               "count": int, "opcode": int, "flags": int} ] } } ] }
   "plan" is null on every op (a tiling checked before scheduling) or on none (a bundle).
   Checker: Plow.Partition.check_checkpoint_b (Plow.Tiles.check_tiling_plan, then the
   task partition and shape checks); soundness: Plow.Tilesproof.checkpoint_b_sound. *)
open Checkers

type ax = { aname : string; extent : int; tile : int; steps : int }

type ptask_r = { tid : int; tname : string; start : int; count : int; topcode : int; tflags : int }

type plan_r = {
  opcode : int; inputs : int list list; outputs : int list list;
  heads : int; head_dim : int; group : int; window : int option; merge_units : int;
  tasks : ptask_r list;
}

type op_r = {
  name : string; kind : string; axes : ax list;
  fpp : int; flops : int; charged : int; bytes : int; plan : plan_r option;
}

(* Tail-recursive map: a 12B plan lists ~60,000 tasks. *)
let map f l = List.rev (List.rev_map f l)

let read_axis j =
  { aname = Jnum.str_field "name" j; extent = Jnum.int_field "extent" j;
    tile = Jnum.int_field "tile" j; steps = Jnum.int_field "steps" j }

let read_task j =
  { tid = Jnum.int_field "task" j; tname = Jnum.str_field "name" j;
    start = Jnum.int_field "start" j; count = Jnum.int_field "count" j;
    topcode = Jnum.int_field "opcode" j; tflags = Jnum.int_field "flags" j }

let read_shape what j = map (Jnum.to_int what) (Jnum.to_list what j)
let read_shapes what j = map (read_shape what) (Jnum.list_field what j)

let read_plan j =
  { opcode = Jnum.int_field "opcode" j;
    inputs = read_shapes "inputs" j; outputs = read_shapes "outputs" j;
    heads = Jnum.int_field "heads" j; head_dim = Jnum.int_field "head_dim" j;
    group = Jnum.int_field "group" j;
    window = (match Jnum.field "window" j with `Null -> None | w -> Some (Jnum.to_int "window" w));
    merge_units = Jnum.int_field "merge_units" j;
    tasks = map read_task (Jnum.list_field "tasks" j) }

let read_op j =
  { name = Jnum.str_field "name" j; kind = Jnum.str_field "kind" j;
    axes = List.map read_axis (Jnum.list_field "axes" j);
    fpp = Jnum.int_field "flops_per_point" j; flops = Jnum.int_field "flops" j;
    charged = Jnum.int_field "charged_cost" j; bytes = Jnum.int_field "bytes" j;
    plan = (match j with
            | `Assoc kv -> (match List.assoc_opt "plan" kv with
                            | None | Some `Null -> None
                            | Some p -> Some (read_plan p))
            | _ -> None) }

let n = Jnum.n_of_int
let i = Jnum.int_of_n

let to_coq_op (o : op_r) : op =
  { op_axes = List.map (fun a -> { ax_extent = n a.extent; ax_tile = n a.tile; ax_steps = n a.steps }) o.axes;
    op_fpp = n o.fpp; op_flops = n o.flops; op_charged = n o.charged; op_bytes = n o.bytes }

(* The op kinds of the graph (docs/graph.md) as the checker's [op_kind]; any other
   kind has no shape rule (rejected). *)
let kind_of (k : string) : op_kind =
  match k with
  | "embedding" -> K_embedding | "rmsnorm" -> K_rmsnorm | "linear" -> K_linear
  | "rope" -> K_rope | "attention" -> K_attention | "gated_mlp" -> K_gated_mlp
  | "residual_add" -> K_residual_add | "lm_head" -> K_lm_head | "sample" -> K_sample
  | "router" -> K_router | "expert_linear" -> K_expert_linear
  | "ssm_conv" -> K_ssm_conv | "ssm_scan" -> K_ssm_scan | "ssm_norm" -> K_ssm_norm
  | "kda" -> K_kda
  (* fused (issue 15, plow/egraph/apply.py): packets carry RMSNORM / MLP_GATE_UP / LINEAR *)
  | "add_rmsnorm" -> K_add_rmsnorm | "linear_glu" -> K_linear_glu | "linear_qkv" -> K_linear_qkv
  | "allreduce" -> K_allreduce
  | _ -> K_other

let to_coq_task (t : ptask_r) : ptask =
  { pt_id = n t.tid; pt_start = n t.start; pt_count = n t.count;
    pt_opcode = n t.topcode; pt_flags = n t.tflags }

let to_coq_opx (kind : string) (x : plan_r) : opx =
  { ox_kind = kind_of kind; ox_opcode = n x.opcode;
    ox_ins = map (map n) x.inputs; ox_outs = map (map n) x.outputs;
    ox_heads = n x.heads; ox_head_dim = n x.head_dim; ox_group = n x.group;
    ox_window = (match x.window with None -> None | Some w -> Some (n w));
    ox_merge_units = n x.merge_units; ox_tasks = map to_coq_task x.tasks }

let opcode_names = [| "nop"; "load"; "embed"; "rmsnorm"; "linear"; "rope"; "attention";
  "attention_merge"; "mlp_gate_up"; "mlp_down"; "residual_add"; "lm_head"; "sample";
  "router"; "expert_linear"; "allreduce"; "ssm_conv"; "ssm_scan"; "ssm_norm"; "kda" |]

let opcode_name c = if c >= 0 && c < Array.length opcode_names then opcode_names.(c) else "?"

let shape_str (s : int list) = "[" ^ String.concat ", " (List.map string_of_int s) ^ "]"
let shapes_str (l : int list list) = String.concat ", " (List.map shape_str l)

let tiling_theorems = [
  "Plow.Tilesproof.checkpoint_b_sound";
  "Plow.Tilesproof.check_axis_sound";
  "Plow.Tilesproof.op_covered_of_axes";
  "Plow.Tilesproof.tile_unique";
  "Plow.Tilesproof.sum_masked_all";
  "Plow.Tilesproof.charged_ge_arithmetic";
  "Plow.Tilesproof.charged_comparison_sound";
  "Plow.Bounds.makespan_lower_bounds";
  "Plow.Bounds.decode_per_token_ge_weights";
]

let task_theorems = [
  "Plow.Partitionproof.check_plan_tasks_sound";
  "Plow.Partitionproof.chain_partitions";
  "Plow.Partitionproof.check_task_sound";
]

(* Numbers in reasons: exact below a million, else like 1.2e10. *)
let num (x : float) : string =
  if Float.abs x < 1e6 && Float.is_integer x then Printf.sprintf "%.0f" x
  else
    let s = Printf.sprintf "%.3g" x in
    match String.index_opt s 'e' with
    | None -> s
    | Some k ->
        let mant = String.sub s 0 k in
        let ex = int_of_string (String.sub s (k + 1) (String.length s - k - 1)) in
        Printf.sprintf "%se%d" mant ex

(* A duration given in (fractional) ns. *)
let dur (ns : float) : string =
  if ns >= 1e9 then Printf.sprintf "%.3g s" (ns /. 1e9)
  else if ns >= 1e6 then Printf.sprintf "%.3g ms" (ns /. 1e6)
  else if ns >= 1e3 then Printf.sprintf "%.3g us" (ns /. 1e3)
  else Printf.sprintf "%.3g ns" ns

let check (payload : Yojson.Safe.t) : Verdict.t =
  let tg = Jnum.field "target" payload in
  let tname = Jnum.str_field "name" tg in
  let bw = Jnum.int_field "bandwidth_bytes_per_s" tg in
  let peak = Jnum.int_field "peak_flops_per_s" tg in
  let min_tile = Jnum.int_field "min_tile" tg in
  let budget = Jnum.int_field "budget_ns" payload in
  let weight_bytes = Jnum.int_field "weight_bytes" payload in
  let ops = Array.of_list (map read_op (Jnum.list_field "ops" payload)) in
  let opl = Array.to_list ops in
  let p = {
    pl_ops = map to_coq_op opl;
    pl_target = { tg_bandwidth = n bw; tg_peak = n peak; tg_min_tile = n min_tile };
    pl_budget_ns = n budget; pl_weight_bytes = n weight_bytes } in
  let with_plan = List.filter (fun o -> o.plan <> None) opl in
  let xs =
    if with_plan = [] then None
    else if List.length with_plan <> Array.length ops then
      Verdict.bad "field \"plan\": set on %d of %d ops (all or none)"
        (List.length with_plan) (Array.length ops)
    else Some (map (fun o -> match o.plan with Some x -> to_coq_opx o.kind x | None -> assert false) opl)
  in
  (* task id -> (name, start, count), for reasons *)
  let task_info = Hashtbl.create 1024 in
  Array.iter (fun o -> match o.plan with
    | Some x -> List.iter (fun t -> Hashtbl.replace task_info t.tid t) x.tasks
    | None -> ()) ops;
  let op k = ops.(i k) in
  let where k a =
    let o = op k in
    let ax = List.nth o.axes (i a) in
    Printf.sprintf "op %S axis %d (%s)" o.name (i a) ax.aname in
  let opk k = let o = op k in Printf.sprintf "op %S (%s)" o.name o.kind in
  let task t =
    match Hashtbl.find_opt task_info (i t) with
    | Some r -> Printf.sprintf "task %d (%s)" r.tid r.tname
    | None -> Printf.sprintf "task %d" (i t) in
  let units c = match i c with 1 -> "merge units" | _ -> "tiles" in
  let plan_of k = match (op k).plan with Some x -> x | None -> assert false in
  let reject r : Verdict.t = { accepted = false; reason = Some r; theorems = [] } in
  match check_checkpoint_b p xs with
  | Accept ->
      { accepted = true; reason = None;
        theorems = tiling_theorems @ (if xs = None then [] else task_theorems) }
  | Reject e -> (
      match e with
      | E_zero_tile (k, a) -> reject (Printf.sprintf "%s: zero-width tile" (where k a))
      | E_below_min (k, a, t, m) ->
          reject (Printf.sprintf "%s: tile %d below the minimum tile %d of target %s"
                    (where k a) (i t) (i m) tname)
      | E_hole (k, a, c, x) ->
          reject (Printf.sprintf "%s: tiles cover 0..%d of %d (hole at %d)" (where k a) (i c) (i x) (i c))
      | E_empty_step (k, a, s, st, x) ->
          reject (Printf.sprintf "%s: step %d starts at %d, at or past the extent %d (empty tile step)"
                    (where k a) (i s) (i st) (i x))
      | E_flops_mismatch (k, d, x) ->
          let o = op k in
          reject (Printf.sprintf "op %S: declared flops %d but the arithmetic on the true extents is %s = %d"
                    o.name (i d)
                    (String.concat " x " (List.map string_of_int (o.fpp :: List.map (fun a -> a.extent) o.axes)))
                    (i x))
      | E_charged_below_arith (k, c, x) ->
          reject (Printf.sprintf "op %S: charged cost %d below arithmetic %d" (op k).name (i c) (i x))
      | E_charged_below_padded (k, c, x) ->
          reject (Printf.sprintf "op %S: charged cost %d below padded work %d (padding must be charged)"
                    (op k).name (i c) (i x))
      | E_weights_undercounted (b, w) ->
          reject (Printf.sprintf "plan: bytes moved %s below the weight bytes %s (every step reads each weight byte at least once)"
                    (num (float_of_int (i b))) (num (float_of_int (i w))))
      | E_bandwidth (k, b) ->
          let b = float_of_int (i b) in
          let o = op k in
          reject (Printf.sprintf "plan: memory-bandwidth bound %s exceeds budget %s (bytes %s at %s B/s on %s; largest op %S moves %s bytes)"
                    (dur (b *. 1e9 /. float_of_int bw)) (dur (float_of_int budget))
                    (num b) (num (float_of_int bw)) tname o.name (num (float_of_int o.bytes)))
      | E_compute (k, f) ->
          let f = float_of_int (i f) in
          let o = op k in
          reject (Printf.sprintf "plan: compute bound %s exceeds budget %s (flops %s at %s flop/s on %s; largest op %S performs %s flops)"
                    (dur (f *. 1e9 /. float_of_int peak)) (dur (float_of_int budget))
                    (num f) (num (float_of_int peak)) tname o.name (num (float_of_int o.flops)))
      | E_tasks_count (a, b) ->
          reject (Printf.sprintf "plan: %d ops but %d task lists" (i a) (i b))
      | E_kind_unknown k -> reject (Printf.sprintf "%s: no shape rule for this kind" (opk k))
      | E_op_opcode (k, a, x) ->
          reject (Printf.sprintf "%s: op table opcode %d (%s), the kind's is %d (%s)"
                    (opk k) (i a) (opcode_name (i a)) (i x) (opcode_name (i x)))
      | E_shapes k ->
          let x = plan_of k in
          reject (Printf.sprintf "%s: tensor shapes %s -> %s do not fit the %s rule"
                    (opk k) (shapes_str x.inputs) (shapes_str x.outputs) (op k).kind)
      | E_axes_count (k, a, x) ->
          reject (Printf.sprintf "%s: %d axes but the %s rule gives %d" (opk k) (i a) (op k).kind (i x))
      | E_extent (k, a, act, x) ->
          let pl = plan_of k in
          reject (Printf.sprintf "%s: extent %d but the tensors' shapes give %d (inputs %s; outputs %s)"
                    (where k a) (i act) (i x) (shapes_str pl.inputs) (shapes_str pl.outputs))
      | E_task_empty (k, t) ->
          reject (Printf.sprintf "%s %s: empty unit range" (opk k) (task t))
      | E_task_range (k, c, t, s, cnt, lim) ->
          reject (Printf.sprintf "%s %s: %s %d..%d past the op's %d %s"
                    (opk k) (task t) (units c) (i s) (i s + i cnt) (i lim) (units c))
      | E_task_overlap (k, c, t, s, prev) ->
          reject (Printf.sprintf "%s: %s %d..%d run twice (%s starts at %d, the task before it ends at %d)"
                    (opk k) (units c) (i s) (i prev) (task t) (i s) (i prev))
      | E_task_gap (k, c, t, s, prev) ->
          reject (Printf.sprintf "%s: %s %d..%d run by no task (%s starts at %d, the task before it ends at %d)"
                    (opk k) (units c) (i prev) (i s) (task t) (i s) (i prev))
      | E_units_uncovered (k, c, cov, lim) ->
          reject (Printf.sprintf "%s: %s %d..%d of %d run by no task (the tasks end at %d)"
                    (opk k) (units c) (i cov) (i lim) (i lim) (i cov))
      | E_task_opcode (k, t, a, x) ->
          reject (Printf.sprintf "%s %s: packet opcode %d (%s) but the op computes %d (%s)"
                    (opk k) (task t) (i a) (opcode_name (i a)) (i x) (opcode_name (i x)))
      | E_task_masked (k, t, flagged, hang) ->
          let range = match Hashtbl.find_opt task_info (i t) with
            | Some r -> Printf.sprintf " %d..%d" r.start (r.start + r.count) | None -> "" in
          let merge = match Hashtbl.find_opt task_info (i t) with
            | Some r -> r.topcode <> 1 && r.tflags land 16 <> 0 | None -> false in
          if merge then
            reject (Printf.sprintf "%s %s: MASKED is set on a merge (a merge writes whole output blocks)"
                      (opk k) (task t))
          else if flagged && not hang then
            reject (Printf.sprintf "%s %s: MASKED is set but none of its tiles%s overhangs an extent"
                      (opk k) (task t) range)
          else
            reject (Printf.sprintf "%s %s: MASKED is not set but one of its tiles%s overhangs an extent"
                      (opk k) (task t) range)
      | E_task_accumulate (k, t) ->
          reject (Printf.sprintf "%s %s: a load with ACCUMULATE set" (opk k) (task t)))
