(* A faster reader for checkpoint D's payload: the two big lists (dataflow.accesses, ~1.1M
   [lo, hi, write] triples on a 12B plan, and edges, ~0.5M objects) are read straight from
   the input bytes into the checker's values, without building yojson's tree for them
   (the tree cost more in allocation and GC than the checker's own data). Every other
   field is read by yojson as before.

   It is an optimisation only, never a second meaning: it reads the plain shapes
   [plow verify] writes ([{"checkpoint": "D", "payload": {...}}], non-negative decimal
   integers, write flags 0/1, edge objects with exactly "producer" and "consumer", no
   duplicate keys) and raises [Fallback] at anything else, whereupon the oracle re-reads the
   whole input with yojson's tree ([Yojson.Safe.from_string]) and the usual adapter, whose
   verdict or error is then the answer. On input it accepts, it gives the adapter the same
   values the tree would (same numbers via [Ckpt_counters.n_shared], same order). Part of
   the trusted base (docs/oracle.md). *)

exception Fallback

let fail () = raise Fallback

type st = { b : Bytes.t; len : int; mutable i : int }

let rec ws s =
  if s.i < s.len then
    match Bytes.unsafe_get s.b s.i with
    | ' ' | '\t' | '\n' | '\r' -> s.i <- s.i + 1; ws s
    | _ -> ()

let peek s = ws s; if s.i < s.len then Bytes.unsafe_get s.b s.i else fail ()

let expect s c = if peek s = c then s.i <- s.i + 1 else fail ()

(* A JSON integer: non-negative, decimal, at most 18 digits (fits OCaml's int); anything
   else (a sign, a fraction, an exponent, a quoted number, a longer literal) falls back. *)
let int s =
  ws s;
  let start = s.i in
  let rec go v =
    if s.i < s.len then
      match Bytes.unsafe_get s.b s.i with
      | '0' .. '9' as c -> s.i <- s.i + 1; go ((v * 10) + Char.code c - 48)
      | '.' | 'e' | 'E' -> fail ()
      | _ -> v
    else v
  in
  let v = go 0 in
  let n = s.i - start in
  if n = 0 || n > 18 || (n > 1 && Bytes.get s.b start = '0') then fail ();
  v

(* A key without escapes. *)
let key s =
  expect s '"';
  let start = s.i in
  while s.i < s.len && Bytes.unsafe_get s.b s.i <> '"' && Bytes.unsafe_get s.b s.i <> '\\' do
    s.i <- s.i + 1
  done;
  if s.i >= s.len || Bytes.get s.b s.i <> '"' then fail ();
  let k = Bytes.sub_string s.b start (s.i - start) in
  s.i <- s.i + 1;
  expect s ':';
  k

(* [f] on each element of a JSON array, results in order (tail-recursive). *)
let list s f =
  expect s '[';
  if peek s = ']' then (s.i <- s.i + 1; [])
  else
    let rec go acc =
      let x = f s in
      match peek s with
      | ',' -> s.i <- s.i + 1; go (x :: acc)
      | ']' -> s.i <- s.i + 1; List.rev (x :: acc)
      | _ -> fail ()
    in
    go []

(* The fields of a JSON object, [f key] on each value; duplicate keys fall back. *)
let fields s f =
  expect s '{';
  let seen = Hashtbl.create 8 in
  let one () =
    let k = key s in
    if Hashtbl.mem seen k then fail ();
    Hashtbl.add seen k ();
    f k
  in
  if peek s = '}' then (s.i <- s.i + 1; [])
  else
    let rec go acc =
      let x = one () in
      match peek s with
      | ',' -> s.i <- s.i + 1; go (x :: acc)
      | '}' -> s.i <- s.i + 1; List.rev (x :: acc)
      | _ -> fail ()
    in
    go []

(* Any other value: yojson's reader from the current position. *)
let json s =
  ws s;
  let lb = Lexing.from_string "" in
  let lb = { lb with Lexing.lex_buffer = s.b; lex_buffer_len = s.len; lex_abs_pos = 0;
                     lex_start_pos = s.i; lex_curr_pos = s.i; lex_last_pos = s.i;
                     lex_eof_reached = true } in
  let v = Yojson.Safe.read_json (Yojson.Safe.init_lexer ()) lb in
  s.i <- lb.Lexing.lex_curr_pos;
  v

let access s =
  expect s '[';
  let lo = int s in
  expect s ',';
  let hi = int s in
  expect s ',';
  let w = int s in
  expect s ']';
  if w > 1 then fail ();
  ((Ckpt_counters.n_shared "accesses" (`Int lo), Ckpt_counters.n_shared "accesses" (`Int hi)), w = 1)

let edge s =
  let p = ref (-1) and c = ref (-1) in
  ignore (fields s (function
    | "producer" -> p := int s
    | "consumer" -> c := int s
    | _ -> fail ()));
  if !p < 0 || !c < 0 then fail ();
  (!p, !c)

(* The whole input as checkpoint D's [check], or [Fallback]. *)
let read (input : string) : unit -> Verdict.t =
  let s = { b = Bytes.unsafe_of_string input; len = String.length input; i = 0 } in
  let acc = ref None and edges = ref None in
  let dataflow () =
    `Assoc (fields s (fun k ->
      if k = "accesses" then (acc := Some (list s (fun s -> list s access)); (k, `Null))
      else (k, json s)))
  in
  let payload () =
    `Assoc (fields s (fun k ->
      match k with
      | "edges" -> edges := Some (list s edge); (k, `Null)
      | "dataflow" -> (k, if peek s = '{' then dataflow () else json s)
      | _ -> (k, json s)))
  in
  let ck = ref None and pl = ref None in
  ignore (fields s (fun k ->
    match k with
    | "checkpoint" -> (
        match json s with `String "D" -> ck := Some () | _ -> fail ())
    | "payload" -> if !ck = None then fail () else pl := Some (payload ())
    | _ -> ignore (json s)));
  ws s;
  if s.i <> s.len then fail ();
  match !pl with
  | None -> fail ()
  | Some p -> fun () -> Ckpt_counters.check_pre ?acc:!acc ?edges:!edges p
