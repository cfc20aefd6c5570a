"""Checkpoint D (counter protocol): the extracted checker against a plan fragment, its
mutants, random DAG plans and their mutants, plus a tiny interpreter of the step semantics
that cross-checks C1 (safety) and C2 (no deadlock) on random interleavings."""

from __future__ import annotations

import json
import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.oracle import run_checkpoint
from plow.oracle.payloads.counters import (
    Counter,
    CounterPayload,
    Edge,
    Task,
    topological_ranks,
    with_ranks,
)

TOP = "Plow.Countersproof.checkpoint_d_sound"
BROKEN = Path(__file__).resolve().parents[1] / "data" / "broken_schedule.json"


# --------------------------------------------------------------------------- plan fragment


def fragment() -> CounterPayload:
    """Layer 3 of a decode step: norm -> qkv (2 slices) -> attn (3 heads) -> o (2) -> resid,
    one coarse counter per producer op, three workers."""
    ops = [
        ("L3.norm", 1, [0]),
        ("L3.qkv", 2, [0, 1]),
        ("L3.attn", 3, [0, 1, 2]),
        ("L3.o", 2, [1, 2]),
        ("L3.resid", 1, [0]),
    ]
    tasks: list[Task] = []
    counters: list[Counter] = []
    edges: list[Edge] = []
    prev: list[int] = []
    for k, (op, slices, workers) in enumerate(ops):
        cur = []
        for s in range(slices):
            name = op if slices == 1 else f"{op}#{s}"
            waits = [k - 1] if k > 0 else []
            signals = [k] if k < len(ops) - 1 else []
            cur.append(len(tasks))
            tasks.append(Task(name=name, worker=workers[s], waits=waits, signals=signals))
        if k < len(ops) - 1:
            counters.append(Counter(name=f"{op}.done", threshold=slices, scope="device"))
        edges.extend(Edge(producer=u, consumer=t) for u in prev for t in cur)
        prev = cur
    queues: list[list[int]] = [[], [], []]
    for i, t in enumerate(tasks):
        queues[t.worker].append(i)
    return with_ranks(CounterPayload(tasks=tasks, queues=queues, counters=counters, edges=edges))


def idx(p: CounterPayload, name: str) -> int:
    return next(i for i, t in enumerate(p.tasks) if t.name == name)


# --------------------------------------------------------------------------- mutant generators


def mut_threshold(p: CounterPayload, c: int, delta: int) -> CounterPayload:
    cs = list(p.counters)
    cs[c] = cs[c].model_copy(update={"threshold": cs[c].threshold + delta})
    return p.model_copy(update={"counters": cs})


def mut_drop_cover(p: CounterPayload, e: int) -> CounterPayload:
    """The consumer of edge e stops waiting on every counter its producer signals."""
    u, t = p.edges[e].producer, p.edges[e].consumer
    ts = list(p.tasks)
    gone = set(ts[u].signals)
    ts[t] = ts[t].model_copy(update={"waits": [c for c in ts[t].waits if c not in gone]})
    return p.model_copy(update={"tasks": ts})


def mut_back_edge(p: CounterPayload, e: int) -> CounterPayload:
    """Add the reverse of edge e, covered by a new counter (consumer signals, producer waits)."""
    u, t = p.edges[e].producer, p.edges[e].consumer
    c = len(p.counters)
    ts = list(p.tasks)
    ts[t] = ts[t].model_copy(update={"signals": [*ts[t].signals, c]})
    ts[u] = ts[u].model_copy(update={"waits": [*ts[u].waits, c]})
    back = Counter(name=f"{ts[t].name}.back", threshold=1, scope="device")
    return with_ranks(
        p.model_copy(
            update={
                "tasks": ts,
                "counters": [*p.counters, back],
                "edges": [*p.edges, Edge(producer=t, consumer=u)],
            }
        )
    )


def mut_queue_before(p: CounterPayload, e: int) -> CounterPayload:
    """Move the consumer of edge e into its producer's queue, just before the producer."""
    u, t = p.edges[e].producer, p.edges[e].consumer
    qs = [[x for x in q if x != t] for q in p.queues]
    w = p.tasks[u].worker
    qs[w].insert(qs[w].index(u), t)
    ts = list(p.tasks)
    ts[t] = ts[t].model_copy(update={"worker": w})
    return with_ranks(p.model_copy(update={"tasks": ts, "queues": qs}))


