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

from plow.schedule.ir import Schedule


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


def signallers(s: Schedule) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for t in s.tasks:
        for c in dict.fromkeys(t.signals):
            out.setdefault(c, []).append(t.index)
    return out


def waiters(s: Schedule) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for t in s.tasks:
        for c in dict.fromkeys(t.waits):
            out.setdefault(c, []).append(t.index)
    return out


def simulate(s: Schedule, atomic_ns: dict[str, float], launch_ns: float = 0.0) -> Timeline:
    """Counter-gated execution with the tasks' est times (see the module docstring)."""
    n = len(s.tasks)
    nc = len(s.counters)
    sig = signallers(s)
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
    return Timeline(
        tuple(start), tuple(finish), launch_ns + (max(finish) if finish else 0.0), stuck
    )


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
