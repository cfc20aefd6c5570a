(** * Makespan lower bounds (T4) and decode weight traffic (T6).

    Execution model (a faithful but tractable abstraction of a persistent
    kernel running the tiles of a plan on [W] workers):

    - The machine has a memory bandwidth [bw] (bytes/s), shared by all
      workers, and [W] workers, worker [w] with peak rate [peak_w] (flop/s);
      the list [peaks] gives them in worker order.
    - Time is cut into phases, at every instant any tile starts, stops or
      changes its rate; inside a phase the rates are constant.  Every
      schedule with piecewise-constant rates is such a list of phases, so
      nothing is lost by the cut: the bandwidth shares of the tiles may vary
      from phase to phase (dynamic sharing), and a tile may run over many
      phases on one worker.
    - In a phase of [d] ns, worker [w] runs pieces of tiles (a piece names its
      op and tile, and the bytes it moves and the flops it performs in the
      phase).  The phase is feasible when the bytes moved by all pieces of
      all workers fit the shared bandwidth, [bytes * 10^9 <= bw * d], and for
      each worker the flops of its pieces fit its peak,
      [flops_w * 10^9 <= peak_w * d].  (Per tile this is "the tile's time is
      at least its bytes over its bandwidth share and its flops over its
      worker's rate", summed over the pieces sharing the phase.)
    - The makespan is the sum of the phase durations.  The schedule
      performs a plan when it moves at least the plan's bytes and performs at
      least the plan's flops in total (a weaker hypothesis than accounting
      op by op, so the bounds hold a fortiori for per-op accounting).

    All inequalities are cross-multiplied in [N]: "time [T] ns is enough for
    [B] bytes at [bw] B/s" is [B * 10^9 <= T * bw]. *)
From Coq Require Import NArith List Lia.
From Coq Require FinFun.
From Plow Require Import Tiles.
Import ListNotations.
Local Open Scope N_scope.

Record piece := mk_piece {
  pc_op : N;           (** index of the op this piece belongs to *)
  pc_tile : list N;    (** the tile: one step number per axis *)
  pc_bytes : N;        (** bytes moved by this piece in the phase *)
  pc_flops : N         (** flops performed by this piece in the phase *)
}.

Record phase := mk_phase {
  ph_ns : N;                    (** duration, ns *)
  ph_work : list (list piece)   (** per worker (in worker order), its pieces *)
}.

Definition schedule := list phase.

Definition pieces_bytes (l : list piece) : N := sumN (map pc_bytes l).
Definition pieces_flops (l : list piece) : N := sumN (map pc_flops l).

Definition phase_bytes (ph : phase) : N := sumN (map pieces_bytes (ph_work ph)).
Definition phase_flops (ph : phase) : N := sumN (map pieces_flops (ph_work ph)).

Definition phase_ok (bw : N) (peaks : list N) (ph : phase) : Prop :=
  phase_bytes ph * ns_per_s <= bw * ph_ns ph /\
  Forall2 (fun w pk => pieces_flops w * ns_per_s <= pk * ph_ns ph) (ph_work ph) peaks.

Definition makespan (s : schedule) : N := sumN (map ph_ns s).
Definition sched_bytes (s : schedule) : N := sumN (map phase_bytes s).
Definition sched_flops (s : schedule) : N := sumN (map phase_flops s).

(** A schedule runs on a target when its workers' peaks add up to at most
    the target's peak and every phase is feasible at the target's bandwidth. *)
Definition runs_on (tg : target) (peaks : list N) (s : schedule) : Prop :=
  sumN peaks <= tg_peak tg /\ Forall (phase_ok (tg_bandwidth tg) peaks) s.

Definition performs (s : schedule) (p : plan) : Prop :=
  plan_bytes p <= sched_bytes s /\ plan_flops p <= sched_flops s.

(** ** T4 *)

Lemma phase_flops_le : forall d ws peaks,
  Forall2 (fun w pk => pieces_flops w * ns_per_s <= pk * d) ws peaks ->
  sumN (map pieces_flops ws) * ns_per_s <= sumN peaks * d.
Proof.
  intros d ws peaks H; induction H; simpl; [lia|].
  unfold sumN in *; simpl. rewrite !N.mul_add_distr_r. lia.
Qed.

Theorem makespan_ge_bytes : forall bw peaks s,
  Forall (phase_ok bw peaks) s -> sched_bytes s * ns_per_s <= makespan s * bw.
Proof.
  intros bw peaks s H; induction H as [|ph s [Hb _] _ IH];
    unfold sched_bytes, makespan, sumN in *; simpl; [lia|].
  rewrite !N.mul_add_distr_r. lia.
Qed.

Theorem makespan_ge_flops : forall bw peaks s,
  Forall (phase_ok bw peaks) s -> sched_flops s * ns_per_s <= makespan s * sumN peaks.
Proof.
  intros bw peaks s H; induction H as [|ph s [_ Hf] _ IH];
    unfold sched_flops, makespan in *; simpl; [unfold sumN; simpl; lia|].
  pose proof (phase_flops_le _ _ _ Hf) as Hp. unfold phase_flops.
  unfold sumN in *; simpl. rewrite N.mul_add_distr_r, N.mul_add_distr_r.
  rewrite (N.mul_comm (ph_ns ph)). apply N.add_le_mono; assumption.
Qed.

(** T4 for a plan: any schedule that performs the plan on the target takes
    at least bytes/bandwidth and at least flops/peak. *)
Theorem makespan_lower_bounds : forall p peaks s,
  runs_on (pl_target p) peaks s -> performs s p ->
  plan_bytes p * ns_per_s <= makespan s * tg_bandwidth (pl_target p) /\
  plan_flops p * ns_per_s <= makespan s * tg_peak (pl_target p).
Proof.
  intros p peaks s [Hpk Hph] [Hb Hf].
  pose proof (makespan_ge_bytes _ _ _ Hph) as B.
  pose proof (makespan_ge_flops _ _ _ Hph) as F.
  split.
  - apply N.le_trans with (sched_bytes s * ns_per_s); [apply N.mul_le_mono_r|]; auto.
  - apply N.le_trans with (sched_flops s * ns_per_s); [apply N.mul_le_mono_r; auto|].
    apply N.le_trans with (makespan s * sumN peaks); auto. apply N.mul_le_mono_l; auto.
Qed.

(** ** T6: decode weight traffic

    The weights occupy [wb] bytes of device memory (addresses [0 .. wb-1]
    of the weight region).  One decode step multiplies every weight matrix
    with the step's activations, so its result depends on every weight byte;
    the on-chip memory does not hold the weights from one step to the next
    (it is orders of magnitude smaller).  Hence the step's trace of
    device-memory reads (one address per byte read, repeats allowed)
    contains every weight address: that is the hypothesis
    [reads_all_weights]. *)
Definition reads_all_weights (wb : N) (trace : list N) : Prop :=
  forall a, a < wb -> In a trace.

Theorem decode_step_reads_weights : forall wb trace,
  reads_all_weights wb trace -> wb <= N.of_nat (length trace).
Proof.
  intros wb trace H.
  set (addrs := map N.of_nat (seq 0 (N.to_nat wb))).
  assert (Hnd : NoDup addrs).
  { apply FinFun.Injective_map_NoDup; [intros x y; apply Nat2N.inj | apply seq_NoDup]. }
  assert (Hincl : incl addrs trace).
  { intros a Ha. unfold addrs in Ha. apply in_map_iff in Ha.
    destruct Ha as [x [<- Hx]]. apply in_seq in Hx. apply H. lia. }
  pose proof (NoDup_incl_length Hnd Hincl) as Hl.
  unfold addrs in Hl. rewrite map_length, seq_length in Hl. lia.
Qed.

(** Per decode step: time >= weight bytes / bandwidth. *)
Theorem decode_step_time_ge_weights : forall bw peaks s wb trace,
  Forall (phase_ok bw peaks) s ->
  reads_all_weights wb trace ->
  N.of_nat (length trace) <= sched_bytes s ->
  wb * ns_per_s <= makespan s * bw.
Proof.
  intros bw peaks s wb trace Hs Hr Ht.
  pose proof (decode_step_reads_weights _ _ Hr).
  pose proof (makespan_ge_bytes _ _ _ Hs).
  apply N.le_trans with (sched_bytes s * ns_per_s); auto.
  apply N.mul_le_mono_r. lia.
Qed.

(** Amortised over a batch of [b] tokens per step: any per-token time
    [tau] (i.e. [b * tau] covers the step) satisfies
    [tau >= wb / (b * bw)]. *)
Theorem decode_per_token_ge_weights : forall bw peaks s wb trace b tau,
  Forall (phase_ok bw peaks) s ->
  reads_all_weights wb trace ->
  N.of_nat (length trace) <= sched_bytes s ->
  makespan s <= b * tau ->
  wb * ns_per_s <= tau * (b * bw).
Proof.
  intros bw peaks s wb trace b tau Hs Hr Ht Hb.
  pose proof (decode_step_time_ge_weights _ _ _ _ _ Hs Hr Ht).
  rewrite N.mul_assoc, (N.mul_comm tau b).
  apply N.le_trans with (makespan s * bw); auto. apply N.mul_le_mono_r; auto.
Qed.

(** A plan whose step reads its weights must account at least those bytes:
    the premise of the checker's weight-traffic test. *)
Theorem plan_bytes_ge_weights : forall p s wb trace,
  reads_all_weights wb trace ->
  N.of_nat (length trace) <= sched_bytes s ->
  sched_bytes s = plan_bytes p ->
  wb <= plan_bytes p.
Proof.
  intros p s wb trace Hr Ht He. pose proof (decode_step_reads_weights _ _ Hr). lia.
Qed.

(** Concrete floors for an 8B-parameter bf16 model (16.06e9 weight bytes):
    the least per-token time, in whole ns, that T6 allows on a target of
    bandwidth [bw] with a batch of [b] tokens per step.  [decode_floor] is
    proved to be a lower bound ([decode_floor_sound]) and the least one
    ([decode_floor_tight]); docs/theorems.md tabulates the values. *)
Definition decode_floor (wb bw b : N) : N :=
  let d := b * bw in (wb * ns_per_s + d - 1) / d.

Lemma decode_floor_sound : forall wb bw b tau,
  0 < b * bw -> wb * ns_per_s <= tau * (b * bw) -> decode_floor wb bw b <= tau.
Proof.
  intros wb bw b tau Hd H. unfold decode_floor. set (d := b * bw) in *.
  assert (Hlt : (wb * ns_per_s + d - 1) / d < N.succ tau).
  { apply N.div_lt_upper_bound; [lia|].
    rewrite N.mul_succ_r, (N.mul_comm d tau). lia. }
  lia.
Qed.

Lemma decode_floor_tight : forall wb bw b,
  0 < b * bw -> wb * ns_per_s <= decode_floor wb bw b * (b * bw).
Proof.
  intros wb bw b Hd. unfold decode_floor. set (d := b * bw) in *.
  assert (Hd0 : d <> 0) by lia.
  pose proof (N.div_mod (wb * ns_per_s + d - 1) d Hd0).
  pose proof (N.mod_lt (wb * ns_per_s + d - 1) d Hd0).
  rewrite (N.mul_comm _ d). lia.
Qed.

(** T6 in whole ns: every schedule of a decode step on [bw] that reads all
    weights has per-token time at least [decode_floor wb bw b]. *)
Theorem decode_per_token_floor : forall bw peaks s wb trace b tau,
  Forall (phase_ok bw peaks) s ->
  reads_all_weights wb trace ->
  N.of_nat (length trace) <= sched_bytes s ->
  makespan s <= b * tau -> 0 < b * bw ->
  decode_floor wb bw b <= tau.
Proof.
  intros. apply decode_floor_sound; auto.
  eapply decode_per_token_ge_weights; eauto.
Qed.

Definition weights_8b_bf16 : N := 16060000000.

Example decode_floor_8b_h100 :
  decode_floor weights_8b_bf16 3350000000000 1 = 4794030 /\
  decode_floor weights_8b_bf16 3350000000000 8 = 599254.
Proof. split; vm_compute; reflexivity. Qed.

Example decode_floor_8b_h200 :
  decode_floor weights_8b_bf16 4800000000000 1 = 3345834 /\
  decode_floor weights_8b_bf16 4800000000000 8 = 418230.
Proof. split; vm_compute; reflexivity. Qed.

(** b200 and mi350x: both 8 TB/s. *)
Example decode_floor_8b_8tbs :
  decode_floor weights_8b_bf16 8000000000000 1 = 2007500 /\
  decode_floor weights_8b_bf16 8000000000000 8 = 250938.
Proof. split; vm_compute; reflexivity. Qed.
