(** Locations carried by checker errors.  Every executable checker in the
    oracle returns either [Accept] or [Reject e] where [e] names the first
    violated condition with binary-number coordinates (op, axis, edge,
    counter, buffer, byte offset).  The OCaml side of the oracle renders an
    error with the names it read from the payload. *)
From Coq Require Import NArith List.

Inductive verdict (E : Type) : Type :=
| Accept : verdict E
| Reject : E -> verdict E.
Arguments Accept {E}.
Arguments Reject {E} _.

Definition is_accept {E} (v : verdict E) : bool :=
  match v with Accept => true | Reject _ => false end.
