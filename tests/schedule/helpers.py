"""Random schedules over random DAGs, and a random-interleaving executor."""

from __future__ import annotations

import random
from dataclasses import replace

from plow.schedule.ir import Counter, Schedule, Task, TaskKind
from plow.schedule.passes import rescope


def random_schedule(seed: int, n: int, workers: int, gpus: int = 1, loads: bool = True) -> Schedule:
    """Tasks 0..n-1 in topological order, grouped into 'ops' of consecutive tasks; random
    edges from earlier ops; one coarse counter per op that has readers; random workers,
    queues in index order. Some source tasks are loads placed right before their reader."""
    rng = random.Random(seed)
    ops: list[list[int]] = []
    i = 0
    while i < n:
        k = rng.randint(1, 3)
        ops.append(list(range(i, min(n, i + k))))
        i += k
    op_of = {t: j for j, ts in enumerate(ops) for t in ts}
    edges: set[tuple[int, int]] = set()
    for j in range(1, len(ops)):
        for t in ops[j]:
            for jp in range(j):
                if rng.random() < 0.35:
                    for u in ops[jp]:
                        if rng.random() < 0.7:
                            edges.add((u, t))
    W = workers * gpus
    worker = [rng.randrange(W) for _ in range(n)]
    kinds = [TaskKind.compute] * n
    if loads:
        # A load: a task of its own op with no incoming edge, feeding only the next task
        # on the same worker.
        for j, ts in enumerate(ops):
            if len(ts) == 1 and j + 1 < len(ops) and not any(e[1] == ts[0] for e in edges):
                t = ts[0]
                nxt = ops[j + 1][0]
                if rng.random() < 0.5:
                    kinds[t] = TaskKind.load
                    worker[t] = worker[nxt]
                    edges = {e for e in edges if e[0] != t} | {(t, nxt)}
    counters: list[Counter] = []
    waits: list[list[int]] = [[] for _ in range(n)]
    signals: list[list[int]] = [[] for _ in range(n)]
    for j, ts in enumerate(ops):
        readers = sorted({t for u, t in edges if op_of[u] == j and kinds[u] is not TaskKind.load})
        if not readers:
            continue
        cid = len(counters)
        counters.append(Counter(cid, f"op{j}.done", len(ts), "device", f"op{j}"))
        for u in ts:
            signals[u].append(cid)
        for t in readers:
            waits[t].append(cid)
    queues: list[list[int]] = [[] for _ in range(W)]
    for t in range(n):
        queues[worker[t]].append(t)
    tasks = tuple(
        Task(
            t, f"op{op_of[t]}#{t}", f"op{op_of[t]}", kinds[t], (t,), worker[t],
            worker[t] // workers, 0, tuple(waits[t]), tuple(signals[t]),
            float(rng.randint(1, 5)), weight_bytes=10 if kinds[t] is TaskKind.load else 0,
        )
        for t in range(n)
    )
    s = Schedule(
        bucket="random", target="random", gpus=gpus, workers_per_gpu=workers, l2_partitions=1,
        tasks=tasks, queues=tuple(tuple(q) for q in queues), counters=tuple(counters),
        edges=tuple(sorted(edges)), op_edges=(), ops=tuple(f"op{j}" for j in range(len(ops))),
    )
    return rescope(s)


def run_interleaving(s: Schedule, seed: int) -> list[int]:
    """Execute with a random choice among enabled workers at every step; returns the order.
    Asserts every task runs after all its producers, and that the run never deadlocks."""
    rng = random.Random(seed)
    pos = [0] * len(s.queues)
    cnt = [0] * len(s.counters)
    done = [False] * len(s.tasks)
    preds: dict[int, list[int]] = {}
    for u, t in s.edges:
        preds.setdefault(t, []).append(u)
    order: list[int] = []
    while len(order) < len(s.tasks):
        ready = []
        for w, q in enumerate(s.queues):
            if pos[w] < len(q):
                t = q[pos[w]]
                if all(cnt[c] >= s.counters[c].threshold for c in s.tasks[t].waits):
                    ready.append(w)
        assert ready, f"deadlock after {len(order)} of {len(s.tasks)} tasks"
        w = rng.choice(ready)
        t = s.queues[w][pos[w]]
        missing = [u for u in preds.get(t, []) if not done[u]]
        assert not missing, f"task {s.tasks[t].name} ran before its producers {missing}"
        pos[w] += 1
        done[t] = True
        order.append(t)
        for c in dict.fromkeys(s.tasks[t].signals):
            cnt[c] += 1
    return order


def with_task(s: Schedule, t: int, **upd: object) -> Schedule:
    tasks = list(s.tasks)
    tasks[t] = replace(tasks[t], **upd)  # type: ignore[arg-type]
    return replace(s, tasks=tuple(tasks))
