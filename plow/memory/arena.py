"""One arena per bucket: every tensor at an aligned byte offset (docs/memory.md "Arena").

Layout, in this order, each buffer aligned to `ALIGN` bytes:

1. `weights` — every weight, in order of first use (the same offsets in every bucket of a
   bundle, since every bucket's graph reads the weights in the same order); never shared.
2. `kv` — the key-value caches and the recurrent state (Mamba-2's `state` tensors); never
   shared (they persist across steps).
3. `io` — inputs (token ids, positions, sample index) and outputs (logits). The sampled
   token ids (`sample`, the last op's output) are written *into the `ids` slot*: the next
   step's embedding reads them there (the two are never live together).
4. `activations` / `scratch` (fp32 partials of split reductions, `<op>#partial`) — one
   pool, first fit in order of writer; a buffer reuses bytes of another only when that
   one's writer and readers are all op-level ancestors of its writer (the sharing rule,
   `plow.memory.ordering`; docs/memory.md "Sharing rule"), which the schedule's coarse
   counters turn into happens-before in every interleaving. A tensor-parallel graph
   (plow/graph/shard.py): one pool per device, one after another (docs/parallel.md).

Program steps: op `i` of the bucket's op list is step `i`; step `n` (= number of ops) is the
host reading the outputs after the step. Live ranges are half-open `[start, end)`:
weights and caches `[0, n + 1)`; inputs `[0, last reader + 1)`; activations
`[first writer, last reader + 1)`; outputs `[writer, n + 1)`; `<op>#partial` `[i, i + 1)`.
Two buffers live at a common step never share a byte (checkpoint F re-checks it; the rule
implies it, ancestors having smaller op indices).
No allocation happens at request time: the executor gets one buffer of `arena_bytes`.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from plow.graph.ops import OpGraph, TensorRole
from plow.memory.ordering import (
    Access,
    accesses,
    ancestors,
    may_share,
    ordered_edges,
    schedule_edges,
)
from plow.oracle.payloads.alloc import AllocPayload, BufferPlacement, Region
from plow.schedule.ir import Schedule
from plow.target.model import dtype_bytes
from plow.tiles.ir import TileGraph

ALIGN = 256
SAMPLED_SLOT = "ids"  # the input the sampled token ids are written into

_SPLIT_AXIS = {
    "linear": 2,
    "lm_head": 2,
    "attention": 1,
    "sample": 1,
    "rmsnorm": 1,
    "add_rmsnorm": 1,
    "linear_glu": 2,  # R2+R3+R13: a step's partial holds a gate and an up per output column
    "linear_qkv": 2,  # R4: a step's partial holds the q, k, v columns side by side
}
_SPLIT_AXIS["expert_linear"] = 2  # routed experts: the down projection sums over experts


@dataclass(frozen=True, slots=True)
class Buffer:
    name: str
    region: Region
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class Arena:
    """`buffers` in placement order; `arena_bytes` a multiple of `align`."""

    arena_bytes: int
    align: int
    buffers: tuple[Buffer, ...]

    def offset(self, name: str) -> int:
        return self.by_name()[name].offset

    def by_name(self) -> dict[str, Buffer]:
        return {b.name: b for b in self.buffers}

    def region_bytes(self) -> dict[str, int]:
        """Bytes the arena reserves per region (the pool's extent for activations+scratch)."""
        return region_bytes(self.buffers)


def region_bytes(buffers: Sequence[Buffer]) -> dict[str, int]:
    out: dict[str, int] = {}
    for region in ("weights", "kv", "io"):
        bs = [b for b in buffers if b.region == region]
        out[region] = max(b.offset + b.size for b in bs) - min(b.offset for b in bs) if bs else 0
    pool = [b for b in buffers if b.region in ("activations", "scratch")]
    out["activations+scratch"] = (
        max(b.offset + b.size for b in pool) - min(b.offset for b in pool) if pool else 0
    )
    out["activations (sum, unshared)"] = sum(b.size for b in pool if b.region == "activations")
    out["scratch (sum, unshared)"] = sum(b.size for b in pool if b.region == "scratch")
    return out


def _up(x: int, a: int) -> int:
    return -(-x // a) * a


def partial_bytes(kind: str, out_numel: int, steps: int) -> int:
    """Bytes of `<op>#partial`: fp32 partials per reduction step of the output
    (`sample` keeps a (value, index) pair per step)."""
    return steps * out_numel * 4 * (2 if kind == "sample" else 1)


def partial_numel(graph: OpGraph, i: int) -> int:
    """Elements of one reduction step of op `i`'s partial: its first output's, twice that for
    linear_glu (gate and up), q + k + v for linear_qkv."""
    op = graph.ops[i]
    if op.kind.value == "linear_qkv":
        return sum(graph.tensor(t).numel for t in op.outputs)
    return graph.tensor(op.outputs[0]).numel * (2 if op.kind.value == "linear_glu" else 1)


def split_steps(tg: TileGraph) -> dict[str, tuple[str, int]]:
    """op name -> (kind, reduction steps) for the ops whose reduction is split across tiles."""
    out: dict[str, tuple[str, int]] = {}
    for o in tg.ops:
        ax = _SPLIT_AXIS.get(o.kind)
        if ax is not None and ax < len(o.axes) and o.axes[ax].steps > 1:
            out[o.name] = (o.kind, o.axes[ax].steps)
    return out


def live_ranges(
    ops: Sequence[tuple[Sequence[str], Sequence[str]]],
    roles: Mapping[str, str],
    scratch: Mapping[str, int] | None = None,
) -> dict[str, tuple[int, int]]:
    """Half-open live range per tensor, from the ops' (inputs, outputs) in program order and
    each tensor's role (`input`, `weight`, `activation`, `cache`, `output`); `scratch`
    maps a scratch buffer to the op index that uses it. Used by the planner and by
    `plow verify` (which derives them from the bundle's op table)."""
    n = len(ops)
    first_w: dict[str, int] = {}
    last_r: dict[str, int] = {}
    for i, (ins, outs) in enumerate(ops):
        for t in ins:
            last_r[t] = i
        for t in outs:
            first_w.setdefault(t, i)
    out: dict[str, tuple[int, int]] = {}
    for t, role in roles.items():
        if role in ("weight", "cache", "state"):
            out[t] = (0, n + 1)
        elif role == "input":
            out[t] = (0, last_r.get(t, 0) + 1)
        elif role == "output":
            out[t] = (first_w.get(t, 0), n + 1)
        else:
            w = first_w.get(t, 0)
            out[t] = (w, max(w, last_r.get(t, w)) + 1)
    for name, i in (scratch or {}).items():
        out[name] = (i, i + 1)
    return out


def plan_arena(
    graph: OpGraph,
    tg: TileGraph,
    align: int = ALIGN,
    unordered: Collection[tuple[str, str]] = (),
    schedule: Schedule | None = None,
) -> Arena:
    """Place every tensor of `graph` (plus the split reductions' partials) in one arena.
    `schedule`: the bucket's schedule; then the ancestor sets are built only from the op
    edges its counters and queues realise as "every task of the producer before every task
    of the consumer" (`plow.memory.ordering.schedule_edges`), so bytes are shared only
    between buffers whose accessors the plan orders. Without it (a graph not yet
    scheduled), every data edge is assumed to order all tasks. `unordered`: op edges that
    do not order all tasks (fine counters; see `plow.memory.ordering.unordered_op_edges`),
    also left out of the ancestor sets."""
    roles = {n: t.role.value for n, t in graph.tensors.items()}
    sizes = {n: t.numel * dtype_bytes(t.dtype) for n, t in graph.tensors.items()}
    idx = {op.name: i for i, op in enumerate(graph.ops)}
    scratch: dict[str, int] = {}
    for name, (kind, steps) in split_steps(tg).items():
        scratch[f"{name}#partial"] = idx[name]
        sizes[f"{name}#partial"] = partial_bytes(kind, partial_numel(graph, idx[name]), steps)
    ios = [(op.inputs, op.outputs) for op in graph.ops]
    live = live_ranges(ios, roles, scratch)

    order: list[str] = []  # first use
    for op in graph.ops:
        for t in (*op.inputs, *op.outputs):
            if t not in order:
                order.append(t)
    order += [t for t in graph.tensors if t not in order]
    placed: list[Buffer] = []
    cursor = 0

    def put(name: str, region: Region) -> None:
        nonlocal cursor
        cursor = _up(cursor, align)
        placed.append(Buffer(name, region, cursor, sizes[name]))
        cursor += sizes[name]

    for region, role in (("weights", "weight"), ("kv", "cache")):
        for t in order:
            if roles[t] == role or (role == "cache" and roles[t] == "state"):
                put(t, region)  # type: ignore[arg-type]
    sampled = (
        graph.ops[-1].outputs[0] if graph.ops and graph.ops[-1].kind.value == "sample" else None
    )
    alias = (
        sampled is not None
        and SAMPLED_SLOT in graph.tensors
        and graph.tensor(SAMPLED_SLOT).role is TensorRole.input
        and sizes[sampled] <= sizes[SAMPLED_SLOT]
        and live[SAMPLED_SLOT][1] <= live[sampled][0]
    )
    for t in order:
        if roles[t] in ("input", "output") and not (alias and t == sampled):
            put(t, "io")
    if alias and sampled is not None:
        slot = next(b for b in placed if b.name == SAMPLED_SLOT)
        placed.append(Buffer(sampled, "io", slot.offset, sizes[sampled]))

    # The shared pool, in order of writer (ties: larger first): each buffer goes to the
    # lowest offset clear of every placed buffer it may not share with (docs/memory.md
    # "Sharing rule": the placed buffer's writer and readers must all be ancestors of its
    # writer in the op DAG).
    base = _up(cursor, align)
    pool = [t for t in order if roles[t] == "activation"] + list(scratch)
    pool.sort(key=lambda t: (live[t][0], -sizes[t]))
    names = [op.name for op in graph.ops]
    edges = ordered_edges(names, ios, unordered)
    if schedule is not None:
        edges = sorted(set(edges).intersection(schedule_edges(names, ios, schedule)))
    anc = ancestors(len(ios), edges)
    acc = accesses(ios, scratch)
    # A tensor-parallel graph (plow/graph/shard.py): the pool partitioned per device, device
    # d's activations and partials in its own contiguous range, one after another (no byte
    # of one device's part is ever another's; docs/parallel.md "Memory").
    dev = {t: int(op.attrs.get("device", 0)) for op in graph.ops for t in op.outputs}
    dev.update({t: int(graph.ops[i].attrs.get("device", 0)) for t, i in scratch.items()})
    start = 0
    for d in sorted({dev.get(t, 0) for t in pool}):
        spans: list[tuple[int, int, Access]] = []  # (offset, end, access), sorted by offset
        end = start
        for t in (t for t in pool if dev.get(t, 0) == d):
            a = acc.get(t) or Access(live[t][0], 1 << live[t][0])
            need = _up(max(sizes[t], 1), align)
            off = start
            for o, e, other in spans:
                if e <= off or may_share(other, a, anc):
                    continue
                if o - off >= need:
                    break
                off = max(off, e)
            insort(spans, (off, off + need, a), key=lambda x: x[0])
            end = max(end, off + need)
            reg: Region = "scratch" if t in scratch else "activations"
            placed.append(Buffer(t, reg, base + off, sizes[t]))
        start = end
    total = _up(base + start, align) if pool else _up(cursor, align)
    return Arena(max(total, align), align, tuple(placed))


def alloc_payload(
    arena_bytes: int,
    buffers: Sequence[tuple[str, str, int, int]],
    live: Mapping[str, tuple[int, int]],
    align: int,
) -> AllocPayload:
    """The checkpoint F payload from (name, region, offset, size) and live ranges."""
    return AllocPayload(
        arena_bytes=arena_bytes,
        buffers=[
            BufferPlacement(
                name=n,
                offset=o,
                size=s,
                align=align,
                live_start=live[n][0],
                live_end=live[n][1],
                region=r,  # type: ignore[arg-type]
            )
            for n, r, o, s in buffers
        ],
    )


def arena_payload(graph: OpGraph, tg: TileGraph, arena: Arena) -> AllocPayload:
    """The checkpoint F payload of a planned arena (compiler side; verify derives its own)."""
    roles = {n: t.role.value for n, t in graph.tensors.items()}
    idx = {op.name: i for i, op in enumerate(graph.ops)}
    scratch = {f"{n}#partial": idx[n] for n in split_steps(tg)}
    live = live_ranges([(op.inputs, op.outputs) for op in graph.ops], roles, scratch)
    return alloc_payload(
        arena.arena_bytes,
        [(b.name, b.region, b.offset, b.size) for b in arena.buffers],
        live,
        arena.align,
    )
