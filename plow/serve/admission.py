"""Admission control: a queue-wait bound that holds, predicted from the work ahead.

Each arrival's wait (arrival to slot) is predicted from the state it finds, since admission is
FIFO and only the requests ahead of it matter: the remaining ticks of every bound slot and of
every waiting request (prefill launches plus decode ticks up to each request's own
`max_tokens`, never the lengths of past requests), scheduled onto the slots in order
(`start_ticks`: the list schedule, or Graham's bound for long queues), at the decode tick and
prefill cost measured under load (`TickEstimate`: the startup calibration scaled by an
exponentially weighted average of measured / predicted ticks). An arrival whose predicted wait
exceeds the bound is refused (HTTP 429 with `Retry-After`); the dispatcher refuses a request
still waiting when the bound runs out instead of admitting it late, so the bound holds for every
admitted request.

The step time is first known before any request arrives: `calibrate_step_time` times decode
ticks at batch 1 and at the full batch (a line `t_step(b) = d0 + d1 * b`) and the prefill launch
cost comes from the prefill fit (`plow/serve/prefill_cost.py`). A compiled step is
deterministic, so the steady-state model is M/D/1 rather than M/M/1; it chooses the
batch-formation window and feeds reports. Its symbols (see docs/serving.md):

    lambda    arrival rate, estimated from the arrivals of the last `horizon_s` seconds
    p, n      mean prompt tokens and mean max_tokens of recent arrivals
    B         slots (the engine's max batch)
    b         expected occupied slots = clamp(lambda * S, 1, B)
    S(w)      slot holding time of a request = launch_s / k(w) + per_row_s * p + n * t_step(b)
    k(w)      requests sharing one prefill launch when admission waits w seconds = 1 + lambda*w
    mu        service rate of the slot table seen as one server = B / S
    rho       lambda / mu
    W_q       rho / (2 mu (1 - rho))            Pollaczek-Khinchine with zero service variance
    W_win(w)  mean wait inside a formation window = (w + lambda w^2 / 2) / (1 + lambda w)
    W_tick    P(engine busy) * t_step(b) / 2   (arrivals wait for the running tick to end;
              P(busy) = 1 - exp(-lambda S), the chance that some request holds a slot)

The expected latency to the first token for a window w is
`L(w) = W_win(w) + W_tick + W_q(w) + launch_s / k(w) + per_row_s * p`, and the batch-formation
window is its minimiser over a grid.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel

from plow.serve.engine import Engine, PrefillChunk
from plow.serve.prefill_cost import PrefillFit


class StepTimes(BaseModel):
    """Decode tick time as a line in the number of occupied slots: `d0 + d1 * b` seconds."""

    d0_s: float
    d1_s: float
    max_batch: int
    samples: dict[int, float] = {}

    def tick_s(self, b: float) -> float:
        return max(self.d0_s + self.d1_s * max(b, 1.0), 1e-9)


def calibrate_step_time(engine: Engine, *, reps: int = 5, prompt_len: int = 4) -> StepTimes:
    """Time decode ticks at batch 1 and at the full batch on scratch slots (all slots must be
    free; they are freed again). Median over `reps` ticks after one warm-up tick."""
    batches = sorted({1, engine.max_batch})
    rng = np.random.default_rng(0)
    samples: dict[int, float] = {}
    ticks = reps + 1
    length = min(prompt_len, max(1, engine.max_context - ticks))
    for b in batches:
        slots = list(range(b))
        for s in slots:
            engine.add(s, [int(t) for t in rng.integers(3, engine.vocab_size, size=length)])
        try:
            engine.prefill([PrefillChunk(s, length) for s in slots])
            times = []
            for r in range(ticks):
                t0 = time.perf_counter()
                engine.decode(slots, [3] * b)
                if r > 0:
                    times.append(time.perf_counter() - t0)
        finally:
            for s in slots:
                engine.free(s)
        samples[b] = float(np.median(times))
    if len(batches) == 1:
        return StepTimes(d0_s=samples[1], d1_s=0.0, max_batch=engine.max_batch, samples=samples)
    b1, b2 = batches
    d1 = max((samples[b2] - samples[b1]) / (b2 - b1), 0.0)
    d0 = max(samples[b1] - d1 * b1, 0.0)
    return StepTimes(d0_s=d0, d1_s=d1, max_batch=engine.max_batch, samples=samples)


def md1_wait(lam: float, service_s: float) -> float:
    """Mean wait in queue of M/D/1: rho / (2 mu (1 - rho)); inf when rho >= 1."""
    if lam <= 0.0:
        return 0.0
    mu = 1.0 / service_s
    rho = lam / mu
    if rho >= 1.0:
        return math.inf
    return rho / (2.0 * mu * (1.0 - rho))


def window_wait(lam: float, w: float) -> float:
    """Mean time a request spends inside a formation window of length w (Poisson arrivals):
    the request that opens it waits w, the lam*w that join it wait w/2 on average."""
    if w <= 0.0:
        return 0.0
    return (w + lam * w * w / 2.0) / (1.0 + lam * w)


@dataclass(frozen=True, slots=True)
class Prediction:
    lam: float
    occupied: float
    service_s: float
    rho: float
    window_s: float
    wait_window_s: float
    wait_tick_s: float
    wait_queue_s: float
    latency_s: float

    @property
    def wait_s(self) -> float:
        return self.wait_window_s + self.wait_tick_s + self.wait_queue_s


@dataclass
class QueueModel:
    """The pure model: step times, prefill fit and slot count in, predictions out."""

    step: StepTimes
    prefill: PrefillFit
    slots: int

    def predict(self, lam: float, prompt: float, out: float, w: float) -> Prediction:
        k = 1.0 + lam * w
        pf = self.prefill.launch_s / k + self.prefill.per_row_s * prompt
        # occupancy fixed point (one refinement from the full-batch estimate)
        s_full = pf + out * self.step.tick_s(self.slots)
        b = min(max(lam * s_full, 1.0), float(self.slots))
        tick = self.step.tick_s(b)
        s = pf + out * tick
        mu = self.slots / s
        rho = lam / mu
        wq = md1_wait(lam, 1.0 / mu)
        busy = 1.0 - math.exp(-lam * s)
        wt = busy * tick / 2.0
        ww = window_wait(lam, w)
        return Prediction(lam, b, s, rho, w, ww, wt, wq, ww + wt + wq + pf)

    def best_window(
        self, lam: float, prompt: float, out: float, grid: Sequence[float]
    ) -> Prediction:
        best = self.predict(lam, prompt, out, 0.0)
        for w in grid:
            p = self.predict(lam, prompt, out, w)
            if p.latency_s < best.latency_s - 1e-12:
                best = p
        return best

    def window_grid(self, points: int = 17) -> list[float]:
        """0 .. 4 decode ticks at the full batch, evenly spaced."""
        top = 4.0 * self.step.tick_s(self.slots)
        return [top * i / (points - 1) for i in range(points)]


@dataclass(frozen=True, slots=True)
class Decision:
    admit: bool
    predicted_wait_s: float
    retry_after_s: int
    reason: str = ""


# ------------------------------------------------------------------- the queue ahead of an arrival


@dataclass(frozen=True, slots=True)
class Work:
    """What a request still needs from the engine: slot ticks and (fitted) prefill seconds.

    A request holds its slot for `ceil(prompt / budget)` prefill launches (the last one samples
    its first token) plus `max_tokens - 1` decode ticks: its own `max_tokens` is the most it
    can ask for, so a prediction built from it is an upper bound (it ends earlier on a stop)."""

    ticks: int
    prefill_s: float


@dataclass(frozen=True, slots=True)
class QueueState:
    """The dispatcher's slot table and queue as a new arrival finds them.

    `busy`: remaining ticks of each bound slot (0 for one that frees on the next tick);
    `waiting`: ticks of each waiting request in FIFO order, or None when the queue is too long
    to schedule one by one (then `waiting_ticks`, their sum, gives Graham's bound);
    `prefill_ahead_s`: the fitted prefill seconds still owed to requests ahead of the arrival;
    `launch_cap_s`: the fitted seconds of one full prefill launch (the most one tick can add)."""

    busy: Sequence[int]
    free_slots: int
    waiting: Sequence[int] | None
    waiting_ticks: int
    prefill_ahead_s: float
    launch_cap_s: float


def start_ticks(
    busy: Sequence[int], free_slots: int, waiting: Sequence[int] | None, waiting_ticks: int
) -> float:
    """Ticks until a new arrival gets a slot, with FIFO admission into the first free slot.

    With `waiting` given this is the list schedule itself: each waiting request takes the slot
    that frees first and holds it for its ticks; the arrival takes the next one. Without it,
    Graham's bound: until the arrival starts no slot is idle (otherwise it or someone ahead of
    it would have been admitted), so B * start <= (work of the busy slots + work ahead)."""
    slots = len(busy) + free_slots
    if slots == 0:
        return math.inf
    if waiting is None:
        if waiting_ticks == 0 and free_slots > 0:
            return 0.0
        return (sum(busy) + waiting_ticks) / slots
    heap = [0] * free_slots + list(busy)
    heapq.heapify(heap)
    for t in waiting:
        heapq.heappush(heap, heapq.heappop(heap) + t)
    return float(heap[0])


@dataclass
class TickEstimate:
    """Step times under load: the startup line and prefill fit, each scaled by an
    exponentially weighted average of measured / predicted over the ticks that ran.

    The startup calibration times the engine alone; under load a tick also carries the host's
    sampling and detokenisation of every row, the event loop's share of the GIL and whatever
    else the machine runs, so a served tick can take several times the calibrated one. The
    average starts as the plain mean of the first `1 / alpha` observations (so a few ticks
    replace the calibration) and then forgets with weight `alpha` per tick."""

    step: StepTimes
    prefill: PrefillFit
    alpha: float = 0.1
    decode_factor: float = 1.0
    prefill_factor: float = 1.0
    decode_seen: int = 0
    prefill_seen: int = 0

    def _update(self, old: float, seen: int, ratio: float) -> float:
        a = max(self.alpha, 1.0 / (seen + 1))
        return old + a * (ratio - old)

    def observe(self, decoding: int, decode_s: float, prefill_rows: int, prefill_s: float) -> None:
        """One tick: `decode_s` is its time outside the prefill launch (the decode launch,
        sampling, detokenisation, bookkeeping) with `decoding` rows; `prefill_s` the launch."""
        if decoding > 0 and decode_s > 0:
            ratio = decode_s / self.step.tick_s(decoding)
            self.decode_factor = self._update(self.decode_factor, self.decode_seen, ratio)
            self.decode_seen += 1
        if prefill_rows > 0 and prefill_s > 0:
            ratio = prefill_s / max(self.prefill.seconds(prefill_rows), 1e-9)
            self.prefill_factor = self._update(self.prefill_factor, self.prefill_seen, ratio)
            self.prefill_seen += 1

    def decode_tick_s(self, b: float) -> float:
        return self.decode_factor * self.step.tick_s(b)


@dataclass
class AdmissionController:
    """Online side: each arrival's predicted queue wait from the requests ahead of it (their
    own remaining ticks and prefills at the measured step time); the M/D/1 model for the
    batch-formation window and for reports."""

    model: QueueModel
    max_wait_s: float = 60.0
    horizon_s: float = 30.0
    default_prompt: float = 32.0
    default_out: float = 16.0
    ewma_alpha: float = 0.1
    max_scheduled: int = 64  # longer queues use Graham's bound instead of the list schedule
    _arrivals: deque[float] = field(default_factory=deque)
    _prompts: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    _outs: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    _start: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _window: float = 0.0
    _window_at: float = -1.0
    estimate: TickEstimate = field(init=False)

    def __post_init__(self) -> None:
        self.estimate = TickEstimate(self.model.step, self.model.prefill, self.ewma_alpha)

    def _rate(self, now: float) -> float:
        while self._arrivals and self._arrivals[0] < now - self.horizon_s:
            self._arrivals.popleft()
        span = max(min(self.horizon_s, now - self._start), 1.0)
        return len(self._arrivals) / span

    def means(self) -> tuple[float, float]:
        """Mean prompt tokens and mean `max_tokens` of recent arrivals (for the window)."""
        p = float(np.mean(self._prompts)) if self._prompts else self.default_prompt
        n = float(np.mean(self._outs)) if self._outs else self.default_out
        return p, n

    def arrival(self, now: float, prompt_tokens: int, max_tokens: int) -> None:
        with self._lock:
            self._arrivals.append(now)
            self._prompts.append(prompt_tokens)
            self._outs.append(max_tokens)

    def predict(self, now: float, extra_arrivals: int = 0) -> Prediction:
        """The M/D/1 steady-state prediction at the current arrival rate (window, reports)."""
        with self._lock:
            lam = self._rate(now) + extra_arrivals / max(
                min(self.horizon_s, now - self._start), 1.0
            )
            p, n = self.means()
        return self.model.best_window(lam, p, n, self.model.window_grid())

    def window(self, now: float) -> float:
        """The batch-formation window to apply now (recomputed at most every 100 ms)."""
        if now - self._window_at > 0.1:
            self._window = self.predict(now).window_s
            self._window_at = now
        return self._window

    # -- the per-arrival prediction ------------------------------------------------------

    def work(self, prompt_tokens: int, max_tokens: int, budget: int) -> Work:
        """Slot ticks and fitted prefill seconds of a new request."""
        launches = -(-prompt_tokens // max(1, budget))
        return Work(
            launches + max(0, max_tokens - 1),
            self.model.prefill.seconds(prompt_tokens, launches) if prompt_tokens else 0.0,
        )

    def observe_tick(
        self, decoding: int, decode_s: float, prefill_rows: int, prefill_s: float
    ) -> None:
        with self._lock:
            self.estimate.observe(decoding, decode_s, prefill_rows, prefill_s)

    def queue_wait(self, state: QueueState) -> float:
        """Predicted seconds from arrival to slot admission for a new request.

        The arrival first waits for the tick in progress (a decode over the busy slots, plus at
        most one prefill launch); then, if no slot is free for it, for `start_ticks` more
        ticks at the measured full-batch decode time plus the prefills of everyone ahead
        (each runs once, inside one of those ticks). On an idle engine it may also wait out
        the batch-formation window."""
        est = self.estimate
        slots = len(state.busy) + state.free_slots
        with self._lock:
            pf = est.prefill_factor
            current = (
                est.decode_tick_s(len(state.busy)) + pf * min(state.prefill_ahead_s,
                                                              state.launch_cap_s)
                if state.busy
                else self._window
            )  # fmt: skip
            start = start_ticks(state.busy, state.free_slots, state.waiting, state.waiting_ticks)
            if start <= 0.0:
                return current
            return current + start * est.decode_tick_s(slots) + pf * state.prefill_ahead_s

    def decide(self, now: float, state: QueueState) -> Decision:
        """Admit or refuse one new arrival given the slot table and queue ahead of it.

        The wait is predicted from the requests ahead (their own `max_tokens`, never the
        lengths of past requests) at the step time measured under load; a request is refused
        when that exceeds the bound. The dispatcher also refuses, at admission time, a request
        that waited past the bound anyway (the prediction was low), so no admitted request
        waits longer than `max_wait_s`."""
        wait = self.queue_wait(state)
        if wait > self.max_wait_s:
            retry = max(1, math.ceil(wait - self.max_wait_s))
            return Decision(
                False,
                wait,
                retry,
                f"predicted queue wait {wait:.3f} s exceeds the bound {self.max_wait_s:g} s",
            )
        return Decision(True, wait, 0)
