"""Emit: a bucket's schedule + arena → its packet stream (wire v1), op table and schedule file.

One packet per task, in stream order: worker 0's queue, then worker 1's, ... (so each
worker's queue is a contiguous run of the plan file). Conventions (docs/wire.md
"Emitter conventions"):

- `opcode` from the op kind (merge of a split attention: `attention_merge`; allreduce tasks:
  `allreduce`; weight loads: `load`); `op_index` the op's index in the op table.
- `row_start`, `rows`: the task's unit range — tile indices `[row_start, row_start + rows)`
  of the op (row-major over the op's `axes` in the op table, last axis fastest), or output
  blocks of a split reduction for merge packets. `col_start`, `cols` are 0.
- `in_offset` / `weight_offset` / `out_offset`: arena offsets of the op's first input, second
  input (the weight for weight ops) and output. A split reduction's compute packets write
  their fp32 partials to the op's `<op>#partial` buffer (`out_offset`); its merge packets
  (flag `ACCUMULATE`) read them (`in_offset`) and write the output.
- `MASKED` when a tile of the task overhangs an axis extent.
- Waits: a task waiting on k counters is preceded on its queue by k-1 `nop` packets carrying
  the first k-1 waits; the task packet carries the last. Signals: the task packet carries
  the first; each further one is a `nop` packet after it. A nop never both waits and
  signals, so the stream parses back into tasks (`group_tasks`).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from plow.bundle.argmax import argmax_bounds, argmax_name, argmax_rows, fused_pair, index_name
from plow.bundle.files import (
    FORMAT,
    ArenaBuffer,
    ArenaMap,
    AxisEntry,
    CounterColumns,
    OpCost,
    OpEntry,
    OpTable,
    PageColumns,
    ScheduleFile,
    TaskColumns,
    TensorEntry,
    TilingInfo,
)
from plow.bundle.wire import NO_COUNTER, PACKET_DTYPE, Flag, Opcode, PacketArray
from plow.errors import PlowError
from plow.graph import Bucket, OpGraph
from plow.memory.arena import Arena, partial_numel, split_steps
from plow.memory.onchip import PagePlan
from plow.schedule.ir import Schedule, TaskKind
from plow.target.model import Target
from plow.tiles.ir import TileGraph

OPCODE_OF_KIND: dict[str, Opcode] = {
    "embedding": Opcode.EMBED,
    "rmsnorm": Opcode.RMSNORM,
    "linear": Opcode.LINEAR,
    "rope": Opcode.ROPE,
    "attention": Opcode.ATTENTION,
    "gated_mlp": Opcode.MLP_GATE_UP,
    "residual_add": Opcode.RESIDUAL_ADD,
    "allreduce": Opcode.ALLREDUCE,  # tensor parallel (plow/graph/shard.py)
    # fused ops (plow/egraph/apply.py): the opcode of their main canonical op; the op table's
    # kind says which (R1: a norm packet; R2+R3+R13: the gate/up linear with the glu epilogue)
    "add_rmsnorm": Opcode.RMSNORM,
    "linear_glu": Opcode.MLP_GATE_UP,
    "linear_qkv": Opcode.LINEAR,  # R4: the q/k/v projections over cat3(Wq, Wk, Wv)
    "lm_head": Opcode.LM_HEAD,
    "sample": Opcode.SAMPLE,
    "router": Opcode.ROUTER,
    "expert_linear": Opcode.EXPERT_LINEAR,
    "ssm_conv": Opcode.SSM_CONV,
    "ssm_scan": Opcode.SSM_SCAN,
    "ssm_norm": Opcode.SSM_NORM,
    "kda": Opcode.KDA,
}
SCOPE_CODE = {"cta": 0, "device": 1, "system": 2}


@dataclass(frozen=True, slots=True)
class EmittedBucket:
    bucket: Bucket
    op_table: OpTable
    schedule: ScheduleFile
    packets: PacketArray


def _jsonable(attrs: Any) -> dict[str, Any]:
    return dict(json.loads(json.dumps(dict(attrs), default=str)))


def op_table(
    bucket: Bucket, graph: OpGraph, tg: TileGraph, arena: Arena, target: Target, budget_ns: int
) -> OpTable:
    """The op table of one bucket (docs/bundle.md "Op table")."""
    bufs = arena.by_name()
    split = split_steps(tg)
    tops = {o.name: o for o in tg.ops}
    tensors: dict[str, TensorEntry] = {}
    for name, t in graph.tensors.items():
        b = bufs[name]
        tensors[name] = TensorEntry(
            shape=list(t.shape),
            dtype=t.dtype,
            role=t.role.value,
            region=b.region,
            offset=b.offset,
            size=b.size,
        )
    ops: list[OpEntry] = []
    for i, op in enumerate(graph.ops):
        top = tops[op.name]
        partial = None
        if op.name in split:
            kind, steps = split[op.name]
            partial = f"{op.name}#partial"
            out_shape = list(graph.tensor(op.outputs[0]).shape)
            if kind in ("linear_glu", "linear_qkv"):  # [steps, .., gate/up pairs or q|k|v]
                out_shape[-1] = partial_numel(graph, i) // max(1, math.prod(out_shape[:-1]))
            b = bufs[partial]
            tensors[partial] = TensorEntry(
                shape=[steps, *out_shape, *([2] if kind == "sample" else [])],
                dtype="float32",
                role="scratch",
                region="scratch",
                offset=b.offset,
                size=b.size,
            )
        ops.append(
            OpEntry(
                index=i,
                name=op.name,
                kind=op.kind.value,
                layer=op.layer,
                attrs=_jsonable(op.attrs),
                inputs=list(op.inputs),
                outputs=list(op.outputs),
                opcode=int(OPCODE_OF_KIND[op.kind.value]),
                axes=[
                    AxisEntry(name=a.name, extent=a.extent, tile=a.tile, steps=a.steps)
                    for a in top.axes
                ],
                cost=OpCost(
                    flops_per_point=top.flops_per_point,
                    flops=top.flops,
                    charged_cost=top.charged_cost,
                    bytes=top.bytes,
                ),
                partial=partial,
            )
        )
    return OpTable(
        bucket=bucket.name,
        phase=bucket.phase.value,
        batch=bucket.batch,
        seq=bucket.seq,
        context=bucket.context,
        arena_bytes=arena.arena_bytes,
        ops=ops,
        tensors=tensors,
        tiling=TilingInfo(
            budget_ns=budget_ns,
            peak_flops_per_s=tg.peak_flops_per_s,
            bandwidth_bytes_per_s=tg.bandwidth_bytes_per_s,
            min_tile=target.min_tile_any_axis,
            weight_bytes=tg.weight_bytes,
            activation_dtype=tg.activation_dtype,
            cache_dtype=tg.cache_dtype,
        ),
    )


def schedule_file(
    s: Schedule, graph: OpGraph, tg: TileGraph, pages: PagePlan, arena: Arena
) -> ScheduleFile:
    """The schedule in stream order (tasks renumbered queue by queue).

    Built from values of the right types, so the models are constructed without
    re-validating hundreds of thousands of list entries (`model_construct`)."""
    order = [t for q in s.queues for t in q]
    op_index = {op.name: i for i, op in enumerate(graph.ops)}
    # Per op, the running count of masked tiles: a run [u0, u0 + n) holds a masked tile
    # when the count grows across it.
    masked_upto = {
        o.name: [0, *np.cumsum([tl.masked for tl in o.tiles], dtype=np.int64).tolist()]
        for o in tg.ops
    }
    tasks = [s.tasks[old] for old in order]
    for t in tasks:
        u0, n = t.units[0], len(t.units)
        if t.units != tuple(range(u0, u0 + n)):
            raise PlowError(f"task {t.name}", f"units {t.units[:4]}... are not one contiguous run")
    tiled = (TaskKind.compute, TaskKind.load)
    masked = [
        t.kind in tiled and masked_upto[t.op][t.units[-1] + 1] > masked_upto[t.op][t.units[0]]
        for t in tasks
    ]
    cols = TaskColumns.model_construct(
        name=[t.name for t in tasks],
        op=[op_index[t.op] for t in tasks],
        kind=[t.kind.value for t in tasks],
        unit_start=[t.units[0] for t in tasks],
        unit_count=[len(t.units) for t in tasks],
        worker=[t.worker for t in tasks],
        waits=[list(t.waits) for t in tasks],
        signals=[list(t.signals) for t in tasks],
        est_ns=[round(t.est_ns) for t in tasks],
        partial=[t.partial for t in tasks],
        masked=masked,
    )
    p = pages.tasks
    new = np.empty(len(s.tasks), dtype=np.int64)
    new[np.asarray(order, dtype=np.int64)] = np.arange(len(order), dtype=np.int64)
    edges: list[int] = new[np.asarray(s.edges, dtype=np.int64).reshape(-1)].tolist()
    pt = [p[o] for o in order]
    return ScheduleFile.model_construct(
        format=FORMAT,
        bucket=s.bucket,
        workers=s.workers,
        gpus=s.gpus,
        workers_per_gpu=s.workers_per_gpu,
        makespan_ns=float(s.makespan_ns),
        tasks=cols,
        counters=CounterColumns.model_construct(
            name=[c.name for c in s.counters],
            threshold=[c.threshold for c in s.counters],
            scope=[c.scope for c in s.counters],
        ),
        edges=edges,
        pages=PageColumns.model_construct(
            budget_pages=pages.budget_pages,
            page_bytes=pages.page_bytes,
            start=[x.start for x in pt],
            finish=[x.finish for x in pt],
            load=[x.load for x in pt],
            weight_pages=[x.weight_pages for x in pt],
            act_pages=[x.act_pages for x in pt],
        ),
        arena=ArenaMap.model_construct(
            arena_bytes=arena.arena_bytes,
            align=arena.align,
            buffers=[
                ArenaBuffer.model_construct(
                    name=b.name, region=b.region, offset=b.offset, size=b.size
                )
                for b in arena.buffers
            ],
        ),
        passes=[f"{r.name} ({r.theorem}): {r.changed} changed" for r in s.reports],
    )


_FIELDS = (
    "opcode",
    "flags",
    "scope",
    "worker",
    "op_index",
    "wait_counter",
    "wait_threshold",
    "signal_counter",
    "row_start",
    "rows",
    "in_offset",
    "weight_offset",
    "out_offset",
)


def emit_packets(sf: ScheduleFile, ot: OpTable) -> PacketArray:
    """The packet stream of a bucket from its schedule file and op table (pure: `plow verify`
    re-runs it on the bundle's files and checkpoint E compares the result with the plan file).

    Offsets come from the schedule file's arena map (checkpoint F checks that map)."""
    offs = {b.name: b.offset for b in sf.arena.buffers}

    def off(name: str | None) -> int:
        if name is None:
            return 0
        if name not in offs:
            raise PlowError(f"bucket {sf.bucket}", f"tensor {name!r} has no arena offset")
        return offs[name]

    per_op: list[tuple[int, int, int, int, int | None]] = []  # opcode, in, weight, out, partial
    for op in ot.ops:
        per_op.append(
            (
                op.opcode,
                off(op.inputs[0]) if op.inputs else 0,
                off(op.inputs[1]) if len(op.inputs) > 1 else 0,
                off(op.outputs[0]),
                off(op.partial) if op.partial else None,
            )
        )
    thr = np.asarray(sf.counters.threshold, dtype=np.int64).reshape(-1)
    scope = np.asarray([SCOPE_CODE[x] for x in sf.counters.scope], dtype=np.int64).reshape(-1)
    ncount = len(thr)
    t = sf.tasks
    n = len(t.name)
    i64 = np.int64
    opi = np.asarray(t.op, dtype=i64).reshape(-1)
    bad = np.flatnonzero((opi < 0) | (opi >= len(per_op)))
    nw = np.fromiter(map(len, t.waits), dtype=i64, count=n)
    ns = np.fromiter(map(len, t.signals), dtype=i64, count=n)
    wflat = np.fromiter(itertools.chain.from_iterable(t.waits), dtype=i64, count=int(nw.sum()))
    sflat = np.fromiter(itertools.chain.from_iterable(t.signals), dtype=i64, count=int(ns.sum()))
    wtask = np.repeat(np.arange(n, dtype=i64), nw)
    stask = np.repeat(np.arange(n, dtype=i64), ns)
    badc = np.concatenate(
        [wtask[(wflat < 0) | (wflat >= ncount)], stask[(sflat < 0) | (sflat >= ncount)]]
    )
    if len(bad) or len(badc):  # the first offending task, in stream order
        i = int(min([*bad.tolist(), *badc.tolist()]))
        if not 0 <= t.op[i] < len(per_op):
            raise PlowError(f"task {t.name[i]}", f"op index {t.op[i]} outside the op table")
        c = next(c for c in (*t.waits[i], *t.signals[i]) if not 0 <= c < ncount)
        raise PlowError(f"task {t.name[i]}", f"counter {c} does not exist ({ncount})")
    ops = np.array([(*x[:4], -1 if x[4] is None else x[4]) for x in per_op], dtype=i64).reshape(
        -1, 5
    )
    code, a_in, a_w, a_out, a_part = (ops[opi, j] for j in range(5))
    kind = np.asarray(t.kind, dtype=object)
    is_load = kind == "load"
    is_all = kind == "allreduce"
    is_merge = (kind == "merge") | is_all
    has_part = a_part >= 0
    flags = np.where(is_merge, int(Flag.ACCUMULATE), 0) | np.where(
        np.asarray(t.masked, dtype=bool), int(Flag.MASKED), 0
    )
    # greedy fused into lm_head (`fuse_argmax`): every non-load packet of both ops
    fused_op = np.asarray([op.argmax is not None for op in ot.ops] or [False], dtype=bool)
    flags = flags | np.where(~is_load & fused_op[opi], int(Flag.FUSED_ARGMAX), 0)
    code = np.where(
        is_load,
        int(Opcode.LOAD),
        np.where(
            is_all,
            int(Opcode.ALLREDUCE),
            np.where(is_merge & (code == int(Opcode.ATTENTION)), int(Opcode.ATTENTION_MERGE), code),
        ),
    )
    a_in = np.where(is_load, 0, np.where(is_merge & has_part, a_part, a_in))
    part = np.asarray(t.partial, dtype=bool)
    a_out = np.where(is_load, 0, np.where(~is_merge & part & has_part, a_part, a_out))
    # Stream layout per task: max(w-1, 0) wait nops, the task packet, max(s-1, 0) signal nops.
    lead = np.maximum(nw - 1, 0)
    size = lead + 1 + np.maximum(ns - 1, 0)
    first = np.cumsum(size) - size
    main = first + lead
    total = int(size.sum())
    cols = {f: np.zeros(total, dtype=i64) for f in _FIELDS}
    worker = np.asarray(t.worker, dtype=i64).reshape(-1)
    tw = np.repeat(np.arange(n, dtype=i64), size)
    cols["worker"] = worker[tw]
    cols["op_index"] = opi[tw]
    cols["wait_counter"][:] = NO_COUNTER
    cols["signal_counter"][:] = NO_COUNTER
    # the task packets
    last_w = np.cumsum(nw) - 1  # index into wflat of each task's last wait
    has_w = nw > 0
    wc = np.where(has_w, wflat[np.where(has_w, last_w, 0)] if len(wflat) else 0, NO_COUNTER)
    has_s = ns > 0
    first_s = np.cumsum(ns) - ns
    sc = np.where(has_s, sflat[np.where(has_s, first_s, 0)] if len(sflat) else 0, NO_COUNTER)
    cols["opcode"][main] = code
    cols["flags"][main] = flags
    cols["scope"][main] = np.where(has_s, scope[np.where(has_s, sc, 0)] if ncount else 0, 0)
    cols["wait_counter"][main] = wc
    cols["wait_threshold"][main] = np.where(has_w, thr[np.where(has_w, wc, 0)] if ncount else 0, 0)
    cols["signal_counter"][main] = sc
    cols["row_start"][main] = np.asarray(t.unit_start, dtype=i64).reshape(-1)
    cols["rows"][main] = np.asarray(t.unit_count, dtype=i64).reshape(-1)
    cols["in_offset"][main] = a_in
    cols["weight_offset"][main] = a_w
    cols["out_offset"][main] = a_out
    # wait nops: every wait but the last, before the task packet
    wpos = np.arange(len(wflat), dtype=i64) - np.repeat(np.cumsum(nw) - nw, nw)
    wk = wpos < nw[wtask] - 1
    at = first[wtask[wk]] + wpos[wk]
    cols["wait_counter"][at] = wflat[wk]
    cols["wait_threshold"][at] = thr[wflat[wk]]
    # signal nops: every signal but the first, after the task packet
    spos = np.arange(len(sflat), dtype=i64) - np.repeat(first_s, ns)
    sk = spos > 0
    at = main[stask[sk]] + spos[sk]
    cols["signal_counter"][at] = sflat[sk]
    cols["scope"][at] = scope[sflat[sk]]
    arr = np.zeros(total, dtype=PACKET_DTYPE)
    for f in _FIELDS:
        arr[f] = cols[f].astype(np.uint64).astype(PACKET_DTYPE[f])
    return arr


def emit_bucket(
    bucket: Bucket,
    graph: OpGraph,
    tg: TileGraph,
    s: Schedule,
    pages: PagePlan,
    arena: Arena,
    target: Target,
    budget_ns: int,
) -> EmittedBucket:
    ot = op_table(bucket, graph, tg, arena, target, budget_ns)
    sf = schedule_file(s, graph, tg, pages, arena)
    ot, sf = fuse_argmax(ot, sf)
    return EmittedBucket(bucket, ot, sf, emit_packets(sf, ot))


def _up(x: int, a: int) -> int:
    return -(-x // a) * a


def fuse_argmax(ot: OpTable, sf: ScheduleFile) -> tuple[OpTable, ScheduleFile]:
    """The compiler's decision to fuse greedy sampling into lm_head (plow/bundle/argmax.py):
    when a sample op reads an lm_head's logits, both ops name `<lm_head>#argmax`, and the
    values and index buffers `[chunks, M]` are placed after every other buffer of the arena
    (their own bytes: no planner reuse to certify); `emit_packets` then sets FUSED_ARGMAX on
    both ops' packets. The tables unchanged when there is nothing to fuse."""
    pair = fused_pair(ot.ops)
    if pair is None:
        return ot, sf
    lm, si = ot.ops[pair[0]], ot.ops[pair[1]]
    chunks = len(argmax_bounds(ot, lm, sf.workers_per_gpu)) - 1
    rows = argmax_rows(lm)
    align = sf.arena.align
    at = _up(sf.arena.arena_bytes, align)
    tensors = dict(ot.tensors)
    buffers = list(sf.arena.buffers)
    for name, dtype in ((argmax_name(lm.name), "float32"), (index_name(lm.name), "int32")):
        size = chunks * rows * 4
        tensors[name] = TensorEntry(
            shape=[chunks, rows], dtype=dtype, role="scratch", region="scratch",
            offset=at, size=size,
        )  # fmt: skip
        buffers.append(ArenaBuffer(name=name, region="scratch", offset=at, size=size))
        at = _up(at + size, align)
    ops = list(ot.ops)
    for i in pair:
        ops[i] = ops[i].model_copy(update={"argmax": argmax_name(lm.name)})
    del si
    ot = ot.model_copy(update={"ops": ops, "tensors": tensors, "arena_bytes": at})
    arena_map = sf.arena.model_copy(update={"arena_bytes": at, "buffers": buffers})
    return ot, sf.model_copy(update={"arena": arena_map})