def rejected(p: CounterPayload, *needles: str) -> str:
    cert = run_checkpoint("D", p)
    assert not cert.accepted
    assert cert.theorems == []
    reason = cert.reason or ""
    for n in needles:
        assert n in reason, reason
    return reason


# --------------------------------------------------------------------------- fixed cases


def test_accepts_fragment() -> None:
    cert = run_checkpoint("D", fragment())
    assert cert.accepted, cert.reason
    assert TOP in cert.theorems


def test_broken_schedule_is_rejected() -> None:
    p = CounterPayload.model_validate(json.loads(BROKEN.read_text()))
    rejected(p, "counter 2 (L3.attn.done)", "threshold 2 but 3 tasks signal it")


def test_broken_schedule_is_the_generated_mutant() -> None:
    expected = mut_threshold(fragment(), 2, -1).model_dump(mode="json")
    assert expected.pop("workers_per_gpu") is None  # the file predates the field
    assert json.loads(BROKEN.read_text()) == expected


def test_threshold_plus_one() -> None:
    rejected(mut_threshold(fragment(), 1, +1), "counter 1 (L3.qkv.done)", "threshold 3 but 2")


def test_threshold_minus_one() -> None:
    rejected(mut_threshold(fragment(), 3, -1), "counter 3 (L3.o.done)", "threshold 1 but 2")


def test_dropped_counter_uncovers_edge() -> None:
    p = fragment()
    q0, a1 = idx(p, "L3.qkv#0"), idx(p, "L3.attn#1")
    e = next(i for i, x in enumerate(p.edges) if (x.producer, x.consumer) == (q0, a1))
    rejected(
        mut_drop_cover(p, e),
        f"edge {e} (L3.qkv#0 -> L3.attn#1): not covered by any counter or same-queue order",
    )


def test_same_queue_order_covers_edge() -> None:
    # norm and qkv#0 share worker 0, norm first: qkv#0 may stop waiting on L3.norm.done
    # (the C4 pass), the edge stays covered by queue order.
    p = fragment()
    n, q0 = idx(p, "L3.norm"), idx(p, "L3.qkv#0")
    e = next(i for i, x in enumerate(p.edges) if (x.producer, x.consumer) == (n, q0))
    cert = run_checkpoint("D", with_ranks(mut_drop_cover(p, e)))
    assert cert.accepted, cert.reason


def test_back_edge_is_a_cycle() -> None:
    p = fragment()
    q1, o0 = idx(p, "L3.qkv#1"), idx(p, "L3.o#0")
    e = next(i for i, x in enumerate(p.edges) if x.consumer == o0)
    # the reverse of an attn -> o edge: o#0 signals a counter some attn head waits on
    r = rejected(mut_back_edge(p, e), "cycle: task")
    assert "L3." in r and "must precede" in r
    # the reverse of qkv#1 -> attn: the ranks expose o/attn/qkv on the cycle
    e2 = next(i for i, x in enumerate(p.edges) if x.producer == q1)
    rejected(mut_back_edge(p, e2), "cycle: task", "must precede")


def test_queue_order_contradicting_gate() -> None:
    p = fragment()
    a1, o0 = idx(p, "L3.attn#1"), idx(p, "L3.o#0")
    e = next(i for i, x in enumerate(p.edges) if (x.producer, x.consumer) == (a1, o0))
    rejected(
        mut_queue_before(p, e), "cycle: task", "(L3.attn#1) on worker 1", "(L3.o#0) on worker 1"
    )


def test_stale_ranks_are_reported() -> None:
    p = fragment()
    bad = list(p.ranks or [])
    bad[idx(p, "L3.norm")] = 99
    rejected(
        p.model_copy(update={"ranks": bad}), "cycle: task 0 (L3.norm) on worker 0", "(ranks 99 >= "
    )


