"""One arena per bucket: every tensor at an aligned byte offset (docs/memory.md "Arena").

Layout, in this order, each buffer aligned to `ALIGN` bytes:

1. `weights` — every weight, in order of first use (the same offsets in every bucket of a
   bundle, since every bucket's graph reads the weights in the same order); never shared.
2. `kv` — the key-value caches; never shared (they persist across steps).
3. `io` — inputs (token ids, positions, sample index) and outputs (logits). The sampled
   token ids (`sample`, the last op's output) are written *into the `ids` slot*: the next
   step's embedding reads them there (the two are never live together).
4. `activations` / `scratch` (fp32 partials of split reductions, `<op>#partial`) — one
   pool shared by liveness: a first-fit free list swept in program order.

Program steps: op `i` of the bucket's op list is step `i`; step `n` (= number of ops) is the
host reading the outputs after the step. Live ranges are half-open `[start, end)`:
weights and caches `[0, n + 1)`; inputs `[0, last reader + 1)`; activations
`[first writer, last reader + 1)`; outputs `[writer, n + 1)`; `<op>#partial` `[i, i + 1)`.
Two buffers live at a common step never share a byte (checkpoint F re-checks it).
No allocation happens at request time: the executor gets one buffer of `arena_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from plow.graph.ops import OpGraph, TensorRole
from plow.oracle.payloads.alloc import AllocPayload, BufferPlacement, Region
from plow.target.model import dtype_bytes
from plow.tiles.ir import TileGraph

ALIGN = 256
SAMPLED_SLOT = "ids"  # the input the sampled token ids are written into

_SPLIT_AXIS = {"linear": 2, "lm_head": 2, "attention": 1, "sample": 1, "rmsnorm": 1}


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
        if role in ("weight", "cache"):
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


def plan_arena(graph: OpGraph, tg: TileGraph, align: int = ALIGN) -> Arena:
    """Place every tensor of `graph` (plus the split reductions' partials) in one arena."""
    roles = {n: t.role.value for n, t in graph.tensors.items()}
    sizes = {n: t.numel * dtype_bytes(t.dtype) for n, t in graph.tensors.items()}
    idx = {op.name: i for i, op in enumerate(graph.ops)}
    scratch: dict[str, int] = {}
    for name, (kind, steps) in split_steps(tg).items():
        out = graph.tensor(graph.ops[idx[name]].outputs[0])
        scratch[f"{name}#partial"] = idx[name]
        sizes[f"{name}#partial"] = partial_bytes(kind, out.numel, steps)
    live = live_ranges([(op.inputs, op.outputs) for op in graph.ops], roles, scratch)

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
            if roles[t] == role:
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

    # The shared pool: sweep in program order with a first-fit free list.
    base = _up(cursor, align)
    pool = [t for t in order if roles[t] == "activation"] + list(scratch)
    pool.sort(key=lambda t: (live[t][0], -sizes[t]))
    free: list[tuple[int, int]] = []  # (offset, size), sorted, coalesced; relative to base
    end = 0
    active: list[tuple[int, int, int]] = []  # (live_end, offset, size)

    def release(off: int, size: int) -> None:
        free.append((off, size))
        free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        free[:] = merged

    for t in pool:
        st = live[t][0]
        still = []
        for e, o, s in active:
            if e <= st:
                release(o, s)
            else:
                still.append((e, o, s))
        active = still
        need = _up(max(sizes[t], 1), align)
        off = -1
        for k, (o, s) in enumerate(free):
            if s >= need:
                off = o
                free[k] = (o + need, s - need)
                if free[k][1] == 0:
                    free.pop(k)
                break
        if off < 0:
            # grow the last free block when it ends at the pool's end
            off = free.pop()[0] if free and free[-1][0] + free[-1][1] == end else end
            end = off + need
        active.append((live[t][1], off, need))
        reg: Region = "scratch" if t in scratch else "activations"
        placed.append(Buffer(t, reg, base + off, sizes[t]))
    total = _up(base + end, align) if pool else _up(cursor, align)
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
