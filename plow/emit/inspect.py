"""`plow inspect BUNDLE`: per bucket, what the plan holds (read from the bundle's files).

Counts: ops, tiles (sum over ops of the product of their axis steps), packets, tasks,
counters (live: some packet signals or waits on it), task-level dependency edges, op-level
edges (distinct producer op -> consumer op pairs of the task edges) and the op-level edges
left after transitive reduction, dead counters (signalled, never waited on), arena bytes by
region, on-chip peak pages per worker (max, mean, and the budget).

Nothing is reported from a bundle whose files do not check out: `plow verify`'s bundle row
(every hash in the manifest, no unlisted file, the cross-references) runs first and a
rejection is a `MalformedBundle` naming the file (exit 2).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from plow.bundle.files import OpTable, ScheduleFile
from plow.bundle.manifest import MalformedBundle, load_json, read_manifest
from plow.bundle.wire import NO_COUNTER, read_plan
from plow.emit.verify import verify_bundle
from plow.memory.arena import Buffer, region_bytes
from plow.memory.onchip import TaskPages, page_windows, peak_pages


def transitive_reduction(n: int, edges: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Edges of a DAG on nodes 0..n-1 (every edge goes from a lower to a higher index) that
    no longer path implies."""
    succ: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges:
        succ[u].append(v)
    reach = [0] * n  # bitset of nodes reachable from i by a path of length >= 1
    for u in range(n - 1, -1, -1):
        r = 0
        for v in succ[u]:
            r |= (1 << v) | reach[v]
        reach[u] = r
    keep = set()
    for u in range(n):
        for v in succ[u]:
            if not any(w != v and (reach[w] >> v) & 1 for w in succ[u]):
                keep.add((u, v))
    return keep


def counter_scopes(ot: OpTable, sf: ScheduleFile, per_gpu: int) -> dict[str, Any]:
    """Counters per scope (cta / device / system), and why each system-scope one is: the
    kinds of the ops that signal it and of those that wait on it, and their GPUs (a
    tensor-parallel plan: the row-parallel partials every device's allreduce reads)."""
    by_scope = {sc: 0 for sc in ("cta", "device", "system")}
    for sc in sf.counters.scope:
        by_scope[sc] = by_scope.get(sc, 0) + 1
    system = {k for k, sc in enumerate(sf.counters.scope) if sc == "system"}
    sig: dict[int, set[tuple[str, int]]] = {k: set() for k in system}
    wait: dict[int, set[tuple[str, int]]] = {k: set() for k in system}
    t = sf.tasks
    for op_i, w, ws, ss in zip(t.op, t.worker, t.waits, t.signals, strict=True):
        g = w // per_gpu if per_gpu else 0
        for k in ss:
            if k in sig:
                sig[k].add((ot.ops[op_i].kind, g))
        for k in ws:
            if k in wait:
                wait[k].add((ot.ops[op_i].kind, g))
    why: dict[str, int] = {}
    for k in sorted(system):
        pk = "/".join(sorted({kd for kd, _ in sig[k]}))
        ck = "/".join(sorted({kd for kd, _ in wait[k]}))
        pg = sorted({g for _, g in sig[k]})
        cg = sorted({g for _, g in wait[k]})
        line = f"{pk} on GPU {pg} -> {ck} on GPU {cg}"
        why[line] = why.get(line, 0) + 1
    return {"counter_scopes": by_scope, "system_counters_why": why}


