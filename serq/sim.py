"""Run a compiled serQ model: seeded random streams, the simulation, and its statistics."""

from __future__ import annotations

import bisect
import math
import time
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from serq import pretty
from serq.checker import check
from serq.compile import Fault, Limits, Model, build
from serq.errors import SerqError
from serq.parser import parse, parse_file

BLOCK = 4096
TRACE_LEN = 4
#: Backlog samples per run, at evenly spaced times.
SAMPLES = 20
DEFAULT_LIMITS = Limits()


def _stream(draw: Callable[[int], list[float]], first: int = BLOCK) -> Callable[[], float]:
    """A fast ``next()`` over an endless sequence of blocks of numbers: ``draw(first)``, then
    ``draw(BLOCK)`` again and again (a generator's numbers do not depend on how they are
    blocked, so neither does the sequence)."""
    blocks = chain([first], iter(lambda: BLOCK, None))
    it = chain.from_iterable(map(draw, blocks))
    return partial(next, it)


def _pct(values: list[float] | list[int] | np.ndarray) -> dict[str, float | int]:
    """Count, mean, the 50th, 90th and 99th percentiles and the maximum of ``values``.

    The percentiles are ``np.percentile``'s (its default, linear method) bit for bit, taken
    from one sorted copy with its interpolation (as :func:`_pct_counts` does): about a fifth
    of its time for a few thousand values (``tests/serq/test_sim_stats.py``).
    """
    if len(values) == 0:
        return {"count": 0}
    # a list of floats converts fastest through array('d'); same values as np.asarray
    a = np.frombuffer(array("d", values)) if isinstance(values, list) else values
    a = np.asarray(a, dtype=float)
    srt = np.sort(a)
    n = int(srt.size)
    out: dict[str, float | int] = {"count": n, "mean": float(a.mean())}
    for name, q in zip(("p50", "p90", "p99"), _QS, strict=True):
        v = (n - 1) * q
        if v >= n - 1:
            out[name] = float(srt[n - 1])
            continue
        i = math.floor(v)
        g = v - i
        lo, hi = float(srt[i]), float(srt[i + 1])
        d = hi - lo
        out[name] = hi - d * (1 - g) if g >= 0.5 else lo + d * g
    out["max"] = float(srt[n - 1])
    return out


#: ``np.percentile``'s ``q / 100`` for the 50th, 90th and 99th percentiles
_QS = (50 / 100, 90 / 100, 99 / 100)


def _pct_counts(counts: Mapping[int, int], dtype: type) -> dict[str, float | int]:
    """``_pct`` of the sorted array holding each key of ``counts`` as many times as its count,
    without building it: the same numbers, bit for bit (``tests/serq/test_sim_stats.py``).

    ``np.percentile``'s default method takes the order statistics at ``floor(v)`` and
    ``floor(v) + 1`` for ``v = (n - 1) * q`` and interpolates them as its ``_lerp`` does
    (``a + (b - a) * g``, or ``b - (b - a) * (1 - g)`` when ``g >= 0.5``); the mean of integers
    whose sum is below 2**53 is that exact sum over ``n``, as numpy's float sum is exact there.
    Counts whose weighted sum is larger take the array path.
    """
    keys = sorted(counts)
    n = 0
    total = 0
    ends: list[int] = []  # ends[j]: the number of values <= keys[j]
    for k in keys:
        c = counts[k]
        n += c
        total += k * c
        ends.append(n)
    if n == 0:
        return {"count": 0}
    if not all(type(k) is int and k >= 0 for k in keys) or total >= 2**53:
        return _pct(_repeat(dict(counts), dtype))

    def at(i: int) -> int:
        return keys[bisect.bisect_right(ends, i)]

    out: dict[str, float | int] = {"count": n, "mean": total / n}
    for name, q in zip(("p50", "p90", "p99"), _QS, strict=True):
        v = (n - 1) * q
        if v >= n - 1:
            out[name] = float(keys[-1])
            continue
        i = math.floor(v)
        g = v - i
        a, b = at(i), at(i + 1)
        d = b - a
        out[name] = float(b - d * (1 - g)) if g >= 0.5 else float(a + d * g)
    out["max"] = float(keys[-1])
    return out


