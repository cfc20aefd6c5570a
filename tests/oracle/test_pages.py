"""Checkpoint C (on-chip page timeline): the extracted checker against hand-made and random
timelines, and against a brute-force occupancy computation."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.oracle import run_checkpoint
from plow.oracle.payloads.pages import PagePayload, PageWindow, WorkerTimeline

SOUND = "Plow.Pagesproof.check_pages_sound"


def win(name: str, start: int, end: int, pages: int) -> PageWindow:
    return PageWindow(name=name, start=start, end=end, pages=pages)


def payload(budget: int, *workers: tuple[int, list[PageWindow]]) -> PagePayload:
    return PagePayload(
        budget_pages=budget,
        workers=[WorkerTimeline(worker=w, windows=ws) for w, ws in workers],
    )


def test_accepts_producer_closing_before_consumer_opens() -> None:
    # M1: each side fits, the producer closes (cycle 1200) when the consumer opens.
    p = payload(16, (5, [win("L3.qkv.w", 0, 1200, 16), win("L3.attn.kv", 1200, 2000, 16)]))
    cert = run_checkpoint("C", p)
    assert cert.accepted, cert.reason
    assert cert.theorems == [SOUND]


def test_accepts_empty_and_many_workers() -> None:
    p = payload(
        8,
        (0, []),
        (1, [win("a", 0, 10, 4), win("b", 5, 15, 4), win("c", 10, 20, 4)]),
        (2, [win("z", 3, 3, 100)]),  # an empty window holds nothing
    )
    assert run_checkpoint("C", p).accepted


def test_rejects_over_budget_naming_worker_cycle_and_pages() -> None:
    # M2 (first counterexample): each side fits, but the windows overlap.
    p = payload(
        16,
        (0, [win("L2.mlp.w", 0, 100, 16)]),
        (5, [win("L3.qkv.w", 0, 1300, 10), win("L3.attn.kv", 1200, 1500, 8)]),
    )
    cert = run_checkpoint("C", p)
    assert not cert.accepted
    assert cert.theorems == []
    assert cert.reason is not None
    assert cert.reason.startswith("worker 5 at cycle 1200: 18 pages live, budget 16")
    assert "L3.qkv.w" in cert.reason and "L3.attn.kv" in cert.reason


def test_rejects_one_side_over_budget() -> None:
    # M2 (second counterexample): ordered windows, but the producer alone overflows.
    p = payload(16, (3, [win("L0.big", 0, 10, 20), win("L0.small", 10, 20, 1)]))
    cert = run_checkpoint("C", p)
    assert not cert.accepted
    assert cert.reason is not None
    assert "worker 3 at cycle 0: 20 pages live, budget 16" in cert.reason
    assert "L0.big" in cert.reason


def occupancy(ws: list[PageWindow], t: int) -> int:
    return sum(w.pages for w in ws if w.start <= t < w.end)


windows_st = st.lists(
    st.builds(
        lambda s, d, p: (s, s + d, p),
        st.integers(0, 40),
        st.integers(0, 15),
        st.integers(0, 9),
    ),
    max_size=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(0, 25),
    workers=st.lists(windows_st, max_size=4),
)
def test_agrees_with_brute_force(budget: int, workers: list[list[tuple[int, int, int]]]) -> None:
    wks = [
        (k * 7, [win(f"w{k}.b{i}", s, e, p) for i, (s, e, p) in enumerate(ws)])
        for k, ws in enumerate(workers)
    ]
    p = payload(budget, *wks)
    over = [
        (wid, t) for wid, ws in wks for t in range(0, 60) if occupancy(ws, t) > budget
    ]
    cert = run_checkpoint("C", p)
    assert cert.accepted == (not over), (cert.reason, over)
    if not cert.accepted:
        assert cert.reason is not None
        m = re.match(r"worker (\d+) at cycle (\d+): (\d+) pages live, budget (\d+)", cert.reason)
        assert m, cert.reason
        wid, t, occ, b = (int(g) for g in m.groups())
        ws = dict(wks)[wid]
        assert b == budget
        assert occupancy(ws, t) == occ > budget
        # the first over-budget worker in payload order is the one named
        assert wid == over[0][0]
