(** Extraction of every checker the oracle runs, into one OCaml module
    [Checkers].  Numbers stay binary ([N], [Z], [positive]) and are extracted
    as Coq's own inductive types: no integer mapping enters the trusted base. *)
From Coq Require Extraction.
From Coq Require Import NArith ZArith.
From Plow Require Import All.

Extraction Language OCaml.
(* Coq's bool/option/list/prod/unit/sumbool become OCaml's own (ExtrOcamlBasic:
   constructor-for-constructor mappings, listed in docs/oracle.md's trusted base);
   otherwise Checkers.list shadows OCaml's list in the adapters. *)
From Coq Require Import ExtrOcamlBasic.
(* [N.add]/[Z.add] make sure the number types that oracle/jnum.ml builds are
   extracted even before a checker uses them. *)
Extraction "checkers.ml" is_accept N.add Z.add check_pages check_alloc check_alloc_ordered check_tiling_plan check_checkpoint_b check_wire check_emit N.mul check_counters check_checkpoint_d check_checkpoint_d_flow check_checkpoint_d_sweep check_checkpoint_d_sweep_counted check_checkpoint_a
  (* checkers: add each checkpoint's top-level checker here *).
