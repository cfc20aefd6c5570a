(* Checkpoint D: the counter protocol is safe and deadlock-free.
   Payload (plow/oracle/payloads/counters.py):
     { "tasks":    [ {"name": str, "worker": int, "waits": [int], "signals": [int]} ],
       "queues":   [ [int] ],                       (* per worker, task indices in order *)
       "counters": [ {"name": str, "threshold": int, "scope": "cta"|"device"|"system"} ],
       "edges":    [ {"producer": int, "consumer": int} ],
       "ranks":    [int],                           (* topological rank per task (witness) *)
       "workers_per_gpu": int,                      (* optional: absent = one GPU (all queues) *)
       "dataflow": {                                (* optional: dependencies from data flow *)
         "keys": [int],                             (* per task, its program key *)
         "accesses": [ [ [lo, hi, write] ] ],       (* per task, byte ranges; write 1, read 0 *)
         "block": int,                              (* block size of the write index *)
         "chains": [ [from, to, [int]] ],           (* witness chains (untrusted, pairwise only) *)
         "order": [int] } }                         (* optional: sweep order (untrusted) *)
   Checker: Plow.Counters.check_checkpoint_d (check_counters, then the scopes);
   soundness: Plow.Countersproof.checkpoint_d_sound.  With "dataflow" and "order" (what
   plow verify sends): Plow.Flowsweep.check_checkpoint_d_sweep; soundness
   Plow.Flowsweepproof.checkpoint_d_sweep_sound.  With "dataflow" and no "order" (hand-made
   payloads): Plow.Dataflow.check_checkpoint_d_flow (pairwise); soundness
   Plow.Dataflowproof.checkpoint_d_flow_sound. *)
open Checkers

type task = { name : string; worker : int; waits : int list; signals : int list }
type counter = { cname : string; threshold : int; scope : string }

(* Tail-recursive map: a 12B plan has ~470,000 edges, deeper than the stack allows
   for OCaml 4.13's List.map. *)
let map f l = List.rev (List.rev_map f l)

let ints what j = map (Jnum.to_int what) (Jnum.to_list what j)

let read_task j =
  { name = Jnum.str_field "name" j; worker = Jnum.int_field "worker" j;
    waits = ints "waits" (Jnum.field "waits" j); signals = ints "signals" (Jnum.field "signals" j) }

let read_counter j =
  let scope = Jnum.str_field "scope" j in
  if not (List.mem scope [ "cta"; "device"; "system" ]) then
    Verdict.bad "field \"scope\": %S is not one of cta, device, system" scope;
  { cname = Jnum.str_field "name" j; threshold = Jnum.int_field "threshold" j; scope }

let read_edge j = (Jnum.int_field "producer" j, Jnum.int_field "consumer" j)

let theorems =
  [ "Plow.Countersproof.checkpoint_d_sound"; "Plow.Countersproof.check_counters_sound";
    "Plow.Countersproof.check_scopes_sound";
    "Plow.Countersproof.counters_safety"; "Plow.Countersproof.counters_progress";
    "Plow.Countersproof.counters_maximal_runs_all" ]

let nl = map Jnum.n_of_int

let theorems_flow =
  [ "Plow.Dataflowproof.checkpoint_d_flow_sound"; "Plow.Dataflowproof.check_dataflow_sound";
    "Plow.Dataflowproof.hb_safety"; "Plow.Dataflowproof.dataflow_safety" ] @ theorems

let theorems_sweep =
  [ "Plow.Flowsweepproof.checkpoint_d_sweep_sound"; "Plow.Flowsweepproof.check_sweep_sound";
    "Plow.Flowsweepproof.checkpoint_d_sweep_counted_verdict";
    "Plow.Dataflowproof.hb_safety"; "Plow.Dataflowproof.dataflow_safety" ] @ theorems

(* One binary number per distinct integer: a whole plan has ~1.5M accesses but only a few
   thousand distinct byte offsets, and a 35-bit [N] is ~35 constructors. Sharing changes
   no value (the numbers are immutable). *)
let shared : (int, n) Hashtbl.t = Hashtbl.create 4096

let n_shared what j =
  let i = Jnum.to_int what j in
  match Hashtbl.find_opt shared i with
  | Some n -> n
  | None ->
      let n = Jnum.n_of_int i in
      Hashtbl.add shared i n;
      n

let read_access j =
  match j with
  | `List [ lo; hi; w ] ->
      let w = Jnum.to_int "accesses" w in
      if w <> 0 && w <> 1 then Verdict.bad "field \"accesses\": write flag %d is not 0 or 1" w;
      ((n_shared "accesses" lo, n_shared "accesses" hi), w = 1)
  | _ -> Verdict.bad "field \"accesses\": an access is [lo, hi, write]"

let read_chain j =
  match j with
  | `List [ u; t; xs ] -> ((Jnum.to_n "chains" u, Jnum.to_n "chains" t), nl (ints "chains" xs))
  | _ -> Verdict.bad "field \"chains\": a chain is [from, to, [tasks in between]]"

(* [acc]: the accesses already read by [Dread] (the same values), else from [j]. *)
let read_dataflow ?acc j =
  { df_keys = map (n_shared "keys") (Jnum.list_field "keys" j);
    df_acc =
      (match acc with
       | Some a -> a
       | None -> map (fun l -> map read_access (Jnum.to_list "accesses" l)) (Jnum.list_field "accesses" j));
    df_block = Jnum.n_field "block" j;
    df_chains =
      (match j with
       | `Assoc kv -> (match List.assoc_opt "chains" kv with
                      | None | Some `Null -> []
                      | Some c -> map read_chain (Jnum.to_list "chains" c))
       | _ -> []) }

