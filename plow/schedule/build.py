"""`build_schedule(tile_graph, graph, target)`: placement, dependency edges, counters,
the collapse decision and the three passes (docs/schedule.md).

Pipeline (each step a pure function of the previous result):

1. Units: every tile of every op (split reductions: partial tiles plus one merge unit per
   output block) with the boxes it reads and writes (`plow.schedule.regions`).
2. Tasks: an op's units (per stage: compute / merge) are cut into `g` contiguous runs,
   `g = min(units, workers of the plan, total work / min_task_ns)`; equal-sized runs when a
   divisor of the unit count is close to `g` (so equal tiles give equal task costs), else
   runs differing by one unit.
3. Placement: list scheduling in the graph's topological order; a task becomes ready when
   the ops it reads have finished (plus the device atomic latency) and goes to the worker
   that frees up first among the allowed ones. L2-partition aware: every task goes to the
   partition (and GPU) of its output column stripe, so a weight slab (rows of W for an output
   column block), the merge of its partials and the element-wise consumers of those columns
   share a partition. Tensor parallel (`tp > 1`): stripes are split across GPUs the same
   way; linears that read an attention or gated-MLP output are row-parallel (partials go to
   the GPU of their reduction slice) and their merges become `allreduce` tasks.
4. Edges: consumer task -> every producer task whose written box overlaps a box it reads.
5. Counters: one coarse counter per producer stage (`<op>.done`, `<op>.partial.done`);
   per op edge, the collapse decision (C8) may give each consumer task its own fine counter.
   A load and its compute task sit back to back on one worker: that edge is covered by queue
   order and has no counter.
6. Passes: drop (C4), merge (C5), hoist loads (C6); scopes = cheapest legal.
7. Simulation: makespan estimate; cross-partition / cross-GPU traffic of the edges.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from plow.errors import GraphError
from plow.graph.ops import OpGraph
from plow.graph.shard import device_of, graph_tp
from plow.schedule.ir import Counter, EdgeDecision, Schedule, Task, TaskKind
from plow.schedule.passes import (
    compact,
    drop_implied_counters,
    fresh_counter,
    hoist_loads,
    merge_same_dependency,
    rescope,
)
from plow.schedule.protocol import simulate
from plow.schedule.regions import (
    Box,
    Regions,
    UnitArrays,
    is_split,
    output_columns,
    partial_name,
    run_bboxes,
    view,
)
from plow.schedule.routing import TaskLoad, coupled_edge, routed_ops, task_load, two_stage_gain
from plow.target.model import Target, dtype_bytes
from plow.tiles.ir import TiledOp, TileGraph


@dataclass(frozen=True, slots=True)
class ScheduleOptions:
    """Knobs of the scheduler.

    `tp`: GPUs of a tensor-parallel plan (None: `target.gpus`). `l2_aware`: stripe tasks
    over L2 partitions (False: any worker of the GPU). `fine`: "auto" applies the collapse
    decision, "never"/"always" force coarse/fine counters (for tests and measurements).
    `min_task_ns`: shortest task worth its own counter traffic (None: 4x the device atomic
    latency). `loads`: explicit weight-slab load tasks (L2 prefetch) before each weight-reading
    task. `passes`: run C4, C5, C6.
    """

    tp: int | None = None
    l2_aware: bool = True
    fine: Literal["auto", "never", "always"] = "auto"
    min_task_ns: float | None = None
    max_tasks_per_op: int | None = None
    loads: bool = False
    passes: bool = True


def _groups(n: int, total_ns: float, cap: int, min_task_ns: float) -> list[tuple[int, int]]:
    """Cut `n` units into contiguous runs [(start, stop)].

    The target count is `want = min(n, cap, total / min_task_ns)`, i.e. runs of about
    `c0 = ceil(n / want)` units. Equal runs are preferred: the divisor `c` of `n` closest to
    `c0` within `[c0/2, 2*c0]` (with `n / c <= cap`) gives `n / c` runs of `c` (equal tiles,
    equal task costs: the collapse decision keeps coarse counters). Without one, `want` runs
    whose sizes differ by one.
    """
    if n == 0:
        return []
    want = max(1, min(n, cap, int(total_ns // max(min_task_ns, 1e-9)) or 1))
    c0 = -(-n // want)
    fits = [c for c in range(-(-c0 // 2), 2 * c0 + 1) if n % c == 0 and n // c <= cap]
    c = min(fits, key=lambda c: (abs(c - c0), -c)) if fits else 0
    g = n // c if c else want
    base, extra = divmod(n, g)
    out, a = [], 0
    for i in range(g):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


@dataclass(slots=True)
class _Draft:
    """A task while it is being placed (mutable only inside `build_schedule`)."""

    name: str
    op: str
    kind: TaskKind
    units: tuple[int, ...]
    stage: str  # producer-group key: op name, "<op>.partial", "<op>.load"
    reads: dict[str, Box]
    write: tuple[str, Box] | None
    est_ns: float
    partial: bool
    weight_bytes: int
    key: float  # stripe used for placement
    worker: int = -1


class _Placer:
    """Earliest-free worker per (gpu, partition) pool, via heaps."""

    def __init__(self, tp: int, workers: int, parts: int) -> None:
        self.W, self.P, self.tp = workers, parts, tp
        self.pools: dict[tuple[int, int], list[tuple[float, int]]] = defaultdict(list)
        for g in range(tp):
            for w in range(workers):
                p = w * parts // workers
                self.pools[(g, p)].append((0.0, g * workers + w))
        for h in self.pools.values():
            heapq.heapify(h)

    def place(self, gpu: int, part: int | None, ready: float, est: float) -> tuple[int, float]:
        keys = [(gpu, part)] if part is not None else [(gpu, p) for p in range(self.P)]
        best = min(keys, key=lambda k: self.pools[k][0])
        free, w = heapq.heappop(self.pools[best])
        start = max(free, ready)
        heapq.heappush(self.pools[best], (start + est, w))
        return w, start + est


def _row_parallel(graph: OpGraph) -> set[str]:
    """Linears whose input comes from attention or the gated MLP (Megatron row-parallel)."""
    kinds = {op.outputs[0]: op.kind.value for op in graph.ops}
    return {
        op.name
        for op in graph.ops
        if op.kind.value == "linear"
        and kinds.get(op.inputs[0]) in ("attention", "gated_mlp", "linear_glu")
    }


def _routed_load(
    tg: TileGraph, graph: OpGraph, drafts: list[_Draft], idle_ns: float
) -> TaskLoad | None:
    """Expected and sampled costs of the routed experts' compute tasks (None: no experts)."""
    routed = routed_ops(tg, graph)
    if not routed:
        return None
    tile_ns = {top.name: float(top.choice.tile_ns) for top in tg.ops if top.name in routed}
    rows = [
        (i, d.op, d.units, d.est_ns, tile_ns[d.op])
        for i, d in enumerate(drafts)
        if d.op in routed and d.kind is TaskKind.compute
    ]
    return task_load(routed, rows, idle_ns, independent_layers=False)


