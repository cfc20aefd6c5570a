"""Compile + verify wall time: a tiny checkpoint (full bundle) and the Gemma-3 12B config
(plan only, h200), oracle included. Writes results/benchmarks/compile_verify.{json,md}.

Run: .venv/bin/python benchmarks/compile_verify.py
"""

from __future__ import annotations

import json
import os
import platform
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


def one(source: Path, target: str, plan_only: bool, tmp: Path, name: str) -> dict[str, Any]:
    out = tmp / name
    t0 = time.perf_counter()
    res = compile_bundle(source, out, load_target(target), CompileProfile(), plan_only=plan_only)
    t1 = time.perf_counter()
    report = verify_bundle(out)
    t2 = time.perf_counter()
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
        "verdicts": {f"{r.checkpoint}": r.verdict for r in report.rows},
        "accepted": report.accepted,
    }


def main() -> None:
    from plow.testing import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tiny = make_tiny_checkpoint("llama", 0, tmp / "tiny_llama")
        rows = [
            one(tiny, "cpu", False, tmp, "tiny llama (full bundle, cpu)"),
            one(
                ROOT / "tests/data/configs/gemma-3-12b",
                "h200",
                True,
                tmp,
                "gemma-3-12b (plan only, h200)",
            ),
        ]
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
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "compile_verify.json").write_text(json.dumps(doc, indent=2) + "\n")
    big = rows[1]
    lines = [
        "# compile + verify",
        "",
        "`benchmarks/compile_verify.py`: `compile_bundle` then `verify_bundle` (every payload",
        "re-derived from the bundle's files, oracle run as separate processes), one run each.",
        "",
        "| case | bucket | ops | tasks | packets | counters | bundle | compile s | verify s | total s | verdicts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        v = " ".join(f"{k}:{x}" for k, x in r["verdicts"].items())
        lines.append(
            f"| {r['case']} | {r['bucket']} | {r['ops']} | {r['tasks']} | {r['packets']} | "
            f"{r['counters']} | {r['bundle_bytes'] / 1e6:.2f} MB | {r['compile_s']} | "
            f"{r['verify_s']} | {r['total_s']} | {v} |"
        )
    lines += [
        "",
        "Compile stages of the 12B plan (s): "
        + ", ".join(f"{k} {v}" for k, v in big["compile_stage_s"].items()),
        "",
        f"Goal for the 12B plan: under {GOAL_S:g} s, oracle included. Measured: "
        f"{big['total_s']} s ({'met' if big['total_s'] < GOAL_S else 'NOT met'}).",
        "",
        "## Limits",
        "",
        f"- One run, on a shared {os.cpu_count()}-core machine (load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end); other jobs ran at the same "
        "time, so the times are upper bounds of an idle machine's.",
        "- The 12B plan is one decode bucket (batch 1, context 4096, the default profile); more "
        "rungs scale compile and verify roughly linearly.",
        "- Checkpoint D on the 12B plan is checked in Python, not by the oracle: the extracted "
        "D checker is quadratic in tasks and above 6000 tasks it is skipped (the verify row says "
        "so). Checkpoint C runs on the timeline cut into slices of 64 windows (exactly the same "
        "occupancy; docs/memory.md).",
        "- The schedule stage (plow/schedule) dominates compile time; checkpoint E's extracted "
        "decoder dominates verify time.",
        "- The tiny case includes copying the weights and tokenizer; the 12B case writes no "
        "weights (`--plan-only`).",
    ]
    (OUT / "compile_verify.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
