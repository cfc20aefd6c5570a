(** * Wire format of the packet stream (checkpoint E): definitions and checker.

    A packet is a fixed-size little-endian record.  The record is described by
    a *layout*: a list of fields, each with a width (1, 2, 4 or 8 bytes, built
    as a byte doubled [k] times) and a kind:
    - [Reserved]: padding; encoded as zero bytes, the decoder demands zeros;
      it carries no value in the packet;
    - [Below b]: a value that must be [< b] (a plain unsigned field when [b]
      is the width's base);
    - [OneOf cs]: a value that must be one of the codes [cs] (the opcode).

    A packet is the list of its non-reserved field values, in layout order
    (binary numbers [N]).  Bytes are [N]s; a byte is valid when [< 256].

    The soundness statements (W1, W2 and [checkpoint_e_sound]) are in
    [Wireproof.v].  The concrete layout of wire version 1 is [packet_layout]
    below; docs/wire.md documents it field by field. *)
From Coq Require Import NArith List Bool.
From Plow Require Import Loc.
Import ListNotations.
Local Open Scope N_scope.

(** ** Widths and little-endian numbers *)

(** A width is one byte, or a width doubled. *)
Inductive width : Type :=
| WByte : width
| WDouble : width -> width.

(** Number of distinct values of a field of this width ([256 ^ bytes]). *)
Fixpoint wbase (w : width) : N :=
  match w with
  | WByte => 256
  | WDouble w' => wbase w' * wbase w'
  end.

(** Number of bytes. *)
Fixpoint wbytes (w : width) : N :=
  match w with
  | WByte => 1
  | WDouble w' => 2 * wbytes w'
  end.

Definition u8 : width := WByte.
Definition u16 : width := WDouble u8.
Definition u32 : width := WDouble u16.
Definition u64 : width := WDouble u32.

(** Little-endian encoding of [v] in width [w] (low half first). *)
Fixpoint le_enc (w : width) (v : N) : list N :=
  match w with
  | WByte => [v]
  | WDouble w' => le_enc w' (v mod wbase w') ++ le_enc w' (v / wbase w')
  end.

(** Little-endian decoding of a prefix: the value and the remaining bytes;
    [None] when the bytes run out or a byte is [>= 256]. *)
Fixpoint le_dec (w : width) (bs : list N) : option (N * list N) :=
  match w with
  | WByte =>
      match bs with
      | b :: r => if b <? 256 then Some (b, r) else None
      | [] => None
      end
  | WDouble w' =>
      match le_dec w' bs with
      | None => None
      | Some (lo, r) =>
          match le_dec w' r with
          | None => None
          | Some (hi, r') => Some (lo + wbase w' * hi, r')
          end
      end
  end.

(** ** Layouts *)

Inductive fkind : Type :=
| Reserved : fkind
| Below : N -> fkind
| OneOf : list N -> fkind.

Record wfield : Type := mk_wfield { fwidth : width; fkind_of : fkind }.

Definition kind_ok (k : fkind) (v : N) : bool :=
  match k with
  | Reserved => v =? 0
  | Below b => v <? b
  | OneOf cs => existsb (N.eqb v) cs
  end.

Definition is_reserved (f : wfield) : bool :=
  match fkind_of f with Reserved => true | _ => false end.

(** Record size in bytes. *)
Fixpoint layout_size (fs : list wfield) : N :=
  match fs with
  | [] => 0
  | f :: fs' => wbytes (fwidth f) + layout_size fs'
  end.

(** Why a field failed to decode. *)
Inductive derr : Type :=
| DShort : derr            (** the record ends inside the field, or a value is not a byte *)
| DReserved : N -> derr    (** padding holds this non-zero value *)
| DRange : N -> derr       (** the value is out of the field's range *)
| DUnknown : N -> derr.    (** the value is not a known code (opcode) *)

Definition kind_err (k : fkind) (v : N) : derr :=
  match k with
  | Reserved => DReserved v
  | Below _ => DRange v
  | OneOf _ => DUnknown v
  end.

(** A field error inside one record: field index in the layout (reserved fields
    counted), byte offset of the field inside the record, what went wrong. *)
Record ferr : Type := mk_ferr { fe_field : N; fe_offset : N; fe_kind : derr }.

Inductive wres (A : Type) : Type :=
| WOk : A -> wres A
| WErr : ferr -> wres A.
Arguments WOk {A} _.
Arguments WErr {A} _.

(** ** Encoding *)

(** Encode the values [vs] of the non-reserved fields of [fs]. *)
Fixpoint enc_fields (fs : list wfield) (vs : list N) : list N :=
  match fs with
  | [] => []
  | f :: fs' =>
      if is_reserved f then le_enc (fwidth f) 0 ++ enc_fields fs' vs
      else
        match vs with
        | v :: vs' => le_enc (fwidth f) v ++ enc_fields fs' vs'
        | [] => le_enc (fwidth f) 0 ++ enc_fields fs' []
        end
  end.

(** A well-formed packet: one value per non-reserved field, each within its
    width and its kind. *)
Fixpoint wf_fields (fs : list wfield) (vs : list N) : Prop :=
  match fs with
  | [] => vs = []
  | f :: fs' =>
      if is_reserved f then wf_fields fs' vs
      else
        match vs with
        | v :: vs' => v < wbase (fwidth f) /\ kind_ok (fkind_of f) v = true /\ wf_fields fs' vs'
        | [] => False
        end
  end.

(** ** Decoding with validation *)

(** Decode one record from a prefix of [bs]: the non-reserved values and the
    remaining bytes.  [fi] / [off]: index and byte offset of the first field. *)
Fixpoint dec_fields (fs : list wfield) (fi off : N) (bs : list N) : wres (list N * list N) :=
  match fs with
  | [] => WOk ([], bs)
  | f :: fs' =>
      match le_dec (fwidth f) bs with
      | None => WErr (mk_ferr fi off DShort)
      | Some (v, r) =>
          if kind_ok (fkind_of f) v then
            match dec_fields fs' (N.succ fi) (off + wbytes (fwidth f)) r with
            | WErr e => WErr e
            | WOk (vs, r') => WOk (if is_reserved f then vs else v :: vs, r')
            end
          else WErr (mk_ferr fi off (kind_err (fkind_of f) v))
      end
  end.

(** ** Streams of records *)

Definition enc_stream (fs : list wfield) (ps : list (list N)) : list N :=
  flat_map (enc_fields fs) ps.

(** A stream error: record index, absolute byte offset of the failing field,
    and the field error. *)
Record serr : Type := mk_serr { se_record : N; se_offset : N; se_err : ferr }.

(** Decode records until the bytes are used up.  [fuel] bounds the number of
    records (the caller passes the byte list itself: every record of a
    non-empty layout consumes at least one byte). *)
Fixpoint dec_stream_aux (fs : list wfield) (fuel : list N) (ri : N) (bs : list N)
    : sum serr (list (list N)) :=
  match bs with
  | [] => inr []
  | _ :: _ =>
      match fuel with
      | [] => inl (mk_serr ri (ri * layout_size fs) (mk_ferr 0 0 DShort))
      | _ :: fuel' =>
          match dec_fields fs 0 0 bs with
          | WErr e => inl (mk_serr ri (ri * layout_size fs + fe_offset e) e)
          | WOk (p, r) =>
              match dec_stream_aux fs fuel' (N.succ ri) r with
              | inl e => inl e
              | inr ps => inr (p :: ps)
              end
          end
      end
  end.

Definition dec_stream (fs : list wfield) (bs : list N) : sum serr (list (list N)) :=
  dec_stream_aux fs bs 0 bs.

(** ** Wire version 1: the packet layout (docs/wire.md) *)

Definition wire_version : N := 1.

(** Opcodes 0..19 (see [Opcode] in plow/emit/wire.py; 16..18 Mamba-2's ssm ops, 19
    Kimi-Linear's kda). *)
Definition opcodes : list N :=
  [0; 1; 2; 3; 4; 5; 6; 7; 8; 9; 10; 11; 12; 13; 14; 15; 16; 17; 18; 19].

(** Field indices (reserved included) — used by the oracle to name fields:
     0 opcode u8, 1 flags u8 (< 32), 2 scope u8 (< 3), 3 reserved u8,
     4 worker u16, 5 reserved u16, 6 op_index u32, 7 wait_counter u32,
     8 wait_threshold u32, 9 signal_counter u32, 10 row_start u32,
     11 col_start u32, 12 rows u32, 13 cols u32, 14 in_offset u64,
     15 weight_offset u64, 16 out_offset u64. *)
Definition packet_layout : list wfield :=
  [ mk_wfield u8 (OneOf opcodes);
    mk_wfield u8 (Below 32);
    mk_wfield u8 (Below 3);
    mk_wfield u8 Reserved;
    mk_wfield u16 (Below 65536);
    mk_wfield u16 Reserved;
    mk_wfield u32 (Below 4294967296);
    mk_wfield u32 (Below 4294967296);
    mk_wfield u32 (Below 4294967296);
    mk_wfield u32 (Below 4294967296);
    mk_wfield u32 (Below 4294967296);
    mk_wfield u32 (Below 4294967296);
    mk_wfield u32 (Below 4294967296);
    mk_wfield u32 (Below 4294967296);
    mk_wfield u64 (Below 18446744073709551616);
    mk_wfield u64 (Below 18446744073709551616);
    mk_wfield u64 (Below 18446744073709551616) ].

Definition wire_record_size : N := layout_size packet_layout.

Definition encode_packet (p : list N) : list N := enc_fields packet_layout p.
Definition wf_packet (p : list N) : Prop := wf_fields packet_layout p.

(** Decode exactly one record: the whole of [bs]. *)
Definition decode_packet (bs : list N) : option (list N) :=
  match dec_fields packet_layout 0 0 bs with
  | WOk (p, []) => Some p
  | _ => None
  end.

Definition encode_packets (ps : list (list N)) : list N := enc_stream packet_layout ps.

Definition decode_packets (bs : list N) : option (list (list N)) :=
  match dec_stream packet_layout bs with
  | inr ps => Some ps
  | inl _ => None
  end.

(** ** The checkpoint E checker *)

Definition wlen {A} (l : list A) : N := fold_left (fun n _ => N.succ n) l 0.

Inductive wire_error : Type :=
| WRecordSize : N -> wire_error
    (** the payload's record size differs from the layout's *)
| WTruncated : N -> wire_error
    (** the byte length is not a multiple of the record size *)
| WNotByte : N -> N -> wire_error
    (** byte offset, value: a "byte" that is [>= 256] *)
| WDecode : N -> N -> ferr -> wire_error
    (** record, absolute byte offset of the field, field error *)
| WCount : N -> N -> wire_error
    (** records in the bytes, packets in the payload *)
| WShape : N -> N -> wire_error
    (** record, number of values: the packet has the wrong number of fields *)
| WField : N -> N -> N -> N -> N -> wire_error.
    (** record, absolute byte offset, field index, decoded value, packet value *)

(** First value that is not a byte: its offset and value. *)
Fixpoint first_nonbyte (off : N) (bs : list N) : option (N * N) :=
  match bs with
  | [] => None
  | b :: r => if b <? 256 then first_nonbyte (N.succ off) r else Some (off, b)
  end.

Fixpoint value_fields (fs : list wfield) : N :=
  match fs with
  | [] => 0
  | f :: fs' => if is_reserved f then value_fields fs' else N.succ (value_fields fs')
  end.

(** Compare the decoded record [q] with the payload's packet [p], field by
    wfield; [fi] / [off]: index and record-relative offset of the first wfield;
    [base]: absolute offset of the record. *)
Fixpoint cmp_fields (ri base : N) (fs : list wfield) (fi off : N) (q p : list N)
    : option wire_error :=
  match fs with
  | [] => None
  | f :: fs' =>
      let off' := off + wbytes (fwidth f) in
      if is_reserved f then cmp_fields ri base fs' (N.succ fi) off' q p
      else
        match q, p with
        | x :: q', y :: p' =>
            if x =? y then cmp_fields ri base fs' (N.succ fi) off' q' p'
            else Some (WField ri (base + off) fi x y)
        | _, _ => None
        end
  end.

Fixpoint cmp_records (fs : list wfield) (ri : N) (qs ps : list (list N))
    : verdict wire_error :=
  match qs, ps with
  | q :: qs', p :: ps' =>
      if wlen p =? value_fields fs then
        match cmp_fields ri (ri * layout_size fs) fs 0 0 q p with
        | Some e => Reject e
        | None => cmp_records fs (N.succ ri) qs' ps'
        end
      else Reject (WShape ri (wlen p))
  | [], [] => Accept
  | _, _ => Reject (WCount (wlen qs) (wlen ps))
  end.

(** Checkpoint E: the payload's [bytes] and structured [packets] describe the
    same stream — [decode bytes = packets] and [encode packets = bytes]. *)
Definition check_wire (rsize : N) (bs : list N) (ps : list (list N)) : verdict wire_error :=
  if negb (rsize =? wire_record_size) then Reject (WRecordSize rsize)
  else
    let n := wlen bs in
    if negb (n mod wire_record_size =? 0) then Reject (WTruncated n)
    else
      match first_nonbyte 0 bs with
      | Some (off, v) => Reject (WNotByte off v)
      | None =>
          match dec_stream packet_layout bs with
          | inl e => Reject (WDecode (se_record e) (se_offset e) (se_err e))
          | inr qs =>
              if negb (wlen qs =? wlen ps) then Reject (WCount (wlen qs) (wlen ps))
              else cmp_records packet_layout 0 qs ps
          end
      end.

(** The stream decoder alone, for cross-checking the Python decoder: the
    decoded packets, or the first error. *)
Definition decode_wire (bs : list N) : sum wire_error (list (list N)) :=
  match dec_stream packet_layout bs with
  | inl e => inl (WDecode (se_record e) (se_offset e) (se_err e))
  | inr qs => inr qs
  end.
