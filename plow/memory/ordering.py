"""Which ops are ordered before which, for sharing arena bytes (docs/memory.md "Sharing
rule", docs/oracle.md "Checkpoint F").

Buffer B may reuse bytes buffer A occupied only when A's writer op and every reader op of A
are *ancestors* of B's writer op in the op dependency DAG (data edges: op `j` writes a
tensor op `i > j` reads) that the schedule realises: an edge X -> Y kept only when every
task of X completes before any task of Y starts (by counters or queue order); that composes
along paths, so ancestors-of-writer implies every access of A happens before any write of
B, whatever the interleaving. Ancestor sets are Python int bitsets (bit `j` = op `j`),
computed in op order (a topological order).

The planner (`plan_arena`) shares bytes only under this rule, with the ancestor sets built
from the op edges the bucket's schedule realises as "every task of the producer before
every task of the consumer" (`schedule_edges`, `realised_edges`: an op edge alone does not
give that for a two-phase op whose consumer waits for one phase only), minus the edges
given fine counters (`unordered_op_edges`). `sharing_violation` checks a placement against
the rule (tests). `plow verify` does not use this module: checkpoint F decides the sharing
rule task by task in the oracle (docs/oracle.md "Checkpoint F").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plow.schedule.ir import EdgeDecision, Schedule

OpIO = tuple[Sequence[str], Sequence[str]]  # (inputs, outputs) of one op, in op order


@dataclass(frozen=True, slots=True)
class Access:
    """The ops touching one pool buffer: `writer` (op index) and `mask` (bitset of the
    writer and every reader)."""

    writer: int
    mask: int


def data_edges(ops: Sequence[OpIO]) -> list[tuple[int, int]]:
    """(producer, consumer) op-index pairs: `j < i`, op `j` writes a tensor op `i` reads;
    sorted, without duplicates."""
    writers: dict[str, list[int]] = {}
    out: set[tuple[int, int]] = set()
    for i, (ins, outs) in enumerate(ops):
        for t in ins:
            for j in writers.get(t, ()):
                out.add((j, i))
        for t in outs:
            writers.setdefault(t, []).append(i)
    return sorted(out)


def ancestors(n: int, edges: Collection[tuple[int, int]]) -> list[int]:
    """Strict ancestor bitset of every op `0..n-1` over `edges` (each `(j, i)` with `j < i`;
    others are ignored: op order is the topological order)."""
    preds: list[list[int]] = [[] for _ in range(n)]
    for j, i in edges:
        if 0 <= j < i < n:
            preds[i].append(j)
    anc = [0] * n
    for i in range(n):
        a = 0
        for j in preds[i]:
            a |= anc[j] | (1 << j)
        anc[i] = a
    return anc


def accesses(ops: Sequence[OpIO], scratch: Mapping[str, int] | None = None) -> dict[str, Access]:
    """Writer and access mask of every tensor some op writes (first writer; every writer and
    reader in the mask), plus `scratch` buffers (`<op>#partial` -> its op index)."""
    writer: dict[str, int] = {}
    mask: dict[str, int] = {}
    for i, (ins, outs) in enumerate(ops):
        for t in (*ins, *outs):
            mask[t] = mask.get(t, 0) | (1 << i)
        for t in outs:
            writer.setdefault(t, i)
    out = {t: Access(w, mask[t]) for t, w in writer.items()}
    for name, i in (scratch or {}).items():
        out[name] = Access(i, 1 << i)
    return out


def may_share(earlier: Access, later: Access, anc: Sequence[int]) -> bool:
    """`later` may take bytes `earlier` used: every access of `earlier` is an ancestor of
    `later`'s writer."""
    return earlier.mask & ~anc[later.writer] == 0


