(* Checkpoint C: on-chip page occupancy never exceeds the per-worker budget.
   Payload (plow/oracle/payloads/pages.py):
     { "budget_pages": int,
       "workers": [ { "worker": int,
                      "windows": [ {"name": str, "start": int, "end": int, "pages": int} ] } ] }
   Checker: Plow.Pages.check_pages; soundness: Plow.Pagesproof.check_pages_sound. *)
open Checkers

type win = { name : string; start : int; stop : int; pages : int }
type worker = { id : int; wins : win list }

let read_window j =
  { name = Jnum.str_field "name" j; start = Jnum.int_field "start" j;
    stop = Jnum.int_field "end" j; pages = Jnum.int_field "pages" j }

let read_worker j =
  { id = Jnum.int_field "worker" j; wins = List.map read_window (Jnum.list_field "windows" j) }

let to_coq (w : win) : window =
  { w_start = Jnum.n_of_int w.start; w_end = Jnum.n_of_int w.stop; w_pages = Jnum.n_of_int w.pages }

let theorems = [ "Plow.Pagesproof.check_pages_sound" ]

(* Names of the windows live at [t] (at most [cap] of them, largest first). *)
let live_names (ws : win list) (t : int) : string =
  let live = List.filter (fun w -> w.start <= t && t < w.stop) ws in
  let live = List.stable_sort (fun a b -> compare b.pages a.pages) live in
  let cap = 8 in
  let shown = List.filteri (fun i _ -> i < cap) live in
  let parts = List.map (fun w -> Printf.sprintf "%s (%d)" w.name w.pages) shown in
  String.concat ", " parts ^ (if List.length live > cap then ", ..." else "")

let check (payload : Yojson.Safe.t) : Verdict.t =
  let budget = Jnum.int_field "budget_pages" payload in
  let workers = List.map read_worker (Jnum.list_field "workers" payload) in
  let tl = List.map (fun wk -> List.map to_coq wk.wins) workers in
  match check_pages (Jnum.n_of_int budget) tl with
  | Accept -> { accepted = true; reason = None; theorems }
  | Reject (Over_budget (k, wi, t, o, b)) ->
      let wk = List.nth workers (Jnum.int_of_n k) in
      let opening = List.nth wk.wins (Jnum.int_of_n wi) in
      let t = Jnum.int_of_n t in
      let reason =
        Printf.sprintf "worker %d at cycle %d: %d pages live, budget %d (when %S opens; pages: %s)"
          wk.id t (Jnum.int_of_n o) (Jnum.int_of_n b) opening.name (live_names wk.wins t)
      in
      { accepted = false; reason = Some reason; theorems = [] }
