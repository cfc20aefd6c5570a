"""`execute(engine, plan)`: one `TickPlan` on an engine of any executor, logits out.

The only code that calls the engine during serving. In the plan's order: free the released
slots, bind the admitted requests to their slots, one prefill launch over the plan's chunks,
one decode launch over its steps. It samples nothing and knows no request beyond its slot and
prompt: the dispatcher's update turns the logits into tokens (`plow.serve.sampling`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from plow.runtime.engine import Engine, PrefillChunk
from plow.serve.scheduler import TickPlan


@dataclass(frozen=True, slots=True)
class TickResult:
    """Logits rows aligned with `plan.prefill` (each chunk's last token) and `plan.decode`,
    and the seconds each launch took."""

    prefill_logits: np.ndarray
    decode_logits: np.ndarray
    prefill_s: float = 0.0
    decode_s: float = 0.0


def execute(engine: Engine, plan: TickPlan, prompts: Mapping[str, Sequence[int]]) -> TickResult:
    """Run `plan` (`prompts`: the admitted requests' prompt ids, by request id)."""
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
    if plan.decode:
        t0 = time.monotonic()
        decode = engine.decode([s.slot for s in plan.decode], [s.token for s in plan.decode])
        decode_s = time.monotonic() - t0
    return TickResult(prefill, decode, prefill_s, decode_s)
