"""``serq sweep``: one program over a grid of ``--set`` values × seeds, as Ray tasks or processes.

Every grid point × seed is one ordinary run (``serq.sim.load`` + ``serq.sim.simulate``, exactly
what ``serq run --set ... --seed ...`` does), so a sweep's numbers are those of the same runs made
one by one. The runs go to a Ray cluster (``--ray ADDRESS``: Ray schedules the tasks, plow
manages no cluster) or to local worker processes. The results are written as two CSV files (one
row per run; one row per point, aggregated over the seeds) and a plot.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serq.compile import Limits
from serq.errors import SerqError
from serq.sim import RunResult, check_run, load, simulate

#: At most this many runs in one sweep (a typo in a range should not start a million runs).
MAX_RUNS = 100_000
#: Latency statistics written per run: (column prefix, key of RunResult.stats).
LATENCIES = (("ttft", "ttft_us"), ("tbt", "tbt_us"), ("response", "response_us"))
PERCENTILES = ("p50", "p90", "p99", "max")
RUNS_CSV, POINTS_CSV, PLOT = "sweep.csv", "sweep_points.csv", "sweep.png"


# ----------------------------------------------------------------------------- the grid


def _number(name: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise SerqError(f"--set {name}: {text!r} is not a number") from None
    if not math.isfinite(v):
        raise SerqError(f"--set {name}: {text!r} is not a finite number")
    return v


def _is_int(text: str) -> bool:
    t = text.strip().lstrip("+-")
    return t.isdigit()


def parse_range(item: str) -> tuple[str, list[float]]:
    """``NAME=LO:HI:N`` (N evenly spaced values, both ends included), ``NAME=A,B,...`` or
    ``NAME=V``: the parameter name and its values."""
    name, sep, spec = item.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise SerqError(f"--set expects NAME=LO:HI:N, NAME=A,B,... or NAME=VALUE, got {item!r}")
    spec = spec.strip()
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) != 3:
            raise SerqError(f"--set {name}: a range is LO:HI:N, got {spec!r}")
        lo, hi = _number(name, parts[0]), _number(name, parts[1])
        if not _is_int(parts[2]) or int(parts[2]) < 1:
            raise SerqError(
                f"--set {name}: the number of points must be an integer >= 1, got {parts[2]!r}"
            )
        n = int(parts[2])
        if n == 1 and lo != hi:
            raise SerqError(f"--set {name}: one point needs LO == HI, got {spec!r}")
        if hi < lo:
            raise SerqError(f"--set {name}: the range {spec!r} runs backwards (HI < LO)")
        values = [float(v) for v in np.linspace(lo, hi, n)]
        if _is_int(parts[0]) and _is_int(parts[1]) and all(v.is_integer() for v in values):
            values = [int(v) for v in values]
        return name, values
    texts = [t.strip() for t in spec.split(",")]
    if not spec or any(not t for t in texts):
        raise SerqError(f"--set {name}: no value in {spec!r}")
    return name, [int(t) if _is_int(t) else _number(name, t) for t in texts]


def parse_seeds(spec: str) -> list[int]:
    """``A..B`` (inclusive), ``A,B,...`` or ``A``: the seeds, each an integer >= 0."""
    spec = spec.strip()
    if ".." in spec:
        a, _, b = spec.partition("..")
        if not (a.strip().isdigit() and b.strip().isdigit()):
            raise SerqError(f"--seeds: a range is A..B with integers A <= B >= 0, got {spec!r}")
        lo, hi = int(a), int(b)
        if hi < lo:
            raise SerqError(f"--seeds: the range {spec!r} runs backwards (B < A)")
        return list(range(lo, hi + 1))
    texts = [t.strip() for t in spec.split(",")]
    if not spec or not all(t.isdigit() for t in texts):
        raise SerqError(f"--seeds expects A..B, A,B,... or A (integers >= 0), got {spec!r}")
    seeds = [int(t) for t in texts]
    if len(set(seeds)) != len(seeds):
        raise SerqError(f"--seeds: {spec!r} names a seed twice")
    return seeds


def grid(ranges: Sequence[tuple[str, list[float]]]) -> list[dict[str, float]]:
    """Every combination of the ranges' values, the first range varying slowest."""
    names = [n for n, _ in ranges]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise SerqError(f"--set {dup} is given twice")
    return [
        dict(zip(names, combo, strict=True))
        for combo in itertools.product(*(vals for _, vals in ranges))
    ]


