"""The priced prefill: a per-launch cost regressed from a prompt-length sweep, and the chunk
size that minimises the total cost of the waiting prompts.

Model. One prefill launch over `r` padded rows (token positions, summed over the chunks it
packs) takes `t(r) = launch_s + per_row_s * r`. Dividing by `per_row_s` expresses the launch
cost in *padded-row equivalents*: `launch_rows = launch_s / per_row_s` is how many extra rows
one more launch costs. The fit is least squares on relative residuals (weights 1/t) over a
sweep of single-chunk prefills at several prompt lengths (median of a few repetitions each);
the residuals are kept and reported so a bad fit is visible.

Chunk size. With chunk size `c` (a rung of the ladder, c <= the token budget), a prompt with
`n` tokens still to prefill becomes ceil(n / c) chunks, each padded to `c` rows (a compiled
prefill bucket has a fixed row count), and one launch packs at most floor(budget / c) chunks,
at most one per request (a request's chunks run in successive launches). The launches needed
are max(max_i ceil(n_i / c), ceil(sum_i ceil(n_i / c) / floor(budget / c))), and the total
cost in rows is

    cost(c) = launches(c) * launch_rows + padded_rows(c)

and the dispatcher uses the `c` that minimises it (ties: the smaller `c`, which bounds the
time a launch holds up the decode tick of running requests).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from plow.serve.engine import Engine, PrefillChunk

FIT_FILENAME = "prefill_fit.json"
DEFAULT_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128)


class SweepPoint(BaseModel):
    rows: int
    seconds: float
    residual_s: float = 0.0


class PrefillFit(BaseModel):
    """`t(rows) = launch_s + per_row_s * rows`, with the sweep it was fitted on."""

    launch_s: float = Field(ge=0.0)
    per_row_s: float = Field(gt=0.0)
    r2: float = 1.0
    max_abs_residual_s: float = 0.0
    rel_rms_residual: float = 0.0
    engine: str = "unknown"
    model: str = ""
    points: list[SweepPoint] = Field(default_factory=list)

    @property
    def launch_rows(self) -> float:
        """The per-launch cost in padded-row equivalents."""
        return self.launch_s / self.per_row_s

    def seconds(self, rows: float, launches: float = 1.0) -> float:
        return launches * self.launch_s + rows * self.per_row_s

    def save(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> PrefillFit:
        return cls.model_validate(json.loads(path.read_text()))


def fit_prefill(
    points: Sequence[tuple[int, float]], *, engine: str = "", model: str = ""
) -> PrefillFit:
    """Relative least-squares line through (rows, seconds); intercept and slope clamped to be
    usable (launch >= 0, per-row > 0), residuals computed against the clamped line."""
    if len(points) < 2:
        raise ValueError("need at least two sweep points")
    x = np.asarray([p[0] for p in points], dtype=np.float64)
    y = np.asarray([p[1] for p in points], dtype=np.float64)
    if np.ptp(x) == 0:
        raise ValueError("sweep points need at least two distinct row counts")
    # Relative least squares (weights 1/y): a geometric sweep spans orders of magnitude, and
    # plain least squares would let the longest prompts decide the intercept alone.
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / np.maximum(y, 1e-12))
    if slope <= 0:  # noisy sweep: fall back to plain least squares, then to the end points
        slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        slope = max(
            (y[np.argmax(x)] - y[np.argmin(x)]) / np.ptp(x), float(y.max() / x.max()) * 1e-3
        )
        intercept = float(np.median(y - slope * x))
    per_row = float(slope)
    launch = max(float(intercept), 0.0)
    pred = launch + per_row * x
    res = y - pred
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((res**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    rel = float(np.sqrt(np.mean((res / np.maximum(y, 1e-12)) ** 2)))
    return PrefillFit(
        launch_s=launch,
        per_row_s=per_row,
        r2=r2,
        max_abs_residual_s=float(np.abs(res).max()),
        rel_rms_residual=rel,
        engine=engine,
        model=model,
        points=[
            SweepPoint(rows=int(a), seconds=float(b), residual_s=float(r))
            for a, b, r in zip(x, y, res, strict=True)
        ],
    )


def sweep_prefill(
    engine: Engine,
    lengths: Sequence[int] = DEFAULT_SWEEP,
    *,
    reps: int = 3,
    seed: int = 0,
    on_point: Callable[[int, float], None] | None = None,
) -> list[tuple[int, float]]:
    """Time one single-chunk prefill per (length, rep) on slot 0; median per length.

    Slot 0 must be free; it is freed again afterwards. Lengths above the engine's context are
    skipped. A warm-up launch per length runs first (graph building, caches)."""
    rng = np.random.default_rng(seed)
    out: list[tuple[int, float]] = []
    for n in lengths:
        if n > engine.max_context:
            continue
        times = []
        for r in range(reps + 1):
            ids = [int(t) for t in rng.integers(3, engine.vocab_size, size=n)]
            engine.add(0, ids)
            try:
                t0 = time.perf_counter()
                engine.prefill([PrefillChunk(0, n)])
                dt = time.perf_counter() - t0
            finally:
                engine.free(0)
            if r > 0:
                times.append(dt)
        med = statistics.median(times)
        out.append((n, med))
        if on_point is not None:
            on_point(n, med)
    return out


def fit_path(model_dir: Path) -> Path:
    return model_dir / FIT_FILENAME


def load_fit(model_dir: Path) -> PrefillFit | None:
    p = fit_path(model_dir)
    if not p.is_file():
        return None
    try:
        return PrefillFit.load(p)
    except (ValueError, OSError):
        return None


# ---------------------------------------------------------------------------------------------
# Chunk size


@dataclass(frozen=True, slots=True)
class ChunkChoice:
    chunk: int
    launches: int
    padded_rows: int
    cost_rows: float


def ladder(budget: int, smallest: int = 16) -> list[int]:
    """Chunk-size candidates: powers of two from `smallest` up to the budget, plus the budget."""
    out = []
    c = max(1, smallest)
    while c < budget:
        out.append(c)
        c *= 2
    out.append(budget)
    return sorted(set(out))


def rows_for(rungs: Sequence[tuple[int, int]], chunk: int) -> int:
    """The most chunks of up to `chunk` tokens one launch holds: the widest prefill rung
    (rows, tokens) whose tokens cover `chunk` (0 when none does)."""
    return max((r for r, t in rungs if t >= chunk), default=0)


def padded_to(rungs: Sequence[tuple[int, int]], length: int) -> int:
    """The rows a chunk of `length` tokens occupies: the smallest covering rung's tokens (the
    engine launches that one), or `length` past the largest (it splits such chunks)."""
    return min((t for _, t in rungs if t >= length), default=length)


def plan_cost(
    remaining: Sequence[int],
    chunk: int,
    budget: int,
    launch_rows: float,
    rungs: Sequence[tuple[int, int]] = (),
) -> ChunkChoice:
    """Cost in padded rows of prefilling `remaining` tokens per request with chunk size
    `chunk`. `rungs` ((rows, tokens) of the engine's prefill rungs): a launch holds at most
    the rows of a rung covering `chunk`, and a prompt's last, shorter chunk is padded to the
    smallest rung that covers it (the one the engine runs), not to `chunk`."""
    per_launch = max(1, budget // chunk)
    if rungs:
        per_launch = min(per_launch, max(1, rows_for(rungs, chunk)))
    per_request = [math.ceil(n / chunk) for n in remaining if n > 0]
    chunks = sum(per_request)
    # a request's chunks run in successive launches (each attends to the one before), and a
    # launch holds at most `per_launch` chunks
    launches = max(max(per_request, default=0), math.ceil(chunks / per_launch))
    if rungs:
        padded = sum(
            (n // chunk) * padded_to(rungs, chunk)
            + (padded_to(rungs, n % chunk) if n % chunk else 0)
            for n in remaining
            if n > 0
        )
    else:
        padded = chunks * chunk
    return ChunkChoice(chunk, launches, padded, launches * launch_rows + padded)


def choose_chunk_size(
    remaining: Sequence[int],
    budget: int,
    launch_rows: float,
    candidates: Sequence[int] | None = None,
    rungs: Sequence[tuple[int, int]] = (),
) -> ChunkChoice:
    """The candidate chunk size with the least total cost (ties: the smaller chunk).
    `rungs`: see `plan_cost`."""
    if budget < 1:
        raise ValueError("token budget must be at least 1")
    cands = [c for c in (candidates or ladder(budget)) if 1 <= c <= budget] or [budget]
    best: ChunkChoice | None = None
    for c in sorted(cands):
        choice = plan_cost(remaining, c, budget, launch_rows, rungs)
        if best is None or choice.cost_rows < best.cost_rows - 1e-9:
            best = choice
    assert best is not None
    return best
