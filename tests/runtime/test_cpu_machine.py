"""The CPU executor's machine on real tiny plans: one step against the reference executor,
bitwise-identical outputs under random interleavings, the checking mode catching broken
schedules (with the packet and counter named), deadlocks reported."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from plow.checkpoint import Checkpoint, load_checkpoint
from plow.graph import Bucket
from plow.runtime.cpu import CpuModel, DeadlockError, Plan, RaceError, RowInput
from plow.runtime.reference import ReferenceSession
from plow.schedule import protocol_errors

CONTEXT = 64
PROMPTS = [[5, 17, 93, 2, 44, 8, 61, 30, 12, 7, 99], [3, 250, 41, 6, 77], [120, 9, 9, 18]]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints: dict[str, Path]) -> Checkpoint:
    return load_checkpoint(tiny_checkpoints["llama"])


def _model(ckpt: Checkpoint, target: str, **kw: object) -> CpuModel:
    return CpuModel(ckpt.spec, ckpt.weights, target=target, max_batch=4, max_context=CONTEXT, **kw)  # type: ignore[arg-type]


def _steps(
    m: CpuModel, decode_steps: int = 3, plans: dict[Bucket, Plan] | None = None, **kw: object
) -> tuple[list[bytes], list[list[int]], list[tuple[int, ...]]]:
    """Prefill PROMPTS (one launch), then greedy decode steps with the sampled ids kept on
    the device; returns the arena bytes after each step, the tokens, and the task orders."""
    for compiled in (plans or {}).values():
        m.add_plan(compiled)
    tables = []
    for p in PROMPTS:
        t = m.kv.new_table()
        m.kv.reserve(t, len(p) + decode_steps + 1)
        tables.append(t)
    snaps, toks, orders = [], [], []
    plan = m.plan(m.prefill_bucket(len(PROMPTS), max(map(len, PROMPTS))))
    m.write_inputs(
        plan,
        [RowInput(t, tuple(range(len(p))), tuple(p)) for t, p in zip(tables, PROMPTS, strict=True)],
    )
    orders.append(m.dispatch(plan, **kw).order)
    snaps.append(m.arena.snapshot())
    toks.append(m.sampled(plan)[: len(PROMPTS)].tolist())
    dplan = m.plan(m.decode_bucket(len(PROMPTS)))
    for i in range(decode_steps):
        rows = [
            RowInput(t, (len(p) + i,), (toks[-1][b],) if i == 0 else None)
            for b, (t, p) in enumerate(zip(tables, PROMPTS, strict=True))
        ]
        m.write_inputs(dplan, rows)
        orders.append(m.dispatch(dplan, **kw).order)
        snaps.append(m.arena.snapshot())
        toks.append(m.sampled(dplan)[: len(PROMPTS)].tolist())
    return snaps, toks, orders


@pytest.mark.parametrize("target", ["cpu", "h100"])
def test_one_step_matches_the_reference(ckpt: Checkpoint, target: str) -> None:
    """A padded prefill launch of three rows, then a decode launch: logits of every row
    equal the reference executor's within fp32 rounding; split reductions included."""
    m = _model(ckpt, target, check=True)
    ref = [ReferenceSession(ckpt.spec, ckpt.weights, CONTEXT) for _ in PROMPTS]
    tables = []
    for p in PROMPTS:
        t = m.kv.new_table()
        m.kv.reserve(t, len(p) + 1)
        tables.append(t)
    plan = m.plan(m.prefill_bucket(3, 11))
    assert plan.batch == 4 and plan.tokens == 16  # rounded up by the ladder
    if target == "h100":
        assert any(p.work == "merge" for p in plan.packets)
    m.write_inputs(
        plan,
        [RowInput(t, tuple(range(len(p))), tuple(p)) for t, p in zip(tables, PROMPTS, strict=True)],
    )
    m.dispatch(plan)
    got = m.logits(plan)
    for b, p in enumerate(PROMPTS):
        want = ref[b].step(p)[-1]
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    dplan = m.plan(m.decode_bucket(3))
    nxt = [int(np.argmax(got[b])) for b in range(3)]
    m.write_inputs(
        dplan,
        [
            RowInput(t, (len(p),), (nxt[b],))
            for b, (t, p) in enumerate(zip(tables, PROMPTS, strict=True))
        ],
    )
    m.dispatch(dplan)
    got = m.logits(dplan)
    for b in range(3):
        want = ref[b].step([nxt[b]])[-1]
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert m.sampled(dplan)[:3].tolist() == [int(np.argmax(got[b])) for b in range(3)]


