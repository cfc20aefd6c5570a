# ruff: noqa: E501  (report tables are long f-strings)
"""Counter graphs of the mixture-of-experts plans: Qwen3-30B-A3B and Gemma-4 26B-A4B on h200,
decode batch 1 and 8, context 4096.

    python benchmarks/counter_graph_moe.py

Writes results/benchmarks/counter_graph_moe.json and .md. Per plan and batch:

- the collapse decisions (C8) on the edges into and out of the router and expert ops: how
  many got fine counters, and the reasons (grouped; layer 0's in full);
- the simulated makespan (`plow.schedule.protocol.simulate`) of the schedule built with the
  decision ("auto"), with coarse counters forced ("never") and fine counters forced
  ("always"), priced three ways: worst case (every expert tile busy: the schedule's own
  makespan, a bound), expected (each routed task at its expected cost under uniform top-k
  routing), and under 20 sampled routings (each row's top-k experts drawn uniformly, per
  layer; an idle expert tile costs only its signal, `tile_overhead_ns`). The sampled
  routings use seed 1, not the decision's seed 0, and the same routings for all three
  schedules (paired).

The numbers are the cost model's, not measurements: deterministic, any machine.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from plow.checkpoint import load_spec
from plow.graph import Bucket, build_graph
from plow.schedule import ScheduleOptions, build_schedule
from plow.schedule.ir import Schedule, TaskKind
from plow.schedule.protocol import simulate
from plow.schedule.routing import routed_ops, task_load
from plow.target import load_target
from plow.tiles import tile_graph

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "qwen3-30b-a3b": ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b",
    "gemma4-26b-a4b": ROOT / "tests" / "data" / "gemma4_26b_a4b.json",
}
OUT = ROOT / "results" / "benchmarks"
CONTEXT = 4096
ROUTINGS = 20
SEED = 1
MOE = ("router", "experts_gate_up", "experts_down", "experts_norm", "post_experts_norm")
MODES = ("auto", "never", "always")


def _moe_edge(p: str, c: str) -> bool:
    return any(k in p or k in c for k in MOE)


def _kind(reason: str) -> str:
    """The decision's rule, from its reason."""
    if "forced" in reason:
        return "forced"
    if reason.startswith("routed") and "C7r for all routings" in reason:
        return "routed consumers, C7r for all routings: coarse"
    if reason.startswith("routed") and "every slice reads all" in reason:
        return "routed consumers, every slice reads all producers"
    if reason.startswith("routed"):
        return "routed consumers, two-stage estimate: " + (
            "fine" if "): fine counters" in reason else "coarse"
        )
    if "in every routing" in reason:
        return "equal in every routing (routed producers): C8"
    if "equal cost" in reason:
        return "equal cost: C8"
    return reason.split(":")[0]


def _with_costs(s: Schedule, cost: list[float]) -> Schedule:
    return replace(s, tasks=tuple(replace(t, est_ns=c) for t, c in zip(s.tasks, cost, strict=True)))


def _span(s: Schedule, lat: dict[str, float], launch: float) -> float:
    tl = simulate(s, lat, launch)
    assert not tl.stuck, "deadlock"
    return tl.makespan_ns


