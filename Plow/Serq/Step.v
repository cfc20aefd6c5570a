(** * serQ's executable fragment: the step semantics (Q1)

    This is [serq/interp.py] carried over, rule for rule, for programs whose engine
    expressions are natural-number valued (the fragment [serq prove] exports: see
    [docs/serq.md], section 11).  Proofs about it are in [Stepproof.v]; the RAD family
    of Bari et al. is in [Rad.v] / [Radproof.v].

    Time and amounts are naturals: arrival times, durations and token amounts.  An
    engine is given by its expressions as Gallina functions of a [view] of the engine
    state (the names an engine expression may read: [now], [served], [running.decoding],
    [running.count], [waiting.count], [batch.tokens], [batch.requests];
    [running.prefilling] is [count - decoding] and [running.preempted] is 0).  A bound
    that is absent ([tokens cap], [each at most]) is infinite: [None].

    One iteration ([step]), at time [now]:
    + every pending arrival at or before [now] joins [waiting] (FIFO; a request with
      neither prefill nor decode ends at its arrival);
    + the batch is formed ([form_batch]): [tokens cap] and both [only] modes are
      evaluated on the state at the start (empty batch); then [advance]: the decoders
      one token each, oldest first, when the mode is not [!decoding] and [each >= 1] and
      the cap leaves room; then the prefills in admission order, each
      [min(left, each, room)], stopping at the first that gets nothing, when the mode is
      not [decoding]; then the admission clause: the head of [waiting] while [while] holds, its phase
      matches the mode and the cap leaves room, with [each] evaluated once before the
      first admission;
    + an empty batch is no iteration: the clock jumps to the next arrival, or the run
      halts when none is left;
    + otherwise the claims are read on the formed batch ([claim_view]), [execute] gives
      the duration, and at its end ([finish]) the served decoders lose a token and those
      at zero end, the served prefills lose their chunks, the admitted join [prefilling]
      (or, done, [decoding] / [ended]), completed prefills start decoding (or end),
      admitted decoders count their token, [served] grows by the batch's tokens.

    Two places differ from the Python text only in form: [interp.py] filters
    [decoding] (and [prefilling]) only when some request finished (completed); here they
    are always filtered.  Both agree because every decoding request has decode left and
    every prefilling one prefill left, which [Stepproof.step_wf] proves for every engine. *)
From Coq Require Import List Bool Arith.
Import ListNotations.

(** ** Data *)

(** A request as the workload makes it: arrival time and the amounts of its
    [run E prefill] and [run E decode]. *)
Record req := mk_req { r_arr : nat; r_vp : nat; r_vd : nat }.

(** A request at the node: its id (arrival index) and the tokens it has left. *)
Record job := mk_job { j_id : nat; j_pre : nat; j_dec : nat }.

(** What an engine expression reads. *)
Record view := mk_view {
  v_now : nat;       (** [now] *)
  v_served : nat;    (** [served]: tokens of all earlier iterations *)
  v_decoding : nat;  (** [running.decoding], [decoders] in claims *)
  v_count : nat;     (** [running.count], [residents] in claims *)
  v_waiting : nat;   (** [waiting.count] as of the evaluation *)
  v_tokens : nat;    (** [batch.tokens] so far; [tokens] in claims *)
  v_requests : nat   (** [batch.requests] so far *)
}.

Record clause := mk_clause {
  c_only : option (view -> bool);   (** [only (P)]: [true] is [decoding] *)
  c_while : option (view -> bool);  (** [while (C)] (admission clause only) *)
  c_each : option (view -> nat)     (** [each at most (E)], floored *)
}.

Record engine := mk_engine {
  e_cap : option (view -> nat);     (** [tokens cap C], floored *)
  e_advance : option clause;
  e_admit : option clause;
  e_execute : view -> nat           (** [execute (...)], µs *)
}.

Record state := mk_state {
  s_now : nat;
  s_served : nat;
  s_iter : nat;
  s_arrived : nat;                  (** requests arrived so far: the next id *)
  s_pending : list req;             (** arrivals still to come *)
  s_waiting : list job;             (** arrived, not admitted; FIFO *)
  s_prefilling : list job;          (** admitted, prefill left; admission order *)
  s_decoding : list job;            (** prefill done, decode left *)
  s_ended : list (nat * nat)        (** (id, finish time), completion order *)
}.

Definition residents (st : state) : nat :=
  length (s_waiting st) + length (s_prefilling st) + length (s_decoding st).

