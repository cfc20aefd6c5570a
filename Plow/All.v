(** Imports every theory of the proof library; [coqchk] runs on this module. *)
From Plow Require Export Loc.
From Plow Require Export Pages Pagesproof.
From Plow Require Export Alloc Allocproof.
From Plow Require Export Tiles Bounds Partition Partitionproof Tilesproof.
From Plow Require Export Wire Wireproof Emitcheck Emitcheckproof.
From Plow Require Export Counters Countersproof.
From Plow Require Export Dataflow Dataflowproof.
From Plow Require Export Flowsweep Flowsweepproof.
From Plow Require Export Collapse Gated Gatedproof.
From Plow Require Export Passes Passesproof.
From Plow Require Export Rewrites Rewritesproof Rewritescheck Rewritescheckproof.
From Plow Require Export Serq.Step Serq.Stepproof Serq.Rad Serq.Radproof Serq.Theorem2 Serq.Theorem2proof.