def _bucket(name: str, batch: int) -> dict[str, Any]:
    spec = load_spec(CONFIGS[name])
    h200 = load_target("h200")
    lat: dict[str, float] = {k: float(v) for k, v in h200.atomic_latency_ns.items()}
    launch = float(h200.launch_overhead_ns)
    g = build_graph(spec, Bucket.decode(batch, CONTEXT))
    tg = tile_graph(g, h200)
    routed = routed_ops(tg, g)
    tile_ns = {top.name: float(top.choice.tile_ns) for top in tg.ops if top.name in routed}
    scheds = {m: build_schedule(tg, g, h200, ScheduleOptions(fine=m)) for m in MODES}  # type: ignore[arg-type]
    base = scheds["auto"]
    assert all([t.units for t in s.tasks] == [t.units for t in base.tasks] for s in scheds.values())
    rows = [
        (t.index, t.op, t.units, t.est_ns, tile_ns[t.op])
        for t in base.tasks
        if t.op in routed and t.kind is TaskKind.compute
    ]
    load = task_load(routed, rows, float(h200.tile_overhead_ns), ROUTINGS, SEED)
    est = [t.est_ns for t in base.tasks]
    expected = [load.expected.get(i, e) for i, e in enumerate(est)]
    worst, exp_span, sampled = {}, {}, {}
    for m, s in scheds.items():
        worst[m] = s.makespan_ns
        exp_span[m] = _span(_with_costs(s, expected), lat, launch)
        spans = []
        for k in range(ROUTINGS):
            cost = [
                float(load.sampled[i][k]) if i in load.sampled else e for i, e in enumerate(est)
            ]
            spans.append(_span(_with_costs(s, cost), lat, launch))
        sampled[m] = spans
    decisions = [d for d in base.decisions if _moe_edge(d.producer, d.consumer)]
    smp = {m: np.array(v) for m, v in sampled.items()}
    return {
        "config": name,
        "batch": batch,
        "tasks": len(base.tasks),
        "routing": next(iter(load.note.values())),
        "fine_edges_all": sum(d.fine for d in base.decisions),
        "counters": {m: len(s.counters) for m, s in scheds.items()},
        **_decision_fields(decisions),
        "makespan_worst_ns": {m: round(v, 1) for m, v in worst.items()},
        "makespan_expected_ns": {m: round(v, 1) for m, v in exp_span.items()},
        "makespan_sampled_ns": {
            m: {
                "mean": round(float(v.mean()), 1),
                "min": round(float(v.min()), 1),
                "max": round(float(v.max()), 1),
            }
            for m, v in smp.items()
        },
        "sampled_fine_over_coarse": {
            "mean": round(float((smp["always"] / smp["never"]).mean()), 6),
            "min": round(float((smp["always"] / smp["never"]).min()), 6),
            "max": round(float((smp["always"] / smp["never"]).max()), 6),
        },
    }


def main() -> None:
    if sys.argv[1:] == ["--render"]:  # the .md again from the .json (no recomputation)
        doc = json.loads((OUT / "counter_graph_moe.json").read_text())
        render(doc["buckets"], doc["wall_s"], doc["loadavg"], doc.get("decisions_refreshed", False))
        return
    if sys.argv[1:] == ["--decisions"]:  # decisions again, makespans kept where unchanged
        _refresh_decisions()
        return
    t0 = time.perf_counter()
    rows = [_bucket(name, batch) for name in CONFIGS for batch in (1, 8)]
    wall = time.perf_counter() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    load = [round(x, 2) for x in os.getloadavg()]
    (OUT / "counter_graph_moe.json").write_text(
        json.dumps(
            {
                "target": "h200",
                "context": CONTEXT,
                "routings": ROUTINGS,
                "seed": SEED,
                "wall_s": round(wall, 1),
                "loadavg": load,
                "buckets": rows,
            },
            indent=2,
        )
        + "\n"
    )
    render(rows, wall, load)


def _decision_fields(decisions: list[Any]) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    for d in decisions:
        kinds[_kind(d.reason)] = kinds.get(_kind(d.reason), 0) + 1
    gated = [int(g_.group(1)) for d in decisions if (g_ := re.search(r"in (\d+) of the", d.reason))]
    return {
        "moe_edges": len(decisions),
        "fine_edges": sum(d.fine for d in decisions),
        "decision_kinds": kinds,
        "c7r_routings_min": min(gated) if gated else None,
        "c7r_edges": len(gated),
        "c7r_all_routings_edges": sum("C7r for all routings" in d.reason for d in decisions),
        "layer0_decisions": [
            {"producer": d.producer, "consumer": d.consumer, "fine": d.fine, "reason": d.reason}
            for d in decisions
            if d.producer.startswith("L0.") or d.consumer.startswith("L0.")
        ],
    }