Definition init (arrivals : list req) : state := mk_state 0 0 0 0 arrivals [] [] [] [].

(** [ceil(a / b)] for naturals, as the export writes it (0 when [b] is 0; the export
    proves [b > 0] where it matters). *)
Definition ceil_div (a b : nat) : nat := (a + (b - 1)) / b.

(** ** Arrivals *)

Fixpoint absorb (now n : nat) (pending : list req) (waiting : list job)
    (ended : list (nat * nat)) : nat * list req * list job * list (nat * nat) :=
  match pending with
  | [] => (n, [], waiting, ended)
  | r :: rest =>
      if r_arr r <=? now then
        if (r_vp r =? 0) && (r_vd r =? 0)
        then absorb now (S n) rest waiting (ended ++ [(n, r_arr r)])
        else absorb now (S n) rest (waiting ++ [mk_job n (r_vp r) (r_vd r)]) ended
      else (n, pending, waiting, ended)
  end.

Definition arrive (st : state) : state :=
  match absorb (s_now st) (s_arrived st) (s_pending st) (s_waiting st) (s_ended st) with
  | (n, pending, waiting, ended) =>
      mk_state (s_now st) (s_served st) (s_iter st) n pending waiting
        (s_prefilling st) (s_decoding st) ended
  end.

(** ** Batch formation *)

Definition view_of (st : state) (waiting tokens requests : nat) : view :=
  mk_view (s_now st) (s_served st) (length (s_decoding st)) (residents st)
    waiting tokens requests.

(** Bounds: [None] is infinite. *)
Definition bound (f : option (view -> nat)) (v : view) : option nat :=
  match f with Some g => Some (g v) | None => None end.
Definition room (cap : option nat) (tokens : nat) : option nat :=
  match cap with Some c => Some (c - tokens) | None => None end.
Definition xmin (a : option nat) (n : nat) : nat :=
  match a with Some m => Nat.min m n | None => n end.
Definition xpos (a : option nat) : bool :=
  match a with Some m => 1 <=? m | None => true end.
Definition xlt (n : nat) (a : option nat) : bool :=
  match a with Some m => n <? m | None => true end.

Record batch := mk_batch {
  b_mode : option bool;            (** the advance clause's mode, else the admission clause's (traces) *)
  b_decoders : nat;                (** the first [b_decoders] of [decoding], one token each *)
  b_prefills : list nat;           (** the chunks of the first prefilling requests *)
  b_admitted : list (job * nat);   (** admitted with prefill: the job and its chunk *)
  b_admitted_dec : list job;       (** admitted without prefill: one decode token *)
  b_taken : nat;                   (** requests admitted from the head of [waiting] *)
  b_tokens : nat;
  b_requests : nat
}.

(** The prefills in admission order, each [min(left, each, room)], until one gets 0:
    the chunks and the tokens after them. *)
Fixpoint serve_prefills (each cap : option nat) (tokens : nat) (ps : list job)
    : list nat * nat :=
  match ps with
  | [] => ([], tokens)
  | p :: rest =>
      let c := xmin each (xmin (room cap tokens) (j_pre p)) in
      if c =? 0 then ([], tokens)
      else let '(cs, t) := serve_prefills each cap (tokens + c) rest in (c :: cs, t)
  end.

Definition mode_ok (mode : option bool) (h : job) : bool :=
  match mode with Some m => Bool.eqb (j_pre h =? 0) m | None => true end.

Definition guard (g : option (view -> bool)) (v : view) : bool :=
  match g with Some p => p v | None => true end.

(** Admission, strictly FIFO over the rest of [waiting] ([ws]). *)
Fixpoint admit_loop (st : state) (mode : option bool) (while_ : option (view -> bool))
    (each cap : option nat) (ws : list job) (b : batch) : batch :=
  match ws with
  | [] => b
  | h :: rest =>
      if negb (guard while_ (view_of st (length ws) (b_tokens b) (b_requests b))) then b
      else if negb (mode_ok mode h) then b
      else if 0 <? j_pre h then
        let c := xmin each (xmin (room cap (b_tokens b)) (j_pre h)) in
        if c =? 0 then b
        else admit_loop st mode while_ each cap rest
          (mk_batch (b_mode b) (b_decoders b) (b_prefills b) (b_admitted b ++ [(h, c)])
             (b_admitted_dec b) (S (b_taken b)) (b_tokens b + c) (S (b_requests b)))
      else if xpos each && xpos (room cap (b_tokens b)) then
        admit_loop st mode while_ each cap rest
          (mk_batch (b_mode b) (b_decoders b) (b_prefills b) (b_admitted b)
             (b_admitted_dec b ++ [h]) (S (b_taken b)) (S (b_tokens b)) (S (b_requests b)))
      else b
  end.