def inspect_bundle(bundle: Path) -> dict[str, Any]:
    """One JSON-able object: the manifest summary and per-bucket figures."""
    bundle = Path(bundle)
    m = read_manifest(bundle)
    row = verify_bundle(bundle, checkpoints=()).rows[0]  # the bundle row, no oracle
    if row.rejected:
        raise MalformedBundle(bundle, f"{row.reason} (see `plow verify {bundle}`)")
    out: dict[str, Any] = {
        "bundle": str(bundle),
        "model": m.model.model_dump(),
        "target": m.target.get("name"),
        "plan_only": m.plan_only,
        "versions": m.versions.model_dump(),
        "buckets": [],
    }
    for rung in m.ladder:
        ot: OpTable = load_json(bundle / rung.ops, OpTable)
        sf: ScheduleFile = load_json(bundle / rung.schedule, ScheduleFile)
        _, arr = read_plan(bundle / rung.plan)
        waited = set(arr["wait_counter"].tolist()) - {NO_COUNTER}
        signalled = set(arr["signal_counter"].tolist()) - {NO_COUNTER}
        e = sf.edges
        task_op = sf.tasks.op
        op_edges = {
            (task_op[e[k]], task_op[e[k + 1]])
            for k in range(0, len(e), 2)
            if task_op[e[k]] != task_op[e[k + 1]]
        }
        reduced = transitive_reduction(len(ot.ops), op_edges)
        p = sf.pages
        tasks = [
            TaskPages(*row)
            for row in zip(p.start, p.finish, p.load, p.weight_pages, p.act_pages, strict=True)
        ]
        peaks = peak_pages(page_windows(sf.tasks.worker, sf.tasks.name, tasks))
        regions = region_bytes(
            [Buffer(b.name, b.region, b.offset, b.size) for b in sf.arena.buffers]  # type: ignore[arg-type]
        )
        out["buckets"].append(
            {
                "bucket": rung.name,
                "phase": rung.phase,
                "batch": rung.batch,
                "seq": rung.seq,
                "context": rung.context,
                "ops": len(ot.ops),
                "tiles": sum(math.prod(a.steps for a in o.axes) for o in ot.ops),
                "tasks": len(sf.tasks.name),
                "packets": int(arr.size),
                "nop_packets": int((arr["opcode"] == 0).sum()),
                "counters": len(waited | signalled),
                "edges": len(e) // 2,
                "op_edges": len(op_edges),
                "op_edges_after_reduction": len(reduced),
                "dead_counters": len(signalled - waited),
                **counter_scopes(ot, sf, sf.workers_per_gpu),
                "arena_bytes": sf.arena.arena_bytes,
                "arena_bytes_by_region": regions,
                "onchip_budget_pages": p.budget_pages,
                "onchip_page_bytes": p.page_bytes,
                "onchip_peak_pages_max": max(peaks.values(), default=0),
                "onchip_peak_pages_mean": round(sum(peaks.values()) / max(1, len(peaks)), 2),
                "onchip_peak_pages_per_worker": {str(w): v for w, v in sorted(peaks.items())},
                "hoisted_loads": sum(1 for t in tasks if t.hoisted),
                "makespan_ns": sf.makespan_ns,
                "cost": rung.cost.model_dump(),
            }
        )
    return out


def rewrites_of_bundle(bundle: Path) -> list[Any]:
    """`plow inspect --rewrites`: the fusion stage's `RewriteReport` (plow/egraph) for every
    bucket of the ladder, from the bundle's `config.json` and target — what the e-graph
    search finds, what each extraction chooses, what the emitter does not implement yet.
    The bundle row runs first, as for `inspect_bundle`."""
    from plow.checkpoint import load_spec
    from plow.egraph import rewrite
    from plow.graph import Bucket, Phase, build_graph
    from plow.target import Target

    bundle = Path(bundle)
    m = read_manifest(bundle)
    row = verify_bundle(bundle, checkpoints=()).rows[0]
    if row.rejected:
        raise MalformedBundle(bundle, f"{row.reason} (see `plow verify {bundle}`)")
    spec = load_spec(bundle)
    target = Target.model_validate(m.target)
    fuse = bool(m.profile.get("fuse", False))  # the emitter's extraction is what was compiled
    return [
        rewrite(
            build_graph(spec, Bucket(Phase(r.phase), r.batch, r.seq, r.context)), target, fuse=fuse
        ).report
        for r in m.ladder
    ]


def applied_rewrites(bundle: Path) -> dict[str, Any]:
    """The rewrites the bundle's packets hold (`rewrites.json`, written by a `--fuse`
    compile; plow/egraph/apply.py): per block its rule, the canonical ops it covers (the
    model's graph, rebuilt from `config.json`, for the first rung) and the fused op of the op
    table; the re-laid-out weights. `{"blocks": [], "layouts": []}` for an unfused bundle."""
    import json

    from plow.bundle.files import OpTable
    from plow.checkpoint import load_spec
    from plow.graph import Bucket, Phase, build_graph

    bundle = Path(bundle)
    m = read_manifest(bundle)
    f = bundle / "rewrites.json"
    if not f.is_file() or not m.ladder:
        return {"blocks": [], "layouts": []}
    try:
        doc = json.loads(f.read_text())
        r = m.ladder[0]
        canon = build_graph(load_spec(bundle), Bucket(Phase(r.phase), r.batch, r.seq, r.context))
        ot = OpTable.model_validate_json((bundle / r.ops).read_bytes())
        blocks = [
            {
                "rule": b["rule"],
                "canonical": [canon.ops[i].name for i in b["canonical"]],
                "fused": ot.ops[b["fused"]].name,
                "kind": ot.ops[b["fused"]].kind,
            }
            for b in doc["blocks"]
        ]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise MalformedBundle(f, f"not a rewrites file of this bundle: {e}") from e
    return {"blocks": blocks, "layouts": doc.get("layouts", [])}
