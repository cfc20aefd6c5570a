"""Compile + verify wall time: a tiny checkpoint (full bundle) and the Gemma-3 12B config
(plan only, h200), oracle included. Writes results/benchmarks/compile_verify.{json,md}.

Besides wall time, each run records the CPU seconds of this process (`time.process_time`)
and of the oracle processes it waited for (`RUSAGE_CHILDREN`): on a shared machine the wall
time depends on the other jobs, the CPU seconds much less. The 12B case runs `REPEATS` times
(the table shows the fastest run; every run is in the JSON).

Run: .venv/bin/python benchmarks/compile_verify.py
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from plow.emit.bundle import compile_bundle
from plow.emit.verify import verify_bundle
from plow.profile import CompileProfile
from plow.target import load_target

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "benchmarks"
GOAL_S = 10.0
REPEATS = 3


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one(source: Path, target: str, plan_only: bool, tmp: Path, name: str) -> dict[str, Any]:
    out = tmp / name
    load0 = os.getloadavg()[0]
    c0, k0 = time.process_time(), _children_cpu()
    t0 = time.perf_counter()
    res = compile_bundle(source, out, load_target(target), CompileProfile(), plan_only=plan_only)
    t1 = time.perf_counter()
    c1, k1 = time.process_time(), _children_cpu()
    report = verify_bundle(out)
    t2 = time.perf_counter()
    c2, k2 = time.process_time(), _children_cpu()
    rung = res.manifest.ladder[0]
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "case": name,
        "source": str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source.name),
        "target": target,
        "plan_only": plan_only,
        "bucket": rung.name,
        "ops": len(res.emitted[0].op_table.ops),
        "tasks": rung.tasks,
        "packets": rung.packets,
        "counters": rung.counters,
        "bundle_bytes": size,
        "compile_s": round(t1 - t0, 3),
        "compile_stage_s": {k: round(v, 3) for k, v in res.stage_seconds.items()},
        "verify_s": round(t2 - t1, 3),
        "total_s": round(t2 - t0, 3),
        "compile_cpu_s": round(c1 - c0, 3),
        "verify_cpu_s": round(c2 - c1, 3),
        "oracle_cpu_s": round((k2 - k1) + (k1 - k0), 3),
        "loadavg_1_at_start": round(load0, 2),
        "verdicts": {f"{r.checkpoint}": r.verdict for r in report.rows},
        "accepted": report.accepted,
    }


def main() -> None:
    from plow.testing import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tiny = make_tiny_checkpoint("llama", 0, tmp / "tiny_llama")
        tiny_row = one(tiny, "cpu", False, tmp, "tiny llama (full bundle, cpu)")
        runs = [
            one(
                ROOT / "tests/data/configs/gemma-3-12b",
                "h200",
                True,
                tmp,
                "gemma-3-12b (plan only, h200)",
            )
            for _ in range(REPEATS)
        ]
    best = min(runs, key=lambda r: r["total_s"])
    rows = [tiny_row, best]
    load = os.getloadavg()
    doc = {
        "benchmark": "compile_verify",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_1_5_15": [round(x, 2) for x in load],
        },
        "goal_12b_total_s": GOAL_S,
        "results": rows,
        "runs_12b": runs,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "compile_verify.json").write_text(json.dumps(doc, indent=2) + "\n")
    big = rows[1]
    totals = [r["total_s"] for r in runs]
    cpu = big["compile_cpu_s"] + big["verify_cpu_s"] + big["oracle_cpu_s"]
    lines = [
        "# compile + verify",
        "",
        "`benchmarks/compile_verify.py`: `compile_bundle` then `verify_bundle` (every payload",
        "re-derived from the bundle's files, oracle run as separate processes). The tiny case",
        f"runs once, the 12B case {REPEATS} times (the fastest run is shown). CPU s: this",
        "process's CPU time (compile + verify) + the oracle processes' CPU time.",
        "",
        "| case | bucket | ops | tasks | packets | counters | bundle | compile s | verify s "
        "| total s | CPU s (python + oracle) | verdicts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        v = " ".join(f"{k}:{x}" for k, x in r["verdicts"].items())
        lines.append(
            f"| {r['case']} | {r['bucket']} | {r['ops']} | {r['tasks']} | {r['packets']} | "
            f"{r['counters']} | {r['bundle_bytes'] / 1e6:.2f} MB | {r['compile_s']} | "
            f"{r['verify_s']} | {r['total_s']} | "
            f"{r['compile_cpu_s'] + r['verify_cpu_s']:.2f} + {r['oracle_cpu_s']:.2f} | {v} |"
        )
    lines += [
        "",
        "Compile stages of the 12B plan (s): "
        + ", ".join(f"{k} {v}" for k, v in big["compile_stage_s"].items()),
        "",
        f"12B runs, total s: {', '.join(str(t) for t in totals)} (median "
        f"{statistics.median(totals):.3f}; 1-min load average at their starts: "
        f"{', '.join(str(r['loadavg_1_at_start']) for r in runs)}).",
        "",
        f"Goal for the 12B plan: under {GOAL_S:g} s, oracle included. Measured: "
        f"{big['total_s']} s ({'met' if big['total_s'] < GOAL_S else 'NOT met'}) in the fastest "
        f"run, {statistics.median(totals):.3f} s median "
        f"({'met' if statistics.median(totals) < GOAL_S else 'NOT met'}).",
        "",
        "## Limits",
        "",
        f"- A shared {os.cpu_count()}-core machine (load average {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} at the end): other jobs ran at the same time, so the wall times are upper "
        "bounds of an idle machine's and vary from run to run. The fastest 12B run used "
        f"{cpu:.1f} CPU s in all ({big['oracle_cpu_s']:.1f} of them in the oracle), so on two "
        "idle cores it cannot take much less than half that.",
        "- The 12B plan is one decode bucket (batch 1, context 4096, the default profile); more "
        "rungs scale compile and verify roughly linearly.",
        "- Checkpoint D on the 12B plan is certified by the oracle at any size (its data-flow "
        "sweep); F decides the task-level sharing rule there too (vector clocks per task), "
        "which costs several oracle CPU seconds on the 12B plan (docs/oracle.md)."
        + " Checkpoint C runs on the timeline cut into slices of 64 windows (exactly the same "
        "occupancy; docs/memory.md).",
        "- Verify runs the oracle jobs three at a time on threads; the Python side of verify "
        "(re-deriving the payloads, serialising them to JSON) holds the GIL, so it is serial.",
        "- The longest chain is checkpoint D, started first: its data flow derived in Python "
        "(~2.3 CPU s on the 12B plan), 55 MB of JSON, then its oracle (~7.5 CPU s: the sweep "
        "~5.5 s, reading the payload and the protocol check ~2 s); so on this machine the "
        "total cannot fall much below compile + the Python prelude + D's ~10 CPU s even when "
        "the other checkpoints run beside it (docs/oracle.md, \"Checkpoint D: the oracle's "
        'cost").',
        "- The tiny case includes copying the weights and tokenizer; the 12B case writes no "
        "weights (`--plan-only`).",
    ]
    (OUT / "compile_verify.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
