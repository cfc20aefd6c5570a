"""The serving-overhead surface through the real serving loop: `plow.serve`'s dispatcher
driving the executor's `Engine`, against the time the engine's own calls took.

Each request is submitted alone (batch 1, greedy, end-of-sequence ignored) and timed from
submission to its last event; the engine is wrapped so every `prefill`/`decode` call (and
`decode_sampled`, the device-sampled decode plain requests take) is timed.
Overhead = (request wall time - time inside engine calls) / time inside engine calls: the
dispatcher's ticks, sampling, detokenisation, event delivery and thread hand-offs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.measure import Metric, summary


@dataclass
class TimedEngine:
    """Delegates the `plow.serve.engine.Engine` protocol, summing the time of each call."""

    inner: Any
    busy_ns: int = 0
    calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def max_batch(self) -> int:
        return int(self.inner.max_batch)

    @property
    def max_context(self) -> int:
        return int(self.inner.max_context)

    @property
    def vocab_size(self) -> int:
        return int(self.inner.vocab_size)

    @property
    def kind(self) -> str:
        return str(self.inner.kind)

    def add(self, slot: int, prompt_ids: Sequence[int]) -> None:
        self.inner.add(slot, prompt_ids)

    def _timed(self, fn: Callable[[], np.ndarray]) -> np.ndarray:
        t0 = time.perf_counter_ns()
        out = fn()
        with self._lock:
            self.busy_ns += time.perf_counter_ns() - t0
            self.calls += 1
        return out

    def prefill(self, chunks: Sequence[Any]) -> np.ndarray:
        return self._timed(lambda: self.inner.prefill(chunks))

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        return self._timed(lambda: self.inner.decode(slots, tokens))

    def free(self, slot: int) -> None:
        self.inner.free(slot)

    def kv_usage(self) -> Any:
        return self.inner.kv_usage()


@dataclass
class TimedSamplingEngine(TimedEngine):
    """`TimedEngine` of an engine that samples on the device (`SamplingEngine`): the
    dispatcher's plain decode launches go through `decode_sampled`, timed the same way."""

    def decode_sampled(
        self,
        slots: Sequence[int],
        tokens: Sequence[int],
        params: Sequence[Any],
        rngs: Sequence[Any],
    ) -> np.ndarray:
        return self._timed(lambda: self.inner.decode_sampled(slots, tokens, params, rngs))


def timed(engine: Any) -> TimedEngine:
    """The timing wrapper that keeps what `engine` can do (device sampling or not)."""
    from plow.runtime.engine import SamplingEngine

    return TimedSamplingEngine(engine) if isinstance(engine, SamplingEngine) else TimedEngine(
        engine
    )


def dispatcher_overhead(
    engine: Any,
    prompts: Sequence[list[int]],
    n: int,
    decode_text: Callable[[list[int]], str],
    executor: str,
    timeout_s: float = 600.0,
) -> list[Metric]:
    from plow.runtime.sampler import SamplingParams
    from plow.serve.dispatcher import Dispatcher, GenerationEvent, Request
    from plow.serve.prefill_cost import PrefillFit

    timer = timed(engine)
    disp = Dispatcher(
        "harness", timer, decode_text, eos_token_ids=(),
        max_num_batched_tokens=max(512, max(len(p) for p in prompts) + 1),
        prefill_fit=PrefillFit(launch_s=1e-3, per_row_s=1e-4, engine=executor),
    )  # fmt: skip
    disp.start()
    walls: list[float] = []
    busy: list[float] = []
    try:
        for i, ids in enumerate(prompts):
            done = threading.Event()

            def sink(ev: GenerationEvent, done: threading.Event = done) -> None:
                if ev.finish_reason is not None:
                    done.set()

            b0 = timer.busy_ns
            t0 = time.perf_counter_ns()
            disp.submit(Request(f"h{i}", list(ids), SamplingParams(), n, sink), check=False)
            if not done.wait(timeout_s):
                raise TimeoutError(f"dispatcher request {i} did not finish in {timeout_s:g} s")
            walls.append((time.perf_counter_ns() - t0) / 1e6)
            busy.append((timer.busy_ns - b0) / 1e6)
    finally:
        disp.stop()
    over = [(w - b) / b * 100 for w, b in zip(walls, busy, strict=True)]
    return [
        summary("serving", "dispatcher_request_ms", executor, None, 1, walls, "ms"),
        summary("serving", "engine_calls_ms", executor, None, 1, busy, "ms"),
        summary("serving", "dispatcher_overhead_pct", executor, None, 1, over, "%"),
    ]
