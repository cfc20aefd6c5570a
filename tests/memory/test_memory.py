"""On-chip pages and the arena of real tiny plans."""

from __future__ import annotations

from pathlib import Path

import pytest

from plow.checkpoint import load_spec
from plow.errors import PlanRejected
from plow.graph import Bucket, build_graph
from plow.memory import (
    arena_payload,
    page_payload,
    page_windows,
    peak_pages,
    plan_arena,
    plan_pages,
    split_timeline,
)
from plow.memory.arena import live_ranges
from plow.oracle import run_checkpoint
from plow.schedule import build_schedule
from plow.target import load_target
from plow.tiles import TilingOptions, tile_graph


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def planned(request: pytest.FixtureRequest, tiny_checkpoints: dict[str, Path]):  # type: ignore[no-untyped-def]
    spec = load_spec(tiny_checkpoints[request.param])
    target = load_target("cpu")
    out = []
    for bucket in (Bucket.decode(2, 64), Bucket.prefill(1, 16, 64)):
        g = build_graph(spec, bucket)
        tg = tile_graph(g, target, TilingOptions())
        s = build_schedule(tg, g, target)
        out.append((g, tg, s))
    return target, out


def test_pages_within_budget_and_hoisted(planned) -> None:  # type: ignore[no-untyped-def]
    target, plans = planned
    for g, tg, s in plans:
        pp = plan_pages(s, tg, target, g)
        assert pp.budget_pages == target.onchip_bytes_per_worker // target.page_bytes
        names = [t.name for t in s.tasks]
        workers = [t.worker for t in s.tasks]
        wins = page_windows(workers, names, pp.tasks)
        assert max(peak_pages(wins).values()) <= pp.budget_pages
        assert pp.hoisted > 0  # weight loads overlap the previous task somewhere
        cert = run_checkpoint("C", page_payload(pp.budget_pages, workers, names, pp.tasks))
        assert cert.accepted, cert.reason


def test_split_timeline_keeps_the_verdict(planned) -> None:  # type: ignore[no-untyped-def]
    target, plans = planned
    g, tg, s = plans[0]
    pp = plan_pages(s, tg, target, g)
    wins = page_windows([t.worker for t in s.tasks], [t.name for t in s.tasks], pp.tasks)
    peak = max(peak_pages(wins).values())
    for budget in (peak, peak - 1):
        whole = run_checkpoint("C", split_timeline(budget, wins, chunk=10**9))
        sliced = run_checkpoint("C", split_timeline(budget, wins, chunk=3))
        assert whole.accepted == sliced.accepted == (budget >= peak)
        if not sliced.accepted:
            assert f"budget {budget}" in (sliced.reason or "")


def test_task_over_budget_is_rejected(planned) -> None:  # type: ignore[no-untyped-def]
    target, plans = planned
    g, tg, s = plans[0]
    tiny = target.model_copy(update={"onchip_bytes_per_worker": target.page_bytes})
    with pytest.raises(PlanRejected, match="pages of .* budget 1"):
        plan_pages(s, tg, tiny, g)


def test_arena_is_safe_and_shares_activations(planned) -> None:  # type: ignore[no-untyped-def]
    _, plans = planned
    for g, tg, _ in plans:
        arena = plan_arena(g, tg)
        payload = arena_payload(g, tg, arena)
        cert = run_checkpoint("F", payload)
        assert cert.accepted, cert.reason
        bufs = payload.buffers
        assert all(b.offset % arena.align == 0 for b in bufs)
        assert all(b.offset + b.size <= arena.arena_bytes for b in bufs)
        # Independent pairwise check of F's property.
        for i, a in enumerate(bufs):
            for b in bufs[i + 1 :]:
                live = a.live_start < b.live_end and b.live_start < a.live_end
                touch = a.offset < b.offset + b.size and b.offset < a.offset + a.size
                assert not (live and touch and a.size and b.size), (a.name, b.name)
        acts = [b for b in bufs if b.region == "activations"]
        pool = max(b.offset + b.size for b in acts) - min(b.offset for b in acts)
        assert pool < sum(b.size for b in acts)  # liveness sharing saves space
        by = {b.name: b for b in bufs}
        assert by["sample"].offset == by["ids"].offset  # sampled ids land in the next step's input
        weights = [b for b in bufs if b.region in ("weights", "kv")]
        assert all(b.live_start == 0 and b.live_end == len(g.ops) + 1 for b in weights)


def test_live_ranges_rules() -> None:
    ops = [(["x", "w"], ["a"]), (["a"], ["b"]), (["b", "a"], ["y"])]
    roles = {"x": "input", "w": "weight", "a": "activation", "b": "activation", "y": "output"}
    lr = live_ranges(ops, roles, {"p#partial": 1})
    assert lr == {
        "x": (0, 1),
        "w": (0, 4),
        "a": (0, 3),
        "b": (1, 3),
        "y": (2, 4),
        "p#partial": (1, 2),
    }


def test_overlap_in_a_broken_arena_is_located(planned) -> None:  # type: ignore[no-untyped-def]
    _, plans = planned
    g, tg, _ = plans[0]
    arena = plan_arena(g, tg)
    payload = arena_payload(g, tg, arena)
    bufs = list(payload.buffers)
    k = next(i for i, b in enumerate(bufs) if b.region == "activations" and b.size)
    w = next(b for b in bufs if b.region == "weights")
    bufs[k] = bufs[k].model_copy(update={"offset": w.offset})
    cert = run_checkpoint("F", payload.model_copy(update={"buffers": bufs}))
    assert not cert.accepted
    assert w.name in (cert.reason or "") and "overlap while both live" in (cert.reason or "")
