(* Conversions between JSON values and the extracted binary numbers.  These
   belong to the trusted base (docs/oracle.md): they are the only place an
   OCaml [int] becomes a Coq [positive]/[N]/[Z]. *)
open Checkers

let rec pos_of_int (n : int) : positive =
  if n <= 1 then XH
  else if n land 1 = 0 then XO (pos_of_int (n lsr 1))
  else XI (pos_of_int (n lsr 1))

let n_of_int (n : int) : n =
  if n < 0 then Verdict.bad "negative number %d where a natural number is required" n
  else if n = 0 then N0 else Npos (pos_of_int n)

let z_of_int (n : int) : z =
  if n = 0 then Z0 else if n > 0 then Zpos (pos_of_int n) else Zneg (pos_of_int (-n))

let rec int_of_pos (p : positive) : int =
  match p with XH -> 1 | XO q -> 2 * int_of_pos q | XI q -> 2 * int_of_pos q + 1

let int_of_n (n : n) : int = match n with N0 -> 0 | Npos p -> int_of_pos p

let int_of_z (z : z) : int =
  match z with Z0 -> 0 | Zpos p -> int_of_pos p | Zneg p -> - int_of_pos p

(* JSON field access with errors that name the field. *)
let field (name : string) (j : Yojson.Safe.t) : Yojson.Safe.t =
  match j with
  | `Assoc kv -> (
      match List.assoc_opt name kv with
      | Some v -> v
      | None -> Verdict.bad "missing field %S" name)
  | _ -> Verdict.bad "expected an object holding field %S" name

let to_int (what : string) (j : Yojson.Safe.t) : int =
  match j with `Int i -> i | _ -> Verdict.bad "field %S: expected an integer" what

let to_n what j = n_of_int (to_int what j)
let to_z what j = z_of_int (to_int what j)

let to_string what (j : Yojson.Safe.t) : string =
  match j with `String s -> s | _ -> Verdict.bad "field %S: expected a string" what

let to_list what (j : Yojson.Safe.t) : Yojson.Safe.t list =
  match j with `List l -> l | _ -> Verdict.bad "field %S: expected a list" what

let int_field name j = to_int name (field name j)
let n_field name j = to_n name (field name j)
let str_field name j = to_string name (field name j)
let list_field name j = to_list name (field name j)
