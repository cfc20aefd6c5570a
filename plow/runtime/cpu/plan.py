"""The in-memory plan the CPU executor runs: for one bucket, the op table, one packet per
schedule task, the schedule (queues, counters, edges) and the arena layout.

A `Packet` is the decoded form of what the emitter writes (issue 5): which op (an index into
the op table), what kind of work (compute / partial / merge), and the units — tile boxes for
compute, output blocks for merges. `plan_from_parts` builds it from the schedule, tile graph and
op graph in memory; a bundle loader produces the same `Plan` from the op table and the decoded
packet stream, so the machine and the kernels never see where a plan came from.

Conventions the kernels rely on (they are the tiler's and the schedule's, restated):

- a tile's `ranges` are half-open per axis, in the op's axis order (`plow.tiles.tiler`);
- a split reduction's partial tiles write `<op>#partial` at their step along the reduction
  axis; merge block `j` is the `j`-th distinct tile box off the reduction axis, in tile order,
  possibly cut into column chunks of the output (`plow.schedule.regions`); a merge reduces
  the steps in ascending order;
- attention rows are ordered `((b * kv_heads + kv) * T + t) * group + g` (query head
  `kv * group + g` of token `t` of batch row `b`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from plow.graph import Bucket, OpGraph, Phase, TensorRole
from plow.runtime.cpu.arena import KVShape, Layout, LayoutBuilder
from plow.schedule import Schedule, TaskKind
from plow.schedule.regions import REDUCTION_AXIS, Regions, partial_name
from plow.tiles.ir import TiledOp, TileGraph

Ranges = tuple[tuple[int, int], ...]
Work = Literal["compute", "partial", "merge", "load"]

PAGE_TABLE = "page_table"
STATE_SLOT = "state_slot"  # [B] each row's recurrent-state slot (graphs with state tensors)
RING = "token_ring"  # [ring, B] sampled ids of the steps of one multi-step quantum
REMAINING = "remaining"  # [B] tokens a row may still generate inside a quantum


@dataclass(frozen=True, slots=True)
class OpEntry:
    """One row of the op table."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(hash=False)
    layer: int | None
    extents: tuple[int, ...]
    tiles: tuple[int, ...]  # tile size per axis
    steps: tuple[int, ...]
    reduction_axis: int | None  # set when the op's reduction is split across tiles

    @property
    def split(self) -> bool:
        return self.reduction_axis is not None


@dataclass(frozen=True, slots=True)
class Packet:
    """One schedule task's work. `units` are tile ranges (compute / partial: with `steps` the
    tile's index along the reduction axis) or merge-block ranges (reduction axis spanning the
    whole extent, and `cols` the columns of the output's 2-D view the unit writes)."""

    task: int
    op: int
    work: Work
    units: tuple[Ranges, ...]
    steps: tuple[int, ...] = ()
    cols: tuple[tuple[int, int], ...] = ()  # merge: output columns of each unit


@dataclass(frozen=True, slots=True)
class MergeUnit:
    ranges: Ranges
    cols: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Stream:
    """The queue entries the machine runs. An entry is one packet: the task packet (`runs`:
    it computes its task's units) or a `nop` (waits / signals only). In-memory plans have one
    entry per task carrying all its waits and signals; a plan loaded from a bundle has one
    entry per record of the plan file, nops included, each with at most one wait and one
    signal and the threshold the record carries (docs/wire.md "Emitter conventions").

    Indices: `entries` are numbered in stream (file) order; `queues[w]` lists worker `w`'s
    entries in queue order; `main[t]` is the entry that runs task `t`; `edges` are the
    schedule's task-level dependencies (the checking mode requires each to be ordered)."""

    task_of: tuple[int, ...]
    runs: tuple[bool, ...]
    waits: tuple[tuple[tuple[int, int], ...], ...]  # (counter, threshold) per entry
    signals: tuple[tuple[int, ...], ...]
    packet: tuple[int, ...]  # record index in the plan file (in-memory plans: the task)
    queues: tuple[tuple[int, ...], ...]
    main: tuple[int, ...]
    task_names: tuple[str, ...]
    task_workers: tuple[int, ...]
    counter_names: tuple[str, ...]
    edges: tuple[tuple[int, int], ...]
    from_packets: bool = False

    @property
    def nops(self) -> int:
        return len(self.runs) - len(self.main)


