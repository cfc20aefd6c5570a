# ruff: noqa: E501  (report tables are long f-strings)
"""Counter graph of a 48-layer 12B dense model (Gemma-3-12B config, decode, batch 1).

    python benchmarks/counter_graph_12b.py

Writes results/benchmarks/counter_graph_12b.json and .md: ops, op-level dependency edges and
their transitive reduction, counters before/after the passes, dead counters, task-level
edges, the collapse decisions, the makespan estimate; L2-partition awareness on mi350x;
tensor-parallel plans (tp 2, 8) with their scopes; checkpoint D on what the oracle can take.
Compared with the seed's 717 edges / 717 after reduction / one dead counter.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path

from plow.checkpoint import load_spec
from plow.graph import Bucket, build_graph
from plow.schedule import ScheduleOptions, build_schedule, certify_schedule, protocol_errors
from plow.schedule.ir import Schedule
from plow.schedule.protocol import signallers, waiters
from plow.target import load_target
from plow.tiles import tile_graph

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "data" / "configs" / "gemma-3-12b"
OUT = ROOT / "results" / "benchmarks"
CONTEXT = 4096


def transitive_reduction_size(nodes: list[str], edges: list[tuple[str, str]]) -> int:
    """Edges left after transitive reduction of a DAG (nodes in topological order)."""
    idx = {n: i for i, n in enumerate(nodes)}
    succ: list[set[int]] = [set() for _ in nodes]
    for u, v in edges:
        succ[idx[u]].add(idx[v])
    reach = [0] * len(nodes)  # bitset of nodes reachable by a path of length >= 1
    for i in reversed(range(len(nodes))):
        r = 0
        for j in succ[i]:
            r |= (1 << j) | reach[j]
        reach[i] = r
    keep = 0
    for i in range(len(nodes)):
        for j in succ[i]:
            # (i, j) is redundant when j is reachable from another successor of i.
            if not any((reach[k] >> j) & 1 for k in succ[i] if k != j):
                keep += 1
    return keep


def scopes(s: Schedule) -> dict[str, int]:
    return dict(Counter(c.scope for c in s.counters))


def system_only_across(s: Schedule) -> bool:
    sig, wai = signallers(s), waiters(s)
    for c in s.counters:
        crosses = any(
            s.tasks[u].gpu != s.tasks[t].gpu for u in sig.get(c.id, []) for t in wai.get(c.id, [])
        )
        if (c.scope == "system") != crosses:
            return False
    return True


def main() -> None:
    spec = load_spec(CONFIG)
    bucket = Bucket.decode(1, CONTEXT)
    graph = build_graph(spec, bucket)
    res: dict[str, object] = {"model": "gemma-3-12b (config)", "bucket": bucket.name}
    ops = [op.name for op in graph.ops]
    per_layer = Counter(op.layer for op in graph.ops if op.layer is not None)
    op_edges = graph.edges()
    res["ops"] = len(ops)
    res["layers"] = len(per_layer)
    res["ops_per_layer"] = sorted(set(per_layer.values()))
    res["ops_outside_layers"] = [op.name for op in graph.ops if op.layer is None]
    res["op_edges"] = len(op_edges)
    res["op_edges_after_reduction"] = transitive_reduction_size(ops, op_edges)

    target = load_target("h200")
    t0 = time.perf_counter()
    tg = tile_graph(graph, target)
    t1 = time.perf_counter()
    raw = build_schedule(tg, graph, target, ScheduleOptions(passes=False))
    t2 = time.perf_counter()
    s = build_schedule(tg, graph, target)
    t3 = time.perf_counter()
    wai = waiters(raw)
    stage_edges = sorted(
        {(c.producer, raw.tasks[t].op) for c in raw.counters for t in wai.get(c.id, [])}
    )
    res["h200"] = {
        "tiles": tg.num_tiles,
        "tasks": len(s.tasks),
        "task_edges": len(s.edges),
        "counters_before_passes": len(raw.counters),
        "dead_counters_before_passes": sum(1 for c in raw.counters if c.id not in wai),
        "dead_counter_names": [c.name for c in raw.counters if c.id not in wai],
        "counter_graph_edges": len(stage_edges),
        "counters_after_passes": len(s.counters),
        "passes": [
            {"name": r.name, "changed": r.changed, "note": r.note, "first": list(r.changes[:3])}
            for r in s.reports
        ],
        "fine_edges": sum(d.fine for d in s.decisions),
        "coarse_edges": sum(not d.fine for d in s.decisions),
        "scopes": scopes(s),
        "makespan_us": round(s.makespan_ns / 1e3, 1),
        "tile_estimate_sum_us": round(tg.estimated_ns / 1e3, 1),
        "python_check_errors": protocol_errors(s),
        "seconds": {
            "tile": round(t1 - t0, 2),
            "schedule_no_passes": round(t2 - t1, 2),
            "schedule": round(t3 - t2, 2),
        },
    }

    mi = load_target("mi350x")
    tgm = tile_graph(graph, mi)
    aware = build_schedule(tgm, graph, mi)
    blind = build_schedule(tgm, graph, mi, ScheduleOptions(l2_aware=False))
    res["mi350x_l2"] = {
        "tasks": len(aware.tasks),
        "aware_cross_partition_MB": round(aware.cross_partition_bytes / 1e6, 2),
        "blind_cross_partition_MB": round(blind.cross_partition_bytes / 1e6, 2),
        "aware_makespan_us": round(aware.makespan_ns / 1e3, 1),
        "blind_makespan_us": round(blind.makespan_ns / 1e3, 1),
    }

    tp_res = {}
    for tp in (2, 8):
        st = build_schedule(tg, graph, target, ScheduleOptions(tp=tp))
        tp_res[str(tp)] = {
            "tasks": len(st.tasks),
            "scopes": scopes(st),
            "system_only_where_edge_crosses_gpus": system_only_across(st),
            "cross_gpu_MB": round(st.cross_gpu_bytes / 1e6, 2),
            "makespan_us": round(st.makespan_ns / 1e3, 1),
            "python_check_errors": protocol_errors(st),
        }
        t0 = time.perf_counter()
        _, cert = certify_schedule(st)
        tp_res[str(tp)]["oracle_verdict"] = cert.verdict.value
        tp_res[str(tp)]["oracle_s"] = round(time.perf_counter() - t0, 2)
    res["tp_full"] = tp_res

    # The oracle on a one-layer cut of the same config too (small enough to read): tp 1, 2, 8.
    cfg = json.loads((CONFIG / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        g1 = build_graph(load_spec(Path(d)), bucket)
        tg1 = tile_graph(g1, target)
        cut = {}
        for tp in (1, 2, 8):
            s1 = build_schedule(tg1, g1, target, ScheduleOptions(tp=tp))
            t0 = time.perf_counter()
            _, cert = certify_schedule(s1)
            cut[str(tp)] = {
                "tasks": len(s1.tasks),
                "edges": len(s1.edges),
                "scopes": scopes(s1),
                "system_only_where_edge_crosses_gpus": system_only_across(s1),
                "verdict": cert.verdict.value,
                "reason": cert.reason,
                "oracle_s": round(time.perf_counter() - t0, 2),
            }
        res["oracle_one_layer"] = cut
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "counter_graph_12b.json").write_text(json.dumps(res, indent=2))
    (OUT / "counter_graph_12b.md").write_text(report(res))
    print(json.dumps(res, indent=2))


def report(r: dict) -> str:  # type: ignore[type-arg]
    h = r["h200"]
    m = r["mi350x_l2"]
    lines = [
        "# Counter graph, 48-layer 12B dense (Gemma-3-12B config, decode b1, context 4096)",
        "",
        "Reproduce: `python benchmarks/counter_graph_12b.py` (plan-only; no weights).",
        "",
        "| quantity | plow | seed |",
        "| --- | --- | --- |",
        f"| ops | {r['ops']} ({r['ops_per_layer']} per layer x {r['layers']} + {len(r['ops_outside_layers'])}) | one counter per op |",
        f"| op-level dependency edges | {r['op_edges']} | 717 |",
        f"| after transitive reduction | {r['op_edges_after_reduction']} | 717 |",
        f"| counters (before passes) | {h['counters_before_passes']} | = ops |",
        f"| counter-graph edges (stage level) | {h['counter_graph_edges']} | 717 |",
        f"| dead counters | {h['dead_counters_before_passes']} ({', '.join(h['dead_counter_names'])}) | 1 |",
        f"| counters after C4/C5/C6 | {h['counters_after_passes']} | - |",
        f"| task-level edges (h200) | {h['task_edges']} over {h['tasks']} tasks | - |",
        f"| collapse decision | {h['coarse_edges']} coarse, {h['fine_edges']} fine | all coarse |",
        f"| makespan estimate (h200) | {h['makespan_us']} us (sum of op estimates {h['tile_estimate_sum_us']} us) | - |",
        "",
        "Passes on the 12B plan: "
        + "; ".join(
            f"{p['name']} changed {p['changed']}" + (f" ({p['note']})" if p["note"] else "")
            for p in h["passes"]
        ),
        "",
        f"L2 partitions (mi350x, 8): cross-partition edge traffic {m['aware_cross_partition_MB']} MB aware vs "
        f"{m['blind_cross_partition_MB']} MB blind; makespan {m['aware_makespan_us']} vs {m['blind_makespan_us']} us.",
        "",
        "Tensor parallel (full 48 layers, h200 x tp):",
        "",
        "| tp | tasks | scopes | system only where an edge crosses GPUs | cross-GPU MB | makespan us "
        "| checkpoint D (oracle) | oracle s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tp, v in r["tp_full"].items():
        lines.append(
            f"| {tp} | {v['tasks']} | {v['scopes']} | {v['system_only_where_edge_crosses_gpus']} "
            f"| {v['cross_gpu_MB']} | {v['makespan_us']} | {v['oracle_verdict']} | {v['oracle_s']} |"
        )
    lines += [
        "",
        "Checkpoint D by the oracle on a one-layer cut of the config:",
        "",
        "| tp | tasks | edges | scopes | system only across GPUs | verdict | oracle s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tp, v in r["oracle_one_layer"].items():
        lines.append(
            f"| {tp} | {v['tasks']} | {v['edges']} | {v['scopes']} | {v['system_only_where_edge_crosses_gpus']} | {v['verdict']} | {v['oracle_s']} |"
        )
    lines += [
        "",
        "## Why the numbers differ from the seed",
        "",
        "The seed counts a fused fp8 graph in which every layer is a chain (residual+norm fused, "
        "q/k/v concatenated, rope in the projection epilogue, gate/up interleaved): one counter per op, "
        "no edge implied by another, so 717 edges stay 717. plow has no fusion stage yet (the e-graph, "
        "checkpoint A), so its Gemma-3 layer has separate q/k/v, q/k norms, two rope ops, four norms, "
        "gate/up and two residual adds. Parallel branches add edges, and each residual add reads the "
        "residual stream directly as well as through its norm branch: those two skip edges per layer "
        "are exactly what the transitive reduction removes. A split reduction (k-split linear, "
        "split-KV attention, split rmsnorm/sample) has two stages (partials, merge), each with its "
        "counter, so counters exceed ops. The one dead counter is the same as the seed's: the last "
        "op (sample) signals a counter no task waits on; C4 drops it.",
        "",
        "## Limits",
        "",
        "- Estimates only: tile times come from the cost model (plow/tiles), atomic latencies from "
        "the target spec (estimates, not datasheet); no GPU run is behind any number here.",
        "- Checkpoint D's extracted checker is O((tasks + edges) log) (docs/oracle.md): the full "
        "tensor-parallel plans above are certified by the oracle, and the same hypotheses are also "
        "checked in Python (`protocol_errors`).",
        "- Tensor parallel is a placement of the one-device tiling: norms and residual adds are not "
        "replicated per GPU (they run once, their readers on other GPUs use system-scope counters); "
        "row-parallel partials follow their reduction slice only as far as the tiler's k-split allows.",
        "- L2 traffic counts edge bytes between tasks on different partitions of one GPU; "
        "broadcast reads (a norm read by every tile of the next linear) cross partitions in both "
        "placements. Weight traffic is not counted (each slab is read once either way).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