def _routed_decision(
    load: TaskLoad,
    note: str,
    producers: list[int],
    ts: list[int],
    us: list[list[int]],
    est: list[float],
    all_full: bool,
    idle_ns: float,
    atomic_ns: float,
) -> tuple[bool, str]:
    """C8 for an edge whose consumer slices are routed expert tasks: their costs differ
    between routings (and between slices in almost every routing), so C8 certifies nothing;
    fine counters where C7's two-stage model, over the sampled routings, opens the barrier
    earlier by more than one device atomic (the extra signal) on average."""
    exp = [load.expected[t] for t in ts]
    worst = [load.worst[t] for t in ts]
    head = (
        f"routed consumer slices ({note}): expected cost "
        f"{min(exp):.0f}..{max(exp):.0f} ns, worst case {min(worst):.0f}..{max(worst):.0f} ns, "
        f"idle tile {idle_ns:.0f} ns; their costs differ between routings, so C8 does not cover "
        "this edge"
    )
    if all_full:
        return False, (
            f"{head}; every slice reads all {len(producers)} producer task(s): "
            "a fine counter would equal the coarse one"
        )
    edge, not_coupled = coupled_edge(producers, us, ts, load, est)
    if edge is not None:
        busy = f"{edge.lo} ns idle, {edge.lo + edge.hi} ns busy" if edge.hi else f"{edge.lo} ns"
        return False, (
            f"{head}; coarse: for all routings a costliest consumer slice waits on a latest "
            "producer slice, so fine gates open C7's two-stage barrier exactly when coarse "
            "ones do (C7r for all routings, Plow.Gatedproof.coupled_c7r_all_routings: "
            f"producer slices {busy}, a busy consumer tile +{edge.cw} ns, every consumer's "
            "experts gated on their producers)"
        )
    coarse, fine, top, gated = two_stage_gain(producers, us, ts, load, est)
    pays = coarse - fine > atomic_ns
    n = len(next(iter(load.sampled.values())))
    return pays, (
        f"{head}; C7's two-stage model over {n} sampled routings: barrier coarse "
        f"{coarse:.0f} ns, fine {fine:.0f} ns (largest gain {top:.0f} ns): "
        f"{'fine counters' if pays else 'coarse'} (gain {'above' if pays else 'not above'} "
        f"one device atomic, {atomic_ns:.0f} ns; an estimate, not a theorem: C7r is not "
        f"certified for all routings, {not_coupled}); in {gated} of "
        f"the {n} routings a costliest consumer slice waits on a latest producer slice, so "
        "there fine gates open that barrier exactly when coarse ones do (C7r)"
    )


