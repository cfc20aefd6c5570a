"""Benchmark: serQ's simulator against a SimPy model of the same RAD node.

Both models simulate one inference node running RAD (Bari et al.; the program
``examples/papers/bari_rad.sq``) for the same horizon with the same seed, check the same two
claims on every iteration, and are timed in the same process. The SimPy model is written the
way a SimPy user would write it: an arrival process, an engine process that forms a batch,
waits ``env.timeout(duration)`` and then updates every request in the batch.

Usage: ``python benchmarks/serq_vs_simpy.py [--horizon US] [--seed N] [--repeat K]``.
Writes ``results/benchmarks/serq_vs_simpy.json`` and ``results/benchmarks/serq_vs_simpy.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import simpy

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "examples" / "papers" / "bari_rad.sq"
OUT = ROOT / "results" / "benchmarks"
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

BCOL = 128
TLIN = 4000
TNL = 5
VPMAX = 8
VDMAX = 512
#: CPU time of this process: less sensitive than wall time to other jobs on a shared machine.
CLOCK = time.process_time


@dataclass
class Req:
    t0: float
    vp: int
    vd: int
    pre_left: int
    dec_left: int


def simpy_rad(rate: float, horizon: float, seed: int) -> dict[str, Any]:
    """The RAD node in SimPy: returns iterations, arrivals, completions and claim results."""
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    waiting: list[Req] = []
    running: list[Req] = []  # admitted, in admission order
    state = {
        "served": 0,
        "iterations": 0,
        "arrivals": 0,
        "completions": 0,
        "token_rate": True,
        "optimal_tiling": True,
    }
    wake: list[simpy.Event | None] = [None]

    def arrivals() -> Any:
        while True:
            yield env.timeout(rng.exponential(1.0 / rate))
            vp = BCOL * math.floor(rng.uniform(1, VPMAX + 1))
            vd = min(math.floor(rng.exponential(200)) + 1, VDMAX)
            waiting.append(Req(env.now, vp, vd, vp, vd))
            state["arrivals"] += 1
            ev = wake[0]
            if ev is not None and not ev.triggered:
                ev.succeed()

    def engine() -> Any:
        while True:
            decoders = [r for r in running if r.pre_left == 0]
            residents = len(running) + len(waiting)
            decode_mode = len(decoders) >= BCOL or len(decoders) == residents
            batch: list[tuple[Req, int]] = []
            tokens = 0
            if decode_mode:
                for r in decoders:
                    if tokens + 1 > BCOL:
                        break
                    batch.append((r, 1))
                    tokens += 1
            else:
                for r in running:
                    if r.pre_left == 0:
                        continue
                    c = min(r.pre_left, BCOL, BCOL - tokens)
                    if c <= 0:
                        break
                    batch.append((r, c))
                    tokens += c
                while waiting and tokens < BCOL:
                    r = waiting[0]
                    c = min(r.pre_left, BCOL, BCOL - tokens)
                    waiting.pop(0)
                    running.append(r)
                    batch.append((r, c))
                    tokens += c
            if not batch:
                wake[0] = env.event()
                yield wake[0]
                wake[0] = None
                continue
            now = env.now
            served = state["served"]
            if state["token_rate"] and not served * (TLIN + TNL * BCOL) <= BCOL * now:
                state["token_rate"] = False
            if state["optimal_tiling"] and not (tokens == BCOL or len(decoders) == residents):
                state["optimal_tiling"] = False
            duration = TLIN * math.ceil(tokens / BCOL) + TNL * tokens
            yield env.timeout(duration)
            for r, c in batch:
                if r.pre_left > 0:
                    r.pre_left -= c
                else:
                    r.dec_left -= 1
                    if r.dec_left == 0:
                        running.remove(r)
                        if env.now <= horizon:
                            state["completions"] += 1
            state["served"] = served + tokens
            state["iterations"] += 1

    env.process(arrivals())
    env.process(engine())
    env.run(until=horizon)
    return state


def serq_rad(rate: float, horizon: float, seed: int) -> tuple[dict[str, Any], float]:
    from serq.sim import load, simulate

    t0 = CLOCK()
    model = load(PROGRAM, overrides={"rate": rate})
    compile_s = CLOCK() - t0
    t1 = CLOCK()
    r = simulate(model, horizon, 0, seed)
    sim_s = CLOCK() - t1
    s = r.stats
    return (
        {
            "iterations": s["iterations"],
            "arrivals": s["arrivals"],
            "completions": s["completions"],
            "token_rate": r.claims[0].status == "holds",
            "optimal_tiling": r.claims[1].status == "holds",
            "sim_s": sim_s,
        },
        compile_s,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--horizon", type=float, default=100_000_000.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    for rate in (0.00002, 0.00003):
        best_simpy = math.inf
        best_serq = math.inf
        best_serq_total = math.inf
        sp: dict[str, Any] = {}
        sq: dict[str, Any] = {}
        for _ in range(args.repeat):
            t = CLOCK()
            sp = simpy_rad(rate, args.horizon, args.seed)
            best_simpy = min(best_simpy, CLOCK() - t)
            t = CLOCK()
            sq, _compile_s = serq_rad(rate, args.horizon, args.seed)
            best_serq_total = min(best_serq_total, CLOCK() - t)
            best_serq = min(best_serq, sq["sim_s"])
        row = {
            "rate_per_us": rate,
            "simpy": {
                **sp,
                "wall_s": best_simpy,
                "iterations_per_s": sp["iterations"] / best_simpy,
            },
            "serq": {
                **sq,
                "wall_s": best_serq,
                "wall_with_compile_s": best_serq_total,
                "iterations_per_s": sq["iterations"] / best_serq,
                "iterations_per_s_with_compile": sq["iterations"] / best_serq_total,
            },
        }
        row["ratio"] = row["serq"]["iterations_per_s"] / row["simpy"]["iterations_per_s"]
        row["ratio_with_compile"] = (
            row["serq"]["iterations_per_s_with_compile"] / row["simpy"]["iterations_per_s"]
        )
        rows.append(row)
        print(
            f"rate {rate}: serq {row['serq']['iterations_per_s']:.0f} it/s "
            f"({row['serq']['iterations_per_s_with_compile']:.0f} with parse+compile), "
            f"simpy {row['simpy']['iterations_per_s']:.0f} it/s, "
            f"ratio {row['ratio']:.1f}x ({row['ratio_with_compile']:.1f}x)"
        )

    result = {
        "benchmark": "serq_vs_simpy",
        "program": str(PROGRAM.relative_to(ROOT)),
        "horizon_us": args.horizon,
        "seed": args.seed,
        "repeat": args.repeat,
        "python": platform.python_version(),
        "simpy": simpy.__version__,
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "goal_ratio": 10.0,
        "rows": rows,
        "min_ratio": min(r["ratio"] for r in rows),
        "min_ratio_with_compile": min(r["ratio_with_compile"] for r in rows),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "serq_vs_simpy.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "serq_vs_simpy.md").write_text(_markdown(result))


def _markdown(res: dict[str, Any]) -> str:
    lines = [
        "# serQ simulator vs a SimPy model of the same RAD node",
        "",
        f"Program `{res['program']}`, horizon {res['horizon_us'] / 1e6:g} s simulated, "
        f"seed {res['seed']}, best of {res['repeat']} interleaved runs each, process CPU time, "
        "one process "
        f"(Python {res['python']}, SimPy {res['simpy']}, numpy {res['numpy']}).",
        "Produced by `python benchmarks/serq_vs_simpy.py`; raw numbers in `serq_vs_simpy.json`.",
        "",
        "| rate (req/s) | model | iterations | arrivals | completions | claims hold | CPU (s) "
        "| iterations/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        for name in ("serq", "simpy"):
            m = r[name]
            holds = "yes" if m["token_rate"] and m["optimal_tiling"] else "NO"
            lines.append(
                f"| {r['rate_per_us'] * 1e6:g} | {name} | {m['iterations']} | {m['arrivals']} | "
                f"{m['completions']} | {holds} | {m['wall_s']:.3f} | "
                f"{m['iterations_per_s']:.0f} |"
            )
    lines += [
        "",
        "| rate (req/s) | ratio (simulation only) | ratio (including parse, check, compile) |",
        "| --- | --- | --- |",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['rate_per_us'] * 1e6:g} | {r['ratio']:.1f}x | {r['ratio_with_compile']:.1f}x |"
        )
    ok = "met in this run" if res["min_ratio"] >= res["goal_ratio"] else "NOT met in this run"
    lines += [
        "",
        f"Goal: at least {res['goal_ratio']:g}x the SimPy model's iterations per second — "
        f"{ok} (lowest ratio {res['min_ratio']:.1f}x; "
        f"{res['min_ratio_with_compile']:.1f}x counting serQ's front end).",
        "",
        "## Limits",
        "",
        "- One machine, one process, CPU time (`time.process_time`) of single-threaded runs, "
        f"best of N interleaved runs. The machine is a shared {res['cpus']}-core box with other "
        "jobs running (1-minute load average "
        f"{res['load_avg_1m'][0]:g} before and {res['load_avg_1m'][1]:g} after this run): CPU "
        "time still varies with cache and memory-bandwidth contention, and repeated invocations "
        "under such load gave simulation-only ratios of about 9.5x to 10.7x, so the ratio is "
        "near the goal rather than safely above it; treat it as an order of magnitude, not a "
        "constant. A noise-free measure, counted separately with callgrind (instructions per "
        "`simulate` call at rate 20, as the difference between a process making 3 calls and "
        "one making 1, after a warm-up call): about 148 million before the latest changes "
        "(claims that read neither `now` nor `served` checked once per run, decode runs chained "
        "through completions and completed prefills when the queues are empty, durations "
        "remembered per token count, completion statistics computed after the loop with "
        "numpy) and 106 million after them (1.4x fewer; the earlier step, runs of identical "
        "iterations, had gone from about 228 to 133 million measured another way). The goal "
        "needs roughly another 1.1-1.3x.",
        "- The two models draw from different random streams (serQ pre-draws blocks from three "
        "spawned numpy generators; the SimPy model draws scalars from one), so their iteration "
        "and completion counts differ slightly; the ratio is computed per model from its own "
        "iteration count.",
        "- The SimPy model is hand-written for RAD only (no parser, no generic scheduler); it "
        "updates every request in the batch after each iteration, as a straightforward SimPy "
        "model does. A SimPy model written with the same O(1) decode bookkeeping as serQ would "
        "narrow the gap; event-loop overhead (one timeout per iteration) would remain.",
        "- serQ's speed comes partly from that bookkeeping (when every decoding request takes a "
        "token, an iteration costs O(1) plus the requests finishing in it) and from stepping "
        "runs of identical iterations between events (decode-only batches until the next "
        "finish; full-tile chunks of one prefill) in a tight loop that still checks both claims "
        "on every iteration (docs/serq.md, section 9). This program spends most iterations in "
        "such runs; programs whose cap is below the decoder count, or whose batch formation "
        "reads `now` or `served`, take the general per-iteration path, which is not measured "
        "here.",
        "- Both models check the same two claims on every iteration; neither records a "
        "per-token latency trace.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