# ----------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Task:
    """One run of a sweep: everything a worker needs, with the program's text (not its path,
    which another node of a cluster may not have)."""

    point: int
    params: dict[str, float]
    seed: int
    text: str
    filename: str
    horizon: float
    warmup: float
    iterations: int
    arrivals: int


def row(result: RunResult) -> dict[str, Any]:
    """The CSV row of one run: throughput, latency percentiles (µs) and claim verdicts."""
    s = result.stats
    out: dict[str, Any] = {
        "arrivals": s["arrivals"],
        "completions": s["completions"],
        "requests_per_s": s["throughput"]["requests_per_s"],
        "tokens_per_s": s["throughput"]["tokens_per_s"],
    }
    for prefix, key in LATENCIES:
        out[f"{prefix}_count"] = s[key].get("count", 0)
        for p in PERCENTILES:
            out[f"{prefix}_{p}"] = s[key].get(p)
    for name, st in s["observe"].items():
        for p in ("p50", "p90", "p99"):
            out[f"observe_{name}_{p}"] = st.get(p)
    for c in result.claims:
        out[f"claim_{c.name}"] = c.status
    out["ok"] = result.ok
    return out


def run_task(task: Task) -> dict[str, Any]:
    """Run one task (in a worker); a serQ error comes back as its text, not as an exception."""
    t0 = time.perf_counter()
    try:
        model = load(text=task.text, filename=task.filename, overrides=task.params)
        limits = Limits(iterations=task.iterations, arrivals=task.arrivals)
        result = simulate(model, task.horizon, task.warmup, task.seed, limits)
    except SerqError as err:
        return {"error": err.render()}
    out = {"point": task.point, **task.params, "seed": task.seed, **row(result)}
    out["wall_s"] = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------- runners