def _repeat(counts: dict[int, int], dtype: type) -> np.ndarray:
    """The sorted array holding each key of ``counts`` as many times as its count."""
    keys = sorted(counts)
    values: np.ndarray = np.array(keys, dtype=dtype)
    return np.repeat(values, np.array([counts[k] for k in keys], dtype=np.int64))


_BINS = [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 127), (128, 255)]


def _histogram(counts: Mapping[int, int]) -> list[dict[str, Any]]:
    """Iterations per batch-size bin, from the number of iterations of each batch size."""
    total = sum(counts.values())
    if not total:
        return []
    out: list[dict[str, Any]] = []
    top = max(counts)
    bins = list(_BINS)
    lo = 256
    while lo <= top:
        bins.append((lo, 2 * lo - 1))
        lo *= 2
    for lo_, hi in bins:
        n = sum(c for size, c in counts.items() if lo_ <= size <= hi)
        if n:
            label = str(lo_) if lo_ == hi else f"{lo_}-{hi}"
            out.append({"requests": label, "iterations": n, "fraction": n / total})
    return out


@dataclass(slots=True)
class ClaimResult:
    name: str
    kind: str
    given: str | None
    status: str  # "holds" | "fails" | "not applicable"
    iterations: int
    counterexample: dict[str, Any] | None = None
    given_failure: dict[str, Any] | None = None

    def result_text(self) -> str:
        if self.status == "holds":
            return f"holds ({self.iterations} iterations)"
        if self.status == "fails":
            assert self.counterexample is not None
            ce = self.counterexample
            return f"fails at iteration {ce['iteration']} (t = {ce['time_us']:g} µs)"
        assert self.given_failure is not None
        gf = self.given_failure
        return f"not applicable (request {gf['request']} breaks 'given')"


@dataclass(slots=True)
class RunResult:
    file: str
    seed: int
    horizon_us: float
    warmup_us: float
    params: dict[str, float]
    claims: list[ClaimResult]
    stats: dict[str, Any]
    wall_s: float
    end_time_us: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.status != "fails" for c in self.claims)

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "seed": self.seed,
            "horizon_us": self.horizon_us,
            "warmup_us": self.warmup_us,
            "params": self.params,
            "claims": [
                {
                    "claim": c.name,
                    "kind": c.kind,
                    "given": c.given,
                    "status": c.status,
                    "result": c.result_text(),
                    "iterations": c.iterations,
                    "counterexample": c.counterexample,
                    "given_failure": c.given_failure,
                }
                for c in self.claims
            ],
            "stats": self.stats,
            "wall_s": self.wall_s,
            "ok": self.ok,
        }


_TRACE_KEYS = (
    "iteration",
    "now",
    "served",
    "tokens",
    "batch_requests",
    "decoders",
    "residents",
    "waiting",
    "mode",
)


def _state(row: tuple[Any, ...]) -> dict[str, Any]:
    d = dict(zip(_TRACE_KEYS, row, strict=True))
    m = d["mode"]
    d["mode"] = "decoding" if m is True else "!decoding" if m is False else "any"
    return d


def streams(
    seed: int, rate: float, expected: float = BLOCK
) -> tuple[Callable[[], float], Callable[[], float], Callable[[], float]]:
    """The three random streams of a run: inter-arrival times, uniform and exponential draws.

    ``rate`` scales the inter-arrival times (a rate of 0, or one so small that its mean gap
    overflows, brings no arrival; the stream is then never read). ``expected`` (the expected
    number of arrivals) sizes the first block of each stream, so that a short run does not
    draw and convert a whole block it will not read; the numbers are the same.
    """
    ss = np.random.SeedSequence(seed)
    g_arr, g_u, g_x = (np.random.Generator(np.random.PCG64(s)) for s in ss.spawn(3))
    inv = 1.0 / rate if rate > 0 else 0.0
    if not math.isfinite(inv):
        inv = 0.0

    def arr_block(n: int) -> list[float]:
        out: list[float] = (g_arr.standard_exponential(n) * inv).tolist()
        return out

    def u_block(n: int) -> list[float]:
        out: list[float] = g_u.random(n).tolist()
        return out

    def x_block(n: int) -> list[float]:
        out: list[float] = g_x.standard_exponential(n).tolist()
        return out

    # Poisson: the count exceeds its mean by more than 4 standard deviations (+ 64) rarely
    first = BLOCK
    if expected < BLOCK:
        first = min(BLOCK, int(expected + 4 * math.sqrt(expected)) + 64)
    return _stream(arr_block, first), _stream(u_block, first), _stream(x_block, first)


