"""`execute(engine, plan)`: one `TickPlan` on an engine of any executor, logits out.

The only code that calls the engine during serving. In the plan's order: free the released
slots, bind the admitted requests to their slots, one prefill launch over the plan's chunks,
one decode launch over its steps. It knows no request beyond its slot and prompt: the
dispatcher's update turns the logits into tokens (`plow.serve.sampling`).

One exception keeps the fast path of plain requests: when the caller passes `device_sampling`
(each decode row's params and generator; it does so when no row of the launch needs logprobs,
penalties or a grammar) and the engine can sample on the device
(`plow.runtime.engine.SamplingEngine`), the decode launch samples in its step epilogue
(greedy fused into the lm_head reduction) and returns token ids, and no logits row is read.

Prompt logprobs: the requests in `every_row` (their ids) are bound without the prefix cache
and prefilled through `PromptLogitsEngine.prefill_all`, which also returns the logits of
every position of their chunks (the rows the prefill rung's lm_head computes anyway).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np

from plow.runtime.engine import Engine, PrefillChunk, SamplingEngine
from plow.runtime.sampler import SamplingParams
from plow.serve.scheduler import TickPlan


class PromptLogitsEngine(Protocol):
    """An engine that can return the logits of every prompt position (`CpuEngine`: the
    native, cpu and cuda executors). `add(..., reuse_prefix=False)` prefills every position
    (the prefix cache would skip some); `prefill_all(chunks, every_row)` is `prefill` plus,
    per chunk index in `every_row`, its rows' logits [length, V]."""

    def add(self, slot: int, prompt_ids: Sequence[int], *, reuse_prefix: bool = True) -> None: ...

    def prefill_all(
        self, chunks: Sequence[PrefillChunk], every_row: Sequence[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]: ...


def gives_prompt_logits(engine: object) -> bool:
    """Whether `engine` implements `PromptLogitsEngine` (by its method)."""
    return callable(getattr(engine, "prefill_all", None))


@dataclass(frozen=True, slots=True)
class TickResult:
    """Logits rows aligned with `plan.prefill` (each chunk's last token) and `plan.decode`
    (or, sampled on the device, `decode_tokens` instead), and the seconds each launch took."""

    prefill_logits: np.ndarray
    decode_logits: np.ndarray
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: np.ndarray | None = None
    prefill_rows: dict[int, np.ndarray] | None = None  # chunk index -> every row's logits


def execute(
    engine: Engine,
    plan: TickPlan,
    prompts: Mapping[str, Sequence[int]],
    device_sampling: Sequence[tuple[SamplingParams, np.random.Generator | None]] | None = None,
    on_prefill: Callable[[np.ndarray, dict[int, np.ndarray]], None] | None = None,
    every_row: Set[str] = frozenset(),
) -> TickResult:
    """Run `plan` (`prompts`: the admitted requests' prompt ids, by request id;
    `device_sampling` and `every_row`: see the module docstring). `on_prefill(logits, rows)`
    runs between the two launches, so the caller can emit first tokens before the decode
    launch (`rows`: chunk index -> every row's logits, for the chunks of `every_row`)."""
    for r in plan.release:
        engine.free(r.slot)
    for a in plan.admit:
        if a.request_id in every_row:
            cast(PromptLogitsEngine, engine).add(
                a.slot, prompts[a.request_id], reuse_prefix=False
            )
        else:
            engine.add(a.slot, prompts[a.request_id])
    empty = np.zeros((0, engine.vocab_size), np.float32)
    prefill, decode = empty, empty
    rows: dict[int, np.ndarray] = {}
    prefill_s = decode_s = 0.0
    if plan.prefill:
        t0 = time.monotonic()
        chunks = [PrefillChunk(c.slot, c.length) for c in plan.prefill]
        want = [i for i, c in enumerate(plan.prefill) if c.request_id in every_row]
        if want:
            prefill, rows = cast(PromptLogitsEngine, engine).prefill_all(chunks, want)
        else:
            prefill = engine.prefill(chunks)
        prefill_s = time.monotonic() - t0
        if on_prefill is not None:
            on_prefill(prefill, rows)
    sampled = None
    if plan.decode:
        slots, toks = [s.slot for s in plan.decode], [s.token for s in plan.decode]
        t0 = time.monotonic()
        # `SamplingEngine` by its method (an isinstance check of the protocol reads every
        # member, on every tick)
        sample_on_device = getattr(engine, "decode_sampled", None)
        if device_sampling is not None and sample_on_device is not None:
            sampled = cast(SamplingEngine, engine).decode_sampled(
                slots, toks, [p for p, _ in device_sampling], [g for _, g in device_sampling]
            )
        else:
            decode = engine.decode(slots, toks)
        decode_s = time.monotonic() - t0
    return TickResult(prefill, decode, prefill_s, decode_s, sampled, rows or None)
