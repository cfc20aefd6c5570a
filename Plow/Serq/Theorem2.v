(** * Theorem 2 of Bari et al. (B4, B5): statements

    Stated on the step semantics of [Step.v].  [theorem2_one_node] (B4) and
    [theorem2_nodes_per_node] (B5's per-node part) are proved in [Theorem2proof.v]
    ([theorem2_one_node_holds], [theorem2_nodes_per_node_holds]), with B4's
    Foster-Lyapunov part stated here as [foster_criterion] and
    [theorem2_one_node_small_set]; [serq prove] uses none of them.  B6 (compound Poisson
    arrivals, [theorem2_compound]) is stated below for countable laws with rational weights,
    and proved ([theorem2_compound_holds]).  B5's joint part ([theorem2_nodes_joint]) is
    proved ([theorem2_nodes_joint_holds]).

    The model, as the seed's account of the Lean proofs describes it.  Time is slotted: in a
    slot, the slot's list of requests arrives (drawn from a finite distribution over lists
    of request types, prompts 128 .. 1024 tokens in whole tiles, outputs 1 .. 512 tokens),
    then the engine runs one iteration of [bari_rad.sq]'s RAD engine ([rad_engine], the
    exported engine of the program).  The chain is on job lists: what is left of each
    waiting, prefilling and decoding request, without the clock, the tokens served, the ids
    or the ended requests (complete machine states never repeat).  It is a Markov chain
    because the RAD engine reads only the counts of the lists, never [now] or [served].

    Probabilities are rationals ([Q], no real numbers).  A state [s] is positive recurrent when
    the expected return time [E_s[tau_s] = sum_{k >= 0} P_s(tau_s > k)] is finite, i.e. its
    partial sums are bounded; [P_s(tau_s > k)] is the mass of the [k]-step paths from [s]
    that avoid [s] at steps [1 .. k] ([avoid]), a finite sum.  Bounded partial sums also give
    [P_s(tau_s = infinity) = 0], so this is positive recurrence, not only finite mean
    among returning paths. *)
From Coq Require Import List Bool Arith QArith.
From Plow Require Import Serq.Step Serq.Rad.
Import ListNotations.
Local Open Scope Q_scope.

(** ** The engine of [bari_rad.sq] *)

Definition rad_engine (bcol tlin tnl : nat) : engine :=
  mk_engine (Some (fun _ => bcol))
    (Some (mk_clause (Some (rad_mode bcol)) None (Some (fun _ => bcol))))
    (Some (mk_clause (Some (rad_mode bcol)) (Some (fun _ => Nat.eqb 0 0)) (Some (fun _ => bcol))))
    (fun v => (tlin * ceil_div (v_tokens v) bcol + tnl * v_tokens v)%nat).

Definition E128 : engine := rad_engine 128 4000 5.

(** ** Job lists and one slot *)

(** Request types: (prompt tokens, output tokens). *)
Definition rtype : Type := (nat * nat)%type.

Definition valid_type (t : rtype) : Prop :=
  (exists k, 1 <= k <= 8 /\ fst t = 128 * k)%nat /\ (1 <= snd t <= 512)%nat.

(** What is left of each request: (prefill, decode), per queue. *)
Record joblist := mk_joblist {
  jl_waiting : list (nat * nat);
  jl_prefilling : list (nat * nat);
  jl_decoding : list (nat * nat)
}.

Definition jl_empty : joblist := mk_joblist [] [] [].

