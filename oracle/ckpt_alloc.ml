(* Checkpoint F: simultaneously live buffers are disjoint; every buffer is in
   bounds and aligned.
   Payload (plow/oracle/payloads/alloc.py):
     { "arena_bytes": int,
       "buffers": [ {"name": str, "offset": int, "size": int, "align": int,
                     "live_start": int, "live_end": int, "region": str} ] }
   Bytes [offset, offset+size), live on program steps [live_start, live_end).
   Checker: Plow.Alloc.check_alloc; soundness: Plow.Allocproof.check_alloc_sound
   (F2), consequences Plow.Allocproof.alloc_safe_exclusive / alloc_safe_frame /
   alloc_safe_in_arena (F1). *)
open Checkers

type buf = { name : string; offset : int; size : int; align : int;
             first : int; last : int; region : string }

let read_buffer j =
  { name = Jnum.str_field "name" j; offset = Jnum.int_field "offset" j;
    size = Jnum.int_field "size" j; align = Jnum.int_field "align" j;
    first = Jnum.int_field "live_start" j; last = Jnum.int_field "live_end" j;
    region = Jnum.str_field "region" j }

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

let check (payload : Yojson.Safe.t) : Verdict.t =
  let arena = Jnum.int_field "arena_bytes" payload in
  let bufs = Array.of_list (List.map read_buffer (Jnum.list_field "buffers" payload)) in
  let nth k = bufs.(Jnum.int_of_n k) in
  let who b = Printf.sprintf "buffer %S (%s)" b.name b.region in
  let i = Jnum.int_of_n in
  match check_alloc (Jnum.n_of_int arena) (List.map to_coq (Array.to_list bufs)) with
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
      in
      { accepted = false; reason = Some reason; theorems = [] }
