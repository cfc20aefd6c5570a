(* Checkpoint B: tile coverage, charged cost >= arithmetic, plan within the
   bandwidth and compute bounds.
   Payload (plow/oracle/payloads/tiles.py, docs/oracle.md "Checkpoint B"):
     { "target": { "name": str, "bandwidth_bytes_per_s": int, "peak_flops_per_s": int,
                   "min_tile": int },
       "budget_ns": int, "weight_bytes": int,
       "ops": [ { "name": str, "kind": str,
                  "axes": [ {"name": str, "extent": int, "tile": int, "steps": int} ],
                  "flops_per_point": int, "flops": int, "charged_cost": int, "bytes": int } ] }
   Checker: Plow.Tiles.check_tiling_plan; soundness: Plow.Tilesproof.checkpoint_b_sound. *)
open Checkers

type ax = { aname : string; extent : int; tile : int; steps : int }

type op_r = {
  name : string; kind : string; axes : ax list;
  fpp : int; flops : int; charged : int; bytes : int;
}

let read_axis j =
  { aname = Jnum.str_field "name" j; extent = Jnum.int_field "extent" j;
    tile = Jnum.int_field "tile" j; steps = Jnum.int_field "steps" j }

let read_op j =
  { name = Jnum.str_field "name" j; kind = Jnum.str_field "kind" j;
    axes = List.map read_axis (Jnum.list_field "axes" j);
    fpp = Jnum.int_field "flops_per_point" j; flops = Jnum.int_field "flops" j;
    charged = Jnum.int_field "charged_cost" j; bytes = Jnum.int_field "bytes" j }

let n = Jnum.n_of_int
let i = Jnum.int_of_n

let to_coq_op (o : op_r) : op =
  { op_axes = List.map (fun a -> { ax_extent = n a.extent; ax_tile = n a.tile; ax_steps = n a.steps }) o.axes;
    op_fpp = n o.fpp; op_flops = n o.flops; op_charged = n o.charged; op_bytes = n o.bytes }

let theorems = [
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
  let ops = List.map read_op (Jnum.list_field "ops" payload) in
  let p = {
    pl_ops = List.map to_coq_op ops;
    pl_target = { tg_bandwidth = n bw; tg_peak = n peak; tg_min_tile = n min_tile };
    pl_budget_ns = n budget; pl_weight_bytes = n weight_bytes } in
  let op k = List.nth ops (i k) in
  let where k a =
    let o = op k in
    let ax = List.nth o.axes (i a) in
    Printf.sprintf "op %S axis %d (%s)" o.name (i a) ax.aname in
  let reject r : Verdict.t = { accepted = false; reason = Some r; theorems = [] } in
  match check_tiling_plan p with
  | Accept -> { accepted = true; reason = None; theorems }
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
                    (num f) (num (float_of_int peak)) tname o.name (num (float_of_int o.flops))))