def _refresh_decisions() -> None:
    """Re-derive the collapse decisions (the auto schedule only) and re-render. The stored
    makespans stay only where they cannot have changed: the same edges get fine counters
    (none or the same set) and the auto schedule's worst-case makespan equals the stored one
    to 0.1 ns (same tasks, same counters); otherwise it stops and asks for the full run."""
    doc = json.loads((OUT / "counter_graph_moe.json").read_text())
    h200 = load_target("h200")
    for r in doc["buckets"]:
        g = build_graph(load_spec(CONFIGS[r["config"]]), Bucket.decode(r["batch"], CONTEXT))
        auto = build_schedule(tile_graph(g, h200), g, h200, ScheduleOptions(fine="auto"))
        decisions = [d for d in auto.decisions if _moe_edge(d.producer, d.consumer)]
        new = _decision_fields(decisions)
        same = (
            new["fine_edges"] == r["fine_edges"]
            and sum(d.fine for d in auto.decisions) == r["fine_edges_all"]
            and round(auto.makespan_ns, 1) == r["makespan_worst_ns"]["auto"]
        )
        if not same:
            sys.exit(f"{r['config']} batch {r['batch']}: decisions changed; run the full benchmark")
        r.update(new)
    doc["decisions_refreshed"] = True
    (OUT / "counter_graph_moe.json").write_text(json.dumps(doc, indent=2) + "\n")
    render(doc["buckets"], doc["wall_s"], doc["loadavg"], True)


