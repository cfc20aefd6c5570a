"""The three counter passes (C4, C5, C6) and scope selection. Each is a pure function
`Schedule -> (Schedule, PassReport)`; the report lists what changed.

- `drop_implied_counters` (C4, `Plow.Passes.droppable`): a counter every (signaller,
  waiter) pair of which is already ordered by one worker's queue is dropped — waiters and
  signallers forget it. A counter nobody waits on (dead) is dropped by the same rule.
- `merge_same_dependency` (C5, `same_dependency`): counters signalled by exactly the same
  tasks with the same threshold are merged into the lowest id.
- `hoist_loads` (C6, `hoist_ok`): a load (a task waiting on nothing) swaps with the task
  just before it in its queue, when that task is not one of the load's producers and the
  L2 budget of the worker holds both the load's slab and the slab the previous task is
  still reading.

After each pass counters are renumbered densely (ids = positions) and scopes recomputed.
"""

from __future__ import annotations

from dataclasses import fields, replace

from plow.schedule.ir import Counter, PassReport, Schedule, Scope, Task, TaskKind
from plow.schedule.protocol import positions, sig_wai

_TASK_FIELDS = (
    "index",
    "name",
    "op",
    "kind",
    "units",
    "worker",
    "gpu",
    "partition",
    "waits",
    "signals",
    "est_ns",
    "partial",
    "weight_bytes",
)
assert tuple(f.name for f in fields(Task)) == _TASK_FIELDS, "update _relabel"


def _relabel(t: Task, waits: tuple[int, ...], signals: tuple[int, ...]) -> Task:
    """`replace(t, waits=waits, signals=signals)`, without `replace`'s per-call overhead."""
    return Task(
        t.index,
        t.name,
        t.op,
        t.kind,
        t.units,
        t.worker,
        t.gpu,
        t.partition,
        waits,
        signals,
        t.est_ns,
        t.partial,
        t.weight_bytes,
    )


def choose_scope(s: Schedule, workers: set[int]) -> Scope:
    """Cheapest legal scope for a counter touched by `workers`."""
    if len(workers) <= 1:
        return "cta"
    if len({s.gpu_of(w) for w in workers}) == 1:
        return "device"
    return "system"