def build_schedule(
    tg: TileGraph, graph: OpGraph, target: Target, options: ScheduleOptions | None = None
) -> Schedule:
    """The schedule of one bucket's tile graph on `target` (pure and deterministic)."""
    opt = options or ScheduleOptions()
    tp = opt.tp or target.gpus
    if tp < 1:
        raise GraphError(tg.bucket or "schedule", f"tp must be at least 1, got {tp}")
    W, P = target.workers, target.l2_partitions
    lat = {k: float(v) for k, v in target.atomic_latency_ns.items()}
    min_task = opt.min_task_ns if opt.min_task_ns is not None else 4 * lat["device"]
    # a sharded graph (plow/graph/shard.py): every op on its own device's workers
    device = {op.name: device_of(op) for op in graph.ops} if graph_tp(graph) > 1 else None
    if device is not None and graph_tp(graph) != tp:
        raise GraphError(
            tg.bucket or "schedule", f"graph sharded for tp {graph_tp(graph)}, planned for {tp}"
        )
    cap = min(W if device else tp * W, opt.max_tasks_per_op or tp * W)
    regions = Regions(graph)
    rowpar = _row_parallel(graph) if tp > 1 and device is None else set()
    overhead = float(target.tile_overhead_ns)
    load_ns_per_byte = W * 1e9 / target.bandwidth_bytes_per_s

    # -- 1-2. units and tasks ----------------------------------------------------------
    drafts: list[_Draft] = []
    op_stages: list[tuple[TiledOp, list[int]]] = []
    for top in tg.ops:
        tile_ns = float(top.choice.tile_ns)
        merge_total = 0.0
        if is_split(top):
            merge_total = max(0.0, top.time_ns - top.choice.waves * tile_ns - overhead)
        compute, merges = regions.unit_arrays(top, tile_ns, merge_total, W, overhead)
        ids: list[int] = []
        stages: list[tuple[UnitArrays | None, TaskKind, str]] = [
            (compute, TaskKind.compute, top.name + (".partial" if merges else ""))
        ]
        if merges:
            kind = TaskKind.allreduce if top.name in rowpar else TaskKind.merge
            stages.append((merges, kind, top.name))
        for units, kind, stage in stages:
            if units is None:
                continue
            runs = _groups(units.n, sum(units.est_ns), cap, min_task)
            starts = [a for a, _ in runs]
            rboxes = {tn: run_bboxes(arr, starts) for tn, arr in units.reads.items()}
            wboxes = run_bboxes(units.write, starts)
            suffix = "" if kind is TaskKind.compute else f".{kind.value}"
            use_k = kind is TaskKind.compute and top.name in rowpar
            keys = units.k_stripe if use_k else units.stripe
            for k, (a, b) in enumerate(runs):
                key = sum(keys[a:b]) / (b - a)
                wbytes = sum(units.weight_bytes[a:b])
                est: float = sum(units.est_ns[a:b])
                run_units = tuple(units.index[a:b])
                if opt.loads and wbytes:
                    lns = wbytes * load_ns_per_byte
                    ids.append(len(drafts))
                    drafts.append(
                        _Draft(
                            f"{top.name}.load#{k}",
                            top.name,
                            TaskKind.load,
                            run_units,
                            f"{top.name}.load",
                            {},
                            None,
                            lns,
                            False,
                            wbytes,
                            key,
                        )
                    )
                    est = max(overhead * (b - a), est - lns)
                ids.append(len(drafts))
                drafts.append(
                    _Draft(
                        f"{top.name}{suffix}#{k}",
                        top.name,
                        kind,
                        run_units,
                        stage,
                        {tn: bx[k] for tn, bx in rboxes.items()},
                        (units.write_name, wboxes[k]),
                        est,
                        units.partial,
                        0 if opt.loads else wbytes,
                        key,
                    )
                )
        op_stages.append((top, ids))

    # -- 3. placement (list scheduling, graph order) ---------------------------------------
    # an op writing several outputs (R1's add_rmsnorm: the same box of each; R4's linear_qkv:
    # q, k, v side by side) writes each its part of the task's box
    multi = {op.outputs[0]: output_columns(graph, op) for op in graph.ops if len(op.outputs) > 1}
    # a split add_rmsnorm (R1): its tiles write the partials and the same box of the sum
    for op in graph.ops:
        if op.kind.value == "add_rmsnorm":
            w = view(graph.tensor(op.outputs[0]).shape)[1]
            multi[partial_name(op.name)] = [(partial_name(op.name), 0, w), (op.outputs[0], 0, w)]

    def writes(d: _Draft) -> list[tuple[str, Box]]:
        assert d.write is not None
        tn, (r0, r1, c0, c1) = d.write
        if tn not in multi:
            return [d.write]
        out = []
        for t, at, w in multi[tn]:
            lo, hi = max(0, c0 - at), min(w, c1 - at)
            if lo < hi:
                out.append((t, (r0, r1, lo, hi)))
        return out

    writer_stage: dict[str, str] = {}
    for d in drafts:
        if d.write is not None:
            for tn, _ in writes(d):
                writer_stage[tn] = d.stage
    stage_finish: dict[str, float] = defaultdict(float)
    placer = _Placer(tp, W, P)
    queues: list[list[int]] = [[] for _ in range(tp * W)]
    for i, d in enumerate(drafts):
        if d.kind is TaskKind.load:
            continue  # placed with its compute task below
        ready = 0.0
        for tn in d.reads:
            st = writer_stage.get(tn)
            if st is not None:
                ready = max(ready, stage_finish[st] + lat["device"])
        if device is not None:  # the op's device; the stripe picks the partition on it
            gpu, part = device[d.op], (min(int(d.key * P), P - 1) if opt.l2_aware else None)
        else:
            s = min(
                int(d.key * tp * (P if opt.l2_aware else 1)), tp * (P if opt.l2_aware else 1) - 1
            )
            gpu, part = (s // P, s % P) if opt.l2_aware else (s, None)
        load = (
            drafts[i - 1]
            if i > 0 and drafts[i - 1].kind is TaskKind.load and drafts[i - 1].op == d.op
            else None
        )
        est_all = d.est_ns + (load.est_ns if load else 0.0)
        w, fin = placer.place(gpu, part, ready, est_all)
        if load is not None:
            load.worker = w
            queues[w].append(i - 1)
        d.worker = w
        queues[w].append(i)
        stage_finish[d.stage] = max(stage_finish[d.stage], fin)

    # -- 4. edges from box overlap -----------------------------------------------------------
    act_b = dtype_bytes(tg.activation_dtype)
    n_d = len(drafts)
    by_tensor: dict[str, list[tuple[int, Box]]] = defaultdict(list)
    for i, d in enumerate(drafts):
        if d.write is not None:
            for tn, bx in writes(d):
                by_tensor[tn].append((i, bx))
    stage_ids: dict[str, list[int]] = defaultdict(list)
    for i, d in enumerate(drafts):
        stage_ids[d.stage].append(i)
    prod_boxes = {
        tn: (
            np.array([bx for _, bx in ws], dtype=np.int64).reshape(-1, 4),
            np.array([i for i, _ in ws]),
        )
        for tn, ws in by_tensor.items()
    }
    e_u: list[npt.NDArray[np.int64]] = []
    e_t: list[npt.NDArray[np.int64]] = []
    e_b: list[npt.NDArray[np.int64]] = []
    for _stage, cids in stage_ids.items():
        first = drafts[cids[0]]
        if first.kind is TaskKind.load:
            continue
        carr = np.array(cids, dtype=np.int64)
        for tn in first.reads:
            if tn not in prod_boxes:
                continue
            pb, pids = prod_boxes[tn]
            cb = np.array([drafts[i].reads[tn] for i in cids], dtype=np.int64)
            ov_r = np.minimum(cb[:, None, 1], pb[None, :, 1]) - np.maximum(
                cb[:, None, 0], pb[None, :, 0]
            )
            ov_c = np.minimum(cb[:, None, 3], pb[None, :, 3]) - np.maximum(
                cb[:, None, 2], pb[None, :, 2]
            )
            ci, pi = np.nonzero((ov_r > 0) & (ov_c > 0))
            esize = 4 if tn.endswith("#partial") else act_b
            e_b.append(ov_r[ci, pi] * ov_c[ci, pi] * esize)
            e_u.append(pids[pi])
            e_t.append(carr[ci])
        lt = [
            t
            for t in cids
            if t > 0 and drafts[t - 1].kind is TaskKind.load and drafts[t - 1].op == first.op
        ]
        if lt:  # the slab its load brought in (queue order covers it)
            e_t.append(np.array(lt, dtype=np.int64))
            e_u.append(e_t[-1] - 1)
            e_b.append(np.zeros(len(lt), dtype=np.int64))
    # Dedupe (a task may read two tensors of one producer) keeping the larger byte count;
    # edges sorted by (producer, consumer).
    eu_all = np.concatenate([*e_u, np.zeros(0, dtype=np.int64)]).astype(np.int64)
    et_all = np.concatenate([*e_t, np.zeros(0, dtype=np.int64)]).astype(np.int64)
    eb_all = np.concatenate([*e_b, np.zeros(0, dtype=np.int64)]).astype(np.int64)
    ekey = eu_all * max(1, n_d) + et_all
    order = np.lexsort((eb_all, ekey))
    ekey, eb_all = ekey[order], eb_all[order]
    last = np.ones(len(ekey), dtype=bool)
    last[:-1] = ekey[1:] != ekey[:-1]  # the last of equal keys holds the largest byte count
    ekey, eb_all = ekey[last], eb_all[last]
    eu, et = ekey // max(1, n_d), ekey % max(1, n_d)
    edge_list = list(zip(eu.tolist(), et.tolist(), strict=True))

    # -- 5. counters: coarse per producer stage, fine where the collapse decision says so -----
    stage_tasks: dict[str, list[int]] = defaultdict(list)
    for i, d in enumerate(drafts):
        stage_tasks[d.stage].append(i)
    stage_names = list(stage_tasks)
    stage_no = {st: k for k, st in enumerate(stage_names)}
    stage_of = np.array([stage_no[d.stage] for d in drafts], dtype=np.int64)
    is_load = np.array([d.kind is TaskKind.load for d in drafts], dtype=bool)
    # Edges from a load are covered by queue order (load right before its task, same worker).
    keep = ~is_load[eu]
    cu, ct = eu[keep], et[keep]
    ns = max(1, len(stage_names))
    gkey = stage_of[cu] * ns + stage_of[ct]
    # Group (producer stage, consumer stage) pairs in order of their first edge; within a
    # pair, by consumer then producer.
    _, gfirst, ginv = np.unique(gkey, return_index=True, return_inverse=True)
    grank = np.empty(len(gfirst), dtype=np.int64)
    grank[np.argsort(gfirst, kind="stable")] = np.arange(len(gfirst))
    gr = grank[ginv.reshape(-1)]
    o = np.lexsort((cu, ct, gr))
    gr, cu, ct = gr[o], cu[o], ct[o]
    gcuts = np.flatnonzero(np.diff(gr)) + 1
    gstart = [0, *gcuts.tolist()]
    gend = [*gcuts.tolist(), len(gr)]
    est_round = [int(round(d.est_ns)) for d in drafts]
    groups: list[tuple[str, str, list[int], list[list[int]]]] = []
    for g0, g1 in zip(gstart, gend, strict=True):
        if g0 == g1:
            continue
        ts_g, us_g = ct[g0:g1], cu[g0:g1]
        tcuts = (np.flatnonzero(np.diff(ts_g)) + 1).tolist()
        ts = ts_g[[0, *tcuts]].tolist()
        us_l = us_g.tolist()
        bounds = [0, *tcuts, len(us_l)]
        us = [us_l[bounds[j] : bounds[j + 1]] for j in range(len(ts))]
        groups.append((stage_names[int(stage_of[us_l[0]])], "", ts, us))
    decisions: list[EdgeDecision] = []
    fine_pairs: set[tuple[str, str]] = set()
    named: list[tuple[str, str, list[int], list[list[int]]]] = []
    # Routed experts: expected / sampled task costs (plow.schedule.routing)
    rload = _routed_load(tg, graph, drafts, overhead) if opt.fine == "auto" else None
    est_list = [d.est_ns for d in drafts]
    for ps, _, ts, us in groups:
        cs = drafts[ts[0]].stage
        named.append((ps, cs, ts, us))
        costs = tuple(est_round[t] for t in ts)
        unequal = len(set(costs)) > 1  # Plow.Collapse.slices_unequal
        nprod = len(stage_tasks[ps])
        all_full = all(len(v) == nprod for v in us)
        routed_c = rload is not None and ts[0] in rload.sampled
        routed_p = rload is not None and stage_tasks[ps][0] in rload.sampled
        if opt.fine == "never":
            fine, why = False, "coarse forced (fine='never')"
        elif opt.fine == "always":
            fine, why = True, "fine forced (fine='always')"
        elif not unequal and not routed_c:
            fine, why = (
                False,
                (
                    f"{len(costs)} consumer slice(s) of equal cost {costs[0]} ns"
                    + (" in every routing" if routed_p else "")
                    + ": coarse is optimal (C8"
                    + ("; C7 lets the routed producer slices cost anything" if routed_p else "")
                    + ")"
                ),
            )
        elif routed_c:
            assert rload is not None
            note = rload.note[drafts[ts[0]].op]
            fine, why = _routed_decision(
                rload, note, stage_tasks[ps], ts, us, est_list, all_full, overhead, lat["device"]
            )
        elif all_full:
            fine, why = (
                False,
                (
                    f"consumer slice costs differ ({min(costs)}..{max(costs)} ns) "
                    "but every slice reads "
                    f"all {nprod} producer task(s): a fine counter would equal the coarse one"
                ),
            )
        else:
            fine, why = (
                True,
                (
                    f"consumer slice costs differ ({min(costs)}..{max(costs)} ns) and slices read "
                    f"different producer subsets: fine counters (C8 cannot certify coarse; C9)"
                ),
            )
        if fine:
            fine_pairs.add((ps, cs))
        decisions.append(EdgeDecision(ps, cs, fine, why, costs))

    counters: list[Counter] = []
    waits: list[list[int]] = [[] for _ in drafts]
    signals: list[list[int]] = [[] for _ in drafts]
    coarse_id: dict[str, int] = {}

    def coarse(stage: str) -> int:
        if stage not in coarse_id:
            coarse_id[stage] = len(counters)
            counters.append(fresh_counter(len(counters), f"{stage}.done", stage))
            for u in stage_tasks[stage]:
                signals[u].append(coarse_id[stage])
        return coarse_id[stage]

    for ps, cs, ts, us in named:
        if (ps, cs) in fine_pairs:
            for t, ul in zip(ts, us, strict=True):
                cid = len(counters)
                counters.append(
                    fresh_counter(cid, f"{ps}->{drafts[t].name}", ps, True, drafts[t].name)
                )
                for u in ul:
                    signals[u].append(cid)
                waits[t].append(cid)
        else:
            c = coarse(ps)
            for t in ts:
                wt = waits[t]
                if c not in wt:
                    wt.append(c)
    # Stages nobody reads still get their op's counter (the seed's one counter per op; a
    # dead counter when no task waits on it — C4 drops it).
    read_stages = {ps for ps, _, _, _ in named}
    for stage in stage_tasks:
        if not stage.endswith(".load") and stage not in read_stages:
            coarse(stage)

    # -- assemble ---------------------------------------------------------------------------
    tasks = tuple(
        Task(  # positional: the field order of Task (index .. weight_bytes)
            i,
            d.name,
            d.op,
            d.kind,
            d.units,
            d.worker,
            d.worker // W,
            (d.worker % W) * P // W,
            tuple(waits[i]),
            tuple(signals[i]),
            d.est_ns,
            d.partial,
            d.weight_bytes,
        )
        for i, d in enumerate(drafts)
    )
    wk = np.array([d.worker for d in drafts], dtype=np.int64)
    wu, wt = wk[eu], wk[et]
    other_gpu = wu // W != wt // W
    other_part = ~other_gpu & ((wu % W) * P // W != (wt % W) * P // W)
    xgpu = int(eb_all[other_gpu].sum())
    xpart = int(eb_all[other_part].sum())
    sched = Schedule(
        bucket=tg.bucket,
        target=target.name,
        gpus=tp,
        workers_per_gpu=W,
        l2_partitions=P,
        tasks=tasks,
        queues=tuple(tuple(q) for q in queues),
        counters=tuple(counters),
        edges=tuple(edge_list),
        op_edges=tuple(tg.edges),
        ops=tuple(o.name for o in tg.ops),
        decisions=tuple(decisions),
        l2_aware=opt.l2_aware,
        cross_partition_bytes=xpart,
        cross_gpu_bytes=xgpu,
    )
    sched = rescope(sched)
    if opt.passes:
        sched = run_passes(sched, target)
    return with_makespan(sched, target)


def run_passes(s: Schedule, target: Target) -> Schedule:
    """C4, C5, C6 in that order; each report is appended to `s.reports`."""
    reports = list(s.reports)
    s, r = drop_implied_counters(s)
    reports.append(r)
    s, r = merge_same_dependency(s)
    reports.append(r)
    budget = target.l2_bytes // max(1, target.workers)
    s, r = hoist_loads(s, budget)
    reports.append(r)
    return replace(compact(s), reports=tuple(reports))


def with_makespan(s: Schedule, target: Target) -> Schedule:
    """The schedule with `makespan_ns` from the counter-gated simulation."""
    lat: dict[str, float] = {k: float(v) for k, v in target.atomic_latency_ns.items()}
    tl = simulate(s, lat, float(target.launch_overhead_ns))
    return replace(s, makespan_ns=math.inf if tl.stuck else tl.makespan_ns)
