(** * Checkpoint E's emitter rules, on the decoded packets.

    [Wire.check_wire] proves that the plan file's bytes decode to the payload's
    packets; this file checks what those packets say against the bundle's op
    table and arena map, field by field, with the rules of the emitter
    (plow/emit/emit.py [emit_packets]; docs/bundle.md "Verify"):

    - every packet: no FUSED_RESIDUAL or FUSED_ROPE flag (bits 1, 2 of
      [flags]);
    - FUSED_ARGMAX (bit 3): set on a packet that is neither a nop nor a load
      exactly when its op is fused ([oo_argmax]: the op table names the op's
      argmax buffer — greedy sampling fused into lm_head, on the lm_head op and
      on the sample op that reads it, plow/emit/argmax.py), clear otherwise;
    - a nop (opcode 0): [flags], [row_start], [col_start], [rows], [cols] and
      the three offsets are zero;
    - every other packet: [col_start] = [cols] = 0, and [op_index] names an op
      of the table; with that op's offsets (its first input, its second input,
      its first output, its partial if it has one):
      - a load (opcode 1): [in_offset] = [out_offset] = 0, [weight_offset] =
        the second input;
      - a merge (flag ACCUMULATE): [in_offset] = the partial, or the first input
        when the op has none; [weight_offset] = the second input;
        [out_offset] = the output;
      - a compute packet: [in_offset] = the first input; [weight_offset] = the
        second input; [out_offset] = the partial, or the output when the op has
        none.

    A packet is the list of its value fields as [Wire.packet_layout] orders
    them (reserved fields left out): 0 opcode, 1 flags, 2 scope, 3 worker,
    4 op_index, 5 wait_counter, 6 wait_threshold, 7 signal_counter,
    8 row_start, 9 col_start, 10 rows, 11 cols, 12 in_offset,
    13 weight_offset, 14 out_offset.  Soundness: [Emitcheckproof.v]. *)
From Coq Require Import NArith List Bool.
From Plow Require Import Loc.
Import ListNotations.
Local Open Scope N_scope.

(** One op's arena offsets: first input, second input (0 when it has none),
    first output, and its partial's offset when it has one; [oo_argmax]: the
    op table names the op's fused argmax buffer. *)
Record op_offsets : Type :=
  mk_op_offsets { oo_in : N; oo_weight : N; oo_out : N; oo_partial : option N;
                  oo_argmax : bool }.

Definition fld (p : list N) (k : nat) : N := nth k p 0.

Definition opcode_nop : N := 0.
Definition opcode_load : N := 1.
Definition flags_fused : N := 6.  (** FUSED_RESIDUAL 2 | FUSED_ROPE 4: never written *)
Definition flag_argmax_bit : N := 3.  (** FUSED_ARGMAX = 8 *)
Definition flag_accumulate_bit : N := 4.  (** ACCUMULATE = 16 *)

(** The fields a packet must carry, as (field position, value) pairs; [None]
    when it is not a nop and its [op_index] names no op of [o]. *)
Definition expected_fields (o : option op_offsets) (p : list N) : option (list (nat * N)) :=
  if fld p 0 =? opcode_nop then
    Some [(1%nat, 0); (8%nat, 0); (9%nat, 0); (10%nat, 0); (11%nat, 0);
          (12%nat, 0); (13%nat, 0); (14%nat, 0)]
  else
    match o with
    | None => None
    | Some oo =>
        let rest :=
          if fld p 0 =? opcode_load then [(12%nat, 0); (13%nat, oo_weight oo); (14%nat, 0)]
          else if N.testbit (fld p 1) flag_accumulate_bit then
            [(12%nat, match oo_partial oo with Some q => q | None => oo_in oo end);
             (13%nat, oo_weight oo); (14%nat, oo_out oo)]
          else
            [(12%nat, oo_in oo); (13%nat, oo_weight oo);
             (14%nat, match oo_partial oo with Some q => q | None => oo_out oo end)]
        in Some ((9%nat, 0) :: (11%nat, 0) :: rest)
    end.

Definition op_of (ops : list op_offsets) (p : list N) : option op_offsets :=
  nth_error ops (N.to_nat (fld p 4)).

(** Whether a packet of op [oo] must carry FUSED_ARGMAX: not a nop, not a
    load, and the op is fused. *)
Definition argmax_expected (oo : op_offsets) (p : list N) : bool :=
  negb (fld p 0 =? opcode_nop) && negb (fld p 0 =? opcode_load) && oo_argmax oo.

(** The packet's FUSED_ARGMAX bit is what its op asks (a packet naming no op:
    nothing to check here; [expected_fields] rejects it unless it is a nop). *)
Definition argmax_ok (ops : list op_offsets) (p : list N) : bool :=
  match op_of ops p with
  | Some oo => Bool.eqb (N.testbit (fld p 1) flag_argmax_bit) (argmax_expected oo p)
  | None => true
  end.

Inductive emit_error : Type :=
| EFused : N -> N -> emit_error
    (** record, flags: a FUSED_RESIDUAL / FUSED_ROPE flag is set *)
| EArgmax : N -> N -> emit_error
    (** record, flags: FUSED_ARGMAX disagrees with the op table *)
| EOpIndex : N -> N -> emit_error
    (** record, op index: not an op of the table *)
| EField : N -> N -> N -> N -> emit_error.
    (** record, value field position, the packet's value, the rules' value *)

Fixpoint first_mismatch (p : list N) (es : list (nat * N)) : option (nat * N) :=
  match es with
  | [] => None
  | (k, v) :: r => if fld p k =? v then first_mismatch p r else Some (k, v)
  end.

Definition check_packet (ops : list op_offsets) (ri : N) (p : list N) : option emit_error :=
  if negb (N.land (fld p 1) flags_fused =? 0) then Some (EFused ri (fld p 1))
  else
    match expected_fields (op_of ops p) p with
    | None => Some (EOpIndex ri (fld p 4))
    | Some es =>
        match first_mismatch p es with
        | None => if argmax_ok ops p then None else Some (EArgmax ri (fld p 1))
        | Some (k, v) => Some (EField ri (N.of_nat k) (fld p k) v)
        end
    end.

Fixpoint check_emit_from (ops : list op_offsets) (ri : N) (ps : list (list N))
    : verdict emit_error :=
  match ps with
  | [] => Accept
  | p :: r =>
      match check_packet ops ri p with
      | Some e => Reject e
      | None => check_emit_from ops (N.succ ri) r
      end
  end.

(** Checkpoint E's emitter rules over the packets, first record 0. *)
Definition check_emit (ops : list op_offsets) (ps : list (list N)) : verdict emit_error :=
  check_emit_from ops 0 ps.
