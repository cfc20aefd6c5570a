# ruff: noqa: E501  (report tables are long f-strings)
"""Counter graph of the Qwen3-30B-A3B plan (routed experts, h200, decode, batch 1 and 8).

    python benchmarks/counter_graph_moe.py

Writes results/benchmarks/counter_graph_moe.json and .md: per batch, the collapse decisions
(C8) on the edges into and out of the router and expert ops (which got fine counters and
why), and the simulated makespan with the decision, with coarse counters forced and with
fine counters forced. The numbers are the cost model's (`plow.schedule.protocol.simulate`),
not measurements: deterministic, any machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from plow.checkpoint import load_spec
from plow.graph import Bucket, build_graph
from plow.schedule import ScheduleOptions, build_schedule
from plow.target import load_target
from plow.tiles import tile_graph

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b"
OUT = ROOT / "results" / "benchmarks"
CONTEXT = 4096
MOE = ("router", "experts_gate_up", "experts_down")


def _moe_edge(p: str, c: str) -> bool:
    return any(k in p or k in c for k in MOE)


def main() -> None:
    spec = load_spec(CONFIG)
    h200 = load_target("h200")
    rows = []
    for batch in (1, 8):
        g = build_graph(spec, Bucket.decode(batch, CONTEXT))
        tg = tile_graph(g, h200)
        span = {}
        decisions = []
        for mode in ("auto", "never", "always"):
            s = build_schedule(tg, g, h200, ScheduleOptions(fine=mode))  # type: ignore[arg-type]
            span[mode] = s.makespan_ns
            if mode == "auto":
                decisions = [d for d in s.decisions if _moe_edge(d.producer, d.consumer)]
        fine = [d for d in decisions if d.fine]
        first = [
            d for d in decisions if d.producer.startswith("L0.") or d.consumer.startswith("L0.")
        ]
        rows.append(
            {
                "batch": batch,
                "moe_edges": len(decisions),
                "fine_edges": len(fine),
                "makespan_ns": {k: round(v, 1) for k, v in span.items()},
                "layer0_decisions": [
                    {
                        "producer": d.producer,
                        "consumer": d.consumer,
                        "fine": d.fine,
                        "reason": d.reason,
                    }
                    for d in first
                ],
            }
        )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "counter_graph_moe.json").write_text(
        json.dumps(
            {"config": "qwen3-30b-a3b", "target": "h200", "context": CONTEXT, "buckets": rows},
            indent=2,
        )
        + "\n"
    )
    lines = [
        "# Counter graph of Qwen3-30B-A3B (h200, decode, context 4096)",
        "",
        "Cost-model estimates (`simulate`), not measurements. `python benchmarks/counter_graph_moe.py`.",
        "",
        "| batch | edges at router / expert ops | fine (C8) | makespan auto ns | coarse forced | fine forced |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r["makespan_ns"]
        lines.append(
            f"| {r['batch']} | {r['moe_edges']} | {r['fine_edges']} | {m['auto']:.0f} | {m['never']:.0f} | {m['always']:.0f} |"
        )
    lines += ["", "Layer 0's decisions (batch 1):", ""]
    for d in rows[0]["layer0_decisions"]:
        lines.append(
            f"- `{d['producer']}` -> `{d['consumer']}`: {'fine' if d['fine'] else 'coarse'}: {d['reason']}"
        )
    (OUT / "counter_graph_moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
