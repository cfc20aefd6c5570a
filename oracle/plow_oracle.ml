(* plow-oracle: reads {"checkpoint": ID, "payload": {...}} on stdin, runs the
   extracted checker for that checkpoint, prints one JSON verdict on stdout.
   Exit status: 0 accepted, 1 rejected, 2 malformed input. *)

let version = "plow-oracle 0.1.0"

(* One entry per checkpoint: its id and the reader+checker for its payload.
   Each checkpoint's adapter lives in its own module (ckpt_<name>.ml). *)
let checkers : (string * (Yojson.Safe.t -> Verdict.t)) list = [
  ("A", Ckpt_rewrites.check);
  ("B", Ckpt_tiles.check);
  ("C", Ckpt_pages.check);
  ("D", Ckpt_counters.check);
  ("E", Ckpt_wire.check);
  ("F", Ckpt_alloc.check);
]

let emit ~checkpoint (fields : (string * Yojson.Safe.t) list) =
  print_string
    (Yojson.Safe.to_string
       (`Assoc (("checkpoint", `String checkpoint) :: ("oracle_version", `String version) :: fields)));
  print_newline ()

let read_all ic =
  let b = Buffer.create (1 lsl 20) and chunk = Bytes.create 65536 in
  let rec go () =
    let n = input ic chunk 0 65536 in
    if n > 0 then (Buffer.add_subbytes b chunk 0 n; go ())
  in
  go ();
  Buffer.contents b

let () =
  (* A larger minor heap: the checkers allocate many short-lived trie nodes and numbers
     (a whole plan's D sweep spent a fifth of its time in the collector). A high
     space_overhead: the major collector marks and sweeps less often (on the 12B plan's D
     payload 18 % less CPU than 160, ~25 % more peak memory; docs/oracle.md). *)
  Gc.set { (Gc.get ()) with Gc.minor_heap_size = 8 * 1024 * 1024; Gc.space_overhead = 1000 };
  let checkpoint = ref "?" in
  try
    let input = read_all stdin in
    (* checkpoint D's plain payloads by the streaming reader (oracle/dread.ml), anything it
       does not read (another checkpoint, an unusual or malformed shape) by yojson's tree *)
    let fast = try Some (Dread.read input) with _ -> None in
    let run =
      match fast with
      | Some run -> checkpoint := "D"; run
      | None ->
          let j = Yojson.Safe.from_string input in
          checkpoint := Jnum.str_field "checkpoint" j;
          let payload = Jnum.field "payload" j in
          (match List.assoc_opt !checkpoint checkers with
           | None -> Verdict.bad "unknown checkpoint %S (known: %s)" !checkpoint
                       (String.concat ", " (List.map fst checkers))
           | Some check -> fun () -> check payload)
    in
    begin
        let v = run () in
        let stats =
          match !Verdict.stats with
          | [] -> []
          | kv -> [ ("stats", `Assoc (List.map (fun (k, n) -> (k, `Int n)) kv)) ]
        in
        emit ~checkpoint:!checkpoint
          ([ ("verdict", `String (if v.accepted then "accept" else "reject"));
             ("reason", (match v.reason with None -> `Null | Some r -> `String r));
             ("theorems", `List (List.map (fun s -> `String s) v.theorems)) ]
           @ stats);
        exit (if v.accepted then 0 else 1)
    end
  with
  | Yojson.Json_error msg ->
      emit ~checkpoint:!checkpoint [ ("verdict", `String "error"); ("reason", `String ("malformed JSON: " ^ msg)) ];
      exit 2
  | Verdict.Bad_payload msg ->
      emit ~checkpoint:!checkpoint [ ("verdict", `String "error"); ("reason", `String ("malformed payload: " ^ msg)) ];
      exit 2
