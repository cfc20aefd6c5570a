"""The per-model dispatcher: a slot table, continuous batching and priced chunked prefill.

One thread per served model drives its `Engine`. Each iteration of its loop is a *tick*:

1. free the slots (and key-value pages) of requests that finished or were aborted (client
   disconnected) since the last tick;
2. admit waiting requests into free slots, oldest first. When no request is decoding (the
   engine is idle) admission may wait for the batch-formation window chosen by the M/D/1
   model (`admission.py`), so that several prompts share one prefill launch; while requests
   decode, arrivals are admitted at the next tick, so a request arriving mid-generation gets
   its first token without waiting for the others to finish. A request that has waited
   longer than the admission bound is refused here instead of admitted (finish reason
   "refused", HTTP 429), so the bound holds for every admitted request even when the
   arrival-time prediction was low;
3. at most one prefill launch: the chunk size minimises the priced cost of the prompts still
   to prefill (`prefill_cost.choose_chunk_size`), and chunks of several requests are packed
   into the launch under the token budget (`max_num_batched_tokens` minus one token per
   decoding request); the request whose prompt completes samples its first token;
4. one decode launch over every request that was decoding at the start of the tick.

Sampling is per request (`plow.runtime.sampler`, one generator per request), so a request's
tokens depend only on its seed and its logits, never on its batch neighbours. Detokenisation
and stop strings run here (`detok.TextStream`), so streamed and non-streamed responses see the
same deltas.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from plow.runtime.sampler import SamplingParams, make_generator, sample_row
from plow.serve.admission import AdmissionController, Decision, QueueState, Work
from plow.serve.detok import TextStream
from plow.serve.engine import Engine, KVUsage, PrefillChunk
from plow.serve.metrics import ModelMetrics
from plow.serve.prefill_cost import PrefillFit, choose_chunk_size

log = logging.getLogger("plow.serve")


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """One step of a request's output, sent to its sink from the dispatcher thread."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None while running; "stop", "length", "abort", "refused", "error"
    prompt_tokens: int
    completion_tokens: int
    tick: int
    error: str | None = None
    retry_after_s: int | None = None  # with "refused": when a retry could be admitted


@dataclass
class RequestRecord:
    """The request's timeline in dispatcher ticks and monotonic seconds (`/debug/requests`)."""

    id: str
    prompt_tokens: int
    max_tokens: int
    arrival_t: float
    arrival_tick: int
    predicted_wait_s: float = 0.0
    admitted_t: float | None = None
    admitted_tick: int | None = None
    slot: int | None = None
    prefill_ticks: list[int] = field(default_factory=list)
    prefill_chunks: list[int] = field(default_factory=list)
    first_token_t: float | None = None
    first_token_tick: int | None = None
    finish_t: float | None = None
    finish_tick: int | None = None
    freed_tick: int | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Sink = Callable[[GenerationEvent], None]


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    sink: Sink
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    # state owned by the dispatcher thread
    record: RequestRecord | None = None
    slot: int | None = None
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    text: TextStream | None = None
    rng: np.random.Generator | None = None
    cancelled: bool = False
    finished: bool = False
    last_token_t: float = 0.0
    work: Work | None = None  # predicted slot ticks and prefill (admission), set on submit


@dataclass
class DispatcherStats:
    running: int
    waiting: int
    slots_in_use: int
    max_slots: int
    kv: KVUsage