let read_order j =
  match j with
  | `Assoc kv -> (
      match List.assoc_opt "order" kv with
      | None | Some `Null -> None
      | Some o -> Some (map (n_shared "order") (Jnum.to_list "order" o)))
  | _ -> None

(* [acc], [edges]: the accesses and edges already read by [Dread] (oracle/dread.ml), which
   puts null in their place in [payload]; absent, they are read from [payload]. *)
let check_pre ?acc ?edges (payload : Yojson.Safe.t) : Verdict.t =
  let tasks = Array.of_list (map read_task (Jnum.list_field "tasks" payload)) in
  let queues = map (ints "queues") (Jnum.list_field "queues" payload) in
  let counters = Array.of_list (map read_counter (Jnum.list_field "counters" payload)) in
  let edges =
    match edges with
    | Some e -> Array.of_list e
    | None -> Array.of_list (map read_edge (Jnum.list_field "edges" payload))
  in
  let ranks =
    match Jnum.field "ranks" payload with
    | `Null -> Verdict.bad "field \"ranks\" is null: fill it with plow.oracle.payloads.counters.with_ranks"
    | j -> ints "ranks" j
  in
  let wpg =
    match payload with
    | `Assoc kv -> (
        match List.assoc_opt "workers_per_gpu" kv with
        | None | Some `Null -> max 1 (List.length queues)
        | Some j ->
            let w = Jnum.to_int "workers_per_gpu" j in
            if w < 1 then Verdict.bad "field \"workers_per_gpu\": %d is not positive" w;
            w)
    | _ -> 1
  in
  let scope_code = function "cta" -> 0 | "device" -> 1 | _ -> 2 in
  let scope_name = function 0 -> "cta" | 1 -> "device" | _ -> "system" in
  let scopes = nl (map (fun c -> scope_code c.scope) (Array.to_list counters)) in
  let tl = Array.to_list tasks in
  let plan =
    { cp_workers = nl (map (fun t -> t.worker) tl);
      cp_queues = map nl queues;
      cp_thresholds = nl (map (fun c -> c.threshold) (Array.to_list counters));
      cp_waits = map (fun t -> nl t.waits) tl;
      cp_signals = map (fun t -> nl t.signals) tl;
      cp_edges = map (fun (u, t) -> (Jnum.n_of_int u, Jnum.n_of_int t)) (Array.to_list edges);
      cp_ranks = nl ranks }
  in
  let i = Jnum.int_of_n in
  let tname k = if k >= 0 && k < Array.length tasks then tasks.(k).name else "?" in
  let task k = Printf.sprintf "task %d (%s)" k (tname k) in
  let task_on k =
    if k >= 0 && k < Array.length tasks then Printf.sprintf "%s on worker %d" (task k) tasks.(k).worker
    else task k
  in
  let cname c = if c >= 0 && c < Array.length counters then counters.(c).cname else "?" in
  let flow =
    match payload with
    | `Assoc kv -> (
        match List.assoc_opt "dataflow" kv with
        | None | Some `Null -> None
        | Some j -> Some (read_dataflow ?acc j, read_order j))
    | _ -> None
  in
  let proto_reason e =
        match e with
        | CErr_lengths (n, nw, nwt, nr) ->
            Printf.sprintf "lengths: %d tasks but %d worker fields, %d wait lists, %d ranks"
              (i n) (i nw) (i nwt) (i nr)
        | CErr_queue_task (w, k, t) ->
            Printf.sprintf "worker %d queue entry %d: task %d does not exist (%d tasks)"
              (i w) (i k) (i t) (Array.length tasks)
        | CErr_task_worker (t, w) ->
            Printf.sprintf "%s is in worker %d's queue but its worker field says %d"
              (task (i t)) (i w) tasks.(i t).worker
        | CErr_task_occurs (t, k) ->
            Printf.sprintf "%s occurs %d times in the queues (must be exactly once)" (task (i t)) (i k)
        | CErr_counter_ref (t, c) ->
            Printf.sprintf "%s references counter %d, which does not exist (%d counters)"
              (task (i t)) (i c) (Array.length counters)
        | CErr_threshold (c, expected, actual) ->
            Printf.sprintf "counter %d (%s): threshold %d but %d tasks signal it"
              (i c) (cname (i c)) (i actual) (i expected)
        | CErr_uncovered (e, u, t) ->
            Printf.sprintf "edge %d (%s -> %s): not covered by any counter or same-queue order"
              (i e) (tname (i u)) (tname (i t))
        | CErr_cycle (a, b, ra, rb) ->
            Printf.sprintf "cycle: %s must precede %s (ranks %d >= %d)"
              (task_on (i a)) (task_on (i b)) (i ra) (i rb)
        | CErr_scope (c, sc, t0, w0, t, w) ->
            let where w = if i sc = 0 then Printf.sprintf "worker %d" w
              else Printf.sprintf "worker %d (GPU %d)" w (w / wpg) in
            Printf.sprintf "counter %d (%s): scope %s but %s on %s and %s on %s both use it (%s)"
              (i c) (cname (i c)) (scope_name (i sc)) (task (i t0)) (where (i w0)) (task (i t))
              (where (i w))
              (if i sc = 0 then "a cta counter is one worker's"
               else Printf.sprintf "a device counter is one GPU's, %d workers per GPU" wpg)
  in
  let flow_reason e =
    match e with
    | DErr_lengths (n, nk, na) ->
        Printf.sprintf "dataflow lengths: %d tasks but %d keys and %d access lists" (i n) (i nk) (i na)
    | DErr_block -> "dataflow: block size 0"
    | DErr_range (t, k, lo, hi) ->
        Printf.sprintf "dataflow: %s access %d, bytes [%d, %d), is empty or crosses a block boundary"
          (task (i t)) (i k) (i lo) (i hi)
    | DErr_race (u, t, lo, hi) ->
        Printf.sprintf "race: %s and %s are one stage but both touch arena bytes [%d, %d), one writing"
          (task_on (i u)) (task_on (i t)) (i lo) (i hi)
    | DErr_unordered (u, t, lo, hi) ->
        Printf.sprintf
          "data flow: %s must precede %s (they share arena bytes [%d, %d), one writing) but no wait, \
           queue order or chain of them orders the two"
          (task_on (i u)) (task_on (i t)) (i lo) (i hi)
  in
  let sweep_reason e =
    match e with
    | SErr_flow e -> flow_reason e
    | SErr_missing t -> Printf.sprintf "dataflow order: %s is not in the sweep order" (task (i t))
    | SErr_order (u, t, lo, hi) ->
        Printf.sprintf
          "dataflow order: %s is swept before %s but comes later in program order (they share \
           arena bytes [%d, %d), one writing): the order is not a topological order of the data flow"
          (task_on (i u)) (task_on (i t)) (i lo) (i hi)
  in
  match flow with
  | None -> (
      match check_checkpoint_d plan scopes (Jnum.n_of_int wpg) with
      | Accept -> { accepted = true; reason = None; theorems }
      | Reject e -> { accepted = false; reason = Some (proto_reason e); theorems = [] })
  | Some (d, Some order) -> (
      match check_checkpoint_d_sweep_counted plan scopes (Jnum.n_of_int wpg) d order with
      | (Accept, n) ->
          let accesses = List.fold_left (fun k l -> k + List.length l) 0 d.df_acc in
          Verdict.stats := [ ("accesses", accesses); ("comparisons", i n) ];
          { accepted = true; reason = None; theorems = theorems_sweep }
      | (Reject (DSProto e), _) -> { accepted = false; reason = Some (proto_reason e); theorems = [] }
      | (Reject (DSFlow e), _) -> { accepted = false; reason = Some (sweep_reason e); theorems = [] })
  | Some (d, None) -> (
      match check_checkpoint_d_flow plan scopes (Jnum.n_of_int wpg) d with
      | Accept -> { accepted = true; reason = None; theorems = theorems_flow }
      | Reject (DProto e) -> { accepted = false; reason = Some (proto_reason e); theorems = [] }
      | Reject (DFlow e) -> { accepted = false; reason = Some (flow_reason e); theorems = [] })

let check (payload : Yojson.Safe.t) : Verdict.t = check_pre payload
