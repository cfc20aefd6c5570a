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

let () =
  (* A larger minor heap: the checkers allocate many short-lived trie nodes and numbers
     (a whole plan's D sweep spent a fifth of its time in the collector). *)
  Gc.set { (Gc.get ()) with Gc.minor_heap_size = 8 * 1024 * 1024; Gc.space_overhead = 160 };
  let checkpoint = ref "?" in
  try
    let j = Yojson.Safe.from_channel stdin in
    checkpoint := Jnum.str_field "checkpoint" j;
    let payload = Jnum.field "payload" j in
    match List.assoc_opt !checkpoint checkers with
    | None -> Verdict.bad "unknown checkpoint %S (known: %s)" !checkpoint
                (String.concat ", " (List.map fst checkers))
    | Some check ->
        let v = check payload in
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
  with
  | Yojson.Json_error msg ->
      emit ~checkpoint:!checkpoint [ ("verdict", `String "error"); ("reason", `String ("malformed JSON: " ^ msg)) ];
      exit 2
  | Verdict.Bad_payload msg ->
      emit ~checkpoint:!checkpoint [ ("verdict", `String "error"); ("reason", `String ("malformed payload: " ^ msg)) ];
      exit 2