def test_random_interleavings_are_bitwise_identical(ckpt: Checkpoint) -> None:
    """20 seeds of random interleaving: the arena bytes after every step and the tokens are
    those of round-robin, and the seeds really ran the tasks in different orders."""
    base = _model(ckpt, "h100")
    snaps, toks, orders = _steps(base)
    plans = dict(base.plans)
    dplan = base.plan(base.decode_bucket(len(PROMPTS)))
    assert len({dplan.schedule.tasks[t].worker for t in orders[1]}) > 8  # many queues
    seen_orders = {orders[1]}
    for seed in range(20):
        m = _model(ckpt, "h100", mode="random", seed=seed)
        s2, t2, o2 = _steps(m, plans=plans)
        assert t2 == toks, f"seed {seed}"
        for i, (a, b) in enumerate(zip(s2, snaps, strict=True)):
            assert a == b, f"seed {seed}: arena differs after step {i}"
        seen_orders.add(o2[1])
    assert len(seen_orders) > 10  # the interleavings differ


def test_checking_mode_passes_the_real_schedule_under_random_orders(ckpt: Checkpoint) -> None:
    ref = _steps(_model(ckpt, "cpu"), decode_steps=2)[1]
    for seed in range(3):
        m = _model(ckpt, "cpu", mode="random", seed=seed, check=True)
        assert _steps(m, decode_steps=2)[1] == ref


def _decode_plan(m: CpuModel) -> tuple[Plan, list[RowInput]]:
    plan = m.plan(m.decode_bucket(4))
    rows = []
    for b in range(4):
        t = m.kv.new_table()
        m.kv.reserve(t, 8)
        rows.append(RowInput(t, (3 + b,), (10 + b,)))
    return plan, rows


def test_lowered_threshold_is_caught_even_when_the_output_is_right(ckpt: Checkpoint) -> None:
    """The schedule issue's broken schedule on a real plan: the attention op's counter with
    its threshold lowered by one. Round-robin happens to produce the right bytes; the
    checking mode still fails, naming the packet and the counter."""
    m = _model(ckpt, "cpu")
    plan, rows = _decode_plan(m)
    s = plan.schedule
    c = next(c for c in s.counters if c.name == "L1.attn.done")
    assert c.threshold >= 2
    counters = list(s.counters)
    counters[c.id] = replace(c, threshold=c.threshold - 1)
    broken = replace(plan, schedule=replace(s, counters=tuple(counters)))
    assert protocol_errors(broken.schedule)  # checkpoint D would reject it too

    m.write_inputs(plan, rows)
    m.dispatch(plan)
    good = m.arena.snapshot()
    m.write_inputs(broken, rows)
    m.machine.dispatch(broken)
    assert m.arena.snapshot() == good  # this interleaving hides the bug

    m.write_inputs(broken, rows)
    with pytest.raises(RaceError) as info:
        m.machine.dispatch(broken, check=True)
    msg = str(info.value)
    assert "L1.o_proj" in msg and "packet" in msg
    assert f"counter {c.id} 'L1.attn.done' has threshold {c.threshold - 1}" in msg
    assert f"but {c.threshold} tasks signal it" in msg
    assert info.value.exit_code == 1


def test_dropped_wait_is_caught_from_the_arena_bytes_alone(ckpt: Checkpoint) -> None:
    """Drop a consumer's wait and its schedule edges: the edge check cannot see it, the
    word-level tracking of who wrote what still names the tensor and the producer."""
    m = _model(ckpt, "h100")
    plan, rows = _decode_plan(m)
    s = plan.schedule
    t = next(t for t in s.tasks if t.name.startswith("L0.o_proj") and t.waits)
    tasks = list(s.tasks)
    tasks[t.index] = replace(t, waits=())
    edges = tuple(e for e in s.edges if e[1] != t.index)
    broken = replace(plan, schedule=replace(s, tasks=tuple(tasks), edges=edges))
    m.write_inputs(broken, rows)
    with pytest.raises(RaceError) as info:
        m.machine.dispatch(broken, check=True)
    msg = str(info.value)
    assert repr(t.name) in msg and "'L0.attn'" in msg
    assert "waits on counters [none]" in msg and "the schedule has no edge" in msg


def test_deadlock_names_workers_tasks_and_counters(ckpt: Checkpoint) -> None:
    m = _model(ckpt, "cpu")
    plan, rows = _decode_plan(m)
    s = plan.schedule
    c = next(c for c in s.counters if c.name == "L0.k_proj.done")
    counters = list(s.counters)
    counters[c.id] = replace(c, threshold=c.threshold + 1)
    stuck = replace(plan, schedule=replace(s, counters=tuple(counters)))
    m.write_inputs(stuck, rows)
    with pytest.raises(DeadlockError) as info:
        m.machine.dispatch(stuck, mode="random", seed=3)
    msg = str(info.value)
    assert "workers blocked" in msg and "L0.k_rope" in msg
    assert f"counter {c.id} 'L0.k_proj.done' at {c.threshold}/{c.threshold + 1}" in msg
