"""The per-model dispatcher: a slot table, continuous batching and priced chunked prefill.

One thread per served model drives its `Engine`. Each iteration of its loop is a *tick*, in
three parts as vLLM v1's `EngineCore.step`:

1. **schedule** (`plow.serve.scheduler.schedule`, pure): a snapshot of the slot table and the
   queue (`SchedulerState`) becomes a `TickPlan`: which slots to free (finished, or aborted
   because the client went away), which waiting requests to refuse (they waited past the
   admission bound: their arrival prediction was low, so they get HTTP 429 and the bound
   holds for every admitted request), which to admit into which slot, the chunks of one
   packed prefill launch (chunk size priced by `prefill_cost`) and the rows of one decode
   launch. The dispatcher applies the plan to its own bookkeeping under its lock;
2. **execute** (`plow.serve.step.execute`): the plan on the engine (any executor of
   `plow.runtime.executors`), logits out;
3. **update** (here): each logits row becomes a token through the request's
   `plow.serve.sampling.RequestSampler` (grammar mask, logprobs, penalties, then the
   sampler), and the token becomes a detokenised, stop-checked event for the request's sink.
   The prefill launch's update runs between the two launches (`execute`'s `on_prefill`), so a
   request whose prompt completes gets its first token before the others' decode launch.

When no request is decoding (the engine is idle) admission may wait for the batch-formation
window chosen by the M/D/1 model (`admission.py`), so that several prompts share one prefill
launch; while requests decode, arrivals are admitted at the next tick, so a request arriving
mid-generation gets its first token without waiting for the others to finish.

Sampling is per request (one generator per request), so a request's tokens depend only on its
seed and its logits, never on its batch neighbours. Detokenisation and stop strings run here
(`detok.TextStream`), so streamed and non-streamed responses see the same deltas.
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

from plow.runtime.sampler import SamplingParams
from plow.serve.admission import AdmissionController, Decision, QueueState, Work
from plow.serve.detok import TextStream
from plow.serve.engine import Engine, KVUsage
from plow.serve.grammar import Grammar, GrammarError
from plow.serve.metrics import ModelMetrics
from plow.serve.prefill_cost import PrefillFit
from plow.serve.sampling import Penalties, RequestSampler, TokenLogprob, prompt_logprobs
from plow.serve.scheduler import Running, SchedulerState, TickPlan, Waiting, schedule
from plow.serve.step import TickResult, execute, gives_prompt_logits
from plow.serve.warm import Prepared, engine_rungs

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
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of `token_ids`, when asked
    # with the first token, when asked: the prompt tokens' logprobs from the second on
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


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
    penalties: Penalties = Penalties()
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and k alternatives
    grammar: Grammar | None = None  # a response_format / regex constraint (plow.serve.grammar)
    prompt_logprobs: int | None = None  # None: none; k: every prompt token's and k alternatives
    # state owned by the dispatcher thread
    record: RequestRecord | None = None
    slot: int | None = None
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    text: TextStream | None = None
    sampler: RequestSampler | None = None
    cancelled: bool = False
    finished: bool = False
    last_token_t: float = 0.0
    prompt_lps: list[TokenLogprob] = field(default_factory=list)
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
        device_sampling: bool = True,
    ) -> None:
        if max_num_batched_tokens < engine.max_batch:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least the number "
                f"of slots ({engine.max_batch})"
            )
        self.name = name
        self.engine = engine
        # a decode launch whose rows are all plain requests samples on the device when the
        # engine can (`plow.serve.step`); False: always logits rows, sampled here
        self.device_sampling = device_sampling
        # the engine returns every prompt position's logits (`Request.prompt_logprobs`)
        self.prompt_logits = gives_prompt_logits(engine)
        self.decode_text = decode
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.fit = prefill_fit
        self.admission = admission
        # the engine's prefill rungs (rows, tokens): a tick's prefill is one launch of one
        # (`schedule`); () for an engine without compiled rungs
        self.prefill_rungs = tuple(
            (r.rows, r.tokens) for r in engine_rungs(engine) if r.phase == "prefill"
        )
        self.prepared: list[Prepared] = []  # the rungs `load_served_model` prepared
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
        # `plow serve --debug-ticks N`: the last N ticks' records (`/debug/ticks`); None: off
        self.tick_log: deque[dict[str, Any]] | None = None
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
        m.gauge(
            "plow:recurrent_state_slots_used",
            "Recurrent-state slots (Mamba-2) held by requests; freed when one finishes or drops.",
            lambda: self._kv.state_slots_used,
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

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def new_id(self, prefix: str = "cmpl") -> str:
        return f"{prefix}-{self.name}-{next(self._ids)}-{time.monotonic_ns() % 10**9:09d}"

    @property
    def _launch_budget(self) -> int:
        """Prompt tokens one prefill launch takes at least (the budget less a full decode,
        at most the largest prefill rung's tokens)."""
        budget = max(1, self.max_num_batched_tokens - self.engine.max_batch)
        if self.prefill_rungs:
            budget = min(budget, max(t for _, t in self.prefill_rungs))
        return budget

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
            req.sampler = RequestSampler(
                req.params, tuple(req.prompt_ids), req.penalties, req.logprobs, req.grammar
            )
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

    def _snapshot(self, now: float) -> SchedulerState:
        """The slot table and queue as `schedule` reads them (call with the lock held)."""
        running = tuple(
            Running(
                r.id, slot, len(r.prompt_ids), r.prefilled, len(r.generated),
                r.generated[-1] if r.generated else None, r.finished, r.cancelled,
            )
            for slot, r in self._active.items()
        )  # fmt: skip
        # only the part of the queue that can change the plan: every cancelled request, the
        # prefix that waited past the bound, and as many more as there may be free slots (the
        # queue is in arrival order), so a long queue costs attribute reads, not snapshots
        slots = len(self._free) + sum(1 for r in self._active.values() if r.finished or r.cancelled)
        bound = self.admission.max_wait_s if self.admission is not None else None
        picked: list[Waiting] = []
        taken = 0
        for r in self._waiting:
            arrival = r.record.arrival_t if r.record is not None else now
            late = bound is not None and now - arrival > bound
            if r.cancelled or late or taken < slots:
                picked.append(Waiting(r.id, arrival, len(r.prompt_ids), r.cancelled))
                taken += not (r.cancelled or late)
        waiting = tuple(picked)
        return SchedulerState(
            self.tick, now, running, waiting, tuple(self._free), self.max_num_batched_tokens,
            self.fit.launch_rows,
            self.admission.max_wait_s if self.admission is not None else None,
            self.prefill_rungs, self._decode_rows(),
        )  # fmt: skip

    def _decode_rows(self) -> float:
        """The running requests' decode launch in prefill row equivalents (0 without
        admission control, whose estimate it reads)."""
        if self.admission is None or not self._active:
            return 0.0
        b = max(1, sum(1 for r in self._active.values() if r.generated))
        return self.admission.estimate.decode_tick_s(b) / self.fit.per_row_s

    def _apply(self, plan: TickPlan, now: float) -> dict[str, list[int]]:
        """The plan's bookkeeping on the dispatcher's own state (lock held); the prompts of
        the admitted requests, for `execute`."""
        tick = plan.tick
        for rel in plan.release:
            r = self._active.pop(rel.slot)
            self._free.append(rel.slot)
            if r.record is not None:
                r.record.freed_tick = tick
            if rel.aborted:
                self._finish(r, "abort", "", tick)
            self._by_id.pop(r.id, None)
        if plan.drop or plan.refuse:
            gone = {*plan.drop, *plan.refuse}
            keep: deque[Request] = deque()
            left: dict[str, Request] = {}
            for r in self._waiting:
                if r.id in gone:
                    left[r.id] = r
                else:
                    keep.append(r)
            self._waiting = keep
            for r in left.values():
                self._dequeued(r)
                self._by_id.pop(r.id, None)
            for rid in plan.drop:
                self._finish(left[rid], "abort", "", tick)
            if plan.refuse:
                self._refuse([left[rid] for rid in plan.refuse], tick)
        prompts: dict[str, list[int]] = {}
        for a in plan.admit:
            r = self._waiting.popleft()
            assert r.id == a.request_id
            self._dequeued(r)
            self._free.remove(a.slot)
            r.slot = a.slot
            self._active[a.slot] = r
            assert r.record is not None
            r.record.admitted_t = now
            r.record.admitted_tick = tick
            r.record.slot = a.slot
            self.metrics.queue.observe(now - r.record.arrival_t)
            prompts[r.id] = r.prompt_ids
        self._free.sort()
        return prompts

    def _tick(self) -> None:
        """schedule -> execute -> update (module docstring)."""
        t_start = time.monotonic()
        with self._cv:
            self.tick += 1
            plan = schedule(self._snapshot(t_start))
            # admitted at the instant the plan was made for (its lateness test used it), so no
            # admitted request's recorded wait exceeds the bound
            prompts = self._apply(plan, t_start)
            owners = {r.id: r for r in self._active.values()}
        rows = [owners[st.request_id].sampler for st in plan.decode]
        device = None
        if self.device_sampling and all(x is not None and x.plain for x in rows):
            device = [(x.params, x.rng) for x in rows if x is not None]
        # requests that asked for prompt logprobs and are still being prefilled (a long
        # prompt's chunks run in later ticks than its admission)
        every = {r.id for r in owners.values()
                 if r.prompt_logprobs is not None and r.prefilled < len(r.prompt_ids)}  # fmt: skip
        result = execute(self.engine, plan, prompts, device,
                         on_prefill=lambda lg, rows: self._prefilled(plan, lg, owners, rows),
                         every_row=every)  # fmt: skip
        self._update(plan, result, owners, t_start)

    def _prefilled(
        self,
        plan: TickPlan,
        logits: np.ndarray,
        owners: dict[str, Request],
        every: dict[int, np.ndarray] | None = None,
    ) -> None:
        """Update for the prefill launch, run before the decode launch: a request whose prompt
        completed gets its first token without waiting for the others' decode. `every`: chunk
        index -> every row's logits, for requests that asked for prompt logprobs."""
        tick = plan.tick
        if plan.prefill:
            self.metrics.prefill_launches.inc()
        now = time.monotonic()
        for i, (ch, row) in enumerate(zip(plan.prefill, logits, strict=True)):
            r = owners[ch.request_id]
            if every and i in every and r.prompt_logprobs is not None:
                nxt = r.prompt_ids[r.prefilled + 1 : r.prefilled + ch.length + 1]
                r.prompt_lps += prompt_logprobs(every[i], nxt, r.prompt_logprobs)
            r.prefilled += ch.length
            assert r.record is not None
            r.record.prefill_ticks.append(tick)
            r.record.prefill_chunks.append(ch.length)
            self.metrics.prompt_tokens.inc(ch.length)
            if ch.completes:
                self._sample(r, row, tick, now)

    def _update(
        self, plan: TickPlan, result: TickResult, owners: dict[str, Request], t_start: float
    ) -> None:
        """Update for the decode launch, and the tick's measurements."""
        tick = plan.tick
        prefill_rows = sum(ch.length for ch in plan.prefill)
        now = time.monotonic()
        if result.decode_tokens is not None:  # sampled on the device (plain requests)
            for st, tok in zip(plan.decode, result.decode_tokens, strict=True):
                self._emit_token(owners[st.request_id], int(tok), tick, now)
        else:
            for st, row in zip(plan.decode, result.decode_logits, strict=True):
                self._sample(owners[st.request_id], row, tick, now)
        with self._cv:
            self._kv = self.engine.kv_usage()
        if plan.launches:
            elapsed = time.monotonic() - t_start
            self.metrics.engine_ticks.inc()
            self.metrics.tick.observe(elapsed)
            if self.admission is not None:
                self.admission.observe_tick(
                    len(plan.decode), elapsed - result.prefill_s, prefill_rows, result.prefill_s
                )
            if self.tick_log is not None:
                self.tick_log.append({
                    "tick": tick, "start_s": t_start, "dur_s": elapsed,
                    "prefill_s": result.prefill_s, "decode_rows": len(plan.decode),
                    "prefill_tokens": prefill_rows, "prefill_chunks": len(plan.prefill),
                    "admitted": len(plan.admit), "running": len(owners),
                })  # fmt: skip

    def _sample(self, r: Request, row: np.ndarray, tick: int, now: float) -> None:
        assert r.sampler is not None
        try:
            tok, lp = r.sampler.sample(row)
        except GrammarError as e:  # this request's constraint failed; the others go on
            self._finish(r, "error", "", tick, error=str(e))
            return
        self._emit_token(r, tok, tick, now, lp)

    def _refuse(self, late: list[Request], tick: int) -> None:
        """Refuse the waiting requests whose wait exceeded the admission bound (already out
        of the queue). Call with the lock held."""
        assert self.admission is not None
        bound = self.admission.max_wait_s
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

    def _emit_token(
        self, r: Request, tok: int, tick: int, now: float, lp: TokenLogprob | None = None
    ) -> None:
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
            elif r.sampler is not None and r.sampler.grammar_done:
                delta += r.text.finish()
                finish = "stop"
            elif (
                len(r.generated) >= r.max_tokens
                or len(r.prompt_ids) + len(r.generated) >= self.engine.max_context
            ):
                delta += r.text.finish()
                finish = "length"
        rec.completion_tokens = len(r.generated)
        lps = (lp,) if lp is not None else ()
        plp = None
        if r.prompt_logprobs is not None and len(r.generated) == 1:
            plp = tuple(r.prompt_lps)
        if finish is None:
            self._send(r, GenerationEvent(
                r.id, delta, (tok,), None, len(r.prompt_ids), len(r.generated), tick,
                logprobs=lps, prompt_logprobs=plp,
            ))  # fmt: skip
        else:
            self._finish(r, finish, delta, tick, (tok,), logprobs=lps, prompt_logprobs=plp)

    def _finish(
        self,
        r: Request,
        reason: str,
        delta: str,
        tick: int,
        toks: tuple[int, ...] = (),
        error: str | None = None,
        retry_after_s: int | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
        prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
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
            retry_after_s, logprobs, prompt_logprobs,
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
