"""Random DAGs: the passes keep every edge covered (Python check and oracle); mutants are
rejected with a located reason; scopes; interleavings never deadlock."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.oracle import run_checkpoint
from plow.schedule import (
    counter_payload,
    drop_implied_counters,
    hoist_loads,
    merge_same_dependency,
    protocol_errors,
)
from plow.schedule.ir import Counter, Schedule, Task, TaskKind
from plow.schedule.passes import rescope
from plow.schedule.protocol import signallers

from .helpers import random_schedule, run_interleaving, with_task

DAGS = st.tuples(
    st.integers(0, 10**6), st.integers(2, 18), st.integers(1, 4), st.integers(1, 2)
)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _passes(s: Schedule) -> list[Schedule]:
    out = [s]
    s, _ = drop_implied_counters(s)
    out.append(s)
    s, _ = merge_same_dependency(s)
    out.append(s)
    s, _ = hoist_loads(s, budget_bytes=10**9)
    out.append(s)
    return out


def _thresholds_exact(s: Schedule) -> None:
    sig = signallers(s)
    for c in s.counters:
        assert c.threshold == len(sig.get(c.id, [])), c


@SETTINGS
@given(DAGS)
def test_passes_keep_every_edge_covered(oracle: Path, dag: tuple[int, int, int, int]) -> None:
    seed, n, workers, gpus = dag
    for s in _passes(random_schedule(seed, n, workers, gpus)):
        assert protocol_errors(s) == []
        _thresholds_exact(s)
        cert = run_checkpoint("D", counter_payload(s))
        assert cert.accepted, cert.reason
        run_interleaving(s, seed)


@SETTINGS
@given(DAGS)
def test_mutants_rejected_with_location(oracle: Path, dag: tuple[int, int, int, int]) -> None:
    seed, n, workers, gpus = dag
    s = random_schedule(seed, n, workers, gpus)
    waited = [c for c in s.counters if any(c.id in t.waits for t in s.tasks)]
    if waited:
        c = waited[0]
        for delta in (1, -1):
            counters = list(s.counters)
            counters[c.id] = replace(c, threshold=c.threshold + delta)
            m = replace(s, counters=tuple(counters))
            assert protocol_errors(m)
            cert = run_checkpoint("D", counter_payload(m))
            assert not cert.accepted
            assert f"counter {c.id}" in (cert.reason or ""), cert.reason
    # Dropped counter: a waiter forgets a counter it needs for an edge not covered by order.
    pos = {t: (w, i) for w, q in enumerate(s.queues) for i, t in enumerate(q)}
    for u, t in s.edges:
        if pos[u][0] != pos[t][0] and s.tasks[t].waits:
            keep = tuple(c for c in s.tasks[t].waits if c not in s.tasks[u].signals)
            m = with_task(s, t, waits=keep)
            cert = run_checkpoint("D", counter_payload(m))
            assert not cert.accepted
            assert "not covered" in (cert.reason or "") and s.tasks[t].name in (cert.reason or "")
            break
    # Back edge: consumer -> producer of an existing edge across workers is not covered.
    for u, t in s.edges:
        if pos[u][0] != pos[t][0]:
            m = replace(s, edges=(*s.edges, (t, u)))
            cert = run_checkpoint("D", counter_payload(m))
            assert not cert.accepted and "not covered" in (cert.reason or ""), cert.reason
            break
    # Queue order contradicting a gate: move a signaller behind its waiter on one worker.
    for t in s.tasks:
        for c in t.waits:
            u = next(x for x in s.tasks if c in x.signals)
            queues = [tuple(x for x in q if x != u.index) for q in s.queues]
            queues[t.worker] = (*queues[t.worker], u.index)  # u last: after its waiter t
            m = with_task(replace(s, queues=tuple(queues)), u.index, worker=t.worker)
            assert protocol_errors(m)
            cert = run_checkpoint("D", counter_payload(m))
            assert not cert.accepted
            # Located: a cycle through the named tasks, or an edge the move uncovered.
            reason = cert.reason or ""
            assert "cycle" in reason or "not covered" in reason, reason
            return


def test_gate_against_queue_order_is_a_cycle(oracle: Path) -> None:
    a = _task(0, 0, signals=(0,))
    b = _task(1, 0, waits=(0,))
    s = rescope(
        Schedule("b", "t", 1, 1, 1, (a, b), ((1, 0),), (Counter(0, "c", 1, "cta", "op"),),
                 ((0, 1),), (), ("op",))
    )
    assert any("deadlock" in e for e in protocol_errors(s))
    cert = run_checkpoint("D", counter_payload(s))
    assert not cert.accepted and "cycle" in (cert.reason or "") and "t1" in (cert.reason or "")


def _task(i: int, w: int, waits: tuple[int, ...] = (), signals: tuple[int, ...] = ()) -> Task:
    return Task(i, f"t{i}", "op", TaskKind.compute, (i,), w, 0, 0, waits, signals, 1.0)


def _two(wa: int, wb: int, gpus: int = 2, per_gpu: int = 2) -> Schedule:
    tasks = (_task(0, wa, signals=(0,)), _task(1, wb, waits=(0,)))
    queues = [[] for _ in range(gpus * per_gpu)]
    queues[wa].append(0)
    queues[wb].append(1)
    return rescope(
        Schedule("b", "t", gpus, per_gpu, 1, tasks, tuple(tuple(q) for q in queues),
                 (Counter(0, "c", 1, "system", "op"),), ((0, 1),), (), ("op",))
    )


def test_scope_is_cheapest_legal() -> None:
    assert _two(0, 0).counters[0].scope == "cta"
    assert _two(0, 1).counters[0].scope == "device"
    assert _two(1, 2).counters[0].scope == "system"  # workers 1 and 2: GPUs 0 and 1
    s, rep = drop_implied_counters(_two(0, 0))
    assert rep.changed == 1 and s.counters == () and protocol_errors(s) == []
    s, rep = drop_implied_counters(_two(0, 1))
    assert rep.changed == 0 and len(s.counters) == 1


def test_hoist_moves_a_load_past_an_independent_task(oracle: Path) -> None:
    # worker 0: a (signals c0), load l, b (waits c0, reads l)
    a = _task(0, 0, signals=(0,))
    ld = replace(_task(1, 0), kind=TaskKind.load, weight_bytes=4)
    b = _task(2, 1, waits=(0,))
    c = _task(3, 0)
    s = rescope(
        Schedule("b", "t", 1, 2, 1, (a, ld, b, c), ((0, 1, 3), (2,)),
                 (Counter(0, "c", 1, "device", "op"),), ((0, 2), (1, 3)), (), ("op",))
    )
    h, rep = hoist_loads(s, budget_bytes=100)
    assert rep.changed == 1 and h.queues[0] == (1, 0, 3)
    assert protocol_errors(h) == [] and run_checkpoint("D", counter_payload(h)).accepted
    none, rep0 = hoist_loads(replace(s, tasks=(a, replace(ld, kind=TaskKind.compute), b, c)), 100)
    assert rep0.changed == 0 and "no load tasks" in rep0.note
