"""Prepare every rung of an engine before serving: load its plan, bind it to the executor
and run one warm launch, so no request pays for a rung's first use.

A bundle engine loads a rung's plan from the bundle's files on the first launch that selects
it (about 2 s for SmolLM2-135M's prefill rungs on the shared 2-core machine), and the native
executor lowers and binds it to the C++ kernel on that launch; the first launch also touches
the rung's weights and arena pages. `prepare_rungs` does all of that at server start, through
the engine protocol alone (`add` / `prefill` / `decode_sampled` or `decode` / `free` on scratch
slots, random prompt ids, every slot free before and after), one launch per rung of the
engine's `RungEngine.rungs()`. An engine without rungs (the reference engine) has nothing to
prepare.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from plow.runtime.engine import Engine, PrefillChunk, Rung, RungEngine
from plow.runtime.sampler import SamplingParams


@dataclass(frozen=True, slots=True)
class Prepared:
    rung: Rung
    seconds: float

    @property
    def label(self) -> str:
        r = self.rung
        return f"{r.phase} {r.rows}x{r.tokens}" if r.phase == "prefill" else f"decode {r.rows}"


def engine_rungs(engine: Engine) -> tuple[Rung, ...]:
    """The engine's rungs (`RungEngine.rungs`), or () for an engine without compiled rungs."""
    get = getattr(engine, "rungs", None)
    return tuple(get()) if callable(get) else ()


def prepare_rungs(
    engine: Engine,
    on_rung: Callable[[int, int, Prepared], None] | None = None,
    *,
    seed: int = 0,
) -> list[Prepared]:
    """One warm launch per rung, prefill rungs first (decode warm-ups prefill one token, on
    the smallest prefill rung, already prepared). `on_rung(i, n, prepared)` after each."""
    rungs = engine_rungs(engine)
    order = [r for r in rungs if r.phase == "prefill"] + [r for r in rungs if r.phase != "prefill"]
    rng = np.random.default_rng(seed)
    out: list[Prepared] = []

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, engine.vocab_size, size=n)]

    for i, rung in enumerate(order):
        t0 = time.perf_counter()
        slots = list(range(rung.rows))
        try:
            if rung.phase == "prefill":
                for s in slots:
                    engine.add(s, ids(rung.tokens))
                engine.prefill([PrefillChunk(s, rung.tokens) for s in slots])
            else:
                for s in slots:
                    engine.add(s, ids(1))
                engine.prefill([PrefillChunk(s, 1) for s in slots])
                if isinstance(engine, RungEngine) and callable(
                    getattr(engine, "decode_sampled", None)
                ):
                    engine.decode_sampled(  # type: ignore[attr-defined]
                        slots, [3] * len(slots), [SamplingParams()] * len(slots),
                        [None] * len(slots),
                    )  # fmt: skip
                else:
                    engine.decode(slots, [3] * len(slots))
        finally:
            for s in slots:
                engine.free(s)
        done = Prepared(rung, time.perf_counter() - t0)
        out.append(done)
        if on_rung is not None:
            on_rung(i, len(order), done)
    return out
