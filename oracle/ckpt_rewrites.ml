(* Checkpoint A: the bundle's op table is the model's canonical graph, transformed only by
   instances of proved rules (docs/egraph.md "Checkpoint A", docs/oracle.md).
   Payload (plow/oracle/payloads/rewrites.py):
     { "canonical": TABLE, "bundle": TABLE,
       "blocks": [ {"rule": str, "canonical": [int], "fused": int} ],
       "layouts": [ {"weight": str, "layout": "interleave" | "cat3", "sources": [str]} ],
       "outputs": [str] }
     TABLE = { "ops": [ {"name": str, "kind": str, "attrs": {...}, "inputs": [str],
                         "outputs": [str]} ],
               "shapes": { tensor name: [int] } }
   The adapter interns every string it compares (tensor names, op kinds, the canonical JSON
   of an op's attributes: keys sorted, recursively) into one table of ids, so two ids are
   equal exactly when the strings are; it writes each op as an instruction of
   Plow.Rewritescheck (the ops the rules rewrite as their specific instructions, every other
   op as [IGen kind attrs output operands]), pairs each bundle op with its canonical op (a
   block of the file, or the next canonical op no block names: a pass-through), and runs
   Plow.Rewritescheck.check_checkpoint_a; soundness: Plow.Rewritescheckproof.checkpoint_a_sound.
   The reasons below only describe the checker's rejection; the verdict is the checker's.
   Tensor parallel (plow/graph/shard.py): an op's placement attributes ("device", "tp") are
   part of the id of every tensor it writes (and so of every read of it), and each record of
   its "slices" ([tensor, source, axis, start, stop]) part of the id of the weight operand it
   names (a fused op's: of the layout source it names), so placement and slices are compared
   wherever the ids are, while the rules match the instructions they rewrite; a record that
   names no operand stays in the attributes' id. *)
open Checkers

let theorems = [
  "Plow.Rewritescheckproof.checkpoint_a_sound";
  "Plow.Rewritescheckproof.check_table_sound";
]

type rop = { name : string; kind : string; attrs : Yojson.Safe.t; astr : string;
             inputs : string list; outputs : string list;
             place : string;                      (* "device" and "tp", as JSON *)
             slices : (string * string) list;     (* slice record's tensor, the record *)
             rest : (string * Yojson.Safe.t) list (* the other attributes *) }

type table = { ops : rop array; shapes : (string, int list) Hashtbl.t;
               writer : (string, string) Hashtbl.t (* tensor -> its writer's place *) }

let rec canon_json (j : Yojson.Safe.t) : Yojson.Safe.t =
  match j with
  | `Assoc kv ->
      `Assoc (List.sort (fun (a, _) (b, _) -> compare a b)
                (List.map (fun (k, v) -> (k, canon_json v)) kv))
  | `List l -> `List (List.map canon_json l)
  | x -> x

let strs what j = List.map (Jnum.to_string what) (Jnum.to_list what j)

let read_op j =
  let attrs = canon_json (Jnum.field "attrs" j) in
  let kv = match attrs with `Assoc kv -> kv | _ -> Verdict.bad "field \"attrs\": expected an object" in
  let place = `Assoc (List.filter (fun (k, _) -> k = "device" || k = "tp") kv) in
  let slices =
    match List.assoc_opt "slices" kv with
    | None -> []
    | Some (`List l) ->
        List.map (fun r -> match r with
            | `List (`String t :: _) -> (t, Yojson.Safe.to_string r)
            | _ -> Verdict.bad "attribute \"slices\": expected [tensor, source, axis, start, stop] records") l
    | Some _ -> Verdict.bad "attribute \"slices\": expected a list" in
  { name = Jnum.str_field "name" j; kind = Jnum.str_field "kind" j; attrs;
    astr = Yojson.Safe.to_string attrs;
    inputs = strs "inputs" (Jnum.field "inputs" j);
    outputs = strs "outputs" (Jnum.field "outputs" j);
    place = Yojson.Safe.to_string place; slices;
    rest = List.filter (fun (k, _) -> k <> "device" && k <> "tp" && k <> "slices") kv }

let read_table j =
  let shapes = Hashtbl.create 256 in
  (match Jnum.field "shapes" j with
   | `Assoc kv ->
       List.iter (fun (k, v) ->
           Hashtbl.replace shapes k (List.map (Jnum.to_int "shapes") (Jnum.to_list "shapes" v)))
         kv
   | _ -> Verdict.bad "field \"shapes\": expected an object");
  let ops = Array.of_list (List.map read_op (Jnum.list_field "ops" j)) in
  let writer = Hashtbl.create 256 in
  Array.iter (fun o -> List.iter (fun d -> Hashtbl.replace writer d o.place) o.outputs) ops;
  { ops; shapes; writer }

(* One table of ids for every compared string (prefixed by what it names). *)
let ids : (string, int) Hashtbl.t = Hashtbl.create 4096
let intern s =
  match Hashtbl.find_opt ids s with
  | Some i -> i
  | None -> let i = Hashtbl.length ids in Hashtbl.add ids s i; i
let nid s = Jnum.n_of_int (intern s)
(* a tensor of table [t] as op [o] reads it: a weight under [o]'s slice records for it, any
   other tensor with its writer's placement *)
let rd (t : table) (o : rop) s =
  match List.filter (fun (n, _) -> n = s) o.slices with
  | [] -> nid ("t:" ^ s ^ "@" ^ Option.value ~default:"" (Hashtbl.find_opt t.writer s))
  | rs -> nid ("t:" ^ s ^ "|" ^ String.concat "," (List.map snd rs))
(* a tensor op [o] writes *)
let wr (o : rop) s = nid ("t:" ^ s ^ "@" ^ o.place)
(* the layouts' sources, by weight (read before the tables' instructions are built) *)
let layout_sources : (string, string list) Hashtbl.t = Hashtbl.create 64
(* the attributes an instruction carries: all but the placement and the slice records that
   name an operand (or a layout source of one) *)
let sem (o : rop) =
  let named = o.inputs @ List.concat_map (fun i ->
      Option.value ~default:[] (Hashtbl.find_opt layout_sources i)) o.inputs in
  let left = List.filter_map (fun (n, r) ->
      if List.mem n named then None else Some (Yojson.Safe.from_string r)) o.slices in
  let kv = if left = [] then o.rest else List.sort compare (("slices", `List left) :: o.rest) in
  Yojson.Safe.to_string (`Assoc kv)
let attr_id (o : rop) = nid ("a:" ^ sem o)
let kind_id k = nid ("k:" ^ k)
let num = Jnum.n_of_int

let shape (t : table) s = Option.value ~default:[] (Hashtbl.find_opt t.shapes s)
let last l = match List.rev l with x :: _ -> x | [] -> 0

(* An op that is no instruction of its own kind: [IGen] over its kind and attributes
   (several outputs: an output id no canonical op has). *)
let generic (t : table) (o : rop) : instr =
  let d = match o.outputs with
    | [d] -> wr o d | l -> nid ("o:" ^ String.concat "," l ^ "@" ^ o.place) in
  IGen (kind_id o.kind, attr_id o, d, List.map (rd t o) o.inputs)

(* An op of either table as the instruction the rules match. *)
let instr_of (t : table) (o : rop) : instr =
  let tn = rd t o and tw = wr o in
  match o.kind, o.inputs, o.outputs with
  | "residual_add", [a; b], [d] when sem o = "{}" -> IAdd (tw d, tn a, tn b)
  | "rmsnorm", [x; w], [d] -> INorm (tw d, tn x, tn w, num (last (shape t w)), attr_id o)
  | "linear", [x; w], [d] when sem o = "{}" -> (
      match shape t w with
      | [m; k] -> ILinear (tw d, tn x, tn w, num k, num m)
      | _ -> generic t o)
  | "gated_mlp", [g; u], [d] -> IGlu (tw d, tn g, tn u, attr_id o)
  | _ -> generic t o

type layout = { lname : string; lkind : string; lsources : string list }

(* The rules a block may name, as the checker's [rule_id], with their fused op's kind. *)
let rule_of (r : string) : rule_id option =
  match r with
  | "R1" -> Some R1 | "R4" -> Some R4 | "R10" -> Some R10 | "R11" -> Some R11
  | "R12" -> Some R12 | "R2+R3+R13" | "R23" -> Some R23
  (* R19, the final norm in the lm_head's prologue, is R11 over an lm_head read as a linear
     (an lm_head without a softcap is x . W^T: [lm_head_linear] below) *)
  | "R19" -> Some R11
  | "R18" -> Some R18
  | _ -> None

let fused_kind = function
  | "R1" -> "add_rmsnorm" | "R4" -> "qkv_concat" | "R10" -> "linear_residual"
  | "R11" -> "rmsnorm_linear" | "R12" -> "rmsnorm_residual" | "R2+R3+R13" | "R23" -> "linear_glu"
  | "R19" -> "lm_head"
  | "R18" -> "embedding"
  | _ -> "?"

(* The canonical lm_head of an R19 block as the linear it computes: x . W^T, W [m; k], when
   it has no softcap (its attributes nothing but "softcap": null); else the generic op, which
   no rule matches. Only an R19 block's lm_head is written so: a pass-through lm_head stays
   [IGen], compared kind and all. *)
let lm_head_linear (t : table) (o : rop) : instr =
  match o.kind, o.inputs, o.outputs, shape t (List.nth_opt o.inputs 1 |> Option.value ~default:"") with
  | "lm_head", [x; w], [d], [m; k]
    when List.for_all (fun (a, v) -> a = "softcap" && v = `Null) o.rest
         && (sem o = "{}" || sem o = "{\"softcap\":null}") ->
      ILinear (wr o d, rd t o x, rd t o w, num k, num m)
  | _ -> generic t o

(* The bundle's fused op of a block of rule [r] as that rule's fused instruction; an op of
   another kind or operand shape is written as a plain op (the checker then rejects the
   block: not an instance of its rule). *)
let fused_instr (t : table) (layouts : layout list) (r : string) (o : rop) : instr =
  let lay w kind = List.find_opt (fun l -> l.lname = w && l.lkind = kind) layouts in
  let width s = last (shape t s) in
  let tn = rd t o and tw = wr o in
  match fused_kind r, o.kind, o.inputs, o.outputs with
  | "add_rmsnorm", "add_rmsnorm", [a; b; w], [s; d] ->
      IAddNorm (tw s, tw d, tn a, tn b, tn w, num (width w), attr_id o)
  | "rmsnorm_residual", "rmsnorm_residual", [res; y; w], [d] ->
      INormResidual (tw d, tn res, tn y, tn w, num (width w), attr_id o)
  | "linear_residual", "linear_residual", [x; w; res], [d] when sem o = "{}" -> (
      match shape t w with
      | [m; k] -> ILinearResidual (tw d, tn x, tn w, num k, num m, tn res)
      | _ -> instr_of t o)
  | "rmsnorm_linear", "rmsnorm_linear", [x; nw; w], [d] -> (
      match shape t w with
      | [m; k] -> INormLinear (tw d, tn x, tn nw, num (width nw), attr_id o, tn w, num k, num m)
      | _ -> instr_of t o)
  (* R18's fused op: an embedding over the ids, the table and the norm's weight writing the
     gathered rows and their norm; its attributes are the embedding's, the norm's under
     "norm" (each compared as the canonical op's attribute id) *)
  | "embedding", "embedding", [ids; table; nw], [e; d] -> (
      match List.assoc_opt "norm" o.rest with
      | Some (`Assoc nkv) ->
          let base = { o with rest = List.remove_assoc "norm" o.rest } in
          let q = nid ("a:" ^ Yojson.Safe.to_string (`Assoc nkv)) in
          IGenNorm (kind_id "embedding", attr_id base, tw e, [tn ids; tn table], tw d, tn nw,
                    num (width nw), q)
      | _ -> instr_of t o)
  (* R19's fused op: an lm_head over x, its weight W and the norm's weight (attributes the
     norm's), the norm-linear of R11 *)
  | "lm_head", "lm_head", [x; w; nw], [d] -> (
      match shape t w with
      | [m; k] -> INormLinear (tw d, tn x, tn nw, num (width nw), attr_id o, tn w, num k, num m)
      | _ -> instr_of t o)
  | "qkv_concat", ("qkv_concat" | "linear_qkv"), [x; w], [dq; dk; dv] when sem o = "{}" -> (
      match lay w "cat3", shape t w with
      | Some { lsources = [wq; wk; wv]; _ }, [rows; k]
        when rows = width dq + width dk + width dv ->
          ILinearQKV (tw dq, tw dk, tw dv, tn x, tn wq, tn wk, tn wv, num k,
                      num (width dq), num (width dk), num (width dv))
      | _ -> instr_of t o)
  | "linear_glu", "linear_glu", [x; w], [d] -> (
      match lay w "interleave", shape t w with
      | Some { lsources = [wg; wu]; _ }, [rows; k] when rows = 2 * width d ->
          ILinearGluI (tw d, tn x, tn wg, tn wu, num k, num (width d), attr_id o)
      | _ -> instr_of t o)
  | _ -> instr_of t o

(* ---- reasons *)

let op_str (t : table) i = Printf.sprintf "op %d (%s)" i t.ops.(i).name
let list_str l = "[" ^ String.concat ", " l ^ "]"

(* What differs between a bundle op and its canonical op, in words. *)
let diff (b : rop) (c : rop) : string =
  if b.kind <> c.kind then Printf.sprintf "kind %s, the model's graph has %s" b.kind c.kind
  else if b.astr <> c.astr then (
    let kv j = match j with `Assoc kv -> kv | _ -> [] in
    let keys = List.sort_uniq compare (List.map fst (kv b.attrs) @ List.map fst (kv c.attrs)) in
    let get k j = match List.assoc_opt k (kv j) with
      | Some v -> Yojson.Safe.to_string v | None -> "absent" in
    match List.filter (fun k -> get k b.attrs <> get k c.attrs) keys with
    | k :: _ -> Printf.sprintf "attribute %s is %s, the model's graph has %s" k
                  (get k b.attrs) (get k c.attrs)
    | [] -> "attributes differ")
  else if b.inputs <> c.inputs then (
    let rec first i l m = match l, m with
      | x :: l', y :: m' -> if x = y then first (i + 1) l' m' else
            Printf.sprintf "operand %d is %S, the model's graph has %S" i x y
      | _ -> Printf.sprintf "operands %s, the model's graph has %s"
               (list_str b.inputs) (list_str c.inputs) in
    first 0 b.inputs c.inputs)
  else if b.outputs <> c.outputs then
    Printf.sprintf "outputs %s, the model's graph has %s" (list_str b.outputs) (list_str c.outputs)
  else "tensor shapes differ from the model's graph"

type blk = {
  rule : string;              (* "" for a pass-through *)
  canon_ix : int list;        (* canonical op indices *)
  fused_ix : int option;      (* bundle op index; None: the bundle has no op for it *)
}

let check (payload : Yojson.Safe.t) : Verdict.t =
  let ct = read_table (Jnum.field "canonical" payload) in
  let bt = read_table (Jnum.field "bundle" payload) in
  let layouts =
    List.map (fun j -> { lname = Jnum.str_field "weight" j; lkind = Jnum.str_field "layout" j;
                         lsources = strs "sources" (Jnum.field "sources" j) })
      (Jnum.list_field "layouts" payload) in
  Hashtbl.reset layout_sources;
  List.iter (fun l -> Hashtbl.replace layout_sources l.lname l.lsources) layouts;
  let outputs = strs "outputs" (Jnum.field "outputs" payload) in
  let nc = Array.length ct.ops and nb = Array.length bt.ops in
  let file_blocks =
    List.map (fun j ->
        let rule = Jnum.str_field "rule" j in
        let cs = List.map (Jnum.to_int "canonical") (Jnum.list_field "canonical" j) in
        let f = Jnum.int_field "fused" j in
        if f < 0 || f >= nb || List.exists (fun c -> c < 0 || c >= nc) cs then
          Verdict.bad "block of rule %s: an op index outside its table" rule;
        (f, { rule; canon_ix = cs; fused_ix = Some f }))
      (Jnum.list_field "blocks" payload) in
  let covered = Array.make nc false in
  List.iter (fun (_, b) -> List.iter (fun c -> covered.(c) <- true) b.canon_ix) file_blocks;
  (* bundle ops in order; a pass-through takes the next canonical op no block names *)
  let next = ref 0 in
  let rec skip () = if !next < nc && covered.(!next) then (incr next; skip ()) in
  let blocks =
    List.init nb (fun f ->
        match List.assoc_opt f file_blocks with
        | Some b -> b
        | None ->
            skip ();
            if !next < nc then (let c = !next in incr next; { rule = ""; canon_ix = [c]; fused_ix = Some f })
            else { rule = ""; canon_ix = []; fused_ix = Some f }) in
  let rest = ref [] in
  skip ();
  while !next < nc do
    if not covered.(!next) then rest := { rule = ""; canon_ix = [!next]; fused_ix = None } :: !rest;
    incr next
  done;
  let blocks = Array.of_list (blocks @ List.rev !rest) in
  let in_r19 = Array.make nc false in
  List.iter (fun (_, b) -> if b.rule = "R19" then List.iter (fun c -> in_r19.(c) <- true) b.canon_ix)
    file_blocks;
  let cinstr =
    Array.mapi (fun c o -> if in_r19.(c) && o.kind = "lm_head" then lm_head_linear ct o
                 else instr_of ct o) ct.ops in
  let finstr =
    Array.mapi (fun f o ->
        match List.assoc_opt f file_blocks with
        | Some b -> fused_instr bt layouts b.rule o
        | None -> instr_of bt o)
      bt.ops in
  let missing = IGen (kind_id "(no op)", nid "a:", nid "o:(no op)", []) in
  let to_coq (b : blk) : block =
    (* R19 is R11 over the final norm and the lm_head only: another pair is no instance *)
    let r19_pair () = List.map (fun c -> ct.ops.(c).kind) b.canon_ix = ["rmsnorm"; "lm_head"] in
    { b_rule = (if b.rule = "" || (b.rule = "R19" && not (r19_pair ())) then RNone
                else Option.value ~default:RNone (rule_of b.rule));
      b_canon = List.map (fun c -> cinstr.(c)) b.canon_ix;
      b_fused = (match b.fused_ix with Some f -> finstr.(f) | None -> missing) } in
  (* a block of an unknown rule is an [RNone] block over its ops: not an instance *)
  let verdict =
    check_checkpoint_a (Array.to_list cinstr) (Array.to_list finstr)
      (Array.to_list (Array.map to_coq blocks))
      (List.map (fun s -> nid ("t:" ^ s ^ "@" ^ Option.value ~default:"" (Hashtbl.find_opt ct.writer s))) outputs) in
  match verdict with
  | Accept -> { accepted = true; reason = None; theorems }
  | Reject (bi, code) ->
      let bi = Jnum.int_of_n bi and code = Jnum.int_of_n code in
      let canon_str b = String.concat ", " (List.map (op_str ct) b.canon_ix) in
      let reason =
        match code with
        | 1 when bi < Array.length blocks -> (
            let b = blocks.(bi) in
            match b.rule, b.fused_ix, b.canon_ix with
            | "", Some f, [c] ->
                Printf.sprintf "%s differs from the model's graph (canonical %s): %s"
                  (op_str bt f) (op_str ct c) (diff bt.ops.(f) ct.ops.(c))
            | "", Some f, _ ->
                Printf.sprintf "%s: no op of the model's graph is left for it (the op table has %d ops, the graph %d)"
                  (op_str bt f) nb nc
            | "", None, cs ->
                Printf.sprintf "the op table has no op for the model graph's %s (the op table has %d ops, the graph %d)"
                  (canon_str { b with canon_ix = cs }) nb nc
            | r, Some f, _ when rule_of r = None ->
                Printf.sprintf "%s: rule %S is not one the checker knows (R1, R4, R10, R11, R12, R2+R3+R13, R18, R19)"
                  (op_str bt f) r
            | r, Some f, _ ->
                (* tensor parallel: the slice records the fused op's sources should have *)
                let want = List.concat_map (fun c -> ct.ops.(c).slices) b.canon_ix in
                let got = bt.ops.(f).slices in
                let why = match List.find_opt (fun x -> not (List.mem x got)) want with
                  | Some (_, rc) when got <> want ->
                      Printf.sprintf ": its slices lack the model graph's %s" rc
                  | _ -> "" in
                Printf.sprintf "%s (%s) is not an instance of rule %s (fused kind %s) over %s%s"
                  (op_str bt f) bt.ops.(f).kind r (fused_kind r) (canon_str b) why
            | r, None, _ -> Printf.sprintf "block of rule %s has no fused op" r)
        | 2 when bi < Array.length blocks ->
            let b = blocks.(bi) in
            let who = match b.fused_ix with Some f -> op_str bt f | None -> "a block" in
            (* the values the earlier rule blocks fused away: their canonical ops' outputs
               that their fused op does not write *)
            let gone = Hashtbl.create 16 in
            Array.iteri (fun k (e : blk) ->
                if k < bi && e.rule <> "" then
                  match e.fused_ix with
                  | Some f ->
                      List.iter (fun c ->
                          List.iter (fun o ->
                              if not (List.mem o bt.ops.(f).outputs) then
                                Hashtbl.replace gone o (op_str bt f, e.rule))
                            ct.ops.(c).outputs)
                        e.canon_ix
                  | None -> ())
              blocks;
            let read = List.concat_map (fun c -> ct.ops.(c).inputs) b.canon_ix in
            (match List.find_opt (Hashtbl.mem gone) read with
             | Some v ->
                 let by, r = Hashtbl.find gone v in
                 Printf.sprintf "%s reads %S, which %s (%s) fused away: no buffer holds it any more"
                   who v by r
             | None -> Printf.sprintf "%s reads a value an earlier rewrite fused away" who)
        | 3 ->
            let gone =
              List.concat_map (fun (f, b) ->
                  List.concat_map (fun c ->
                      List.filter_map (fun o ->
                          if List.mem o outputs && not (List.mem o bt.ops.(f).outputs)
                          then Some (Printf.sprintf "%s, fused away by %s (%s)" o (op_str bt f) b.rule)
                          else None)
                        ct.ops.(c).outputs)
                    b.canon_ix)
                file_blocks in
            (match gone with
             | g :: _ -> "program output " ^ g
             | [] -> "a program output is a value a rewrite fused away")
        | 4 ->
            let seq = List.concat_map (fun b -> b.canon_ix) (Array.to_list blocks) in
            let rec first k = function
              | c :: l -> if c = k then first (k + 1) l else Some (k, c)
              | [] -> None in
            (match first 0 seq with
             | Some (k, c) ->
                 Printf.sprintf
                   "the applied rewrites do not keep the model graph's op order: the blocks of rewrites.json put %s where %s is (a fusion may not move an op across another)"
                   (op_str ct c) (op_str ct k)
             | None -> "the op tables are not the concatenation of the applied rewrites' blocks")
        | _ -> Printf.sprintf "rejected (block %d, code %d)" bi code
      in
      { accepted = false; reason = Some reason; theorems = [] }
