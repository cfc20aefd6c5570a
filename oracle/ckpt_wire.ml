(* Checkpoint E: the wire round trip.  decode(bytes) = packets and
   encode(packets) = bytes, for the fixed-size little-endian records of wire
   version 1 (docs/wire.md).
   Payload (plow/oracle/payloads/wire.py, docs/oracle.md "Checkpoint E"):
     { "version": 1, "record_size": 64,
       "bytes": "<hex, two lowercase or uppercase digits per byte, records only>",
       "packets": [ { "opcode": int, "flags": int, "scope": int, "worker": int,
                      "op_index": int, "wait_counter": int, "wait_threshold": int,
                      "signal_counter": int, "row_start": int, "col_start": int,
                      "rows": int, "cols": int, "in_offset": int,
                      "weight_offset": int, "out_offset": int } ] }
   With "ops" (per op: "name", and "in", "weight", "out", "partial", each null
   or [buffer name, arena offset]), the packets are then checked against the
   emitter's rules: Plow.Emitcheck.check_emit; soundness:
   Plow.Emitcheckproof.checkpoint_e_emit_sound.
   Checker: Plow.Wire.check_wire; soundness: Plow.Wireproof.checkpoint_e_sound.
   Trusted here (docs/oracle.md): the hex -> byte-list conversion, the decimal
   reading of JSON integers (including those above OCaml's int range, which
   Yojson hands over as `Intlit`), and the field-name -> position table. *)
open Checkers

(* Layout of wire version 1 as Plow.Wire.packet_layout lists it: field index
   -> (name, reserved?, exclusive upper bound for the message). *)
let layout : (string * bool * string) array = [|
  ("opcode", false, "a known opcode");
  ("flags", false, "32");
  ("scope", false, "3");
  ("reserved0", true, "");
  ("worker", false, "2^16");
  ("reserved1", true, "");
  ("op_index", false, "2^32");
  ("wait_counter", false, "2^32");
  ("wait_threshold", false, "2^32");
  ("signal_counter", false, "2^32");
  ("row_start", false, "2^32");
  ("col_start", false, "2^32");
  ("rows", false, "2^32");
  ("cols", false, "2^32");
  ("in_offset", false, "2^64");
  ("weight_offset", false, "2^64");
  ("out_offset", false, "2^64");
|]

let value_names : string list =
  Array.to_list layout |> List.filter (fun (_, r, _) -> not r) |> List.map (fun (n, _, _) -> n)

let wire_version = 1

let theorems = [
  "Plow.Wireproof.checkpoint_e_sound";
  "Plow.Wireproof.decode_encode_packets";
  "Plow.Wireproof.encode_decode_packets";
  "Plow.Wireproof.decode_encode_packet";
  "Plow.Wireproof.encode_decode_packet";
]

let ten = Jnum.n_of_int 10

