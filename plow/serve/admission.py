"""Admission control from a deterministic-service (M/D/1) queueing model.

The step time of an engine is known before any request arrives: it is measured once at
startup (`calibrate_step_time`: decode ticks at batch 1 and at the full batch, a line
`t_step(b) = d0 + d1 * b`) and the prefill launch cost comes from the prefill fit
(`plow/serve/prefill_cost.py`). A compiled step is deterministic, so the service model is
M/D/1 rather than M/M/1. The symbols (see docs/serving.md for the derivation and limits):

    lambda    arrival rate, estimated from the arrivals of the last `horizon_s` seconds
    p, n      mean prompt and mean output tokens of recent requests
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
window is its minimiser over a grid. The predicted queue wait (arrival to admission) is
`W_win + W_tick + W_q`, plus a backlog term when requests are already waiting for slots:
`max(0, waiting + 1 - free_slots) * S / B` (slots free at rate B / S); when the estimated
rho >= 1 there is no steady state and the drain term alone is the prediction. A request is
refused (HTTP 429 with `Retry-After`) when the predicted wait exceeds the configured bound.
"""

from __future__ import annotations

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


@dataclass
class AdmissionController:
    """Online side of the model: arrival-rate and length estimates, window, admit/refuse."""

    model: QueueModel
    max_wait_s: float = 60.0
    horizon_s: float = 30.0
    default_prompt: float = 32.0
    default_out: float = 16.0
    _arrivals: deque[float] = field(default_factory=deque)
    _prompts: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    _outs: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    _start: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _window: float = 0.0
    _window_at: float = -1.0

    def _rate(self, now: float) -> float:
        while self._arrivals and self._arrivals[0] < now - self.horizon_s:
            self._arrivals.popleft()
        span = max(min(self.horizon_s, now - self._start), 1.0)
        return len(self._arrivals) / span

    def means(self) -> tuple[float, float]:
        p = float(np.mean(self._prompts)) if self._prompts else self.default_prompt
        n = float(np.mean(self._outs)) if self._outs else self.default_out
        return p, n

    def arrival(self, now: float, prompt_tokens: int, max_tokens: int) -> None:
        with self._lock:
            self._arrivals.append(now)
            self._prompts.append(prompt_tokens)
            if not self._outs:
                self.default_out = float(max_tokens)

    def finished(self, completion_tokens: int) -> None:
        with self._lock:
            self._outs.append(completion_tokens)

    def predict(self, now: float, extra_arrivals: int = 0) -> Prediction:
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

    def decide(self, now: float, waiting: int, free_slots: int) -> Decision:
        """Admit or refuse one new arrival given the dispatcher's current queue.

        While the estimated load is stable (rho < 1) the predicted wait is the larger of the
        M/D/1 mean and the deterministic drain time of the requests already waiting. When the
        estimated rate exceeds the service rate there is no steady state: the prediction is
        the drain time alone, so a burst is queued until its drain time passes the bound."""
        pred = self.predict(now, extra_arrivals=1)
        backlog = max(0, waiting + 1 - free_slots) * pred.service_s / self.model.slots
        wait = backlog if math.isinf(pred.wait_queue_s) else max(pred.wait_s, backlog)
        if wait > self.max_wait_s:
            retry = max(1, math.ceil(wait - self.max_wait_s))
            return Decision(
                False,
                wait,
                retry,
                f"predicted queue wait {wait:.3f} s exceeds the bound {self.max_wait_s:g} s",
            )
        return Decision(True, wait, 0)