def sharing_violation(
    buffers: Sequence[tuple[str, int, int]],
    acc: Mapping[str, Access],
    anc: Sequence[int],
    op_names: Sequence[str],
) -> tuple[str, int, int] | None:
    """The first two of `buffers` ((name, offset, size)) whose bytes overlap with neither
    ordered before the other: (message, the op index of the earlier buffer's accessor that
    is not an ancestor, the op index of the later buffer's writer); None when every
    overlapping pair is ordered."""
    order = sorted((b for b in buffers if b[2] > 0), key=lambda b: (b[1], b[1] + b[2], b[0]))
    active: list[tuple[int, str, int]] = []  # (end, name, offset)
    for name, off, size in order:
        active = [x for x in active if x[0] > off]
        for end, other, ooff in active:
            a, b = acc[other], acc[name]
            if may_share(a, b, anc) or may_share(b, a, anc):
                continue
            (ea, ra, sa, za), (eb, rb, sb, zb) = sorted(
                (
                    (a.writer, other, ooff, end),
                    (b.writer, name, off, off + size),
                )
            )
            first, later = acc[ra], acc[rb]
            loose = first.mask & ~anc[later.writer]
            k = (loose & -loose).bit_length() - 1
            role = "writer" if k == first.writer else "reader"
            return (
                f'buffers "{ra}" [{sa}, {za}) and "{rb}" [{sb}, {zb}) share bytes but '
                f'{role} "{op_names[k]}" is not ordered before writer "{op_names[later.writer]}"',
                k,
                later.writer,
            )
        active.append((off + size, name, off))
    return None


# ----------------------------------------------------------------- the packets' guarantee


@dataclass(frozen=True, slots=True)
class TaskView:
    """What the packets say about the tasks (from `plow.emit.verify.CounterGraph` plus the
    schedule file's columns): per task its op index, whether it writes partials, whether it
    is a load; per task worker, waits and signals (counter ids); queues per worker;
    thresholds per counter."""

    op: Sequence[int]
    partial: Sequence[bool]
    load: Sequence[bool]
    workers: Sequence[int]
    waits: Sequence[Sequence[int]]
    signals: Sequence[Sequence[int]]
    queues: Sequence[Sequence[int]]
    thresholds: Sequence[int]


def realised_edges(
    n_ops: int, edges: Sequence[tuple[int, int]], tv: TaskView
) -> tuple[list[tuple[int, int]], dict[tuple[int, int], str]]:
    """The op edges X -> Y the packets realise as "every task of X before every task of Y",
    and a reason per edge that is not.

    Per op, loads aside (they read weights only): `P` its partial tasks, `F` the others (its
    final stage), `E` = `P` if any else `F` (the tasks that read the op's inputs). A set `S`
    is before task `t` when `t` waits on a counter every task of `S` signals whose threshold
    equals its number of signallers (C1: it opens after all of them), or every task of `S`
    precedes `t` in `t`'s worker queue. Op `o` is coherent when `F` is non-empty and `P` is
    before every task of `F`. X -> Y is realised when X and Y are coherent and `F(X)` is
    before every task of `E(Y)`; then any task of X precedes any task of Y (through `F(X)`,
    and through `E(Y)` for `F(Y)`), and realised edges compose by transitivity."""
    nt = len(tv.op)
    nsig = [0] * len(tv.thresholds)
    for ss in tv.signals:
        for c in set(ss):
            nsig[c] += 1
    exact = {c for c, th in enumerate(tv.thresholds) if th == nsig[c]}
    pos: dict[int, int] = {}
    for q in tv.queues:
        for k, t in enumerate(q):
            pos[t] = k
    part: list[list[int]] = [[] for _ in range(n_ops)]
    fin: list[list[int]] = [[] for _ in range(n_ops)]
    for t in range(nt):
        o = tv.op[t]
        if tv.load[t] or not 0 <= o < n_ops:
            continue
        (part if tv.partial[t] else fin)[o].append(t)
    cov_cache: dict[tuple[int, bool], tuple[set[int], dict[int, int]]] = {}

    def cover(o: int, partial: bool) -> tuple[set[int], dict[int, int]]:
        """Counters every task of the set signals (exact thresholds); per worker the last
        queue position of the set's tasks, when they all sit on one worker."""
        key = (o, partial)
        if key not in cov_cache:
            s = part[o] if partial else fin[o]
            cs: set[int] | None = None
            for t in s:
                cs = set(tv.signals[t]) if cs is None else cs.intersection(tv.signals[t])
            ws = {tv.workers[t] for t in s}
            last = {ws.pop(): max(pos.get(t, 1 << 62) for t in s)} if len(ws) == 1 else {}
            cov_cache[key] = ((cs or set()) & exact, last)
        return cov_cache[key]

    def before(o: int, partial: bool, t: int) -> bool:
        cs, last = cover(o, partial)
        if cs and not cs.isdisjoint(tv.waits[t]):
            return True
        w = tv.workers[t]
        return w in last and last[w] < pos.get(t, -1)

    coherent: list[str | None] = []  # None: coherent, else why not
    for o in range(n_ops):
        if not fin[o]:
            coherent.append(f"op {o} has no final-stage task")
            continue
        bad = next((t for t in fin[o] if part[o] and not before(o, True, t)), None)
        coherent.append(
            None if bad is None else f"task {bad} does not wait for all of its op's partial tasks"
        )
    ok: list[tuple[int, int]] = []
    why: dict[tuple[int, int], str] = {}
    for x, y in edges:
        r = coherent[x] or coherent[y]
        if r is None:
            bad = next((t for t in (part[y] or fin[y]) if not before(x, False, t)), None)
            if bad is not None:
                r = (
                    f"task {bad} waits on no counter signalled by every task of op {x} "
                    "and does not follow them in its queue"
                )
        if r is None:
            ok.append((x, y))
        else:
            why[(x, y)] = r
    return ok, why


