"""Checkpoint F payload: the arena address map with live ranges, and who touches it.

Every tensor of a plan lives at an offset in one arena. A buffer holds bytes
`[offset, offset + size)` and is live on program steps `[live_start, live_end)`. Without a
`protocol` the oracle (Plow.Alloc.check_alloc) accepts when every buffer is in bounds and
aligned and two buffers live at a common step share no byte (Plow.Allocproof.check_alloc_sound,
alloc_safe_exclusive). With one (what `plow verify` sends), Plow.Alloc.check_alloc_ordered
also requires, for every two buffers that share bytes, that every task touching the earlier
one (its live range ends before the other's starts) happens before every task touching the
later one, by the counter protocol's happens-before: waits on counters and worker-queue
order, transitively (Plow.Allocproof.checkpoint_f_sound; with checkpoint D's hypotheses on
the same protocol, shared_ordered_safety: in every execution the earlier buffer's tasks have
all run before a task of the later one runs). The protocol is checkpoint D's (the packets'
waits, signals and queues, `plow.emit.verify.counter_graph_from_packets`) and its sweep
order (`plow.oracle.payloads.dataflow.sweep_order`, an untrusted witness). `region` is a
label for messages only; no rule depends on it. Integers only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from plow.bundle.files import OpTable
from plow.oracle.payloads.dataflow import LOAD, TaskUnits, sweep_order

Region = Literal["weights", "activations", "kv", "scratch", "io"]


class BufferPlacement(BaseModel):
    """One buffer of the address map."""

    model_config = ConfigDict(frozen=True)

    name: str
    offset: int = Field(ge=0)
    size: int = Field(ge=0)
    align: int = Field(ge=0)
    live_start: int = Field(ge=0)
    live_end: int = Field(ge=0)
    region: Region
    accessors: list[int] = Field(default_factory=list)  # tasks reading or writing it


class SharingProtocol(BaseModel):
    """The counter protocol the sharing rule is decided against (checkpoint D's): per task
    its name, the counters it waits on and signals; per worker its queue; a sweep order."""

    model_config = ConfigDict(frozen=True)

    tasks: list[str]
    waits: list[list[int]]
    signals: list[list[int]]
    queues: list[list[int]]
    order: list[int]


class AllocPayload(BaseModel):
    """`arena_bytes` is the arena size; `buffers` every placed buffer (any order)."""

    model_config = ConfigDict(frozen=True)

    arena_bytes: int = Field(ge=0)
    buffers: list[BufferPlacement]
    protocol: SharingProtocol | None = None


def buffer_accessors(
    ot: OpTable, units: Sequence[TaskUnits], names: Sequence[str]
) -> list[list[int]]:
    """Per buffer of `names`, the tasks that read or write it: every task (index in
    `units`, op and stage from its packets) of an op naming the tensor among its inputs or
    outputs, or owning it as its split reduction's partial. Loads are left out: they read
    weights into on-chip pages, no arena byte (as in checkpoint D's byte model)."""
    by_op: dict[int, list[int]] = {}
    for k, u in enumerate(units):
        if u.stage != LOAD:
            by_op.setdefault(u.op, []).append(k)
    users: dict[str, list[int]] = {}
    for i, o in enumerate(ot.ops):
        own = (o.partial,) if o.partial else ()
        if o.argmax:  # greedy fused into lm_head: its values and index buffers
            own = (*own, o.argmax, o.argmax + ".index")
        for t in dict.fromkeys((*o.inputs, *o.outputs, *own)):
            users.setdefault(t, []).append(i)
    out: list[list[int]] = []
    for n in names:
        ts: list[int] = []
        for i in users.get(n, ()):
            ts += by_op.get(i, ())
        out.append(sorted(ts))
    return out


def with_sharing(
    payload: AllocPayload,
    ot: OpTable,
    units: Sequence[TaskUnits],
    tasks: Sequence[str],
    waits: Sequence[Sequence[int]],
    signals: Sequence[Sequence[int]],
    queues: Sequence[Sequence[int]],
    order: Sequence[int] | None = None,
) -> dict[str, object]:
    """`payload` with every buffer's accessors and the protocol the oracle orders them by, as
    a plain dict (the JSON of `AllocPayload` with `protocol`, built without one model per
    task: a whole plan has tens of thousands); `order`: D's sweep order when already
    computed (`sweep_order` of the same protocol)."""
    accs = buffer_accessors(ot, units, [b.name for b in payload.buffers])
    return {
        "arena_bytes": payload.arena_bytes,
        "buffers": [
            {
                "name": b.name,
                "offset": b.offset,
                "size": b.size,
                "align": b.align,
                "live_start": b.live_start,
                "live_end": b.live_end,
                "region": b.region,
                "accessors": a,
            }  # fmt: skip
            for b, a in zip(payload.buffers, accs, strict=True)
        ],
        "protocol": {
            "tasks": list(tasks),
            "waits": [list(w) for w in waits],
            "signals": [list(s) for s in signals],
            "queues": [list(q) for q in queues],
            "order": sweep_order(waits, signals, queues) if order is None else list(order),
        },
    }
