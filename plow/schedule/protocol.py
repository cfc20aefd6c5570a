"""Checks and simulation of a schedule's counter protocol (the Python side of checkpoint D).

`protocol_errors` checks the hypotheses of C1 + C2 (queues partition the tasks, every edge
covered by a counter or by same-queue order, every threshold = number of signallers, the
must-precede relation acyclic) and names the first problems; the oracle checks the same
conditions on the payload (`plow.schedule.payload`). `simulate` runs the counter-gated
execution in time (each task starts when its worker is free and every counter it waits on
has reached its threshold plus that counter's atomic latency) and doubles as the deadlock
check: a task that never becomes ready is reported.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from plow.schedule.ir import Schedule, Task


@dataclass(frozen=True, slots=True)
class Timeline:
    """Simulated start/finish per task (ns from the start of the step); `stuck` lists
    tasks that never ran (a deadlock), empty when every task ran."""

    start: tuple[float, ...]
    finish: tuple[float, ...]
    makespan_ns: float
    stuck: tuple[int, ...]


def positions(s: Schedule) -> dict[int, tuple[int, int]]:
    """task -> (worker, position in that worker's queue)."""
    return {t: (w, i) for w, q in enumerate(s.queues) for i, t in enumerate(q)}


def _by_counter(lists: list[tuple[int, tuple[int, ...]]]) -> dict[int, list[int]]:
    """counter -> the tasks whose list holds it (each task once, in task order)."""
    out: dict[int, list[int]] = {}
    get = out.get
    for i, cs in lists:
        if len(cs) == 1:
            lst = get(cs[0])
            if lst is None:
                out[cs[0]] = [i]
            else:
                lst.append(i)
            continue
        for c in dict.fromkeys(cs):
            lst = get(c)
            if lst is None:
                out[c] = [i]
            else:
                lst.append(i)
    return out


def signallers(s: Schedule) -> dict[int, list[int]]:
    return _by_counter([(t.index, t.signals) for t in s.tasks if t.signals])


def waiters(s: Schedule) -> dict[int, list[int]]:
    return _by_counter([(t.index, t.waits) for t in s.tasks if t.waits])


# (tasks, signallers, waiters) of the last `sig_wai` call: the passes ask again and again
# for the same task tuple (a pass that changes only counters or queues keeps it).
_SW: list[tuple[tuple[Task, ...], dict[int, list[int]], dict[int, list[int]]]] = []


def sig_wai(s: Schedule) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """`(signallers(s), waiters(s))`, shared between calls on the same task tuple: callers
    must not modify them."""
    if _SW and _SW[0][0] is s.tasks:
        return _SW[0][1], _SW[0][2]
    sig, wai = signallers(s), waiters(s)
    _SW[:] = [(s.tasks, sig, wai)]
    return sig, wai


# The last simulation's inputs (held, so their ids stay unique) and its result: the
# compile simulates the final schedule twice (makespan, then the page windows).
_LAST: list[tuple[tuple[object, ...], tuple[tuple[str, float], ...], Timeline]] = []


def simulate(s: Schedule, atomic_ns: dict[str, float], launch_ns: float = 0.0) -> Timeline:
    """Counter-gated execution with the tasks' est times (see the module docstring)."""
    held = (s.tasks, s.queues, s.counters)
    lat = tuple(sorted(atomic_ns.items()))
    if _LAST and all(a is b for a, b in zip(_LAST[0][0], held, strict=True)) and _LAST[0][1] == lat:
        tl = _LAST[0][2]
    else:
        tl = _simulate(s, atomic_ns)
        _LAST[:] = [(held, lat, tl)]
    return Timeline(
        tl.start, tl.finish, launch_ns + (max(tl.finish) if tl.finish else 0.0), tl.stuck
    )


def _simulate(s: Schedule, atomic_ns: dict[str, float]) -> Timeline:
    n = len(s.tasks)
    nc = len(s.counters)
    sig, _ = sig_wai(s)
    # Nodes 0..n-1 tasks, n..n+nc-1 counters.
    succ: list[list[int]] = [[] for _ in range(n + nc)]
    indeg = [0] * (n + nc)
    for q in s.queues:
        for a, b in zip(q, q[1:], strict=False):
            succ[a].append(b)
            indeg[b] += 1
    for c, ts in sig.items():
        for a in ts:
            succ[a].append(n + c)
            indeg[n + c] += 1
    for t in s.tasks:
        for c in dict.fromkeys(t.waits):
            succ[n + c].append(t.index)
            indeg[t.index] += 1
    ready_at = [0.0] * (n + nc)  # earliest start (task) / time the counter opens
    start = [0.0] * n
    finish = [0.0] * n
    done = [False] * (n + nc)
    queue = deque(i for i in range(n + nc) if indeg[i] == 0)
    while queue:
        x = queue.popleft()
        done[x] = True
        if x < n:
            start[x] = ready_at[x]
            finish[x] = start[x] + s.tasks[x].est_ns
            t_out = finish[x]
        else:
            t_out = ready_at[x] + atomic_ns.get(s.counters[x - n].scope, 0.0)
        for y in succ[x]:
            if t_out > ready_at[y]:
                ready_at[y] = t_out
            indeg[y] -= 1
            if indeg[y] == 0:
                queue.append(y)
    stuck = tuple(i for i in range(n) if not done[i])
    return Timeline(tuple(start), tuple(finish), 0.0, stuck)


def protocol_errors(s: Schedule, limit: int = 5) -> list[str]:
    """The hypotheses of C1 + C2 on a schedule; an empty list means they hold."""
    errs: list[str] = []
    n = len(s.tasks)
    seen: dict[int, int] = {}
    for w, q in enumerate(s.queues):
        for t in q:
            if not 0 <= t < n:
                errs.append(f"worker {w} queue holds task {t}, which does not exist")
                continue
            seen[t] = seen.get(t, 0) + 1
            if s.tasks[t].worker != w:
                errs.append(
                    f"task {t} ({s.tasks[t].name}) is in worker {w}'s queue "
                    f"but says worker {s.tasks[t].worker}"
                )
    for t in range(n):
        if seen.get(t, 0) != 1:
            errs.append(f"task {t} ({s.tasks[t].name}) occurs {seen.get(t, 0)} times in the queues")
    sig = signallers(s)
    for c in s.counters:
        k = len(sig.get(c.id, []))
        if c.threshold != k and (k or c.id in waiters(s)):
            errs.append(
                f"counter {c.id} ({c.name}): threshold {c.threshold} but {k} tasks signal it"
            )
    pos = positions(s)
    for e, (u, t) in enumerate(s.edges):
        if set(s.tasks[t].waits) & set(s.tasks[u].signals):
            continue
        pu, pt = pos.get(u), pos.get(t)
        if pu and pt and pu[0] == pt[0] and pu[1] < pt[1]:
            continue
        errs.append(f"edge {e} ({s.tasks[u].name} -> {s.tasks[t].name}) is not covered")
        if len(errs) >= limit:
            return errs
    if not errs:
        tl = simulate(s, {})
        if tl.stuck:
            t = tl.stuck[0]
            errs.append(
                f"deadlock: {len(tl.stuck)} tasks never run, e.g. task {t} ({s.tasks[t].name})"
            )
    return errs[:limit]