Definition clause_mode (cl : option clause) (v : view) : option bool :=
  match cl with
  | Some c => match c_only c with Some p => Some (p v) | None => None end
  | None => None
  end.

Definition not_mode (m : bool) (mode : option bool) : bool :=
  match mode with Some m' => negb (Bool.eqb m m') | None => true end.

(** The decoders [advance] serves: [min(|decoding|, room)] when it serves them. *)
Definition serve_decoders (E : engine) (st : state) (cap : option nat) : nat :=
  let v0 := view_of st (length (s_waiting st)) 0 0 in
  match e_advance E with
  | Some a =>
      if negb (length (s_decoding st) =? 0) && not_mode false (clause_mode (e_advance E) v0)
      then if xpos (bound (c_each a) v0) && xpos (room cap 0)
           then xmin (room cap 0) (length (s_decoding st)) else 0
      else 0
  | None => 0
  end.

Definition advance_prefills (E : engine) (st : state) (cap : option nat) (nd : nat)
    : list nat * nat :=
  let w := length (s_waiting st) in
  match e_advance E with
  | Some a =>
      if negb (length (s_prefilling st) =? 0)
         && not_mode true (clause_mode (e_advance E) (view_of st w 0 0))
      then serve_prefills (bound (c_each a) (view_of st w nd nd)) cap nd (s_prefilling st)
      else ([], nd)
  | None => ([], nd)
  end.

Definition form_batch (E : engine) (st : state) : batch :=
  let w := length (s_waiting st) in
  let v0 := view_of st w 0 0 in
  let cap := bound (e_cap E) v0 in
  let adv_mode := clause_mode (e_advance E) v0 in
  let adm_mode := clause_mode (e_admit E) v0 in
  let mode := match adv_mode with Some m => Some m | None => adm_mode end in
  let nd := serve_decoders E st cap in
  let '(chunks, t1) := advance_prefills E st cap nd in
  let b1 := mk_batch mode nd chunks [] [] 0 t1 (nd + length chunks) in
  match e_admit E with
  | Some a =>
      if negb (w =? 0) && xlt t1 cap
      then admit_loop st adm_mode (c_while a) (bound (c_each a) (view_of st w t1 (b_requests b1)))
             cap (s_waiting st) b1
      else b1
  | None => b1
  end.

(** What claims and [execute] read: the state at the start of the iteration, the whole
    batch, and the requests still waiting after admission. *)
Definition claim_view (st : state) (b : batch) : view :=
  view_of st (length (s_waiting st) - b_taken b) (b_tokens b) (b_requests b).

(** ** End of an iteration *)

Definition dec1 (j : job) : job := mk_job (j_id j) (j_pre j) (j_dec j - 1).
Definition has_pre (j : job) : bool := 0 <? j_pre j.
Definition has_dec (j : job) : bool := 0 <? j_dec j.
Definition stamp (t : nat) (js : list job) : list (nat * nat) := map (fun j => (j_id j, t)) js.

Fixpoint apply_chunks (cs : list nat) (ps : list job) : list job :=
  match cs, ps with
  | c :: cs', p :: ps' => mk_job (j_id p) (j_pre p - c) (j_dec p) :: apply_chunks cs' ps'
  | _, _ => ps
  end.

Definition cut (hc : job * nat) : job :=
  let '(h, c) := hc in mk_job (j_id h) (j_pre h - c) (j_dec h).

Definition finish (st : state) (b : batch) (t_end : nat) : state :=
  let nd := b_decoders b in
  let served_dec := map dec1 (firstn nd (s_decoding st)) in
  let finished := filter (fun j => negb (has_dec j)) served_dec in
  let decoding1 := filter has_dec (served_dec ++ skipn nd (s_decoding st)) in
  let pre1 := apply_chunks (b_prefills b) (s_prefilling st) in
  let done1 := filter (fun j => negb (has_pre j)) (firstn (length (b_prefills b)) pre1) in
  let adm := map cut (b_admitted b) in
  let done2 := filter (fun j => negb (has_pre j)) adm in
  let prefilling := filter has_pre (pre1 ++ adm) in
  let done := done1 ++ done2 in
  let adm_dec := map dec1 (b_admitted_dec b) in
  let decoding := decoding1 ++ filter has_dec done ++ filter has_dec adm_dec in
  let ended := s_ended st ++ stamp t_end finished
               ++ stamp t_end (filter (fun j => negb (has_dec j)) done)
               ++ stamp t_end (filter (fun j => negb (has_dec j)) adm_dec) in
  mk_state t_end (s_served st + b_tokens b) (S (s_iter st)) (s_arrived st) (s_pending st)
    (skipn (b_taken b) (s_waiting st)) prefilling decoding ended.