def _call(
    model: Model,
    horizon: float,
    warmup: float,
    seed: int,
    sample_times: list[float],
    obs: dict[str, list[float]],
    trace: bool,
    limits: Limits,
) -> dict[str, Any]:
    ia, u, x = streams(seed, model.rate, model.rate * horizon)
    try:
        return model.simulate(
            float(horizon),
            float(warmup),
            ia,
            u,
            x,
            sample_times,
            TRACE_LEN + 1,
            obs,
            trace,
            limits.iterations,
            limits.arrivals,
        )
    except (Fault, ZeroDivisionError, OverflowError, ValueError) as err:
        raise model.runtime_error(err).attach(model.filename, model.text or "") from None


def check_run(
    model: Model, horizon: float, warmup: float, seed: int, limits: Limits
) -> list[float]:
    """Check a run's settings; return the backlog sample times (and ``inf`` after them)."""
    if not (horizon > 0 and math.isfinite(horizon)):
        raise SerqError(f"--horizon must be a positive number of µs, got {horizon}")
    if not (0 <= warmup < horizon):
        raise SerqError(f"--warmup must be in [0, horizon), got {warmup}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SerqError(f"--seed must be an integer >= 0, got {seed}")
    for name, v in (("iterations", limits.iterations), ("arrivals", limits.arrivals)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SerqError(f"--max-{name} must be an integer >= 1, got {v}")
    if model.rate * horizon > limits.arrivals:
        raise SerqError(
            f"about {model.rate * horizon:.3g} arrivals expected; a run takes at most "
            f"{limits.arrivals} (lower the rate or the horizon, or raise --max-arrivals)",
            model.rate_loc,
        ).attach(model.filename, model.text or "")
    return [horizon * (i + 1) / SAMPLES for i in range(SAMPLES)] + [math.inf]


def _check_observed(model: Model, obs: Mapping[str, list[float]]) -> None:
    """Every ``observe``d value is finite (else the statistics would be NaN or inf)."""
    for i, name in enumerate(model.observe_names):
        values = np.asarray(obs[name], dtype=float)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            loc = model.observe_locs[i] if i < len(model.observe_locs) else None
            raise SerqError(
                f"observe '{name}' gave a non-finite value {values[bad[0]]}", loc
            ).attach(model.filename, model.text or "")


def simulate(
    model: Model,
    horizon: float = 10_000_000.0,
    warmup: float = 0.0,
    seed: int = 0,
    limits: Limits = DEFAULT_LIMITS,
) -> RunResult:
    """Simulate ``model`` for ``horizon`` µs; statistics skip requests before ``warmup``.

    More iterations or arrivals than ``limits`` allow is an error (a model whose clock barely
    advances would otherwise run for ever, and one flooded with arrivals fill the memory).
    """
    sample_times = check_run(model, horizon, warmup, seed, limits)
    obs: dict[str, list[float]] = {n: [] for n in model.observe_names}
    t0 = time.perf_counter()
    raw = _call(model, horizon, warmup, seed, sample_times, obs, False, limits)
    wall = time.perf_counter() - t0
    _check_observed(model, obs)
    if any(v is not None for v, _ in raw["claims"]):
        # replay the same seed, recording the trace prefix of each violation
        traced = _call(
            model,
            horizon,
            warmup,
            seed,
            sample_times,
            {n: [] for n in model.observe_names},
            True,
            limits,
        )
        raw["claims"] = traced["claims"]

    claims: list[ClaimResult] = []
    for spec, (viol, gfail) in zip(model.claims, raw["claims"], strict=True):
        given = pretty.expr(spec.claim.given) if spec.claim.given is not None else None
        cr = ClaimResult(spec.name, "every iteration", given, "holds", raw["iterations"])
        if gfail is not None:
            cr.status = "not applicable"
            cr.given_failure = {"request": gfail[0], "time_us": gfail[1]}
        elif viol is not None:
            it, now, trace = viol
            cr.status = "fails"
            cr.counterexample = {
                "iteration": it,
                "time_us": now,
                "claim": pretty.expr(spec.claim.body),
                "trace": [_state(row) for row in trace],
            }
        claims.append(cr)

    # batches after warm-up, counted by (requests, tokens): the statistics below depend only on
    # the multiset of sizes, built here sorted (which makes the percentiles cheap)
    by_req: dict[int, int] = {}
    by_tok: dict[int, int] = {}
    tokens_w = 0
    for (nr, nt), n in raw["batches"].items():
        by_req[nr] = by_req.get(nr, 0) + n
        by_tok[nt] = by_tok.get(nt, 0) + n
        tokens_w += nt * n
    window_s = (horizon - warmup) / 1e6
    arrivals = raw["arrivals"]
    stats: dict[str, Any] = {
        "iterations": raw["iterations"],
        "iterations_after_warmup": sum(by_req.values()),
        "arrivals": arrivals,
        "completions": raw["completions"],
        "completion_fraction": raw["completions"] / arrivals if arrivals else None,
        "in_system_at_end": raw["residents"],
        "waiting_at_end": raw["waiting"],
        "decoding_at_end": raw["decoders"],
        "tokens_served": raw["served"],
        "throughput": {
            "requests_per_s": raw["completions_w"] / window_s,
            "tokens_per_s": tokens_w / window_s,
        },
        "ttft_us": _pct(raw["ttft"]),
        "tbt_us": _pct(raw["tbt"]),
        "response_us": _pct(raw["resp"]),
        "observe": {n: _pct(v) for n, v in obs.items()},
        "batch": {
            "requests": _pct_counts(by_req, np.int64),
            "tokens": _pct_counts(by_tok, np.float64),
            "histogram": _histogram(by_req),
        },
        "backlog": [
            {"t_us": t, "residents": r, "waiting": w, "decoding": d}
            for (t, r, w, d) in raw["samples"]
        ],
        "sim_iterations_per_s": raw["iterations"] / wall if wall > 0 else None,
    }
    return RunResult(
        file=model.filename,
        seed=seed,
        horizon_us=float(horizon),
        warmup_us=float(warmup),
        params={k: float(v) for k, v in model.params.items()},
        claims=claims,
        stats=stats,
        wall_s=wall,
        end_time_us=raw["now"],
    )


def load(
    path: str | Path | None = None,
    text: str | None = None,
    overrides: Mapping[str, float] | None = None,
    filename: str | None = None,
    fast: bool = True,
) -> Model:
    """Parse, check and compile a program from a file or from source text.

    ``fast=False`` compiles the plain loop without runs of identical iterations (the same
    results, more slowly; the tests compare the two).
    """
    if text is None:
        if path is None:
            raise ValueError("load() needs a path or a text")
        program, text = parse_file(path)
        name = str(path)
    else:
        name = filename or (str(path) if path is not None else "<input>")
        program = parse(text, name)
    info = check(program, name, text)
    try:
        model = build(program, info, overrides, name, fast=fast)
    except SerqError as err:
        raise err.attach(name, text) from None
    model.text = text
    return model


def run_file(
    path: str | Path,
    horizon: float = 10_000_000.0,
    warmup: float = 0.0,
    seed: int = 0,
    overrides: Mapping[str, float] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> RunResult:
    """Load and simulate a program file."""
    model = load(path, overrides=overrides)
    try:
        return simulate(model, horizon, warmup, seed, limits)
    except SerqError as err:
        raise err.attach(str(path), model.text or "") from None
