(* What one checkpoint answers: accepted or not, a located reason, and the
   theorems whose hypotheses the checker established. *)
type t = { accepted : bool; reason : string option; theorems : string list }

(* Counts a checker reports beside its verdict (D's sweep: accesses and frontier entries
   compared); printed as "stats" when not empty. Diagnostics, never a verdict. *)
let stats : (string * int) list ref = ref []

exception Bad_payload of string
(* Raised by a payload reader: the JSON does not have the expected shape. *)

let bad fmt = Printf.ksprintf (fun s -> raise (Bad_payload s)) fmt