def test_queue_must_partition_tasks() -> None:
    p = fragment()
    qs = [list(q) for q in p.queues]
    qs[0].append(qs[0][0])
    rejected(p.model_copy(update={"queues": qs}), "task 0 (L3.norm) occurs 2 times")


def test_unknown_counter() -> None:
    p = fragment()
    ts = list(p.tasks)
    ts[1] = ts[1].model_copy(update={"waits": [17]})
    rejected(p.model_copy(update={"tasks": ts}), "task 1 (L3.qkv#0) references counter 17")


# --------------------------------------------------------------------------- step semantics


def simulate(p: CounterPayload, rng: random.Random) -> list[int]:
    """Run one random interleaving; returns the trace. Asserts C1 at every step and C2 at
    the end (a stuck state with tasks left is a deadlock)."""
    pos = [0] * len(p.queues)
    cnt = [0] * len(p.counters)
    done: set[int] = set()
    preds: dict[int, set[int]] = {}
    for e in p.edges:
        preds.setdefault(e.consumer, set()).add(e.producer)
    trace: list[int] = []
    while True:
        ready = []
        for w, q in enumerate(p.queues):
            if pos[w] < len(q):
                t = q[pos[w]]
                if all(cnt[c] >= p.counters[c].threshold for c in p.tasks[t].waits):
                    ready.append(w)
        if not ready:
            break
        w = rng.choice(ready)
        t = p.queues[w][pos[w]]
        assert preds.get(t, set()) <= done, f"task {t} ran before {preds[t] - done}"
        pos[w] += 1
        for c in set(p.tasks[t].signals):
            cnt[c] += 1
        done.add(t)
        trace.append(t)
    assert len(trace) == len(p.tasks), f"deadlock after {trace}"
    return trace


def reachable_violation(p: CounterPayload) -> bool:
    """Exhaustive search (small plans only): can some interleaving run a task early?"""
    preds: dict[int, set[int]] = {}
    for e in p.edges:
        preds.setdefault(e.consumer, set()).add(e.producer)
    seen: set[tuple[int, ...]] = set()
    stack = [tuple([0] * len(p.queues))]
    while stack:
        pos = stack.pop()
        if pos in seen:
            continue
        seen.add(pos)
        done = {t for w, q in enumerate(p.queues) for t in q[: pos[w]]}
        cnt = [sum(1 for t in done if c in p.tasks[t].signals) for c in range(len(p.counters))]
        for w, q in enumerate(p.queues):
            if pos[w] < len(q):
                t = q[pos[w]]
                if all(cnt[c] >= p.counters[c].threshold for c in p.tasks[t].waits):
                    if not preds.get(t, set()) <= done:
                        return True
                    stack.append(pos[:w] + (pos[w] + 1,) + pos[w + 1 :])
    return False


def test_simulation_fragment_and_broken_schedule() -> None:
    rng = random.Random(7)
    for _ in range(50):
        simulate(fragment(), rng)
    assert not reachable_violation(fragment())
    # the checked-in broken schedule (threshold one short) really can run a task early
    assert reachable_violation(CounterPayload.model_validate(json.loads(BROKEN.read_text())))


# --------------------------------------------------------------------------- random DAGs


