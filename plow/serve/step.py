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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from plow.runtime.engine import Engine, PrefillChunk, SamplingEngine
from plow.runtime.sampler import SamplingParams
from plow.serve.scheduler import TickPlan


@dataclass(frozen=True, slots=True)
class TickResult:
    """Logits rows aligned with `plan.prefill` (each chunk's last token) and `plan.decode`
    (or, sampled on the device, `decode_tokens` instead), and the seconds each launch took."""

    prefill_logits: np.ndarray
    decode_logits: np.ndarray
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: np.ndarray | None = None


def execute(
    engine: Engine,
    plan: TickPlan,
    prompts: Mapping[str, Sequence[int]],
    device_sampling: Sequence[tuple[SamplingParams, np.random.Generator | None]] | None = None,
    on_prefill: Callable[[np.ndarray], None] | None = None,
) -> TickResult:
    """Run `plan` (`prompts`: the admitted requests' prompt ids, by request id;
    `device_sampling`: see the module docstring). `on_prefill(logits)` runs between the two
    launches, so the caller can emit first tokens before the decode launch."""
    for r in plan.release:
        engine.free(r.slot)
    for a in plan.admit:
        engine.add(a.slot, prompts[a.request_id])
    empty = np.zeros((0, engine.vocab_size), np.float32)
    prefill, decode = empty, empty
    prefill_s = decode_s = 0.0
    if plan.prefill:
        t0 = time.monotonic()
        prefill = engine.prefill([PrefillChunk(c.slot, c.length) for c in plan.prefill])
        prefill_s = time.monotonic() - t0
        if on_prefill is not None:
            on_prefill(prefill)
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
    return TickResult(prefill, decode, prefill_s, decode_s, sampled)