def map_processes(tasks: Sequence[Task], jobs: int | None = None) -> list[dict[str, Any]]:
    """Run the tasks in local worker processes, results in task order."""
    workers = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(run_task, tasks, chunksize=max(1, len(tasks) // (4 * workers))))


def check_address(address: str | None) -> None:
    """A ``HOST:PORT`` (or ``ray://HOST:PORT``) that takes no connection is an error at once
    (Ray itself would retry for minutes); ``auto`` and ``local`` are Ray's to resolve."""
    if address is None or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, _, port = hostport.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SerqError(f"--ray {address}: expected auto, local, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as err:
        raise SerqError(f"--ray {address}: cannot connect ({err.strerror or err})") from None


def map_ray(tasks: Sequence[Task], address: str | None) -> list[dict[str, Any]]:
    """Run the tasks as Ray tasks (one CPU each), results in task order.

    Uses the Ray session this process already has, else connects with ``ray.init(address)``
    (``auto``: the cluster started by ``ray start`` on this machine; ``local``: a new
    single-machine one; ``HOST:PORT`` or ``ray://HOST:PORT``: a cluster) and disconnects after.
    """
    check_address(address)
    try:
        import ray
    except ImportError:
        raise SerqError("--ray needs the ray package (pip install 'ray[serve]')") from None
    started = False
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as err:
            msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise SerqError(f"--ray {address}: cannot connect ({msg})") from None
        started = True
    try:
        remote = ray.remote(num_cpus=1)(run_task)
        out: list[dict[str, Any]] = ray.get([remote.remote(t) for t in tasks])
        return out
    finally:
        if started:
            ray.shutdown()


# ----------------------------------------------------------------------------- the sweep


@dataclass
class Sweep:
    rows: list[dict[str, Any]]  # one per run, in grid order then seed order
    points: list[dict[str, Any]]  # one per grid point, aggregated over the seeds
    names: list[str]  # the swept parameter names
    claims: list[str]
    wall_s: float

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)


def tasks_for(
    path: str | Path,
    ranges: Sequence[tuple[str, list[float]]],
    seeds: Sequence[int],
    horizon: float,
    warmup: float,
    limits: Limits,
    text: str | None = None,
) -> list[Task]:
    """The runs of a sweep, every point checked here first (a bad name or value, or a point
    that would bring too many arrivals, is an error before any run starts)."""
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SerqError("no such file") from None
        except UnicodeDecodeError:
            raise SerqError("the file is not UTF-8 text") from None
        except OSError as err:
            raise SerqError(f"cannot read the file ({err.strerror})") from None
    points = grid(ranges)
    if not seeds:
        raise SerqError("--seeds names no seed")
    if len(points) * len(seeds) > MAX_RUNS:
        raise SerqError(f"{len(points)} points × {len(seeds)} seeds is more than {MAX_RUNS} runs")
    out: list[Task] = []
    for i, params in enumerate(points):
        model = load(text=text, filename=str(path), overrides=params)
        for seed in seeds:
            check_run(model, horizon, warmup, seed, limits)
            out.append(
                Task(
                    i,
                    params,
                    seed,
                    text,
                    str(path),
                    horizon,
                    warmup,
                    limits.iterations,
                    limits.arrivals,
                )
            )
    return out


def _aggregate(rows: list[dict[str, Any]], names: list[str], claims: list[str]) -> list[dict]:
    out: list[dict[str, Any]] = []
    for point, group in itertools.groupby(rows, key=lambda r: r["point"]):
        g = list(group)
        agg: dict[str, Any] = {"point": point, **{n: g[0][n] for n in names}, "seeds": len(g)}
        numeric = [
            k
            for k, v in g[0].items()
            if k not in ("point", "seed", "wall_s", *names)
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        ]
        for k in numeric:
            vals = [r[k] for r in g if r.get(k) is not None]
            # the mean over the seeds of each run's statistic (a percentile's mean, say)
            agg[k] = float(np.mean(vals)) if vals else None
        for c in claims:
            verdicts = [r[f"claim_{c}"] for r in g]
            n_fail = verdicts.count("fails")
            agg[f"claim_{c}"] = (
                "fails" if n_fail else "holds" if "holds" in verdicts else "not applicable"
            )
            agg[f"claim_{c}_fails"] = n_fail
        agg["ok"] = all(r["ok"] for r in g)
        out.append(agg)
    return out


def run_sweep(
    path: str | Path,
    ranges: Sequence[tuple[str, list[float]]],
    seeds: Sequence[int],
    horizon: float = 10_000_000.0,
    warmup: float = 0.0,
    limits: Limits | None = None,
    ray_address: str | None = None,
    jobs: int | None = None,
    runner: Callable[[Sequence[Task]], list[dict[str, Any]]] | None = None,
) -> Sweep:
    """Run every point × seed; on Ray when ``ray_address`` is given (or a Ray session is open
    and ``ray_address`` is ``""``), else in ``jobs`` local processes (or with ``runner``)."""
    limits = limits or Limits()
    tasks = tasks_for(path, ranges, seeds, horizon, warmup, limits)
    t0 = time.perf_counter()
    if runner is not None:
        results = runner(tasks)
    elif ray_address is not None:
        results = map_ray(tasks, ray_address or None)
    else:
        results = map_processes(tasks, jobs)
    wall = time.perf_counter() - t0
    for t, r in zip(tasks, results, strict=True):
        if "error" in r:
            raise SerqError(f"point {_label(t.params)} seed {t.seed}: {r['error']}")
    names = [n for n, _ in ranges]
    claims = [k[len("claim_") :] for k in results[0] if k.startswith("claim_")]
    return Sweep(results, _aggregate(results, names, claims), names, claims, wall)


def _label(params: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in params.items()) or "(defaults)"


# ----------------------------------------------------------------------------- output


def _write_csv(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    rows = list(rows)
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with path.open("x", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            # repr of a float round-trips exactly: the CSV holds the runs' own numbers
            w.writerow({k: repr(v) if isinstance(v, float) else v for k, v in r.items()})


def plot(sweep: Sweep, path: Path) -> None:
    """Latency percentiles (mean over seeds, min..max over seeds as a band) and claim verdicts
    (the seeds whose run broke the claim) per grid point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sweep.points
    swept = [n for n in sweep.names if len({p[n] for p in pts}) > 1]
    if len(swept) == 1:
        x = [float(p[swept[0]]) for p in pts]
        xlabel = swept[0]
    else:
        x = [float(p["point"]) for p in pts]
        xlabel = "grid point (" + ", ".join(sweep.names) + ")" if sweep.names else "grid point"
    fig, axes = plt.subplots(3, 1, figsize=(7, 9), sharex=True)
    for ax, (prefix, title) in zip(
        axes[:2], (("ttft", "time to first token"), ("response", "response time")), strict=True
    ):
        for p in ("p50", "p90", "p99"):
            col = f"{prefix}_{p}"
            mean = [q[col] / 1e3 if q.get(col) is not None else math.nan for q in pts]
            by_point = [
                [
                    r[col] / 1e3
                    for r in sweep.rows
                    if r["point"] == q["point"] and r.get(col) is not None
                ]
                for q in pts
            ]
            lo = [min(v) if v else math.nan for v in by_point]
            hi = [max(v) if v else math.nan for v in by_point]
            (line,) = ax.plot(x, mean, marker="o", label=p)
            ax.fill_between(x, lo, hi, alpha=0.15, color=line.get_color())
        ax.set_ylabel("ms")
        ax.set_title(f"{title} (mean over seeds; band: min..max)", fontsize=10)
        ax.legend(fontsize=8)
    ax = axes[2]
    for k, c in enumerate(sweep.claims):
        fails = [q[f"claim_{c}_fails"] for q in pts]
        colors = [
            "tab:red" if f else "tab:green" if q[f"claim_{c}"] == "holds" else "tab:gray"
            for f, q in zip(fails, pts, strict=True)
        ]
        ax.scatter(
            x,
            [k] * len(x),
            c=colors,
            s=[40 + 160 * f / q["seeds"] for f, q in zip(fails, pts, strict=True)],
        )
        for xi, f, q in zip(x, fails, pts, strict=True):
            if f:
                ax.annotate(
                    f"{f}/{q['seeds']}",
                    (xi, k),
                    textcoords="offset points",
                    xytext=(0, 8),
                    ha="center",
                    fontsize=7,
                )
    ax.set_yticks(range(len(sweep.claims)), sweep.claims)
    ax.set_ylim(-0.7, max(len(sweep.claims) - 0.3, 0.7))
    ax.set_title("claims (green: holds; red: fails for n/seeds; gray: not applicable)", fontsize=10)
    ax.set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def outputs(out_dir: Path) -> tuple[Path, Path, Path]:
    """The three files a sweep writes into ``out_dir``; an error if any exists already."""
    files = (out_dir / RUNS_CSV, out_dir / POINTS_CSV, out_dir / PLOT)
    if out_dir.exists() and not out_dir.is_dir():
        raise SerqError(f"--out {out_dir}: exists and is not a directory")
    for f in files:
        if f.exists():
            raise SerqError(f"--out {out_dir}: {f.name} exists already (choose another --out)")
    return files


def write(sweep: Sweep, out_dir: Path) -> tuple[Path, Path, Path]:
    runs, points, png = outputs(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(runs, sweep.rows)
    _write_csv(points, sweep.points)
    plot(sweep, png)
    return runs, points, png
