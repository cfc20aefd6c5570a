(** * Soundness of [Emitcheck.check_emit]: an accepted packet list follows the
    emitter's rules field by field ([packet_rules]); with [Wire.check_wire]
    accepting the same packets, they are the plan file's decoded records
    ([checkpoint_e_emit_sound]). *)
From Coq Require Import NArith List Bool.
From Plow Require Import Loc Wire Wireproof Emitcheck.
Import ListNotations.
Local Open Scope N_scope.

(** What the rules demand of one packet. *)
Definition packet_rules (ops : list op_offsets) (p : list N) : Prop :=
  N.land (fld p 1) flags_fused = 0 /\
  (exists es, expected_fields (op_of ops p) p = Some es /\
              Forall (fun kv => fld p (fst kv) = snd kv) es) /\
  (forall oo, op_of ops p = Some oo ->
     N.testbit (fld p 1) flag_argmax_bit = argmax_expected oo p).

Lemma first_mismatch_none : forall p es,
  first_mismatch p es = None -> Forall (fun kv => fld p (fst kv) = snd kv) es.
Proof.
  intros p es. induction es as [|[k v] r IH]; simpl; intros H; [constructor|].
  destruct (fld p k =? v) eqn:E; [|discriminate].
  constructor; [apply N.eqb_eq; exact E | apply IH; exact H].
Qed.

Lemma check_packet_sound : forall ops ri p,
  check_packet ops ri p = None -> packet_rules ops p.
Proof.
  intros ops ri p H. unfold check_packet in H.
  destruct (N.land (fld p 1) flags_fused =? 0) eqn:F; simpl in H; [|discriminate].
  destruct (expected_fields (op_of ops p) p) as [es|] eqn:X; [|discriminate].
  destruct (first_mismatch p es) as [[k v]|] eqn:M; [discriminate|].
  destruct (argmax_ok ops p) eqn:A; [|discriminate].
  split; [apply N.eqb_eq; exact F|].
  split; [exists es; split; [exact X | apply first_mismatch_none; exact M]|].
  intros oo O. unfold argmax_ok in A. rewrite O in A.
  apply Bool.eqb_prop. exact A.
Qed.

Lemma check_emit_from_sound : forall ops ps ri,
  check_emit_from ops ri ps = Accept -> Forall (packet_rules ops) ps.
Proof.
  intros ops ps. induction ps as [|p r IH]; simpl; intros ri H; [constructor|].
  destruct (check_packet ops ri p) eqn:C; [discriminate|].
  constructor; [eapply check_packet_sound; exact C | eapply IH; exact H].
Qed.

Theorem check_emit_sound : forall ops ps,
  check_emit ops ps = Accept -> Forall (packet_rules ops) ps.
Proof. intros ops ps H. eapply check_emit_from_sound. exact H. Qed.

(** Checkpoint E with the emitter rules: the bytes decode to the packets, and
    those decoded records follow the rules for the op table's offsets. *)
Theorem checkpoint_e_emit_sound : forall rsize bs ps ops,
  check_wire rsize bs ps = Accept ->
  check_emit ops ps = Accept ->
  decode_packets bs = Some ps /\ Forall wf_packet ps /\ Forall (packet_rules ops) ps.
Proof.
  intros rsize bs ps ops Hw He.
  destruct (checkpoint_e_sound _ _ _ Hw) as [_ [Hd [_ Hwf]]].
  split; [exact Hd | split; [exact Hwf | apply check_emit_sound; exact He]].
Qed.
