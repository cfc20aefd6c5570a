(** * Wire format (checkpoint E): soundness.

    W1 ([decode_encode_packet], [decode_encode_packets]): decoding the encoding
    of a well-formed packet (stream) gives it back.
    W2 ([encode_decode_packet], [encode_decode_packets]): every record (stream)
    the decoder accepts is the encoding of what it decoded, and what it decoded
    is well formed.
    [checkpoint_e_sound]: when [check_wire] accepts a payload, its bytes decode
    to its packets, its packets encode to its bytes, and every packet is well
    formed. *)
From Coq Require Import NArith List Bool Lia.
From Plow Require Import Loc Wire.
Import ListNotations.
Local Open Scope N_scope.

(** ** Little-endian numbers *)

Lemma wbase_pos : forall w, 0 < wbase w.
Proof.
  induction w as [|w IH]; simpl.
  - lia.
  - apply N.mul_pos_pos; exact IH.
Qed.

Lemma wbase_nz : forall w, wbase w <> 0.
Proof. intros w H. pose proof (wbase_pos w). lia. Qed.

Lemma le_dec_enc : forall w v r,
  v < wbase w -> le_dec w (le_enc w v ++ r) = Some (v, r).
Proof.
  induction w as [|w IH]; intros v r Hv; simpl in *.
  - apply N.ltb_lt in Hv. rewrite Hv. reflexivity.
  - pose proof (wbase_nz w) as Hnz.
    rewrite <- app_assoc.
    rewrite IH by (apply N.mod_lt; exact Hnz).
    rewrite IH by (apply N.div_lt_upper_bound; assumption).
    rewrite N.add_comm, <- (N.div_mod v (wbase w) Hnz).
    reflexivity.
Qed.

Lemma le_dec_sound : forall w bs v r,
  le_dec w bs = Some (v, r) -> bs = le_enc w v ++ r /\ v < wbase w.
