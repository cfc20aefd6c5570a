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

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from plow.emit.files import (
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
from plow.emit.wire import NO_COUNTER, PACKET_DTYPE, Flag, Opcode, PacketArray
from plow.errors import PlowError
from plow.graph import Bucket, OpGraph
from plow.memory.arena import Arena, split_steps
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
    "lm_head": Opcode.LM_HEAD,
    "sample": Opcode.SAMPLE,
    "router": Opcode.ROUTER,
    "expert_linear": Opcode.EXPERT_LINEAR,
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
    """The schedule in stream order (tasks renumbered queue by queue)."""
    order = [t for q in s.queues for t in q]
    new = {old: i for i, old in enumerate(order)}
    op_index = {op.name: i for i, op in enumerate(graph.ops)}
    tops = {o.name: o for o in tg.ops}
    cols: dict[str, list[Any]] = {k: [] for k in TaskColumns.model_fields}
    for old in order:
        t = s.tasks[old]
        u0, n = t.units[0], len(t.units)
        if t.units != tuple(range(u0, u0 + n)):
            raise PlowError(f"task {t.name}", f"units {t.units[:4]}... are not one contiguous run")
        masked = t.kind in (TaskKind.compute, TaskKind.load) and any(
            tops[t.op].tiles[u].masked for u in t.units
        )
        for k, v in (
            ("name", t.name),
            ("op", op_index[t.op]),
            ("kind", t.kind.value),
            ("unit_start", u0),
            ("unit_count", n),
            ("worker", t.worker),
            ("waits", list(t.waits)),
            ("signals", list(t.signals)),
            ("est_ns", round(t.est_ns)),
            ("partial", t.partial),
            ("masked", masked),
        ):
            cols[k].append(v)
    p = pages.tasks
    edges: list[int] = []
    for pu, ct in s.edges:
        edges += (new[pu], new[ct])
    return ScheduleFile(
        bucket=s.bucket,
        workers=s.workers,
        gpus=s.gpus,
        workers_per_gpu=s.workers_per_gpu,
        makespan_ns=float(s.makespan_ns),
        tasks=TaskColumns(**cols),
        counters=CounterColumns(
            name=[c.name for c in s.counters],
            threshold=[c.threshold for c in s.counters],
            scope=[c.scope for c in s.counters],
        ),
        edges=edges,
        pages=PageColumns(
            budget_pages=pages.budget_pages,
            page_bytes=pages.page_bytes,
            start=[p[o].start for o in order],
            finish=[p[o].finish for o in order],
            load=[p[o].load for o in order],
            weight_pages=[p[o].weight_pages for o in order],
            act_pages=[p[o].act_pages for o in order],
        ),
        arena=ArenaMap(
            arena_bytes=arena.arena_bytes,
            align=arena.align,
            buffers=[
                ArenaBuffer(name=b.name, region=b.region, offset=b.offset, size=b.size)
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
    thr = sf.counters.threshold
    scope = [SCOPE_CODE[x] for x in sf.counters.scope]
    ncount = len(thr)
    cols: dict[str, list[int]] = {f: [] for f in _FIELDS}
    t = sf.tasks

    def add(*vals: int) -> None:
        for f, v in zip(_FIELDS, vals, strict=True):
            cols[f].append(v)

    for i in range(len(t.name)):
        opi, kind, w = t.op[i], t.kind[i], t.worker[i]
        if not 0 <= opi < len(per_op):
            raise PlowError(f"task {t.name[i]}", f"op index {opi} outside the op table")
        code, a_in, a_w, a_out, a_part = per_op[opi]
        for c in (*t.waits[i], *t.signals[i]):
            if not 0 <= c < ncount:
                raise PlowError(f"task {t.name[i]}", f"counter {c} does not exist ({ncount})")
        flags = 0
        if kind == "load":
            code, a_in, a_out = int(Opcode.LOAD), 0, 0
        elif kind in ("merge", "allreduce"):
            if kind == "allreduce":
                code = int(Opcode.ALLREDUCE)
            elif code == Opcode.ATTENTION:
                code = int(Opcode.ATTENTION_MERGE)
            a_in = a_part if a_part is not None else a_in
            flags |= Flag.ACCUMULATE
        elif t.partial[i] and a_part is not None:
            a_out = a_part
        if t.masked[i]:
            flags |= Flag.MASKED
        waits, sigs = t.waits[i], t.signals[i]
        for c in waits[:-1]:
            add(0, 0, 0, w, opi, c, thr[c], NO_COUNTER, 0, 0, 0, 0, 0)
        wc = waits[-1] if waits else NO_COUNTER
        wt = thr[wc] if waits else 0
        sc = sigs[0] if sigs else NO_COUNTER
        add(
            code,
            flags,
            scope[sc] if sigs else 0,
            w,
            opi,
            wc,
            wt,
            sc,
            t.unit_start[i],
            t.unit_count[i],
            a_in,
            a_w,
            a_out,
        )
        for c in sigs[1:]:
            add(0, 0, scope[c], w, opi, NO_COUNTER, 0, c, 0, 0, 0, 0, 0)
    arr = np.zeros(len(cols["opcode"]), dtype=PACKET_DTYPE)
    for f in _FIELDS:
        arr[f] = np.asarray(cols[f], dtype=np.uint64).astype(PACKET_DTYPE[f])
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
    return EmittedBucket(bucket, ot, sf, emit_packets(sf, ot))