(** ** One iteration, runs, claims *)

Inductive outcome :=
  | Iterated (st1 : state) (b : batch) (st' : state)  (** an iteration: start, batch, end *)
  | Idle (st' : state)                                (** empty batch: the clock jumps *)
  | Halted (st' : state).                             (** empty batch, nothing to come *)

Definition set_now (st : state) (t : nat) : state :=
  mk_state t (s_served st) (s_iter st) (s_arrived st) (s_pending st) (s_waiting st)
    (s_prefilling st) (s_decoding st) (s_ended st).

Definition step (E : engine) (st : state) : outcome :=
  let st1 := arrive st in
  let b := form_batch E st1 in
  if b_tokens b =? 0 then
    match s_pending st1 with
    | [] => Halted st1
    | r :: _ => Idle (set_now st1 (r_arr r))
    end
  else Iterated st1 b (finish st1 b (s_now st1 + e_execute E (claim_view st1 b))).

Definition next (o : outcome) : state :=
  match o with Iterated _ _ st' | Idle st' | Halted st' => st' end.

Fixpoint run (E : engine) (n : nat) (st : state) : state :=
  match n with
  | 0 => st
  | S n' => run E n' (next (step E st))
  end.

(** A claim holds on every path: for every arrival list whose requests all satisfy the
    claim's [given], every iteration of the run satisfies it (a claim reads the view
    of an iteration: [tokens] is [v_tokens], [decoders] [v_decoding], [residents]
    [v_count]). *)
Definition every_iteration (E : engine) (arrivals : list req) (P : view -> Prop) : Prop :=
  forall n st1 b st',
    step E (run E n (init arrivals)) = Iterated st1 b st' -> P (claim_view st1 b).

Definition every_path (E : engine) (given : req -> bool) (P : view -> Prop) : Prop :=
  forall arrivals, Forall (fun r => given r = true) arrivals -> every_iteration E arrivals P.

(** ** Random costs: draws in [execute]

    A draw in [execute] ([serq/interp.py]: one sample per iteration, read after the
    iteration's arrivals drew their [init]) is modelled as an input: the iteration's
    sample [u], a natural, from a stream [draws : nat -> nat] indexed by the iteration
    count.  A [dengine]'s [execute] reads the view and the sample; for a fixed stream a
    run is deterministic, and a claim holds on every path when it holds for every
    arrival list and every stream.  An engine without draws is the [dengine] that
    ignores its sample ([of_engine]); [Stepproof.every_path_d_of_engine] shows the two
    semantics agree on it, so every claim proved of [step] holds of [stepd]. *)
Record dengine := mk_dengine {
  d_cap : option (view -> nat);
  d_advance : option clause;
  d_admit : option clause;
  d_execute : view -> nat -> nat    (** [execute (...)] given the iteration's sample, µs *)
}.

(** The engine one iteration runs: the sample [u] fixed. *)
Definition at_draw (D : dengine) (u : nat) : engine :=
  mk_engine (d_cap D) (d_advance D) (d_admit D) (fun v => d_execute D v u).

Definition of_engine (E : engine) : dengine :=
  mk_dengine (e_cap E) (e_advance E) (e_admit E) (fun v _ => e_execute E v).

Definition stepd (D : dengine) (draws : nat -> nat) (st : state) : outcome :=
  step (at_draw D (draws (s_iter st))) st.

Fixpoint rund (D : dengine) (draws : nat -> nat) (n : nat) (st : state) : state :=
  match n with
  | 0 => st
  | S n' => rund D draws n' (next (stepd D draws st))
  end.

Definition every_iteration_d (D : dengine) (draws : nat -> nat) (arrivals : list req)
    (P : view -> Prop) : Prop :=
  forall n st1 b st',
    stepd D draws (rund D draws n (init arrivals)) = Iterated st1 b st' ->
    P (claim_view st1 b).

Definition every_path_d (D : dengine) (given : req -> bool) (P : view -> Prop) : Prop :=
  forall draws arrivals, Forall (fun r => given r = true) arrivals ->
    every_iteration_d D draws arrivals P.
