"""The collapse decision (C8) on routed experts: expected and worst-case pricing of expert
tasks, the sampled two-stage estimate where C8 certifies nothing, fine counters exactly
where that estimate says they pay (plow.schedule.routing, plow.schedule.build)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from plow.checkpoint.loader import spec_from_config
from plow.checkpoint.spec import ModelSpec
from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.graph import Bucket, build_graph
from plow.profile import CompileProfile
from plow.schedule import ScheduleOptions, build_schedule
from plow.schedule.build import _routed_decision
from plow.schedule.ir import TaskKind
from plow.schedule.protocol import protocol_errors, simulate
from plow.schedule.routing import (
    CoupledEdge,
    RoutedOp,
    TaskLoad,
    coupled_edge,
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
    certified = [d for d in routed_reasons if "C7r for all routings" in d.reason]
    # gate_up -> down reads per-expert subsets: C7r certified for every routing, no estimate
    assert {d.consumer for d in certified} == {f"L{i}.experts_down.partial" for i in (0, 2)}
    for d in certified:
        assert "Plow.Gatedproof.coupled_c7r_all_routings" in d.reason
        assert "two-stage model over" not in d.reason
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


def _barriers(
    f: Sequence[float], c: Sequence[float], gates: Sequence[Sequence[int]]
) -> tuple[float, float]:
    """C7's two-stage barrier (Plow.Gated.fine_barrier / coarse_barrier): (fine, coarse)."""
    fine = max(max((f[k] for k in p), default=0) + cj for cj, p in zip(c, gates, strict=True))
    return fine, max(f) + max(c)


def _gains(e: CoupledEdge) -> list[float]:
    """coarse - fine barrier in every busy set of the edge's atoms (every routing and more)."""
    atoms = sorted({a for at in e.atoms for a in at} | set(e.keys))
    out = []
    for bits in itertools.product((False, True), repeat=len(atoms)):
        f, c = e.costs({a for a, on in zip(atoms, bits, strict=True) if on})
        fine, coarse = _barriers(f, c, [list(p) for p in e.gates])
        assert fine <= coarse  # fine_barrier_le_coarse
        out.append(coarse - fine)
    return out


# the structure of the real plans' gate_up -> down edge, small: producer k is expert k's
# gate_up slice; consumer slices read tiles of two experts each (split-k over experts) and
# wait on those experts' producers
_DOWN = CoupledEdge(
    keys=(0, 1, 2, 3),
    lo=2,
    hi=30,
    clo=5,
    cw=7,
    atoms=((0, 1), (2, 3), (1, 2)),
    gates=((0, 1), (2, 3), (1, 2)),
)


def test_coupled_edge_has_c7r_in_every_routing_and_each_clause_is_needed() -> None:
    """Plow.Gatedproof.coupled_c7r_all_routings, checked by brute force over every busy set
    where `coupled_ok` holds; where one clause is dropped, a routing where fine gates open
    the barrier earlier (a counterexample to C7r for all routings)."""
    assert _DOWN.ok() and set(_gains(_DOWN)) == {0}
    # a consumer slice's expert not in its gate: expert 1 busy alone, consumer 2 (the
    # costliest, the only one reading expert 1) waits on producer 2 only
    lost = replace(_DOWN, atoms=((0,), (2, 3), (1, 2)), gates=((0,), (2, 3), (2,)))
    assert not lost.ok() and max(_gains(lost)) > 0
    # a producer's expert read by no consumer: expert 3 busy alone, every consumer idle
    orphan = replace(_DOWN, atoms=((0, 1), (2,), (1, 2)), gates=((0, 1), (2,), (1, 2)))
    assert not orphan.ok() and max(_gains(orphan)) > 0
    # (`cw > 0` is sufficient, not needed: with cw == 0 every consumer slice is a costliest
    # one; the plans' busy tiles always cost more than an idle one's signal)
    # producers that cost the same in every routing: any gates (non-empty) will do
    assert replace(lost, hi=0).ok() and set(_gains(replace(lost, hi=0))) == {0}


def test_unequal_unrouted_producers_are_outside_the_model_and_c7r_fails_there() -> None:
    """The witness edge (unrouted producers of 10 and 1 ns, routed consumers): not on
    Plow.Gated's structured model, and in its second routing fine gates win 9 ns."""
    est = [10.0, 10.0, 10.0, 1.0]
    edge, why = coupled_edge([2, 3], [[2], [3]], [0, 1], _witness(), est)
    assert edge is None and why == "unrouted producer slices of unequal cost (1..10 ns)"
    # routing 2 of _witness: consumers (1, 10), producers (10, 1): fine 11, coarse 20
    assert _barriers([10, 1], [1, 10], [[0], [1]]) == (11, 20)