(* Decimal rendering of an extracted N (values may exceed OCaml's int). *)
let rec n_to_string (x : n) : string =
  match x with
  | N0 -> "0"
  | Npos _ ->
      let q, r = N.div_eucl x ten in
      (match q with N0 -> "" | Npos _ -> n_to_string q) ^ string_of_int (Jnum.int_of_n r)

(* A JSON natural number as N: small ones arrive as `Int, big ones as `Intlit. *)
let to_n_big (what : string) (j : Yojson.Safe.t) : n =
  match j with
  | `Int i -> if i < 0 then Verdict.bad "field %S: negative number %d" what i else Jnum.n_of_int i
  | `Intlit s ->
      if s = "" then Verdict.bad "field %S: empty number" what;
      String.fold_left
        (fun acc c ->
          if c < '0' || c > '9' then Verdict.bad "field %S: not a natural number: %s" what s
          else N.add (N.mul acc ten) (Jnum.n_of_int (Char.code c - Char.code '0')))
        N0 s
  | _ -> Verdict.bad "field %S: expected an integer" what

let hex_digit (c : char) : int =
  match c with
  | '0' .. '9' -> Char.code c - Char.code '0'
  | 'a' .. 'f' -> Char.code c - Char.code 'a' + 10
  | 'A' .. 'F' -> Char.code c - Char.code 'A' + 10
  | _ -> Verdict.bad "field \"bytes\": %C is not a hexadecimal digit" c

(* The byte table: every byte value as an N, built once. *)
let byte_n : n array = Array.init 256 Jnum.n_of_int

(* Hex string -> list of byte values (each < 256 by construction). *)
let bytes_of_hex (s : string) : n list =
  let len = String.length s in
  if len mod 2 <> 0 then Verdict.bad "field \"bytes\": odd number of hex digits (%d)" len;
  let acc = ref [] in
  for k = len / 2 - 1 downto 0 do
    acc := byte_n.((hex_digit s.[2 * k] lsl 4) lor hex_digit s.[2 * k + 1]) :: !acc
  done;
  !acc

let read_packet (j : Yojson.Safe.t) : n list =
  List.map (fun name -> to_n_big name (Jnum.field name j)) value_names

let field_name fi = match layout.(fi) with (n, _, _) -> n

let describe_derr (fi : int) (k : derr) : string =
  let name, _, bound = layout.(fi) in
  match k with
  | DShort -> "the record ends inside the field"
  | DReserved v -> Printf.sprintf "reserved bytes not zero (field value %s)" (n_to_string v)
  | DUnknown v -> Printf.sprintf "unknown %s %s" name (n_to_string v)
  | DRange v -> Printf.sprintf "value %s out of range (must be below %s)" (n_to_string v) bound

let i = Jnum.int_of_n

let render (rsize : int) (e : wire_error) : string =
  match e with
  | WRecordSize r ->
      Printf.sprintf "record size %d in the payload is not the wire format's %d bytes (version %d)"
        (i r) rsize wire_version
  | WTruncated len ->
      Printf.sprintf "truncated: %d bytes is not a multiple of %d" (i len) rsize
  | WNotByte (off, v) ->
      Printf.sprintf "byte offset %d: value %s is not a byte" (i off) (n_to_string v)
  | WDecode (ri, off, fe) ->
      let fi = i fe.fe_field in
      Printf.sprintf "record %d (byte offset %d) field %s: %s" (i ri) (i off) (field_name fi)
        (describe_derr fi fe.fe_kind)
  | WCount (nb, np) ->
      Printf.sprintf "the bytes hold %d records but the payload lists %d packets" (i nb) (i np)
  | WShape (ri, k) ->
      Printf.sprintf "packet %d has %d fields, the wire format has %d" (i ri) (i k)
        (List.length value_names)
  | WField (ri, off, fi, x, y) ->
      Printf.sprintf "record %d (byte offset %d) field %s: bytes decode to %s but packet says %s"
        (i ri) (i off) (field_name (i fi)) (n_to_string x) (n_to_string y)

(* The emitter rules (Plow.Emitcheck.check_emit) need the op table's offsets:
   per op its name and [name, offset] (or null) of its first input, second
   input, first output and partial. *)
type op_row = { name : string; bufs : (string * int) option array (* in, weight, out, partial *);
                argmax : string option (* the fused argmax buffer the op table names *) }

let read_buf (what : string) (j : Yojson.Safe.t) : (string * int) option =
  match j with
  | `Null -> None
  | `List [ `String n; o ] -> Some (n, Jnum.to_int what o)
  | _ -> Verdict.bad "field %S: expected null or [name, offset]" what

let read_op (j : Yojson.Safe.t) : op_row =
  { name = Jnum.str_field "name" j;
    bufs = Array.map (fun k -> read_buf k (Jnum.field k j)) [| "in"; "weight"; "out"; "partial" |];
    argmax = (match j with
              | `Assoc kv -> (match List.assoc_opt "argmax" kv with
                              | None | Some `Null -> None
                              | Some (`String n) -> Some n
                              | Some _ -> Verdict.bad "field \"argmax\": expected null or a name")
              | _ -> None) }

let offsets_of (o : op_row) : op_offsets =
  let off k = match o.bufs.(k) with Some (_, x) -> Jnum.n_of_int x | None -> N0 in
  { oo_in = off 0; oo_weight = off 1; oo_out = off 2;
    oo_partial = (match o.bufs.(3) with Some (_, x) -> Some (Jnum.n_of_int x) | None -> None);
    oo_argmax = o.argmax <> None }

let emit_theorems = [
  "Plow.Emitcheckproof.checkpoint_e_emit_sound";
  "Plow.Emitcheckproof.check_emit_sound";
]

