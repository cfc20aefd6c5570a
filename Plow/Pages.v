(** On-chip memory (checkpoint C): the per-worker page timeline and its
    executable check.

    A worker's on-chip memory is handed out in pages.  The schedule gives
    every on-chip allocation a window [\[start, end)] in cycles and a page
    count; the occupancy of a worker at cycle [t] is the sum of the page
    counts of the windows that contain [t].  The check accepts a timeline
    when, on every worker, the occupancy never exceeds the page budget.

    The checker evaluates the occupancy at every window's start cycle only;
    [Pagesproof.occupancy_max_at_start] shows that this is enough (occupancy
    is piecewise constant and only rises at a window start).  Cost: O(n²) per
    worker in the number of windows, on binary numbers. *)
From Coq Require Import NArith List Bool.
From Plow Require Import Loc.
Import ListNotations.
Local Open Scope N_scope.

(** One on-chip allocation: [w_pages] pages held during cycles
    [w_start <= t < w_end].  A window with [w_end <= w_start] is empty. *)
Record window : Type := mk_window {
  w_start : N;
  w_end : N;
  w_pages : N
}.

(** [t] lies in the window. *)
Definition live_at (w : window) (t : N) : bool :=
  (w_start w <=? t) && (t <? w_end w).

(** Pages held at cycle [t] by a list of windows. *)
Fixpoint occupancy (ws : list window) (t : N) : N :=
  match ws with
  | [] => 0
  | w :: rest => (if live_at w t then w_pages w else 0) + occupancy rest t
  end.

(** The specification: occupancy never exceeds the budget. *)
Definition fits (budget : N) (ws : list window) : Prop :=
  forall t, occupancy ws t <= budget.

(** [p] closes before [c] opens (the producer/consumer hypothesis of M1). *)
Definition closes_before (p c : window) : Prop := w_end p <= w_start c.

(** A timeline: one list of windows per worker (the worker is its position). *)
Definition timeline := list (list window).

Definition timeline_fits (budget : N) (tl : timeline) : Prop :=
  forall k ws, nth_error tl k = Some ws -> fits budget ws.

(** Errors: on worker [worker] (position in the timeline), at cycle [cycle]
    (the start of window [window], a position in that worker's list),
    [occupancy] pages are live, more than [budget]. *)
Inductive page_error : Type :=
| Over_budget (worker window cycle occupancy budget : N).

(** Check the occupancy at the start of every window of [all]; [ws] is the
    suffix still to visit, [i] the position of its head in [all]. *)
Fixpoint check_starts (budget worker : N) (all : list window) (i : N)
    (ws : list window) : verdict page_error :=
  match ws with
  | [] => Accept
  | w :: rest =>
      let o := occupancy all (w_start w) in
      if o <=? budget then check_starts budget worker all (N.succ i) rest
      else Reject (Over_budget worker i (w_start w) o budget)
  end.

Definition check_worker (budget worker : N) (ws : list window) : verdict page_error :=
  check_starts budget worker ws 0 ws.

Fixpoint check_workers (budget : N) (k : N) (tl : timeline) : verdict page_error :=
  match tl with
  | [] => Accept
  | ws :: rest =>
      match check_worker budget k ws with
      | Accept => check_workers budget (N.succ k) rest
      | Reject e => Reject e
      end
  end.

(** The checkpoint-C checker. *)
Definition check_pages (budget : N) (tl : timeline) : verdict page_error :=
  check_workers budget 0 tl.
