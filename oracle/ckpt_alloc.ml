(* Checkpoint F: simultaneously live buffers are disjoint; every buffer is in
   bounds and aligned; buffers that share bytes are ordered by happens-before.
   Payload (plow/oracle/payloads/alloc.py):
     { "arena_bytes": int,
       "buffers": [ {"name": str, "offset": int, "size": int, "align": int,
                     "live_start": int, "live_end": int, "region": str,
                     "accessors": [int]} ],          (* optional: the tasks touching it *)
       "protocol": {                                 (* optional: the counter plan *)
         "tasks": [str],                             (* task names, for messages *)
         "waits": [[int]], "signals": [[int]],       (* per task, counter ids *)
         "queues": [[int]],                          (* per worker, task indices in order *)
         "order": [int] } }                          (* sweep order (untrusted) *)
   Bytes [offset, offset+size), live on program steps [live_start, live_end).
   Without "protocol": Plow.Alloc.check_alloc; soundness Plow.Allocproof.check_alloc_sound
   (F2), consequences alloc_safe_exclusive / alloc_safe_frame / alloc_safe_in_arena (F1).
   With "protocol" (what plow verify sends): Plow.Alloc.check_alloc_ordered; soundness
   Plow.Allocproof.checkpoint_f_sound (F1, F2 and F3: every accessor of the earlier of two
   byte-sharing buffers happens before every accessor of the later one), with D's
   hypotheses Plow.Allocproof.shared_ordered_safety. *)
open Checkers

type buf = { name : string; offset : int; size : int; align : int;
             first : int; last : int; region : string; accessors : int list }

let map f l = List.rev (List.rev_map f l)

let ints what j = map (Jnum.to_int what) (Jnum.to_list what j)

let read_buffer j =
  let accessors =
    match j with
    | `Assoc kv -> (match List.assoc_opt "accessors" kv with
                    | None -> [] | Some a -> ints "accessors" a)
    | _ -> [] in
  { name = Jnum.str_field "name" j; offset = Jnum.int_field "offset" j;
    size = Jnum.int_field "size" j; align = Jnum.int_field "align" j;
    first = Jnum.int_field "live_start" j; last = Jnum.int_field "live_end" j;
    region = Jnum.str_field "region" j; accessors }

let to_coq (b : buf) : buffer =
  { b_offset = Jnum.n_of_int b.offset; b_size = Jnum.n_of_int b.size;
    b_align = Jnum.n_of_int b.align; b_first = Jnum.n_of_int b.first;
    b_last = Jnum.n_of_int b.last }

let theorems = [
  "Plow.Allocproof.check_alloc_sound";
  "Plow.Allocproof.alloc_safe_exclusive";
  "Plow.Allocproof.alloc_safe_frame";
  "Plow.Allocproof.alloc_safe_in_arena";
]

let theorems_ordered =
  "Plow.Allocproof.checkpoint_f_sound" :: "Plow.Allocproof.check_shared_sound"
  :: "Plow.Allocproof.shared_ordered_safety" :: theorems

type protocol = { tnames : string array; cplan : cplan; order : n list }

let read_protocol j =
  let tnames = Array.of_list (map (Jnum.to_string "tasks") (Jnum.list_field "tasks" j)) in
  let nll what l = map (fun x -> map Jnum.n_of_int (ints what x)) (Jnum.list_field what l) in
  let waits = nll "waits" j and signals = nll "signals" j in
  let n = Array.length tnames in
  if List.length waits <> n || List.length signals <> n then
    Verdict.bad "field \"protocol\": %d task names but %d waits and %d signals lists" n
      (List.length waits) (List.length signals);
  let cplan =
    { cp_workers = []; cp_queues = nll "queues" j; cp_thresholds = []; cp_waits = waits;
      cp_signals = signals; cp_edges = []; cp_ranks = [] } in
  { tnames; cplan; order = map Jnum.n_of_int (ints "order" (Jnum.field "order" j)) }

let check (payload : Yojson.Safe.t) : Verdict.t =
  let arena = Jnum.int_field "arena_bytes" payload in
  let bufs = Array.of_list (List.map read_buffer (Jnum.list_field "buffers" payload)) in
  let proto =
    match payload with
    | `Assoc kv -> (match List.assoc_opt "protocol" kv with
                    | None | Some `Null -> None | Some j -> Some (read_protocol j))
    | _ -> None in
  let nth k = bufs.(Jnum.int_of_n k) in
  let who b = Printf.sprintf "buffer %S (%s)" b.name b.region in
  let i = Jnum.int_of_n in
  let task k =
    let k = i k in
    match proto with
    | Some pr when k < Array.length pr.tnames -> Printf.sprintf "task %d (%s)" k pr.tnames.(k)
    | _ -> Printf.sprintf "task %d" k in
  let coq_bufs = List.map to_coq (Array.to_list bufs) in
  let verdict, theorems =
    match proto with
    | None -> (check_alloc (Jnum.n_of_int arena) coq_bufs, theorems)
    | Some pr ->
        let accs = map (fun b -> map Jnum.n_of_int b.accessors) (Array.to_list bufs) in
        (check_alloc_ordered (Jnum.n_of_int arena) coq_bufs pr.cplan pr.order accs,
         theorems_ordered) in
  match verdict with
  | Accept -> { accepted = true; reason = None; theorems }
  | Reject e ->
      let reason =
        match e with
        | Zero_align k -> Printf.sprintf "%s has alignment 0" (who (nth k))
        | Misaligned (k, off, al) ->
            Printf.sprintf "%s misaligned: offset %d is not a multiple of its alignment %d"
              (who (nth k)) (i off) (i al)
        | Past_end (k, e, ar) ->
            let b = nth k in
            Printf.sprintf "%s [%d, %d) ends at byte %d, past the arena end %d"
              (who b) b.offset (i e) (i e) (i ar)
        | Overlap (k1, lo1, hi1, k2, lo2, hi2, s1, s2) ->
            (* name the pair in payload order *)
            let (k1, lo1, hi1, k2, lo2, hi2) =
              if i k1 <= i k2 then (k1, lo1, hi1, k2, lo2, hi2) else (k2, lo2, hi2, k1, lo1, hi1) in
            let b1 = nth k1 and b2 = nth k2 in
            Printf.sprintf
              "buffers %S (%s) [%d, %d) and %S (%s) [%d, %d) overlap while both live (steps %d..%d)"
              b1.name b1.region (i lo1) (i hi1) b2.name b2.region (i lo2) (i hi2)
              (i s1) (i s2 - 1)
        | Unordered (k1, u, k2, t) ->
            let b1 = nth k1 and b2 = nth k2 in
            let lo = max b1.offset b2.offset and hi = min (b1.offset + b1.size) (b2.offset + b2.size) in
            Printf.sprintf
              "buffers %S (%s, live steps %d..%d) and %S (%s, live steps %d..%d) share bytes \
               [%d, %d) but %s, which touches %S, does not happen before %s, which touches %S"
              b1.name b1.region b1.first (b1.last - 1) b2.name b2.region b2.first (b2.last - 1)
              lo hi (task u) b1.name (task t) b2.name
        | Unlive k ->
            let b = nth k in
            Printf.sprintf "%s has tasks and bytes but an empty live range (steps %d..%d)"
              (who b) b.first (b.last - 1)
      in
      { accepted = false; reason = Some reason; theorems = [] }