Proof.
  induction w as [|w IH]; intros bs v r H; simpl in *.
  - destruct bs as [|b bs']; [discriminate|].
    destruct (b <? 256) eqn:Hb; [|discriminate].
    inversion H; subst. apply N.ltb_lt in Hb. split; [reflexivity|exact Hb].
  - destruct (le_dec w bs) as [[lo r1]|] eqn:H1; [|discriminate].
    destruct (le_dec w r1) as [[hi r2]|] eqn:H2; [|discriminate].
    inversion H; subst v r; clear H.
    apply IH in H1 as [E1 L1]. apply IH in H2 as [E2 L2].
    pose proof (wbase_nz w) as Hnz.
    assert (Hm : (lo + wbase w * hi) mod wbase w = lo).
    { rewrite N.mul_comm, N.mod_add by exact Hnz. apply N.mod_small; exact L1. }
    assert (Hd : (lo + wbase w * hi) / wbase w = hi).
    { rewrite N.mul_comm, N.div_add by exact Hnz. rewrite N.div_small by exact L1. reflexivity. }
    rewrite Hm, Hd. split.
    + subst bs r1. apply app_assoc.
    + assert (wbase w * (hi + 1) <= wbase w * wbase w).
      { apply N.mul_le_mono_l. lia. }
      lia.
Qed.

Lemma le_enc_nonnil : forall w v, le_enc w v <> [].
Proof.
  induction w as [|w IH]; intros v; simpl.
  - discriminate.
  - intros H. apply app_eq_nil in H as [H _]. exact (IH _ H).
Qed.

(** ** One record *)

Lemma kind_ok_reserved : forall v, kind_ok Reserved v = true -> v = 0.
Proof. intros v H. simpl in H. apply N.eqb_eq. exact H. Qed.

Lemma dec_enc_fields : forall fs vs fi off r,
  wf_fields fs vs -> dec_fields fs fi off (enc_fields fs vs ++ r) = WOk (vs, r).
Proof.
  induction fs as [|[w k] fs IH]; intros vs fi off r Hwf; simpl in *.
  - subst vs. reflexivity.
  - unfold is_reserved in *; simpl in *.
    destruct k as [|b|cs].
    + rewrite <- app_assoc, le_dec_enc by apply wbase_pos. simpl.
      rewrite IH by exact Hwf. reflexivity.
    + destruct vs as [|v vs']; [contradiction|]. destruct Hwf as [Hv [Hk Hwf]].
      rewrite <- app_assoc, le_dec_enc by exact Hv. simpl in Hk |- *. rewrite Hk.
      rewrite IH by exact Hwf. reflexivity.
    + destruct vs as [|v vs']; [contradiction|]. destruct Hwf as [Hv [Hk Hwf]].
      rewrite <- app_assoc, le_dec_enc by exact Hv. simpl in Hk |- *. rewrite Hk.
      rewrite IH by exact Hwf. reflexivity.
Qed.

Lemma dec_fields_sound : forall fs fi off bs vs r,
  dec_fields fs fi off bs = WOk (vs, r) -> wf_fields fs vs /\ bs = enc_fields fs vs ++ r.
Proof.
  induction fs as [|[w k] fs IH]; intros fi off bs vs r H; simpl in *.
  - inversion H; subst. split; reflexivity.
  - destruct (le_dec w bs) as [[v r1]|] eqn:Hd; [|discriminate].
    apply le_dec_sound in Hd as [Eb Lv].
    destruct (kind_ok k v) eqn:Hk; [|discriminate].
    destruct (dec_fields fs (N.succ fi) (off + wbytes w) r1) as [[vs1 r2]|e] eqn:Hr;
      [|discriminate].
    inversion H; subst; clear H.
    apply IH in Hr as [Hwf Er].
    unfold is_reserved; simpl. destruct k as [|b|cs].
    + apply kind_ok_reserved in Hk. subst v. split; [exact Hwf|].
      rewrite Er, app_assoc. reflexivity.
    + split; [repeat split; assumption|]. rewrite Er, app_assoc. reflexivity.
    + split; [repeat split; assumption|]. rewrite Er, app_assoc. reflexivity.
Qed.

(** W1 for one record. *)
Theorem decode_encode_packet : forall p,
  wf_packet p -> decode_packet (encode_packet p) = Some p.
Proof.
  intros p Hwf. unfold decode_packet, encode_packet.
  rewrite <- (app_nil_r (enc_fields packet_layout p)).
  rewrite dec_enc_fields by exact Hwf. reflexivity.
Qed.

(** W2 for one record. *)
Theorem encode_decode_packet : forall bs p,
  decode_packet bs = Some p -> encode_packet p = bs /\ wf_packet p.
Proof.
  intros bs p H. unfold decode_packet in H.
  destruct (dec_fields packet_layout 0 0 bs) as [[q r]|e] eqn:Hd; [|discriminate].
  destruct r; [|discriminate]. inversion H; subst q; clear H.
  apply dec_fields_sound in Hd as [Hwf E].
  rewrite app_nil_r in E. split; [symmetry; exact E|exact Hwf].
Qed.

(** ** Streams *)

Lemma enc_fields_nonnil : forall f fs vs, enc_fields (f :: fs) vs <> [].
Proof.
  intros f fs vs. simpl.
  destruct (is_reserved f); [|destruct vs];
    intros H; apply app_eq_nil in H as [H _]; exact (le_enc_nonnil _ _ H).
Qed.

Lemma enc_stream_length : forall f fs ps,
  (length ps <= length (enc_stream (f :: fs) ps))%nat.
Proof.
  intros f fs ps. induction ps as [|p ps IH]; [simpl; lia|].
  unfold enc_stream in *. cbn [flat_map length]. rewrite app_length.
  pose proof (enc_fields_nonnil f fs p) as Hn.
  destruct (enc_fields (f :: fs) p); [contradiction|]. cbn [length]. lia.
Qed.

Lemma dec_stream_aux_cons : forall fs x fuel ri bs,
  bs <> [] ->
  dec_stream_aux fs (x :: fuel) ri bs =
    match dec_fields fs 0 0 bs with
    | WErr e => inl (mk_serr ri (ri * layout_size fs + fe_offset e) e)
    | WOk (p, r) =>
        match dec_stream_aux fs fuel (N.succ ri) r with
        | inl e => inl e
        | inr ps => inr (p :: ps)
        end
    end.
Proof. intros fs x fuel ri bs H. destruct bs; [contradiction|reflexivity]. Qed.

Lemma dec_enc_stream_aux : forall f fs ps fuel ri,
  Forall (wf_fields (f :: fs)) ps -> (length ps <= length fuel)%nat ->
  dec_stream_aux (f :: fs) fuel ri (enc_stream (f :: fs) ps) = inr ps.
Proof.
  intros f fs ps. induction ps as [|p ps IH]; intros fuel ri Hwf Hlen.
  - destruct fuel; reflexivity.
  - inversion Hwf as [|? ? Hp Hps]; subst.
    destruct fuel as [|x0 fuel']; [simpl in Hlen; lia|].
    unfold enc_stream; cbn [flat_map].
    rewrite dec_stream_aux_cons.
    + rewrite dec_enc_fields by exact Hp.
      fold (enc_stream (f :: fs) ps).
      rewrite IH by (simpl in Hlen; lia || assumption). reflexivity.
    + intros E. apply app_eq_nil in E as [E _]. exact (enc_fields_nonnil _ _ _ E).
Qed.

Lemma dec_stream_aux_sound : forall fs fuel ri bs ps,
  dec_stream_aux fs fuel ri bs = inr ps ->
  bs = enc_stream fs ps /\ Forall (wf_fields fs) ps.
Proof.
  intros fs fuel. induction fuel as [|x0 fuel IH]; intros ri bs ps H;
    destruct bs as [|b bs]; simpl in H.
  - inversion H; subst. split; [reflexivity|constructor].
  - discriminate.
  - inversion H; subst. split; [reflexivity|constructor].
  - destruct (dec_fields fs 0 0 (b :: bs)) as [[p r]|e] eqn:Hd; [|discriminate].
    destruct (dec_stream_aux fs fuel (N.succ ri) r) as [e|ps'] eqn:Hs; [discriminate|].
    inversion H; subst ps; clear H.
    apply dec_fields_sound in Hd as [Hp Eb]. apply IH in Hs as [Er Hps].
    rewrite Eb, Er. split; [reflexivity|constructor; assumption].
Qed.

Lemma packet_layout_cons : exists f fs, packet_layout = f :: fs.
Proof. eexists. eexists. reflexivity. Qed.

(** W1 for streams: a list of well-formed packets encodes to bytes that decode
    to the same list. *)
Theorem decode_encode_packets : forall ps,
  Forall wf_packet ps -> decode_packets (encode_packets ps) = Some ps.
Proof.
  intros ps Hwf. unfold decode_packets, encode_packets, dec_stream.
  destruct packet_layout_cons as [f [fs E]]. rewrite E in *.
  rewrite dec_enc_stream_aux.
  - reflexivity.
  - unfold wf_packet in Hwf. rewrite E in Hwf. exact Hwf.
  - apply enc_stream_length.
Qed.

(** W2 for streams: every byte string the decoder accepts is the encoding of
    the (well-formed) packets it decodes to. *)
Theorem encode_decode_packets : forall bs ps,
  decode_packets bs = Some ps -> encode_packets ps = bs /\ Forall wf_packet ps.
Proof.
  intros bs ps H. unfold decode_packets, dec_stream in H.
  destruct (dec_stream_aux packet_layout bs 0 bs) as [e|qs] eqn:Hd; [discriminate|].
  inversion H; subst qs; clear H.
  apply dec_stream_aux_sound in Hd as [E Hwf].
  split; [symmetry; exact E|exact Hwf].
Qed.

(** ** The checker *)

Lemma wlen_fold : forall A (l : list A) a,
  fold_left (fun n _ => N.succ n) l a = a + N.of_nat (length l).
Proof.
  intros A l. induction l as [|x l IH]; intros a; simpl.
  - lia.
  - rewrite IH. lia.
Qed.

Lemma wlen_length : forall A (l : list A), wlen l = N.of_nat (length l).
Proof. intros A l. unfold wlen. rewrite wlen_fold. lia. Qed.

Lemma cmp_fields_eq : forall fs ri base fi off q p,
  wf_fields fs q -> N.of_nat (length p) = value_fields fs ->
  cmp_fields ri base fs fi off q p = None -> q = p.
Proof.
  induction fs as [|f fs IH]; intros ri base fi off q p Hwf Hlen Hc; simpl in *.
  - subst q. destruct p; [reflexivity|simpl in Hlen; lia].
  - destruct (is_reserved f).
    + eapply IH; eassumption.
    + destruct q as [|x q]; [contradiction|]. destruct Hwf as [_ [_ Hwf]].
      destruct p as [|y p]; [simpl in Hlen; lia|].
      destruct (x =? y) eqn:Hxy; [|discriminate].
      apply N.eqb_eq in Hxy. subst y. f_equal.
      eapply IH; [exact Hwf| |exact Hc]. simpl in Hlen. lia.
Qed.

Lemma cmp_records_eq : forall fs qs ri ps,
  Forall (wf_fields fs) qs -> cmp_records fs ri qs ps = Accept -> qs = ps.
Proof.
  intros fs qs. induction qs as [|q qs IH]; intros ri ps Hwf H; destruct ps as [|p ps];
    simpl in H; try discriminate.
  - reflexivity.
  - inversion Hwf as [|? ? Hq Hqs]; subst.
    destruct (wlen p =? value_fields fs) eqn:Hl; [|discriminate].
    apply N.eqb_eq in Hl. rewrite wlen_length in Hl.
    destruct (cmp_fields ri (ri * layout_size fs) fs 0 0 q p) eqn:Hc; [discriminate|].
    f_equal.
    + eapply cmp_fields_eq; eassumption.
    + eapply IH; eassumption.
Qed.

Lemma record_size_64 : wire_record_size = 64.
Proof. reflexivity. Qed.

(** Top theorem of checkpoint E: an accepted payload's bytes decode to its
    packets (W2 side: they are the packets' encoding) and its packets encode
    to its bytes and are well formed (so W1 applies to them). *)
Theorem checkpoint_e_sound : forall rsize bs ps,
  check_wire rsize bs ps = Accept ->
  rsize = wire_record_size /\
  decode_packets bs = Some ps /\
  encode_packets ps = bs /\
  Forall wf_packet ps.
Proof.
  intros rsize bs ps H. unfold check_wire in H.
  destruct (rsize =? wire_record_size) eqn:Hr; simpl in H; [|discriminate].
  destruct (wlen bs mod wire_record_size =? 0); simpl in H; [|discriminate].
  destruct (first_nonbyte 0 bs) as [[o v]|]; [discriminate|].
  destruct (dec_stream packet_layout bs) as [e|qs] eqn:Hd; [discriminate|].
  destruct (wlen qs =? wlen ps); simpl in H; [|discriminate].
  assert (Hq : decode_packets bs = Some qs) by (unfold decode_packets; rewrite Hd; reflexivity).
  pose proof (encode_decode_packets _ _ Hq) as [Enc Hwf].
  assert (qs = ps) by exact (cmp_records_eq packet_layout qs 0 ps Hwf H).
  subst qs. apply N.eqb_eq in Hr.
  repeat split; assumption.
Qed.