class Dispatcher:
    """Owns one engine; `submit`/`abort` from any thread, the loop runs in its own thread."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        decode: Callable[[list[int]], str],
        *,
        eos_token_ids: Sequence[int] = (),
        max_num_batched_tokens: int = 512,
        prefill_fit: PrefillFit,
        admission: AdmissionController | None = None,
        metrics: ModelMetrics | None = None,
        history: int = 4096,
    ) -> None:
        if max_num_batched_tokens < engine.max_batch:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least the number "
                f"of slots ({engine.max_batch})"
            )
        self.name = name
        self.engine = engine
        self.decode_text = decode
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.fit = prefill_fit
        self.admission = admission
        self.metrics = metrics or ModelMetrics(name)
        self.tick = 0
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._active: dict[int, Request] = {}  # slot -> request, in admission order
        self._by_id: dict[str, Request] = {}
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()
        self._history = history
        self._free = list(range(engine.max_batch))
        self._stop = False
        self._thread: threading.Thread | None = None
        self._kv = engine.kv_usage()
        self._ids = itertools.count()
        self._waiting_ticks = 0  # sum of the waiting requests' Work.ticks
        self._waiting_prefill_s = 0.0  # sum of their fitted prefill seconds
        m = self.metrics
        m.gauge(
            "vllm:num_requests_running", "Requests holding a slot.", lambda: self.stats().running
        )
        m.gauge(
            "vllm:num_requests_waiting",
            "Requests waiting for a slot.",
            lambda: self.stats().waiting,
        )
        m.gauge(
            "vllm:kv_cache_usage_perc", "Key-value pool usage (0..1).", lambda: self._kv.fraction
        )
        m.gauge("plow:slots_in_use", "Slots bound to a request.", lambda: self.stats().slots_in_use)
        m.gauge("plow:slots_total", "Slots in the table (max batch).", lambda: engine.max_batch)
        m.gauge("plow:kv_cache_pages_used", "Key-value pages in use.", lambda: self._kv.pages_used)
        m.gauge(
            "plow:kv_cache_pages_total",
            "Key-value pages in the pool.",
            lambda: self._kv.pages_total,
        )
        if admission is not None:
            m.gauge(
                "plow:admission_decode_tick_seconds",
                "Full-batch decode tick the admission controller predicts with (the startup "
                "calibration scaled by the moving average of measured ticks).",
                lambda: admission.estimate.decode_tick_s(engine.max_batch),
            )

    # ----------------------------------------------------------------------------- threads

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name=f"dispatch-{self.name}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def new_id(self, prefix: str = "cmpl") -> str:
        return f"{prefix}-{self.name}-{next(self._ids)}-{time.monotonic_ns() % 10**9:09d}"

    @property
    def _launch_budget(self) -> int:
        """Prompt tokens one prefill launch takes at least (the budget less a full decode)."""
        return max(1, self.max_num_batched_tokens - self.engine.max_batch)

    def _work(self, prompt_tokens: int, max_tokens: int) -> Work:
        assert self.admission is not None
        return self.admission.work(prompt_tokens, max_tokens, self._launch_budget)

    def _queue_state(self) -> QueueState:
        """The slot table and queue as an arrival now finds them (call with the lock held).
        Reads the running requests' progress without the dispatcher thread's cooperation:
        a count may be a tick stale, which moves a prediction by one tick."""
        assert self.admission is not None
        fit = self.fit
        busy: list[int] = []
        ahead = self._waiting_prefill_s
        budget = self._launch_budget
        for r in self._active.values():
            if r.finished or r.cancelled:
                busy.append(0)
                continue
            left = len(r.prompt_ids) - r.prefilled
            if left > 0:
                launches = -(-left // budget)
                busy.append(launches + max(0, r.max_tokens - 1))
                ahead += fit.seconds(left, launches)
            else:
                busy.append(max(0, r.max_tokens - len(r.generated)))
        waiting = (
            [r.work.ticks if r.work is not None else 0 for r in self._waiting]
            if len(self._waiting) <= self.admission.max_scheduled
            else None
        )
        return QueueState(
            busy, len(self._free), waiting, self._waiting_ticks, ahead,
            fit.seconds(self.max_num_batched_tokens),
        )  # fmt: skip

    def _enqueue(self, r: Request) -> None:
        self._waiting.append(r)
        if r.work is not None:
            self._waiting_ticks += r.work.ticks
            self._waiting_prefill_s += r.work.prefill_s

    def _dequeued(self, r: Request) -> None:
        """Bookkeeping for `r` having left the waiting queue."""
        if r.work is not None:
            self._waiting_ticks -= r.work.ticks
            self._waiting_prefill_s -= r.work.prefill_s
        if not self._waiting:  # no drift from float sums
            self._waiting_ticks, self._waiting_prefill_s = 0, 0.0

    def predicted_wait(self) -> float:
        """The queue wait a request arriving now is predicted (0 without admission control)."""
        if self.admission is None:
            return 0.0
        with self._cv:
            return self.admission.queue_wait(self._queue_state())

    def submit(self, req: Request, *, check: bool = True) -> Decision:
        """Queue a request unless admission control refuses it; the decision says which."""
        now = time.monotonic()
        with self._cv:
            decision = Decision(True, 0.0, 0)
            if self.admission is not None:
                if check:
                    decision = self.admission.decide(now, self._queue_state())
                    if not decision.admit:
                        self.metrics.refused("arrival")
                        return decision
                req.work = self._work(len(req.prompt_ids), req.max_tokens)
                self.admission.arrival(now, len(req.prompt_ids), req.max_tokens)
            self.metrics.request_max_tokens.observe(req.max_tokens)
            req.record = RequestRecord(
                req.id, len(req.prompt_ids), req.max_tokens, now, self.tick,
                predicted_wait_s=decision.predicted_wait_s,
            )  # fmt: skip
            req.text = TextStream.create(self.decode_text, req.stop)
            req.rng = None if req.params.is_greedy else make_generator(req.params)
            self._records[req.id] = req.record
            while len(self._records) > self._history:
                self._records.popitem(last=False)
            self._by_id[req.id] = req
            self._enqueue(req)
            self._cv.notify_all()
        return decision

    def abort(self, request_id: str) -> None:
        """Mark a request aborted (client gone); its slot is freed on the next tick."""
        with self._cv:
            req = self._by_id.get(request_id)
            if req is not None and not req.finished:
                req.cancelled = True
                self._cv.notify_all()

    def record(self, request_id: str) -> RequestRecord | None:
        with self._cv:
            return self._records.get(request_id)

    def stats(self) -> DispatcherStats:
        with self._cv:
            running = sum(1 for r in self._active.values() if not r.finished)
            return DispatcherStats(
                running, len(self._waiting), len(self._active), self.engine.max_batch, self._kv
            )

    # ----------------------------------------------------------------------------- the loop

    def _idle(self) -> bool:
        return not self._active and not self._waiting

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and self._idle():
                    self._cv.wait()
                if self._stop:
                    break
                hold = self._window_hold()
                if hold > 0:
                    self._cv.wait(hold)
                    continue
            try:
                self._tick()
            except Exception as e:  # keep serving: fail the requests in flight, free them
                log.exception("dispatcher %s: tick %d failed", self.name, self.tick)
                self._fail_all(f"engine error: {e}")
        # shutting down: everything still queued or running ends as aborted
        self._fail_all("server shutting down", reason="abort")

    def _window_hold(self) -> float:
        """Seconds to keep waiting before admitting (the batch-formation window), or 0."""
        if self.admission is None or not self._waiting or self._active:
            return 0.0
        if len(self._waiting) >= len(self._free):
            return 0.0
        now = time.monotonic()
        w = self.admission.window(now)
        oldest = self._waiting[0].record
        assert oldest is not None
        return max(0.0, oldest.arrival_t + w - now)

    def _tick(self) -> None:
        t_start = time.monotonic()
        with self._cv:
            self.tick += 1
            tick = self.tick
            # 1. free finished / aborted
            for slot, r in list(self._active.items()):
                if r.finished or r.cancelled:
                    self.engine.free(slot)
                    del self._active[slot]
                    self._free.append(slot)
                    if r.record is not None:
                        r.record.freed_tick = tick
                    if not r.finished:
                        self._finish(r, "abort", "", tick)
                    self._by_id.pop(r.id, None)
            for r in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(r)
                self._dequeued(r)
                self._finish(r, "abort", "", tick)
                self._by_id.pop(r.id, None)
            self._free.sort()
            # 2. admit; a request still waiting past the bound is refused instead (its
            # predicted wait was too low), so no admitted request waited longer than the bound
            now = time.monotonic()
            self._refuse_late(now, tick)
            while self._waiting and self._free:
                r = self._waiting.popleft()
                self._dequeued(r)
                slot = self._free.pop(0)
                self.engine.add(slot, r.prompt_ids)
                r.slot = slot
                self._active[slot] = r
                assert r.record is not None
                r.record.admitted_t = now
                r.record.admitted_tick = tick
                r.record.slot = slot
                self.metrics.queue.observe(now - r.record.arrival_t)
            active = list(self._active.values())
        pending = [r for r in active if r.prefilled < len(r.prompt_ids) and not r.cancelled]
        decoding = [r for r in active if r.generated and not r.finished and not r.cancelled]
        launched = False
        prefill_rows, prefill_s = 0, 0.0
        # 3. one packed prefill launch
        if pending:
            budget = max(1, self.max_num_batched_tokens - len(decoding))
            remaining = [len(r.prompt_ids) - r.prefilled for r in pending]
            choice = choose_chunk_size(remaining, budget, self.fit.launch_rows)
            per_launch = max(1, budget // choice.chunk)
            owners = pending[:per_launch]
            chunks = [
                PrefillChunk(r.slot, min(choice.chunk, n))
                for r, n in zip(owners, remaining, strict=False)
                if r.slot is not None
            ]
            t0 = time.monotonic()
            logits = self.engine.prefill(chunks)
            now = time.monotonic()
            launched = True
            prefill_rows, prefill_s = sum(c.length for c in chunks), now - t0
            self.metrics.prefill_launches.inc()
            for r, ch, row in zip(owners, chunks, logits, strict=True):
                r.prefilled += ch.length
                assert r.record is not None
                r.record.prefill_ticks.append(tick)
                r.record.prefill_chunks.append(ch.length)
                self.metrics.prompt_tokens.inc(ch.length)
                if r.prefilled == len(r.prompt_ids):
                    self._emit_token(r, sample_row(row, r.params, r.rng), tick, now)
        # 4. one decode launch
        if decoding:
            slots = [r.slot for r in decoding if r.slot is not None]
            logits = self.engine.decode(slots, [r.generated[-1] for r in decoding])
            launched = True
            now = time.monotonic()
            for r, row in zip(decoding, logits, strict=True):
                self._emit_token(r, sample_row(row, r.params, r.rng), tick, now)
        with self._cv:
            self._kv = self.engine.kv_usage()
        if launched:
            elapsed = time.monotonic() - t_start
            self.metrics.engine_ticks.inc()
            self.metrics.tick.observe(elapsed)
            if self.admission is not None:
                self.admission.observe_tick(
                    len(decoding), elapsed - prefill_s, prefill_rows, prefill_s
                )

    def _refuse_late(self, now: float, tick: int) -> None:
        """Refuse the waiting requests whose wait already exceeds the admission bound (the
        queue is in arrival order, so they are a prefix). Call with the lock held."""
        if self.admission is None:
            return
        bound = self.admission.max_wait_s
        late: list[Request] = []
        while self._waiting:
            rec = self._waiting[0].record
            assert rec is not None
            if now - rec.arrival_t <= bound:
                break
            r = self._waiting.popleft()
            self._dequeued(r)
            self._by_id.pop(r.id, None)
            late.append(r)
        if not late:
            return
        wait = self.admission.queue_wait(self._queue_state())
        retry = max(1, math.ceil(wait - bound))
        for r in late:
            self.metrics.refused("deadline")
            self._finish(
                r, "refused", "", tick,
                error=f"no slot within the queue-wait bound {bound:g} s (predicted wait now "
                f"{wait:.3f} s)",
                retry_after_s=retry,
            )  # fmt: skip

    # ----------------------------------------------------------------------------- outputs

    def _emit_token(self, r: Request, tok: int, tick: int, now: float) -> None:
        assert r.record is not None and r.text is not None
        r.generated.append(tok)
        rec = r.record
        m = self.metrics
        m.generation_tokens.inc()
        if rec.first_token_t is None:
            rec.first_token_t = now
            rec.first_token_tick = tick
            m.ttft.observe(now - rec.arrival_t)
            if rec.admitted_t is not None:
                m.prefill.observe(now - rec.admitted_t)
        else:
            m.itl.observe(now - r.last_token_t)
            m.tpot.observe(now - r.last_token_t)
        r.last_token_t = now
        finish: str | None = None
        if tok in r.stop_token_ids:
            delta = r.text.finish()
            finish = "stop"
        else:
            delta = r.text.push(tok)
            if r.text.stopped:
                finish = "stop"
            elif (
                len(r.generated) >= r.max_tokens
                or len(r.prompt_ids) + len(r.generated) >= self.engine.max_context
            ):
                delta += r.text.finish()
                finish = "length"
        rec.completion_tokens = len(r.generated)
        if finish is None:
            self._send(r, GenerationEvent(
                r.id, delta, (tok,), None, len(r.prompt_ids), len(r.generated), tick
            ))  # fmt: skip
        else:
            self._finish(r, finish, delta, tick, (tok,))

    def _finish(
        self,
        r: Request,
        reason: str,
        delta: str,
        tick: int,
        toks: tuple[int, ...] = (),
        error: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        if r.finished:
            return
        r.finished = True
        now = time.monotonic()
        rec = r.record
        m = self.metrics
        if rec is not None:
            rec.finish_t = now
            rec.finish_tick = tick
            rec.finish_reason = reason
            rec.completion_tokens = len(r.generated)
            if reason in ("stop", "length"):
                m.e2e.observe(now - rec.arrival_t)
                m.request_prompt.observe(len(r.prompt_ids))
                m.request_generation.observe(len(r.generated))
                if rec.admitted_t is not None:
                    m.inference.observe(now - rec.admitted_t)
                if rec.first_token_t is not None:
                    m.decode.observe(r.last_token_t - rec.first_token_t)
                    if len(r.generated) > 1:
                        m.request_tpot.observe(
                            (r.last_token_t - rec.first_token_t) / (len(r.generated) - 1)
                        )
        if reason in ("stop", "length", "abort"):
            m.finished(reason)
        self._send(r, GenerationEvent(
            r.id, delta, toks, reason, len(r.prompt_ids), len(r.generated), tick, error,
            retry_after_s,
        ))  # fmt: skip

    def _send(self, r: Request, ev: GenerationEvent) -> None:
        try:
            r.sink(ev)
        except Exception:  # a gone client must not stop the loop
            log.debug("sink of %s failed", r.id, exc_info=True)

    def _fail_all(self, message: str, reason: str = "error") -> None:
        with self._cv:
            reqs = list(self._active.items())
            waiting = list(self._waiting)
            self._waiting.clear()
            self._waiting_ticks, self._waiting_prefill_s = 0, 0.0
            for slot, r in reqs:
                self.engine.free(slot)
                self._free.append(slot)
                del self._active[slot]
                self._by_id.pop(r.id, None)
            for r in waiting:
                self._by_id.pop(r.id, None)
            self._free.sort()
            self._kv = self.engine.kv_usage()
            tick = self.tick
        for _, r in reqs:
            self._finish(r, reason, "", tick, error=message)
        for r in waiting:
            self._finish(r, reason, "", tick, error=message)