@st.composite
def dag_plans(draw: st.DrawFn) -> CounterPayload:
    n = draw(st.integers(1, 10))
    order = draw(st.permutations(range(n)))  # a random topological order
    nworkers = draw(st.integers(1, 4))
    worker = [draw(st.integers(0, nworkers - 1)) for _ in range(n)]
    edges = [
        (order[i], order[j])
        for i in range(n)
        for j in range(i + 1, n)
        if draw(st.integers(0, 3)) == 0
    ]
    mode = draw(st.sampled_from(["per_producer", "per_edge", "per_consumer"]))
    waits: list[list[int]] = [[] for _ in range(n)]
    signals: list[list[int]] = [[] for _ in range(n)]
    counters: list[Counter] = []

    def new_counter(name: str, signallers: list[int], waiters: list[int]) -> None:
        c = len(counters)
        same = len({worker[x] for x in signallers + waiters}) == 1
        counters.append(
            Counter(name=name, threshold=len(signallers), scope="cta" if same else "device")
        )
        for x in signallers:
            signals[x].append(c)
        for x in waiters:
            waits[x].append(c)

    if mode == "per_edge":
        for u, t in edges:
            new_counter(f"t{u}->t{t}", [u], [t])
    elif mode == "per_producer":
        for u in range(n):
            cons = [t for (a, t) in edges if a == u]
            if cons:
                new_counter(f"t{u}.done", [u], cons)
    else:
        for t in range(n):
            prods = [u for (u, b) in edges if b == t]
            if prods:
                new_counter(f"t{t}.ready", prods, [t])
    queues: list[list[int]] = [[] for _ in range(nworkers)]
    for t in order:
        queues[worker[t]].append(t)
    tasks = [
        Task(name=f"t{i}", worker=worker[i], waits=waits[i], signals=signals[i]) for i in range(n)
    ]
    return with_ranks(
        CounterPayload(
            tasks=tasks,
            queues=queues,
            counters=counters,
            edges=[Edge(producer=u, consumer=t) for u, t in edges],
        )
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag_plans(), st.randoms(use_true_random=False))
def test_random_dag_accepted_and_simulates(p: CounterPayload, rng: random.Random) -> None:
    cert = run_checkpoint("D", p)
    assert cert.accepted, cert.reason
    assert TOP in cert.theorems
    assert sorted(p.ranks or []) == list(range(len(p.tasks)))
    for _ in range(5):
        simulate(p, rng)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag_plans(), st.data())
def test_random_mutants_rejected(p: CounterPayload, data: st.DataObject) -> None:
    kinds = []
    if p.counters:
        kinds += ["plus", "minus"]
    cross = [
        i for i, e in enumerate(p.edges) if p.tasks[e.producer].worker != p.tasks[e.consumer].worker
    ]
    if cross:
        kinds.append("drop")
    if p.edges:
        kinds += ["back", "queue"]
    if not kinds:
        return
    kind = data.draw(st.sampled_from(kinds))
    if kind in ("plus", "minus"):
        c = data.draw(st.integers(0, len(p.counters) - 1))
        d = 1 if kind == "plus" else -1
        r = rejected(mut_threshold(p, c, d), f"counter {c} ({p.counters[c].name}): threshold")
        assert f"but {p.counters[c].threshold} tasks signal it" in r
    elif kind == "drop":
        e = data.draw(st.sampled_from(cross))
        rejected(mut_drop_cover(p, e), "not covered by any counter or same-queue order")
    elif kind == "back":
        e = data.draw(st.integers(0, len(p.edges) - 1))
        rejected(mut_back_edge(p, e), "cycle: task", "must precede")
    else:
        e = data.draw(st.integers(0, len(p.edges) - 1))
        rejected(mut_queue_before(p, e), "cycle: task", "must precede")


def test_kahn_ranks_leave_cycle_tied() -> None:
    p = mut_queue_before(fragment(), 0)
    ranks = topological_ranks(p)
    assert len(set(ranks)) < len(ranks)


# --------------------------------------------------------------------------- scale


def layered(layers: int, width: int, workers: int = 16, group: int = 8) -> CounterPayload:
    """A layered DAG at plan scale: task i of layer k runs on worker i % workers, signals the
    coarse counter of its group of `group` tasks; in the next layer task i waits on its group's
    counter (edges from three tasks of that group) and follows task i + workers of the
    previous layer, on the same worker in another group (an edge covered by queue order
    only). Ranks: the task index."""
    ngroups = width // group
    tasks: list[Task] = []
    counters: list[Counter] = []
    edges: list[Edge] = []
    queues: list[list[int]] = [[] for _ in range(workers)]
    for k in range(layers):
        for g in range(ngroups):
            counters.append(Counter(name=f"L{k}.g{g}.done", threshold=group, scope="device"))
        for i in range(width):
            t = k * width + i
            g = i // group
            waits = [(k - 1) * ngroups + g] if k else []
            tasks.append(
                Task(name=f"L{k}#{i}", worker=i % workers, waits=waits, signals=[k * ngroups + g])
            )
            queues[i % workers].append(t)
            if k:
                base = (k - 1) * width + g * group
                edges.extend(Edge(producer=base + (i + j) % group, consumer=t) for j in range(3))
                edges.append(Edge(producer=(k - 1) * width + (i + workers) % width, consumer=t))
    return CounterPayload(
        tasks=tasks, queues=queues, counters=counters, edges=edges, ranks=list(range(len(tasks)))
    )