# ----------------------------------------------------------------- compiler side


def task_view(op_names: Sequence[str], schedule: Schedule) -> TaskView:
    """The `TaskView` of a schedule: each task's op index in `op_names` (-1 for a task of no
    listed op, which `realised_edges` leaves out), its partial and load columns, workers,
    waits, signals, queues and counter thresholds as the schedule has them."""
    idx = {n: i for i, n in enumerate(op_names)}
    ts = schedule.tasks
    return TaskView(
        op=[idx.get(t.op, -1) for t in ts],
        partial=[t.partial for t in ts],
        load=[t.is_load for t in ts],
        workers=[t.worker for t in ts],
        waits=[t.waits for t in ts],
        signals=[t.signals for t in ts],
        queues=schedule.queues,
        thresholds=[c.threshold for c in schedule.counters],
    )


def schedule_edges(
    op_names: Sequence[str], ops: Sequence[OpIO], schedule: Schedule
) -> list[tuple[int, int]]:
    """The data edges of `ops` that `schedule` realises as "every task of the producer before
    every task of the consumer" (`realised_edges` over the schedule's counters and queues).
    An op edge alone does not give that: a consumer of a two-phase op (a fused add_rmsnorm's
    sum, read by a router norm) may wait for the op's compute tasks only, while its merge
    tasks still read the op's partial."""
    return realised_edges(len(ops), data_edges(ops), task_view(op_names, schedule))[0]


def unordered_op_edges(decisions: Sequence[EdgeDecision]) -> set[tuple[str, str]]:
    """Op pairs the collapse decision gave fine counters (`EdgeDecision.fine`): those edges
    do not give the all-tasks guarantee. Stage names map to ops (`<op>.partial`,
    `<op>.load` -> `<op>`); a fine edge inside one op (partials -> merge) is `(op, op)`,
    which makes every edge touching that op unordered."""

    def op_of(stage: str) -> str:
        for suf in (".partial", ".load"):
            if stage.endswith(suf):
                return stage[: -len(suf)]
        return stage

    out: set[tuple[str, str]] = set()
    for d in decisions:
        if d.fine:
            out.add((op_of(d.producer), op_of(d.consumer)))
    return out


def ordered_edges(
    op_names: Sequence[str], ops: Sequence[OpIO], unordered: Collection[tuple[str, str]] = ()
) -> list[tuple[int, int]]:
    """The data edges of `ops` minus `unordered` (op-name pairs; `(X, X)` drops every edge
    touching X)."""
    bad_ops = {x for x, y in unordered if x == y}
    return [
        (j, i)
        for j, i in data_edges(ops)
        if op_names[j] not in bad_ops
        and op_names[i] not in bad_ops
        and (op_names[j], op_names[i]) not in unordered
    ]
