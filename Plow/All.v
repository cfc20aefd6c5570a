(** Imports every theory of the proof library; [coqchk] runs on this module. *)
From Plow Require Export Loc.
From Plow Require Export Pages Pagesproof.
