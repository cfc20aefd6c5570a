"""Benchmark: prefill launches per rung, and one prompt's prefill as the scheduler plans it on
the old (16, 64) and the serving (16..512) ladders, on one native engine (issue 19, TTFT).

The bundle must hold the serving rungs (the default `compile_cached` bundle of a checkpoint
does): the old ladder's plan runs on its 16- and 64-token rungs, so both ladders are measured
in one process, interleaved per round. Prints JSON lines; results in
results/benchmarks/serving_overhead_ttft.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

OLD = ((1, 16), (1, 64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path, help="a bundle with prefill rungs 16..512")
    ap.add_argument("--rungs", default="16,64,128,256,512", help="launch per rung (tokens)")
    ap.add_argument("--prompts", default="96,128,160,300", help="prompt lengths to plan")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launch-rows", type=float, default=15.0, help="the fit's launch cost")
    args = ap.parse_args()

    from plow.runtime.cpu.bundle import Bundle
    from plow.runtime.engine import PrefillChunk
    from plow.runtime.executors import get_executor
    from plow.serve.scheduler import Running, SchedulerState, schedule

    eng = get_executor("native").open_engine(Bundle.open(args.bundle), max_batch=8)
    new = tuple((1, s) for s in sorted(eng.model.prefill_seqs))  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)

    def chunks(n: int, rungs: tuple[tuple[int, int], ...]) -> list[int]:
        done, out = 0, []
        while done < n:
            st = SchedulerState(
                tick=0, now=0.0, running=(Running("a", 0, n, done, 0, None),), waiting=(),
                free_slots=(), max_num_batched_tokens=512, launch_rows=args.launch_rows,
                prefill_rungs=rungs,
            )  # fmt: skip
            c = schedule(st).prefill[0].length
            out.append(c)
            done += c
        return out

    def run(plan: list[int]) -> float:
        eng.add(0, [int(t) for t in rng.integers(3, eng.vocab_size, size=sum(plan))])
        t = time.perf_counter()
        for c in plan:
            eng.prefill([PrefillChunk(0, c)])
        dt = time.perf_counter() - t
        eng.free(0)
        return dt

    cases = [("rung", n, [n]) for n in map(int, args.rungs.split(","))]
    for n in map(int, args.prompts.split(",")):
        cases += [("old", n, chunks(n, OLD)), ("new", n, chunks(n, new))]
    for _, _, plan in cases:
        run(plan)  # warm
    times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        order = range(len(cases)) if r % 2 == 0 else reversed(range(len(cases)))
        for i in order:
            times[i].append(run(cases[i][2]))
    for i, (kind, n, plan) in enumerate(cases):
        v = sorted(times[i])
        print(json.dumps({"kind": kind, "tokens": n, "chunks": plan,
                          "min_ms": round(v[0] * 1e3), "median_ms": round(v[len(v) // 2] * 1e3),
                          "per_token_min_ms": round(v[0] * 1e3 / n, 2),
                          "load": [load0, os.getloadavg()[0]]}))  # fmt: skip


if __name__ == "__main__":
    main()