def stream_from_schedule(s: Schedule) -> Stream:
    """One entry per task (the in-memory plan: no nops)."""
    thr = [c.threshold for c in s.counters]
    n = len(s.tasks)
    return Stream(
        task_of=tuple(range(n)),
        runs=(True,) * n,
        waits=tuple(tuple((c, thr[c]) for c in dict.fromkeys(t.waits)) for t in s.tasks),
        signals=tuple(tuple(dict.fromkeys(t.signals)) for t in s.tasks),
        packet=tuple(range(n)),
        queues=tuple(tuple(q) for q in s.queues),
        main=tuple(range(n)),
        task_names=tuple(t.name for t in s.tasks),
        task_workers=tuple(t.worker for t in s.tasks),
        counter_names=tuple(c.name for c in s.counters),
        edges=tuple(s.edges),
    )


@dataclass(frozen=True, slots=True)
class FusedArgmax:
    """Greedy sampling fused into the output projection (docs/wire.md flag `FUSED_ARGMAX`).

    Every task that writes columns of `lm_head`'s logits (its compute tiles, or the merges of
    a k-split) also writes, per chunk of its columns and per logits row, the chunk's (max value,
    lowest index of the max) to `<lm_head>#argmax` / `<lm_head>#argmax.index` `[chunks, M]`.
    Chunk `i` is columns `[bounds[i], bounds[i + 1])`: `bounds` are every column boundary of
    the lm_head units, so each unit covers whole chunks and each chunk has one writer. The
    sample op no longer scans the logits: its partial tasks only wait and signal, and its
    merge (or its single compute task when unsplit) reduces the chunks of each row's sampled
    position in ascending order, strict `>` (ties keep the lower index): the result is the
    full row's first maximum, the same bits as the unfused path, under every interleaving."""

    lm_head: str  # op name
    sample: str
    bounds: tuple[int, ...]

    @property
    def chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def values(self) -> str:
        return self.lm_head + "#argmax"

    @property
    def index(self) -> str:
        return self.lm_head + "#argmax.index"


@dataclass(frozen=True)
class Plan:
    """Everything the machine needs to run one step of `bucket`. A plan compiled in memory
    has `schedule` and `tiles` (its stream is derived from the schedule); a plan loaded from
    a bundle has `wire`, the stream decoded from the plan file, and `source`, the bundle."""

    bucket: Bucket
    graph: OpGraph
    tiles: TileGraph | None
    schedule: Schedule | None
    ops: tuple[OpEntry, ...]
    packets: tuple[Packet, ...]
    layout: Layout
    kv: KVShape
    ring: int
    wire: Stream | None = None
    source: str = ""
    fused: FusedArgmax | None = None  # greedy fused into lm_head (`fuse_argmax`)

    @property
    def batch(self) -> int:
        return self.bucket.batch

    @property
    def tokens(self) -> int:
        return self.bucket.tokens_per_row

    def op(self, packet: Packet) -> OpEntry:
        return self.ops[packet.op]

    @cached_property
    def stream(self) -> Stream:
        if self.wire is not None:
            return self.wire
        assert self.schedule is not None, "a plan needs a schedule or a decoded stream"
        return stream_from_schedule(self.schedule)

    def describe(self, entry: int) -> str:
        """An entry for error messages: its task, its packet (record index) and worker."""
        st = self.stream
        t = st.task_of[entry]
        name, w = st.task_names[t], st.task_workers[t]
        if st.runs[entry]:
            return f"task {t} {name!r} (packet {st.packet[entry]}, worker {w})"
        return f"nop packet {st.packet[entry]} of task {t} {name!r} (worker {w})"