def test_consumers_of_unequal_base_are_outside_the_model_and_c7r_fails_there() -> None:
    """Routed consumer slices whose idle costs differ (20 ns and 5 ns): not on the model,
    and with expert 0 busy alone fine gates open the barrier 8 ns earlier."""
    shape: dict[int, tuple[tuple[int, ...], float, float, float]] = {
        0: ((0,), 2.0, 30.0, 1.0),  # idle 2, busy 32
        1: ((1,), 2.0, 30.0, 1.0),
    }
    shape |= {2: ((0,), 5.0, 7.0, 1.0), 3: ((1,), 20.0, 7.0, 1.0)}
    load = TaskLoad({}, {}, {}, {}, shape)
    edge, why = coupled_edge([0, 1], [[0], [1]], [2, 3], load, [0.0] * 4)
    assert edge is None and why == "consumer slices of unequal base or busy-tile cost"
    # expert 0 busy: producers (32, 2), consumers (12, 20): fine max(44, 22), coarse 52
    assert _barriers([32, 2], [12, 20], [[0], [1]]) == (44, 52)
    shape[3] = ((1,), 5.0, 7.0, 1.0)  # equal bases: on the model, C7r for all routings
    edge, why = coupled_edge([0, 1], [[0], [1]], [2, 3], load, [0.0] * 4)
    assert edge is not None and why == "" and set(_gains(edge)) == {0}


def test_tiny_moe_routed_edges_have_c7r_in_every_routing_on_the_task_costs(
    tiny_moe: ModelSpec,
) -> None:
    """The tiny qwen3_moe plan's gate_up -> down edges: on the model (coupled_edge) and,
    by brute force over every busy set of the layer's experts, on the task costs themselves
    (max(floor, base + add * busy tiles), not the rounded model): fine never gains."""
    h200 = load_target("h200")
    g = build_graph(tiny_moe, Bucket.decode(4, 64))
    tg = tile_graph(g, h200)
    routed = routed_ops(tg, g)
    # fine counters everywhere: consumer j's gate is read off the counters it waits on
    s = build_schedule(tg, g, h200, ScheduleOptions(min_task_ns=1.0, fine="always"))
    tile_ns = {t.name: float(t.choice.tile_ns) for t in tg.ops if t.name in routed}
    rows = [
        (t.index, t.op, t.units, t.est_ns, tile_ns[t.op])
        for t in s.tasks
        if t.op in routed and t.kind is TaskKind.compute
    ]
    load = task_load(routed, rows, float(h200.tile_overhead_ns), samples=2)
    for layer in (0, 2):
        comp = [t for t in s.tasks if t.kind is TaskKind.compute]
        prod = [t.index for t in comp if t.op == f"L{layer}.experts_gate_up"]
        cons = [t.index for t in comp if t.op == f"L{layer}.experts_down"]
        pset = set(prod)
        signals = {c: {t.index for t in s.tasks if c in t.signals} for c in range(len(s.counters))}
        subsets = [sorted(u for c in s.tasks[j].waits for u in signals[c] & pset) for j in cons]
        est = [t.est_ns for t in s.tasks]
        edge, why = coupled_edge(prod, subsets, cons, load, est)
        assert edge is not None, why
        atoms = sorted({a for j in prod + cons for a in load.shape[j][0]})
        assert len(atoms) <= 8  # one row range: an atom per expert
        pos = {t: i for i, t in enumerate(prod)}
        for bits in itertools.product((False, True), repeat=len(atoms)):
            busy = {a for a, on in zip(atoms, bits, strict=True) if on}

            def cost(t: int, busy: set[int] = busy) -> float:
                at, base, add, floor = load.shape[t]
                return max(floor, base + add * sum(a in busy for a in at))

            fine, coarse = _barriers(
                [cost(t) for t in prod],
                [cost(t) for t in cons],
                [[pos[u] for u in p] for p in subsets],
            )
            assert fine == pytest.approx(coarse), (layer, busy)


THEOREM = "Plow.Gatedproof.coupled_c7r_all_routings"


def test_inspect_counters_says_coarse_for_all_routings_with_the_theorem(
    tiny_moe: ModelSpec, tmp_path: Path
) -> None:
    """`plow inspect --counters` on a plan-only qwen3_moe bundle for h200 (the tiny config,
    widened to hidden 512, expert width 256, so that a down task reads a few experts' gate_up
    tasks, as in the real plans): the routed gate_up -> down edges are coarse for all
    routings, named by the theorem."""
    from plow.testing.fixtures import _BASE

    cfg = tmp_path / "config.json"
    wide = {"hidden_size": 512, "moe_intermediate_size": 256, "intermediate_size": 512}
    cfg.write_text(json.dumps({**_BASE["qwen3_moe"], **wide, "model_type": "qwen3_moe"}))
    out = tmp_path / "b"
    profile = CompileProfile(name="t", decode_batches=(4,), prefill_seqs=(), context=64)
    compile_bundle(cfg, out, load_target("h200"), profile, plan_only=True)
    res = CliRunner().invoke(app, ["inspect", str(out), "--counters", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    (b,) = doc["buckets"]
    assert b["c7r_all_routings"] == 2 and b["estimated"] == 0 and b["fine_edges"] == 0
    verdicts = {(r["producer"], r["consumer"]): r["verdict"] for r in b["routed"]}
    for layer in (0, 2):
        edge = (f"L{layer}.experts_gate_up", f"L{layer}.experts_down.partial")
        assert (
            verdicts[edge] == "coarse for all routings (Plow.Gatedproof.coupled_c7r_all_routings)"
        )
    text = CliRunner().invoke(app, ["inspect", str(out), "--counters"]).output
    assert f"2 coarse for all routings ({THEOREM})" in text