let render_emit (ops : op_row array) (packets : n list array) (e : emit_error) : string =
  let pkt ri = packets.(i ri) in
  let v p k = i (List.nth p k) in
  let kind p =
    if v p 0 = 0 then "nop" else if v p 0 = 1 then "load"
    else if v p 1 land 16 <> 0 then "merge" else "compute" in
  let where ri =
    let p = pkt ri in
    let oi = v p 4 in
    if oi < Array.length ops then Printf.sprintf "record %d (%s packet of op %d %S)" (i ri) (kind p) oi ops.(oi).name
    else Printf.sprintf "record %d (%s packet, op index %d)" (i ri) (kind p) oi in
  match e with
  | EFused (ri, fl) ->
      Printf.sprintf "%s: flags %d set FUSED_RESIDUAL or FUSED_ROPE, which the emitter never writes" (where ri) (i fl)
  | EArgmax (ri, fl) ->
      let p = pkt ri in
      let oi = v p 4 in
      let named = if oi < Array.length ops then ops.(oi).argmax else None in
      (match named with
       | Some b ->
           Printf.sprintf "%s: flags %d lack FUSED_ARGMAX but the op table fuses the op (argmax buffer %S)" (where ri) (i fl) b
       | None ->
           Printf.sprintf "%s: flags %d set FUSED_ARGMAX but the op table names no argmax buffer for the op" (where ri) (i fl))
  | EOpIndex (ri, oi) ->
      Printf.sprintf "%s: op index %d is not an op of the op table (%d ops)" (where ri) (i oi) (Array.length ops)
  | EField (ri, k, found, want) ->
      let p = pkt ri in
      let fname = List.nth value_names (i k) in
      let o = let oi = v p 4 in if oi < Array.length ops then Some ops.(oi) else None in
      let buf b = match o with
        | Some o -> (match o.bufs.(b) with
                     | Some (n, _) -> Printf.sprintf "%S" n
                     | None -> "none")
        | None -> "none" in
      let has_partial = match o with Some o -> o.bufs.(3) <> None | None -> false in
      let role =
        match kind p, i k with
        | "nop", _ -> "a nop carries zeros"
        | _, (9 | 11) -> "the emitter writes no column range"
        | "load", (12 | 14) -> "a load touches no arena input or output"
        | _, 13 -> "the op's second input " ^ buf 1
        | "merge", 12 -> if has_partial then "the op's partial " ^ buf 3 else "the op's first input " ^ buf 0
        | "merge", 14 -> "the op's output " ^ buf 2
        | _, 12 -> "the op's first input " ^ buf 0
        | _, 14 -> if has_partial then "the op's partial " ^ buf 3 else "the op's output " ^ buf 2
        | _ -> "the emitter's rule" in
      Printf.sprintf "%s field %s: %s but the op table and arena map give %s (%s)" (where ri) fname
        (n_to_string found) (n_to_string want) role

let check (payload : Yojson.Safe.t) : Verdict.t =
  let version = Jnum.int_field "version" payload in
  let rsize_n = Jnum.n_field "record_size" payload in
  let bytes = bytes_of_hex (Jnum.str_field "bytes" payload) in
  let packets = List.map read_packet (Jnum.list_field "packets" payload) in
  let ops =
    match payload with
    | `Assoc kv -> (match List.assoc_opt "ops" kv with
                    | None | Some `Null -> None
                    | Some j -> Some (Array.of_list (List.map read_op (Jnum.to_list "ops" j))))
    | _ -> None in
  let rsize = i wire_record_size in
  if version <> wire_version then
    { accepted = false; theorems = [];
      reason = Some (Printf.sprintf "wire version %d is not the oracle's version %d" version wire_version) }
  else
    match check_wire rsize_n bytes packets with
    | Reject e -> { accepted = false; reason = Some (render rsize e); theorems = [] }
    | Accept ->
        match ops with
        | None -> { accepted = true; reason = None; theorems }
        | Some ops ->
            match check_emit (Array.to_list (Array.map offsets_of ops)) packets with
            | Accept -> { accepted = true; reason = None; theorems = theorems @ emit_theorems }
            | Reject e ->
                { accepted = false; theorems = [];
                  reason = Some (render_emit ops (Array.of_list packets) e) }
