(** * The tactics [serq prove] runs on an exported program

    An exported file ([serq/prove.py]) defines the program's constants, its engine [E]
    and, per claim, the statement [every_path E given (fun v => claim v = true)].  It
    proves a claim with [serq_claim bcol unfold_consts], which tries the RAD family's
    theorems ([Radproof.v]) with [bcol] the program's [tokens cap]:

    - [serq_rate]: [rad_token_rate], after showing [capped bcol E] and [rad_cost] by
      computation (the cost's [tlin], [tnl] are found by unification);
    - [serq_tiled]: [rad_batch_tiled], after showing [rad_schedule bcol E] (the modes are
      compared as boolean functions, by case analysis on their comparisons) and that the
      claim's [given] implies [tiled bcol];

    then closes [forall v, family_claim v -> claim v = true] by turning the boolean claim
    into a proposition and calling [lia].  Nothing here is trusted: the statement is
    what is checked, and a tactic that fails leaves the claim not proved. *)
From Coq Require Import List Bool Arith Lia.
From Plow Require Import Serq.Step Serq.Stepproof Serq.Rad Serq.Radproof.

Ltac serq_bool :=
  repeat first
    [ rewrite orb_true_iff in * | rewrite andb_true_iff in * | rewrite negb_true_iff in *
    | rewrite orb_false_iff in * | rewrite andb_false_iff in * | rewrite negb_false_iff in *
    | rewrite Nat.eqb_eq in * | rewrite Nat.eqb_neq in * | rewrite Nat.leb_le in *
    | rewrite Nat.leb_gt in * | rewrite Nat.ltb_lt in * | rewrite Nat.ltb_ge in * ].

Ltac serq_cases :=
  repeat match goal with
  | |- context [if ?b then _ else _] => destruct b
  | |- context [Nat.leb ?a ?b] => destruct (Nat.leb a b)
  | |- context [Nat.eqb ?a ?b] => destruct (Nat.eqb a b)
  | |- context [Nat.ltb ?a ?b] => destruct (Nat.ltb a b)
  end.

(** Two boolean functions of a view agree: by cases, then by computation. *)
Ltac serq_same_bool uc := intro; uc; unfold rad_mode; cbn beta; serq_cases; reflexivity.
Ltac serq_same_nat uc := intro; uc; cbn beta; reflexivity.

Ltac serq_pos uc := uc; apply Nat.ltb_lt; reflexivity.

Ltac serq_capped uc := eexists; split; [reflexivity|serq_same_nat uc].

Ltac serq_clause uc :=
  do 3 eexists; split; [reflexivity|split; [serq_same_bool uc|serq_same_nat uc]].

Ltac serq_schedule uc := split; [serq_capped uc|split; serq_clause uc].

Ltac serq_cost := intro; cbn beta; reflexivity.

Ltac serq_close uc :=
  intros ?v ?H; unfold token_rate, optimal_tiling, decoder_bound in *; cbn beta in *;
  serq_bool; first [lia | uc; lia].

Ltac serq_given uc :=
  intros ?r ?Hr; unfold tiled; cbn beta in *; uc;
  first [exact Hr | serq_bool; first [lia | uc; lia]].

Ltac serq_rate bcol uc :=
  apply (every_path_given _ (fun _ => true)); [intros; reflexivity|];
  eapply every_path_impl;
    [|eapply (rad_token_rate bcol); [serq_pos uc|serq_capped uc|serq_cost]];
  serq_close uc.

Ltac serq_tiled bcol uc :=
  apply (every_path_given _ (tiled bcol)); [serq_given uc|];
  eapply every_path_impl;
    [|eapply (rad_batch_tiled bcol); [serq_pos uc|serq_schedule uc]];
  serq_close uc.

Ltac serq_all bcol uc :=
  apply (every_path_given _ (tiled bcol)); [serq_given uc|];
  eapply every_path_impl;
    [|eapply (rad_all bcol); [serq_pos uc|serq_schedule uc|serq_cost]];
  serq_close uc.

Ltac serq_claim bcol uc := first [serq_rate bcol uc | serq_tiled bcol uc | serq_all bcol uc].

(** What is left when no route closes a claim: the claim at a view, knowing what the
    family theorems say of it (the most they say: all three, else tiling, else rate). *)
Ltac serq_open :=
  intros ?v ?H; unfold token_rate, optimal_tiling, decoder_bound in *; cbn beta in *;
  serq_bool.

Ltac serq_residual bcol uc :=
  first
    [ apply (every_path_given _ (tiled bcol)); [serq_given uc|];
      eapply every_path_impl;
        [|eapply (rad_all bcol); [serq_pos uc|serq_schedule uc|serq_cost]]; serq_open
    | apply (every_path_given _ (tiled bcol)); [serq_given uc|];
      eapply every_path_impl;
        [|eapply (rad_batch_tiled bcol); [serq_pos uc|serq_schedule uc]]; serq_open
    | apply (every_path_given _ (fun _ => true)); [intros; reflexivity|];
      eapply every_path_impl;
        [|eapply (rad_token_rate bcol); [serq_pos uc|serq_capped uc|serq_cost]]; serq_open
    | idtac ].