def test_large_plan_is_certified() -> None:
    # 30,000 tasks, 3,750 counters, ~120,000 edges: the checker is O((tasks + edges) log),
    # so this runs in about a second under the default 120 s oracle timeout.
    p = layered(125, 240)
    assert len(p.tasks) == 30_000
    cert = run_checkpoint("D", p)
    assert cert.accepted, cert.reason
    assert TOP in cert.theorems


def test_large_plan_mutants_are_located() -> None:
    p = layered(125, 240)
    # an edge near the end loses its queue-order cover: the consumer moves to another worker
    e = len(p.edges) - 1
    u, t = p.edges[e].producer, p.edges[e].consumer
    assert p.tasks[u].worker == p.tasks[t].worker and p.tasks[u].signals != p.tasks[t].waits
    qs = [list(q) for q in p.queues]
    w = p.tasks[t].worker
    qs[w].remove(t)
    qs[(w + 1) % 16].append(t)
    ts = list(p.tasks)
    ts[t] = ts[t].model_copy(update={"worker": (w + 1) % 16})
    rejected(
        p.model_copy(update={"tasks": ts, "queues": qs}),
        f"edge {e} ({p.tasks[u].name} -> {p.tasks[t].name}): not covered",
    )
    # a stale rank in the layer before the last: it must precede its group's waiters
    a = 123 * 240 + 5
    bad = list(p.ranks or [])
    bad[a] = 10**9
    r = rejected(p.model_copy(update={"ranks": bad}), "cycle: task", "must precede")
    assert f"task {a} ({p.tasks[a].name})" in r


# --------------------------------------------------------------------------- scopes


def _scoped(p: CounterPayload, c: int, scope: str, wpg: int | None = None) -> CounterPayload:
    cs = list(p.counters)
    cs[c] = cs[c].model_copy(update={"scope": scope})
    return p.model_copy(update={"counters": cs, "workers_per_gpu": wpg})


def test_scope_must_cover_the_placement() -> None:
    p = fragment()  # counter 0 (L3.norm.done): signalled on worker 0, waited on 0 and 1
    cert = run_checkpoint("D", _scoped(p, 0, "cta"))
    assert not cert.accepted
    assert cert.reason == (
        "counter 0 (L3.norm.done): scope cta but task 0 (L3.norm) on worker 0 and task 2 "
        "(L3.qkv#1) on worker 1 both use it (a cta counter is one worker's)"
    )
    # device: workers 0..2 on one GPU with 3 workers per GPU, not with 1
    assert run_checkpoint("D", _scoped(p, 0, "device", 3)).accepted
    cert = run_checkpoint("D", _scoped(p, 0, "device", 1))
    assert not cert.accepted and cert.reason is not None
    assert "scope device but task 0 (L3.norm) on worker 0 (GPU 0)" in cert.reason
    assert "on worker 1 (GPU 1)" in cert.reason and "1 workers per GPU" in cert.reason
    ok = run_checkpoint("D", _scoped(p, 0, "system", 3))
    assert ok.accepted and "Plow.Countersproof.check_scopes_sound" in ok.theorems


def test_cta_counter_on_one_worker_is_legal() -> None:
    # counter 3 (L3.o.done): signalled by L3.o#0 (worker 1), L3.o#1 (worker 2): not cta;
    # move all of them onto worker 0 and it is
    p = fragment()
    ts = [t.model_copy(update={"worker": 0}) for t in p.tasks]
    q = with_ranks(p.model_copy(update={"tasks": ts, "queues": [list(range(len(ts))), [], []]}))
    for c in range(len(q.counters)):
        q = _scoped(q, c, "cta", 3)
    cert = run_checkpoint("D", q)
    assert cert.accepted, cert.reason