def rescope(s: Schedule) -> Schedule:
    """Recompute every counter's scope and threshold from its current signallers/waiters."""
    sig, wai = sig_wai(s)
    wk = [t.worker for t in s.tasks]
    per_gpu = s.workers_per_gpu
    counters = []
    for c in s.counters:
        ss, ws = sig.get(c.id, []), wai.get(c.id, [])
        workers = {wk[t] for t in ss}
        workers.update(wk[t] for t in ws)
        if len(workers) <= 1:
            scope: Scope = "cta"
        elif len({w // per_gpu for w in workers}) == 1:
            scope = "device"
        else:
            scope = "system"
        th = len(ss)
        counters.append(
            c if (c.scope, c.threshold) == (scope, th) else replace(c, scope=scope, threshold=th)
        )
    return replace(s, counters=tuple(counters))


def compact(s: Schedule) -> Schedule:
    """Remove counters no task uses and renumber the rest densely; recompute scopes."""
    seen: set[int] = set()
    for t in s.tasks:
        seen.update(t.waits)
        seen.update(t.signals)
    used = sorted(seen)
    if used == list(range(len(s.counters))):
        return rescope(s)
    remap = {old: new for new, old in enumerate(used)}
    counters = tuple(replace(s.counters[old], id=new) for old, new in remap.items())
    moved = {old for old, new in remap.items() if old != new}
    tasks = tuple(
        t
        if moved.isdisjoint(t.waits) and moved.isdisjoint(t.signals)
        else _relabel(
            t,
            tuple(remap[c] for c in t.waits),
            tuple(remap[c] for c in t.signals),
        )
        for t in s.tasks
    )
    return rescope(replace(s, tasks=tasks, counters=counters))


def drop_implied_counters(s: Schedule) -> tuple[Schedule, PassReport]:
    """C4: drop counters whose every (signaller, waiter) pair is ordered by one queue."""
    sig, wai = sig_wai(s)
    pos = positions(s)
    drop: set[int] = set()
    changes: list[str] = []
    for c in s.counters:
        ss, ws = sig.get(c.id, []), wai.get(c.id, [])
        if not ws:
            drop.add(c.id)
            changes.append(f"dropped {c.name}: dead (no task waits on it)")
            continue
        if not ss:
            continue  # nobody signals it: a waiter would block; left for the checker to name
        workers = {pos[t][0] for t in (*ss, *ws)}
        if len(workers) == 1 and max(pos[t][1] for t in ss) < min(pos[t][1] for t in ws):
            drop.add(c.id)
            w = next(iter(workers))
            changes.append(
                f"dropped {c.name}: its {len(ss)} signaller(s) precede its {len(ws)} "
                f"waiter(s) in worker {w}'s queue"
            )
    tasks = tuple(
        t
        if drop.isdisjoint(t.waits) and drop.isdisjoint(t.signals)
        else _relabel(
            t,
            tuple(c for c in t.waits if c not in drop),
            tuple(c for c in t.signals if c not in drop),
        )
        for t in s.tasks
    )
    out = compact(replace(s, tasks=tasks))
    report = PassReport(
        "drop_implied_counters",
        "Plow.Passesproof.drop_counter_preserves (C4)",
        len(drop),
        tuple(changes),
        "" if drop else "every counter has a waiter on another worker than some signaller",
    )
    return out, report


def merge_same_dependency(s: Schedule) -> tuple[Schedule, PassReport]:
    """C5: merge counters with the same signalling tasks and threshold."""
    sig, _ = sig_wai(s)
    keep: dict[tuple[tuple[int, ...], int], int] = {}
    rename: dict[int, int] = {}
    changes: list[str] = []
    for c in s.counters:
        ss = tuple(sorted(sig.get(c.id, [])))
        if not ss:
            continue
        key = (ss, c.threshold)
        if key in keep:
            rename[c.id] = keep[key]
            changes.append(
                f"merged {c.name} into {s.counters[keep[key]].name}: same {len(ss)} signaller(s)"
            )
        else:
            keep[key] = c.id
    tasks = tuple(
        t
        if rename.keys().isdisjoint(t.waits) and rename.keys().isdisjoint(t.signals)
        else _relabel(
            t,
            tuple(dict.fromkeys(rename.get(c, c) for c in t.waits)),
            tuple(c for c in t.signals if c not in rename),
        )
        for t in s.tasks
    )
    out = compact(replace(s, tasks=tasks))
    report = PassReport(
        "merge_same_dependency",
        "Plow.Passesproof.merge_counters_preserves (C5)",
        len(rename),
        tuple(changes),
        "" if rename else "no two counters are signalled by the same tasks",
    )
    return out, report


def hoist_loads(s: Schedule, budget_bytes: int) -> tuple[Schedule, PassReport]:
    """C6: move each load one place earlier in its queue (past the task before it)."""
    loads = [t for t in s.tasks if t.kind is TaskKind.load]
    if not loads:
        return s, PassReport(
            "hoist_loads",
            "Plow.Passesproof.hoist_load_preserves (C6)",
            0,
            (),
            "the schedule has no load tasks (weight slabs are streamed by the tiles that use "
            "them; ScheduleOptions.loads=True makes them explicit), so there is nothing to hoist",
        )
    producers: dict[int, set[int]] = {}
    for u, t in s.edges:
        producers.setdefault(t, set()).add(u)
    # The slab a task reads is the one its own load brought in (its queue predecessor).
    slab_of: dict[int, int] = {}
    for q in s.queues:
        for a, b in zip(q, q[1:], strict=False):
            if s.tasks[a].kind is TaskKind.load and s.tasks[b].kind is not TaskKind.load:
                slab_of[b] = s.tasks[a].weight_bytes
    queues: list[tuple[int, ...]] = []
    changes: list[str] = []
    for q in s.queues:
        ql = list(q)
        for i in range(1, len(ql)):
            lt = s.tasks[ql[i]]
            x = s.tasks[ql[i - 1]]
            if lt.kind is not TaskKind.load or x.kind is TaskKind.load or lt.waits:
                continue
            if x.index in producers.get(lt.index, set()):
                continue
            if lt.weight_bytes + slab_of.get(x.index, 0) > budget_bytes:
                continue
            ql[i - 1], ql[i] = ql[i], ql[i - 1]
            changes.append(f"hoisted {lt.name} before {x.name} on worker {lt.worker}")
        queues.append(tuple(ql))
    out = replace(s, queues=tuple(queues))
    note = (
        ""
        if changes
        else f"no load fits the {budget_bytes}-byte L2 share next to the slab before it"
    )
    return out, PassReport(
        "hoist_loads",
        "Plow.Passesproof.hoist_load_preserves (C6)",
        len(changes),
        tuple(changes),
        note,
    )


def fresh_counter(
    cid: int, name: str, producer: str, fine: bool = False, consumer: str = ""
) -> Counter:
    """A counter before thresholds/scopes are filled in by `rescope`."""
    return Counter(cid, name, 0, "device", producer, fine, consumer)