def _op_table(tg: TileGraph, graph: OpGraph) -> tuple[OpEntry, ...]:
    gops = {op.name: op for op in graph.ops}
    out = []
    for top in tg.ops:
        op = gops[top.name]
        red = REDUCTION_AXIS.get(top.kind)
        split = red is not None and red < len(top.axes) and top.axes[red].steps > 1
        out.append(
            OpEntry(
                name=op.name,
                kind=op.kind.value,
                inputs=op.inputs,
                outputs=op.outputs,
                attrs=dict(op.attrs),
                layer=op.layer,
                extents=tuple(a.extent for a in top.axes),
                tiles=tuple(a.tile for a in top.axes),
                steps=tuple(a.steps for a in top.axes),
                reduction_axis=red if split else None,
            )
        )
    return tuple(out)


def layout_for(graph: OpGraph, ops: tuple[OpEntry, ...], kv: KVShape, ring: int) -> Layout:
    lb = LayoutBuilder()
    bucket_b = graph.tensor("ids").shape[0]
    decode = graph.tensor("ids").shape[1] == 1
    for name, t in graph.tensors.items():
        if t.role in (TensorRole.weight, TensorRole.cache, TensorRole.state):
            continue  # state: the arena's persistent region (`StateShape`), by slot
        if name == "sample" and decode:
            continue  # aliased onto `ids` below
        lb.add(name, t.shape, "int32" if t.dtype == "int32" else "float32")
    if decode:
        lb.alias("sample", "ids")  # the sampled id lands where the next step's embedding reads
    lb.add(PAGE_TABLE, (bucket_b, -(-max(1, _context(graph)) // kv.block_size)), "int32")
    lb.add(RING, (ring, bucket_b), "int32")
    if any(t.role is TensorRole.state for t in graph.tensors.values()):
        lb.add(STATE_SLOT, (bucket_b,), "int32")
    lb.add(REMAINING, (bucket_b,), "int32")
    for op in ops:
        if op.reduction_axis is None:
            continue
        s = op.steps[op.reduction_axis]
        pn = partial_name(op.name)
        if op.kind in ("linear", "lm_head", "expert_linear", "linear_qkv", "linear_glu"):
            m, n = op.extents[0], op.extents[1]
            lb.add(pn, (s, m, 2 * n if op.kind == "linear_glu" else n))
        elif op.kind == "attention":
            rows, d = op.extents[0], op.extents[2]
            lb.add(pn, (s, rows, d))
            lb.add(pn + ".ml", (s, rows, 2))
        elif op.kind in ("rmsnorm", "add_rmsnorm"):
            lb.add(pn, (s, op.extents[0]))
        elif op.kind == "sample":
            lb.add(pn, (s, op.extents[0]))
            lb.add(pn + ".index", (s, op.extents[0]), "int32")
        else:  # pragma: no cover - REDUCTION_AXIS lists exactly these kinds
            raise ValueError(f"no partial layout for {op.kind}")
    return lb.build()


def _context(graph: OpGraph) -> int:
    for t in graph.tensors.values():
        if t.role is TensorRole.cache:
            return t.shape[2]
    return 1


def merge_units(graph: OpGraph, top: TiledOp, op: OpEntry, workers: int) -> list[MergeUnit]:
    """The merge units of a split op, in the schedule's numbering: block `j` is the `j`-th
    distinct tile box off the reduction axis (tile order); the schedule may cut a block's
    output box into column chunks (consecutive units). Each unit is (block ranges with the
    reduction axis spanning its extent, columns of the output's 2-D view)."""
    red = op.reduction_axis
    assert red is not None
    reg = Regions(graph)
    if "merge_units" in inspect.signature(Regions.units).parameters:
        _, merges = reg.units(top, 0.0, 0.0, workers, 0.0)
    else:  # pragma: no cover - one merge unit per block
        _, merges = reg.units(top, 0.0, 0.0)
    blocks: dict[Ranges, list[tuple[int, int, int, int]]] = {}
    for t in top.tiles:
        key = t.ranges[:red] + ((0, op.extents[red]),) + t.ranges[red + 1 :]
        blocks.setdefault(key, []).append(reg.tile_boxes(top, t.ranges)[1])
    out: list[MergeUnit] = []
    it = iter(merges)
    for key, boxes in blocks.items():
        c0, c1 = min(b[2] for b in boxes), max(b[3] for b in boxes)
        at = c0
        while at < c1:
            u = next(it)
            wc0, wc1 = u.write[1][2], u.write[1][3]
            if wc0 != at or wc1 <= wc0:
                raise ValueError(f"{op.name}: merge unit {u.index} does not continue block {key}")
            out.append(MergeUnit(key, (wc0, wc1)))
            at = wc1
    if next(it, None) is not None:
        raise ValueError(f"{op.name}: more merge units than blocks")
    return out


def plan_from_parts(
    bucket: Bucket,
    graph: OpGraph,
    tg: TileGraph,
    schedule: Schedule,
    kv: KVShape,
    ring: int = 8,
) -> Plan:
    """The executor's plan of one bucket from the compiler's in-memory results."""
    if bucket.phase is Phase.decode and bucket.tokens_per_row != 1:  # pragma: no cover
        raise ValueError("a decode bucket has one token per row")
    ops = _op_table(tg, graph)
    index = {o.name: i for i, o in enumerate(ops)}
    tile_ranges = {top.name: [t.ranges for t in top.tiles] for top in tg.ops}
    blocks = {
        o.name: merge_units(graph, tg.op(o.name), o, schedule.workers_per_gpu)
        for o in ops
        if o.reduction_axis is not None
    }
    packets = []
    for task in schedule.tasks:
        oi = index[task.op]
        op = ops[oi]
        if task.kind is TaskKind.load:
            packets.append(Packet(task.index, oi, "load", ()))  # a weight-slab prefetch: no-op here
            continue
        if task.kind in (TaskKind.merge, TaskKind.allreduce):
            mu = [blocks[op.name][j] for j in task.units]
            units = tuple(m.ranges for m in mu)
            packets.append(Packet(task.index, oi, "merge", units, cols=tuple(m.cols for m in mu)))
            continue
        ranges = tuple(tile_ranges[op.name][j] for j in task.units)
        if op.reduction_axis is not None:
            red = op.reduction_axis
            steps = tuple(r[red][0] // op.tiles[red] for r in ranges)
            packets.append(Packet(task.index, oi, "partial", ranges, steps))
        else:
            packets.append(Packet(task.index, oi, "compute", ranges))
    layout = layout_for(graph, ops, kv, ring)
    return Plan(bucket, graph, tg, schedule, ops, tuple(packets), layout, kv, ring)


def fuse_argmax(plan: Plan) -> Plan:
    """`plan` with greedy sampling fused into its lm_head tasks (`FusedArgmax`); the same plan
    when it has no sample op fed by an lm_head. The stream (queues, counters) is unchanged:
    the sample tasks keep their waits and signals, so every lm_head task is still ordered
    before the sample merge that reads its partials."""
    if plan.fused is not None:
        return plan
    sample = next((o for o in plan.ops if o.kind == "sample"), None)
    if sample is None:
        return plan
    lm = next(
        (
            i
            for i, o in enumerate(plan.ops)
            if o.kind == "lm_head" and sample.inputs[0] in o.outputs
        ),
        None,
    )
    if lm is None:
        return plan
    op = plan.ops[lm]
    bounds = {0, op.extents[1]}
    for p in plan.packets:
        if p.op != lm:
            continue
        if p.work == "compute":
            for u in p.units:
                bounds.update(u[1])
        elif p.work == "merge":
            for u, c in zip(p.units, p.cols, strict=True):
                n0, n1 = max(u[1][0], c[0]), min(u[1][1], c[1])
                if n1 > n0:
                    bounds.update((n0, n1))
    fused = FusedArgmax(op.name, sample.name, tuple(sorted(bounds)))
    lb = LayoutBuilder()
    for name, sl in plan.layout.slots.items():
        lb.place(name, sl.offset, sl.shape, sl.dtype)
    for name, target in plan.layout.aliases.items():
        lb.alias(name, target)
    lb.reserve(plan.layout.words)
    lb.add(fused.values, (fused.chunks, op.extents[0]))
    lb.add(fused.index, (fused.chunks, op.extents[0]), "int32")
    return dataclasses.replace(plan, layout=lb.build(), fused=fused)
