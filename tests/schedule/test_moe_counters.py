"""The collapse decision (C8) on routed experts: expected and worst-case pricing of expert
tasks, the sampled two-stage estimate where C8 certifies nothing, fine counters exactly
where that estimate says they pay (plow.schedule.routing, plow.schedule.build)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from plow.checkpoint.loader import spec_from_config
from plow.checkpoint.spec import ModelSpec
from plow.graph import Bucket, build_graph
from plow.schedule import ScheduleOptions, build_schedule
from plow.schedule.build import _routed_decision
from plow.schedule.ir import TaskKind
from plow.schedule.protocol import protocol_errors, simulate
from plow.schedule.routing import (
    RoutedOp,
    TaskLoad,
    routed_ops,
    sample_routings,
    task_load,
    two_stage_gain,
)
from plow.target import load_target
from plow.tiles import tile_graph


def test_sampled_routings_pick_top_k_and_tiles_are_busy_at_the_uniform_rate() -> None:
    chosen = sample_routings(4000, 3, 8, 2, seed=5)
    assert (chosen.sum(axis=2) == 2).all()  # every row exactly k experts
    # expert 3, a tile of rows 0..3 and one of row 2 only
    r = RoutedOp("x", 0, 8, 2, 3, np.array([3, 3]), np.array([0, 2]), np.array([3, 3]))
    q = r.busy_probability()
    assert q == pytest.approx([1 - 0.75**3, 0.25])
    freq = r.busy(chosen).mean(axis=0)
    assert freq == pytest.approx(q, abs=0.03)
    # a task of both tiles, 100 ns a busy tile, 10 ns an idle one
    load = task_load({"x": r}, [(7, "x", (0, 1), 200.0, 100.0)], 10.0, samples=4000, seed=5)
    assert load.worst[7] == 200.0
    assert load.expected[7] == pytest.approx(10 + 90 * q[0] + 10 + 90 * q[1])
    assert set(np.unique(load.sampled[7])) <= {20.0, 110.0, 200.0}
    assert load.sampled[7].mean() == pytest.approx(load.expected[7], rel=0.03)


def _witness() -> TaskLoad:
    """Two producer slices of two experts, one routing each: expert 0 busy, then expert 1
    (busy 10 ns, idle 1 ns); consumer j reads producer j only."""
    return TaskLoad(
        worst={0: 10.0, 1: 10.0},
        expected={0: 5.5, 1: 5.5},
        sampled={0: np.array([10.0, 1.0]), 1: np.array([1.0, 10.0])},
        note={"p": "top-1 of 2 experts over 1 row(s)"},
    )


def test_two_stage_gain_equals_the_hand_computed_barriers() -> None:
    # consumers cost 10 and 1 ns (not routed). Routing 1: producers (10, 1): fine
    # max(10+10, 1+1) = 20, coarse 10 + 10 = 20. Routing 2: (1, 10): fine max(1+10, 10+1)
    # = 11, coarse 20. Means: coarse 20, fine 15.5; largest gain 9.
    est = [10.0, 10.0, 10.0, 1.0]
    coarse, fine, top, gated = two_stage_gain([0, 1], [[0], [1]], [2, 3], _witness(), est)
    assert (coarse, fine, top) == (20.0, 15.5, 9.0)
    # C7r's test: routing 1's costliest consumer (10 ns) waits on the latest producer
    # (producer 0, 10 ns); routing 2's waits on producer 0, which finishes at 1 ns
    assert gated == 1
    # every consumer reading both producers: the gates are the coarse ones
    assert two_stage_gain([0, 1], [[0, 1], [0, 1]], [2, 3], _witness(), est) == (20, 20, 0, 2)


def test_routed_decision_gives_fine_exactly_where_the_estimate_pays() -> None:
    # routed consumers 0, 1 reading producers 2, 3 (10 and 1 ns, not routed): consumer j
    # reads producer j+2. Routing 1: consumers (10, 1): fine max(10+10, 1+1) = 20,
    # coarse 10 + 10 = 20; routing 2: consumers (1, 10): fine max(10+1, 1+10) = 11, coarse
    # 20. Mean gain 4.5 ns.
    est = [10.0, 10.0, 10.0, 1.0]
    pays, why = _routed_decision(_witness(), "n", [2, 3], [0, 1], [[2], [3]], est, False, 1, 4.0)
    assert pays and "fine counters" in why and "C8 does not cover" in why
    assert "expected cost 6..6 ns, worst case 10..10 ns" in why
    assert "barrier coarse 20 ns, fine 16 ns" in why  # 15.5 rounds to 16
    no, why = _routed_decision(_witness(), "n", [2, 3], [0, 1], [[2], [3]], est, False, 1, 5.0)
    assert not no and "not above one device atomic" in why
    # every slice reads every producer: coarse, whatever the costs
    full, why = _routed_decision(_witness(), "n", [2, 3], [0, 1], [[2, 3]] * 2, est, True, 1, 0)
    assert not full and "every slice reads all 2 producer task(s)" in why


@pytest.fixture(scope="module")
def tiny_moe() -> ModelSpec:
    """The tiny qwen3_moe checkpoint's spec: `make_tiny_checkpoint("qwen3_moe")`'s config
    (top-2 of 8 experts, layer 1 dense); the schedule needs no weights."""
    from plow.testing.fixtures import _BASE

    return spec_from_config({**_BASE["qwen3_moe"], "model_type": "qwen3_moe"}, "tiny qwen3_moe")


@pytest.mark.parametrize("batch", [1, 4])
def test_tiny_moe_plan_prices_expert_slices_and_fine_counters_would_not_pay(
    tiny_moe: ModelSpec, batch: int
) -> None:
    """On the tiny qwen3_moe plan every edge into a routed expert op is decided on the
    expected / worst-case / sampled pricing (C8 certifies nothing there); the estimate finds
    no gain, and the full counter-gated simulation agrees: under sampled routings, fine
    counters everywhere never open the step earlier than the decision's plan."""
    h200 = load_target("h200")
    g = build_graph(tiny_moe, Bucket.decode(batch, 64))
    tg = tile_graph(g, h200)
    routed = routed_ops(tg, g)
    assert sorted(routed) == [f"L{i}.experts_{m}" for i in (0, 2) for m in ("down", "gate_up")]
    # one task per tile (a tiny plan's work would fill a few tasks that each read every
    # producer): an expert's down tiles read its own gate_up tiles, as in the real plans
    auto = build_schedule(tg, g, h200, ScheduleOptions(min_task_ns=1.0))
    fine = build_schedule(tg, g, h200, ScheduleOptions(fine="always", min_task_ns=1.0))
    assert protocol_errors(auto) == [] and protocol_errors(fine) == []
    into_experts = [d for d in auto.decisions if ".experts_" in d.consumer]
    routed_reasons = [d for d in into_experts if d.reason.startswith("routed consumer slices")]
    # gate_up and down's compute stage of both MoE layers; down's merge is not routed
    assert {d.consumer for d in routed_reasons} == {
        f"L{i}.experts_{m}" for i in (0, 2) for m in ("gate_up", "down.partial")
    }
    for d in routed_reasons:
        assert "top-2 of 8 experts" in d.reason and "C8 does not cover" in d.reason
        assert "expected cost" in d.reason and "worst case" in d.reason
    estimated = [d for d in routed_reasons if "two-stage" in d.reason]
    assert estimated  # gate_up -> down reads per-expert subsets: the estimate ran
    for d in estimated:  # C7r holds in every sampled routing (structural: see docs)
        assert "largest gain 0 ns" in d.reason and "in 20 of the 20 routings" in d.reason
    assert not any(d.fine for d in auto.decisions)
    # the routed slices are cheaper in expectation than in the worst case
    tile_ns = {n: float(t.choice.tile_ns) for t in tg.ops if (n := t.name) in routed}
    rows = [
        (t.index, t.op, t.units, t.est_ns, tile_ns[t.op])
        for t in auto.tasks
        if t.op in routed and t.kind is TaskKind.compute
    ]
    load = task_load(routed, rows, float(h200.tile_overhead_ns), samples=10, seed=3)
    assert all(load.expected[i] < load.worst[i] for i, *_ in rows)
    lat: dict[str, float] = {k: float(v) for k, v in h200.atomic_latency_ns.items()}
    for k in range(10):
        spans = []
        for s in (auto, fine):
            cost = [
                float(load.sampled[t.index][k]) if t.index in load.sampled else t.est_ns
                for t in s.tasks
            ]
            tasks = tuple(replace(t, est_ns=c) for t, c in zip(s.tasks, cost, strict=True))
            spans.append(simulate(replace(s, tasks=tasks), lat).makespan_ns)
        assert spans[1] >= spans[0] - 1e-6, (k, spans)