def render(
    rows: list[dict[str, Any]], wall: float, load: list[float], refreshed: bool = False
) -> None:
    lines = [
        "# Counter graphs of the MoE plans (h200, decode, context 4096)",
        "",
        "Cost-model estimates (`simulate`), not measurements: deterministic on any machine. "
        "`python benchmarks/counter_graph_moe.py` "
        f"({wall:.0f} s here). Configs: `tests/data/configs/qwen3-30b-a3b` (Qwen3-30B-A3B, 48 layers, "
        "top-8 of 128 experts) and `tests/data/gemma4_26b_a4b.json` (Gemma-4 26B-A4B, 30 layers, "
        "top-8 of 128 experts beside a dense MLP).",
        *(
            [
                "",
                "The decisions (the Why section and layer 0's reasons) were re-derived by "
                "`python benchmarks/counter_graph_moe.py --decisions`, which keeps the makespans of "
                "the full run only after checking that they cannot have changed (the same edges got "
                "fine counters, the auto schedule's worst-case makespan is the stored one).",
            ]
            if refreshed
            else []
        ),
        "",
        "Schedules: **auto** (the collapse decision), **coarse** forced (`fine='never'`), "
        "**fine** forced (`fine='always'`); same tasks and placement, only the counters differ. "
        "Each priced three ways: **worst case** (every expert tile busy: the schedule's makespan, "
        "a bound on every routing), **expected** (each routed task at its expected cost under uniform "
        f"top-k routing), **sampled** ({ROUTINGS} routings, each row's top-k experts drawn uniformly "
        f"per layer, seed {SEED}; an idle expert tile costs its signal only; the same routings for "
        "all three schedules).",
        "",
        "| plan | batch | MoE edges | fine (auto) | worst case auto / coarse / fine, us | expected auto / coarse / fine, us | sampled mean auto / coarse / fine, us | sampled fine / coarse (min..max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        w, e, s, q = (
            r["makespan_worst_ns"],
            r["makespan_expected_ns"],
            r["makespan_sampled_ns"],
            r["sampled_fine_over_coarse"],
        )
        lines.append(
            f"| {r['config']} | {r['batch']} | {r['moe_edges']} | {r['fine_edges']} "
            f"| {w['auto'] / 1e3:.1f} / {w['never'] / 1e3:.1f} / {w['always'] / 1e3:.1f} "
            f"| {e['auto'] / 1e3:.1f} / {e['never'] / 1e3:.1f} / {e['always'] / 1e3:.1f} "
            f"| {s['auto']['mean'] / 1e3:.1f} / {s['never']['mean'] / 1e3:.1f} / {s['always']['mean'] / 1e3:.1f} "
            f"| {q['mean']:.4f} ({q['min']:.4f}..{q['max']:.4f}) |"
        )
    lines += ["", "Why (the decision's rule per MoE edge, all layers):", ""]
    for r in rows:
        kinds = ", ".join(f"{k}: {v}" for k, v in r["decision_kinds"].items())
        lines.append(f"- {r['config']} batch {r['batch']} ({r['routing']}): {kinds}")
        if r.get("c7r_all_routings_edges"):
            lines.append(
                f"  - on all {r['c7r_all_routings_edges']} edges whose routed consumer slices read "
                "producer subsets (`experts_gate_up` -> `experts_down.partial`), C7r holds **for all "
                "routings** (`Plow.Gatedproof.coupled_c7r_all_routings`; every busy set of experts, "
                "so every top-k routing, not a sample): `plow.schedule.routing.coupled_ok`, the "
                "theorem's `coupled_ok` clause for clause, holds on the plan's structure, so in every "
                "routing a costliest consumer slice waits on a latest producer slice and fine gates "
                "open C7's barrier exactly when coarse ones do"
            )
        if r["c7r_edges"]:
            lines.append(
                f"  - on all {r['c7r_edges']} estimated edges, C7r's condition (a costliest consumer slice "
                f"waits on a latest producer slice) held in at least {r['c7r_routings_min']} of the "
                f"decision's {ROUTINGS} sampled routings: there fine gates provably gain nothing on C7's model"
            )
    for r in rows:
        if r["batch"] != 8:
            continue
        lines += ["", f"Layer 0's MoE decisions, {r['config']}, batch 8:", ""]
        for d in r["layer0_decisions"]:
            lines.append(
                f"- `{d['producer']}` -> `{d['consumer']}`: {'fine' if d['fine'] else 'coarse'}: {d['reason']}"
            )
    lines += [
        "",
        "## Limits",
        "",
        "- Cost-model numbers (`simulate`: task est times, atomic latency per counter scope, "
        "launch overhead), not GPU measurements; no GPU ran this.",
        "- C7r for all routings is a statement on C7's two-stage model (in whole ns); it uses no "
        "routing distribution. The expected and sampled makespans do: "
        "uniform, independent top-k per row and per layer. Real routers are "
        "skewed (hot experts), which makes busy sets overlap more across rows; no checkpoint "
        "plow reads ships a router load histogram, so none is used.",
        "- An idle expert tile costs `tile_overhead_ns` (its signal); a busy tile costs its full "
        "worst-case time whatever its token count (decode GEMV tiles are weight-bandwidth bound).",
        '- "Expected" prices each task at its expected cost and simulates once: that is not '
        "the expected makespan (a layer waits for its slowest busy expert; E[max] >= max E), "
        "which is why it is far below the sampled mean. The sampled mean is the estimate to read.",
        "- The decision's two-stage model (C7's) puts every slice on its own worker; the whole "
        "simulation has worker queues. That is where forcing fine counters everywhere still "
        "gains at Gemma-4 batch 1 (mean 0.03%, at most 0.08%, 0.6 to 2.2 us in one layer of a "
        "routing): traced to the `experts_down` merge, 132 slices of equal cost (C8: coarse "
        "optimal in C7's model), several to a worker queue; with fine gates a merge whose "
        "partials finished early (idle experts) starts before the last partial and frees its "
        "worker sooner: a queueing effect that C7 and C8 do not model.",
        f"- Wall time {wall:.0f} s on this VM (2 cores shared; load average {load[0]:.1f} / "
        f"{load[1]:.1f} / {load[2]:.1f} at the end); the numbers do not depend on it.",
    ]
    (OUT / "counter_graph_moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
