"""Step (c): the performance surfaces, each measured on its own (DESIGN.md §5).

- raw: decode step time per (context, batch): a host timer around `runner.decode` (or the
  executor's own timer), after warm-up steps; `decode_step_ms` is the best (minimum) step,
  `decode_step_median_ms` the median, both with the p10/p90 of all steps;
- host: host utilisation during those steps: process CPU time / wall time (all threads;
  1.0 = one core busy);
- serving: the serving loop's per-token time against the raw steps inside it (greedy
  sampling, stop check and incremental detokenisation per token, timed around each step);
- cold_start: checkpoint load to first token (`load_checkpoint` + `Executor.open` + prefill
  + first sample, in this process);
- e2e: one request, text in to text out (tokenise, prefill, decode, detokenise) per prompt at
  batch 1.

A decode point at context L starts from a cache holding L positions of seeded random token
ids and times the following steps (L, L+1, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial

import numpy as np

from harness.compile_step import CompiledStudy
from harness.executors import Executor, Runner
from plow.checkpoint import Checkpoint, load_checkpoint

METRIC_COLUMNS = [
    "surface",
    "metric",
    "executor",
    "context",
    "batch",
    "value",
    "unit",
    "samples",
    "p10",
    "p90",
    "spread",
]


@dataclass(frozen=True, slots=True)
class Metric:
    surface: str
    metric: str
    executor: str
    context: int | None
    batch: int | None
    value: float
    unit: str
    samples: int = 1
    p10: float | None = None
    p90: float | None = None
    spread: float | None = None  # (p90 - p10) / median: the noise of this point

    def row(self) -> dict[str, object]:
        return asdict(self)


def summary(
    surface: str,
    metric: str,
    executor: str,
    context: int | None,
    batch: int | None,
    values: Sequence[float],
    unit: str,
) -> Metric:
    arr = np.asarray(values, dtype=np.float64)
    med = float(np.median(arr))
    p10, p90 = (float(x) for x in np.percentile(arr, [10, 90]))
    return Metric(
        surface,
        metric,
        executor,
        context,
        batch,
        med,
        unit,
        len(arr),
        p10,
        p90,
        (p90 - p10) / med if med else None,
    )


def _timed(runner: Runner, call: Callable[[], np.ndarray]) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter_ns()
    out = call()
    host = time.perf_counter_ns() - t0
    own = runner.last_step_ns()
    return out, (own if own is not None else host) / 1e6


def filler(vocab: int, length: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(0, vocab, size=length)]


def decode_sweep(
    open_runner: Callable[[int], Runner],
    vocab: int,
    contexts: Sequence[int],
    batches: Sequence[int],
    warmup: int,
    steps: int,
    seed: int,
    on_step: Callable[[str], None] | None = None,
) -> list[Metric]:
    """Raw decode step time and host utilisation per (context, batch). `open_runner(ctx)` gives
    the runner for context `ctx` (sized to it: the plan a step runs is the one compiled for
    that context). Every row of a batch starts from the same filler prompt (a repeated prompt
    is prefilled once where the executor shares prefixes)."""
    ex = ""
    out: list[Metric] = []
    for ctx in contexts:
        prompt = filler(vocab, ctx, seed)
        runner = open_runner(ctx)
        ex = runner.executor
        for b in batches:
            logits = runner.prefill([prompt] * b)
            if on_step:
                on_step(f"prefill context {ctx} batch {b}")
            times: list[float] = []
            cpu0 = wall0 = 0.0
            for i in range(warmup + steps):
                if i == warmup:
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                toks = [int(np.argmax(r)) for r in logits]
                logits, ms = _timed(runner, partial(runner.decode, toks))
                if i >= warmup:
                    times.append(ms)
                if on_step:
                    on_step(f"decode context {ctx} batch {b}")
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            med = summary("raw", "decode_step_median_ms", ex, ctx, b, times, "ms")
            # best of the steps: the one least disturbed by other processes on a shared machine
            out.append(replace(med, metric="decode_step_ms", value=min(times)))
            out.append(med)
            out.append(
                summary("raw", "tokens_per_s", ex, ctx, b, [b * 1e3 / t for t in times], "tok/s")
            )
            out.append(Metric("host", "cpu_time_per_wall", ex, ctx, b, cpu / wall, "cores", steps))
    for b in batches:
        first = next(
            m
            for m in out
            if m.metric == "decode_step_ms" and m.batch == b and m.context == contexts[0]
        )
        last = next(
            m
            for m in out
            if m.metric == "decode_step_ms" and m.batch == b and m.context == contexts[-1]
        )
        out.append(
            Metric(
                "raw",
                f"growth_ratio_{contexts[0]}_to_{contexts[-1]}",
                ex,
                contexts[-1],
                b,
                last.value / first.value,
                "x",
            )
        )
    return out


def serving_overhead(
    runner: Runner,
    prompt: list[int],
    n: int,
    detok: Callable[[list[int]], str],
    stop_ids: Sequence[int],
) -> list[Metric]:
    """The serving loop at batch 1: per token, greedy sampling on the host, the stop check and
    incremental detokenisation (a streamed delta), around the raw decode step."""
    ex = runner.executor
    logits = runner.prefill([prompt])
    toks: list[int] = []
    text = ""
    raw: list[float] = []
    loop: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        tok = int(np.argmax(logits[0]))
        toks.append(tok)
        _ = tok in stop_ids  # a server stops here; the study keeps going
        full = detok(toks)
        delta = full[len(text) :]
        text = full
        del delta
        logits, ms = _timed(runner, partial(runner.decode, [tok]))
        raw.append(ms)
        loop.append((time.perf_counter_ns() - t0) / 1e6)
    ctx = len(prompt)
    raw_m = summary("serving", "raw_step_ms", ex, ctx, 1, raw, "ms")
    loop_m = summary("serving", "loop_per_token_ms", ex, ctx, 1, loop, "ms")
    overhead = [(lp - r) / r * 100 for lp, r in zip(loop, raw, strict=True)]
    return [raw_m, loop_m, summary("serving", "overhead_pct", ex, ctx, 1, overhead, "%")]


def cold_start(
    executor: Executor,
    path: str,
    prompt: list[int],
    max_context: int,
    compiled: CompiledStudy | None = None,
) -> tuple[list[Metric], Checkpoint]:
    """Checkpoint load (memory-mapped) + executor open, then prefill and the first token."""
    t0 = time.perf_counter()
    ckpt = load_checkpoint(path)
    runner = executor.open(ckpt, max_batch=1, max_context=max_context, compiled=compiled)
    t1 = time.perf_counter()
    logits = runner.prefill([prompt])
    _ = int(np.argmax(logits[0]))
    t2 = time.perf_counter()
    ex = executor.name
    ctx = len(prompt)
    return [
        Metric("cold_start", "load_ms", ex, ctx, 1, (t1 - t0) * 1e3, "ms"),
        Metric("cold_start", "first_token_ms", ex, ctx, 1, (t2 - t1) * 1e3, "ms"),
        Metric("cold_start", "load_to_first_token_ms", ex, ctx, 1, (t2 - t0) * 1e3, "ms"),
    ], ckpt


def end_to_end(
    runner: Runner,
    prompts: Sequence[tuple[str | None, list[int]]],
    n: int,
    encode: Callable[[str], list[int]],
    detok: Callable[[list[int]], str],
) -> list[Metric]:
    """Per request at batch 1: text (or ids) in, `n` tokens of text out."""
    ex = runner.executor
    ttft: list[float] = []
    total: list[float] = []
    per_tok: list[float] = []
    for text, ids in prompts:
        t0 = time.perf_counter()
        prompt = encode(text) if text is not None else ids
        logits = runner.prefill([prompt])
        toks = [int(np.argmax(logits[0]))]
        t1 = time.perf_counter()
        while len(toks) < n:
            logits = runner.decode([toks[-1]])
            toks.append(int(np.argmax(logits[0])))
        _ = detok(toks)
        t2 = time.perf_counter()
        ttft.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
        per_tok.append((t2 - t1) * 1e3 / max(1, n - 1))
    return [
        summary("e2e", "time_to_first_token_ms", ex, None, 1, ttft, "ms"),
        summary("e2e", "request_ms", ex, None, 1, total, "ms"),
        summary("e2e", "inter_token_ms", ex, None, 1, per_tok, "ms"),
    ]