Definition left_of (js : list job) : list (nat * nat) := map (fun j => (j_pre j, j_dec j)) js.
Definition jobs_of (ls : list (nat * nat)) : list job :=
  map (fun '(p, d) => mk_job 0 p d) ls.

Definition project (st : state) : joblist :=
  mk_joblist (left_of (s_waiting st)) (left_of (s_prefilling st)) (left_of (s_decoding st)).

(** One slot: the arrivals [a] join at time 0, then one step of [E]. *)
Definition slot (E : engine) (a : list rtype) (s : joblist) : joblist :=
  let st := mk_state 0 0 0 0 (map (fun '(p, d) => mk_req 0 p d) a)
              (jobs_of (jl_waiting s)) (jobs_of (jl_prefilling s)) (jobs_of (jl_decoding s)) [] in
  project (next (step E st)).

Definition pairs_eqb (l m : list (nat * nat)) : bool :=
  (length l =? length m)%nat
  && forallb (fun '((a, b), (c, d)) => (a =? c)%nat && (b =? d)%nat) (combine l m).

Definition jl_eqb (s t : joblist) : bool :=
  pairs_eqb (jl_waiting s) (jl_waiting t) && pairs_eqb (jl_prefilling s) (jl_prefilling t)
  && pairs_eqb (jl_decoding s) (jl_decoding t).

(** ** The chain *)

(** A slot distribution: finitely many (probability, the slot's request list). *)
Definition dist : Type := list (Q * list rtype).

Definition valid_dist (D : dist) : Prop :=
  Forall (fun pa => 0 < fst pa /\ Forall valid_type (snd pa)) D
  /\ fold_right (fun pa acc => fst pa + acc) 0 D == 1.

Definition tokens_of (a : list rtype) : nat := fold_right (fun t n => fst t + snd t + n)%nat 0%nat a.

(** [L]: the expected number of arriving tokens per slot. *)
Definition load (D : dist) : Q :=
  fold_right (fun pa acc => fst pa * inject_Z (Z.of_nat (tokens_of (snd pa))) + acc) 0 D.

(** [avoid E D s k x]: the probability that the chain from [x] avoids [s] at steps [1 .. k]. *)
Fixpoint avoid (E : engine) (D : dist) (s : joblist) (k : nat) (x : joblist) : Q :=
  match k with
  | O => 1
  | S k' =>
      fold_right (fun pa acc =>
        let y := slot E (snd pa) x in
        (if jl_eqb y s then 0 else fst pa * avoid E D s k' y) + acc) 0 D
  end.

Fixpoint partial_return (E : engine) (D : dist) (s : joblist) (n : nat) : Q :=
  match n with
  | O => 0
  | S n' => partial_return E D s n' + avoid E D s n' s
  end.

Definition positive_recurrent (E : engine) (D : dist) (s : joblist) : Prop :=
  exists M : Q, forall n, partial_return E D s n <= M.

Inductive reachable (E : engine) (D : dist) : joblist -> Prop :=
  | reachable_empty : reachable E D jl_empty
  | reachable_slot x p a :
      reachable E D x -> In (p, a) D -> 0 < p -> reachable E D (slot E a x).

(** ** B4: one node, a finite slot-arrival distribution, [L < 128] *)

Definition theorem2_one_node_for (E : engine) : Prop :=
  forall D : dist, valid_dist D -> load D < inject_Z 128 ->
  forall s, reachable E D s -> positive_recurrent E D s.

Definition theorem2_one_node : Prop := theorem2_one_node_for E128.

(** The engines B4's proof covers: RAD's schedule with 128-token tiles ([Rad.rad_schedule],
    any [execute]: the job-list chain does not read durations) and an admission [while] that
    always holds.  [serq prove] shows a program's engine is one of them. *)
Definition rad128 (E : engine) : Prop :=
  rad_schedule 128 E /\ (forall c, e_admit E = Some c -> forall v, guard (c_while c) v = true).

(** ** The Foster-Lyapunov part of B4 (proved in [Theorem2proof.v])

    A chain with a finite-support kernel ([kernel]: the list of (probability, next state)
    from a state), expectations of one step ([expect]), and [hit_partial K C n x], the
    expected value of [min(tau_C, n)] from [x], where [tau_C >= 1] is the first step in
    [C]: [E_x[min(tau_C, n)] = sum_{k < n} P_x(tau_C > k)], a finite sum. *)

Definition qsum {A : Type} (f : A -> Q) (l : list A) : Q := fold_right (fun a acc => f a + acc) 0 l.

Definition kernel (X : Type) : Type := X -> list (Q * X).

Definition expect {X : Type} (K : kernel X) (f : X -> Q) (x : X) : Q :=
  qsum (fun py => fst py * f (snd py)) (K x).

Fixpoint hit_partial {X : Type} (K : kernel X) (C : X -> bool) (n : nat) (x : X) : Q :=
  match n with
  | O => 0
  | S n' =>
      1 + qsum (fun py => if C (snd py) then 0 else fst py * hit_partial K C n' (snd py)) (K x)
  end.

(** Foster's criterion, on an invariant set [I] closed under the kernel: a Lyapunov function
    [V >= 0] that drops by [eps > 0] in expectation outside [C] and whose one-step
    expectation is at most [b] on [C] bounds [eps * E_x[tau_C]] by [V x] outside [C] and by
    [eps + b] on [C], for every horizon. *)
Definition foster_criterion : Prop :=
  forall (X : Type) (K : kernel X) (C : X -> bool) (I : X -> Prop) (V : X -> Q) (eps b : Q),
    0 < eps ->
    (forall x, I x -> forall py, In py (K x) -> 0 <= fst py /\ I (snd py)) ->
    (forall x, I x -> 0 <= V x) ->
    (forall x, I x -> C x = false -> expect K V x + eps <= V x) ->
    (forall x, I x -> C x = true -> expect K V x <= b) ->
    forall x, I x -> forall n,
      (C x = false -> eps * hit_partial K C n x <= V x)
      /\ (C x = true -> eps * hit_partial K C n x <= eps + b).

(** The job-list chain of a slot distribution. *)
Definition chain (E : engine) (D : dist) : kernel joblist :=
  fun x => map (fun pa => (fst pa, slot E (snd pa) x)) D.

(** The Lyapunov function: the work left, prefill plus decode tokens of every request. *)
Definition pairs_work (l : list (nat * nat)) : nat := fold_right (fun pd acc => fst pd + snd pd + acc)%nat 0%nat l.

Definition work (s : joblist) : nat :=
  (pairs_work (jl_waiting s) + pairs_work (jl_prefilling s) + pairs_work (jl_decoding s))%nat.

Definition work_q (s : joblist) : Q := inject_Z (Z.of_nat (work s)).

(** The small set: less than [2^16] tokens of work.  It is finite (fewer than [2^16] requests,
    each with less than [2^16] tokens left), which is not stated here. *)
Definition small_bound : nat := 256 * 256.
Definition small (s : joblist) : bool := (work s <? small_bound)%nat.

(** What is proved of B4: from every reachable state, the expected time to reach the small
    set is at most [work s / (128 - L)], and from a small state the expected return to it is
    at most [65664 / (128 - L)] (the same bound for every small state), at every horizon. *)
Definition theorem2_one_node_small_set : Prop :=
  forall D : dist, valid_dist D -> load D < inject_Z 128 ->
  forall s, reachable E128 D s -> forall n,
    (inject_Z 128 - load D) * hit_partial (chain E128 D) small n s
      <= (if small s then inject_Z 65664 else work_q s).

(** ** B5: [g] nodes, each arrival routed independently and uniformly, [L < 128 g]

    The nodes do not interact and advance one iteration per shared slot, so each node's job
    list is the chain above under the slot distribution thinned by the routing: each request
    of the slot's list comes to this node with probability [1/g], independently. *)
Fixpoint route_list (g : positive) (a : list rtype) : list (Q * list rtype) :=
  match a with
  | [] => [(1, [])]
  | t :: rest =>
      flat_map (fun pr => [((1 # g) * fst pr, t :: snd pr); ((1 - (1 # g)) * fst pr, snd pr)])
        (route_list g rest)
  end.

Definition route (g : positive) (D : dist) : dist :=
  flat_map (fun pa => map (fun pr => (fst pa * fst pr, snd pr)) (route_list g (snd pa))) D.

Definition theorem2_nodes_per_node_for (E : engine) : Prop :=
  forall (g : positive) (D : dist), valid_dist D -> load D < inject_Z (128 * Zpos g) ->
  forall s, reachable E (route g D) s -> positive_recurrent E (route g D) s.

Definition theorem2_nodes_per_node : Prop := theorem2_nodes_per_node_for E128.

(** ** B5, the joint part (proved: [Theorem2proof.theorem2_nodes_joint_holds])

    The [g] nodes together: a state is the list of their job lists; in a slot, the slot's
    request list is drawn from [D], each of its requests goes to one of the nodes, each node
    with probability [1/g], independently ([jroute]: the routings with their probabilities),
    and every node takes one slot step with what it got ([jslot]).  With an empty slot of
    positive probability (without it the nodes need not ever be empty together: every slot
    could bring a request), the expected return time of the joint chain to all nodes empty is
    finite: [hit_partial] of the all-empty set from the all-empty state is bounded at every
    horizon.  The job lists forget the clocks, so "every engine empty" is this one state.

    The proof: the work left summed over the nodes is no Lyapunov function (a node with a
    large backlog drains [128] a slot while an empty one gains [L / g] in expectation, and
    [L / g + L / g - 128] can be positive when [g > 1]); the sum of the squares of the nodes'
    work is, its drift being at most [-2 (128 - L / g) w + C] at a node with [w >= 2^16]
    tokens left and at most a constant elsewhere; then regeneration from the states with
    every node below a threshold, as in B4. *)
Fixpoint add_at (i : nat) (t : rtype) (l : list (list rtype)) : list (list rtype) :=
  match l, i with
  | [], _ => []
  | a :: l', O => (t :: a) :: l'
  | a :: l', S i' => a :: add_at i' t l'
  end.

Fixpoint jroute (g : positive) (a : list rtype) : list (Q * list (list rtype)) :=
  match a with
  | [] => [(1, repeat [] (Pos.to_nat g))]
  | t :: rest =>
      flat_map (fun pr => map (fun i => ((1 # g) * fst pr, add_at i t (snd pr)))
                              (seq 0 (Pos.to_nat g)))
        (jroute g rest)
  end.

Definition jslot (E : engine) (arr : list (list rtype)) (x : list joblist) : list joblist :=
  map (fun '(a, s) => slot E a s) (combine arr x).

Definition jchain (E : engine) (g : positive) (D : dist) : kernel (list joblist) :=
  fun x => flat_map (fun pa => map (fun ro => (fst pa * fst ro, jslot E (snd ro) x))
                                   (jroute g (snd pa))) D.

Definition jempty (g : positive) : list joblist := repeat jl_empty (Pos.to_nat g).

Definition all_empty (x : list joblist) : bool := forallb (fun s => jl_eqb s jl_empty) x.

Definition theorem2_nodes_joint_for (E : engine) : Prop :=
  forall (g : positive) (D : dist), valid_dist D -> load D < inject_Z (128 * Zpos g) ->
  (exists q, In (q, []) D /\ 0 < q) ->
  exists M : Q, forall n, hit_partial (jchain E g D) all_empty n (jempty g) <= M.

Definition theorem2_nodes_joint : Prop := theorem2_nodes_joint_for E128.

(** ** B6: compound Poisson arrivals, one node

    A slot lasts one full-tile iteration, [tlin + tnl * 128 = 4640] µs, so under a compound
    Poisson stream of rate [lam] per µs the slot's request list has infinitely many possible
    values: a Poisson([4640 lam]) number of requests, each of an independent type, and the
    expected tokens per slot is [L = 4640 lam E[vp + vd]].  A countable slot law is an
    enumeration of (probability, request list); its [N]-prefix is a finite [dist].

    Compound Poisson's weights [e^-m m^n / n!] are not rational, and this library has no
    real numbers.  The statement is therefore about every countable law with rational
    weights whose prefixes have mass at most 1 (a sub-probability: it need not sum to 1)
    and expected tokens at most [L < 128], and it bounds the expected return time to the
    empty engine by one [M] for every prefix and every horizon.  The prefix's
    [partial_return] is the expected return time restricted to the paths whose slots take
    their lists among the first [N] values, so [M] bounds the law's own expected return time
    (monotone convergence, all terms being non-negative).  Every rational sub-law below a
    real law (weights at most the real weights) meets the hypotheses with the same [L], so
    [M] bounds the compound Poisson law's expected return time too; that last limit (from
    rational sub-laws to real weights) is the one step of B6 not carried out in Rocq. *)
Definition cdist : Type := nat -> Q * list rtype.

Definition cprefix (P : cdist) (N : nat) : dist := map P (seq 0 N).

Definition valid_cdist (P : cdist) : Prop :=
  (forall k, 0 <= fst (P k) /\ Forall valid_type (snd (P k)))
  /\ (forall N, fold_right (fun pa acc => fst pa + acc) 0 (cprefix P N) <= 1).

Definition theorem2_compound_for (E : engine) : Prop :=
  forall (P : cdist) (L : Q), valid_cdist P -> (forall N, load (cprefix P N) <= L) ->
  L < inject_Z 128 ->
  exists M : Q, forall N n, partial_return E (cprefix P N) jl_empty n <= M.

Definition theorem2_compound : Prop := theorem2_compound_for E128.

