"""Checkpoint B, tasks and shapes (Plow.Partition): the extracted checker against hand-made
ops with tasks, and random partitions computed in Python."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.oracle import run_checkpoint
from plow.oracle.payloads.tiles import (
    TileAxis,
    TileOp,
    TileOpPlan,
    TilePayload,
    TileTarget,
    TileTask,
    arithmetic,
    covering_steps,
    padded_work,
)

CPU = TileTarget(name="cpu", bandwidth_bytes_per_s=10**10, peak_flops_per_s=5 * 10**10, min_tile=1)
TASKS_TOP = "Plow.Partitionproof.check_plan_tasks_sound"
LINEAR, ATTENTION_MERGE, ALLREDUCE, LOAD, ROPE = 4, 7, 15, 1, 5
MASKED, ACCUMULATE = 1, 16


def ax(name: str, extent: int, tile: int) -> TileAxis:
    return TileAxis(name=name, extent=extent, tile=tile, steps=covering_steps(extent, tile))


def task(i: int, start: int, count: int, opcode: int = LINEAR, flags: int = 0) -> TileTask:
    return TileTask(task=i, name=f"q#{i}", start=start, count=count, opcode=opcode, flags=flags)


def linear(
    tasks: list[TileTask], *, n: int = 64, tile_n: int = 16, k: int = 32, tile_k: int = 32,
    extent_n: int | None = None, merge_units: int = 0, opcode: int = LINEAR,
    shapes: tuple[list[list[int]], list[list[int]]] | None = None,
) -> TileOp:  # fmt: skip
    """`q = x[1, 1, k] @ W[n, k]^T`: axes (m 1, n, k), tiles (1, ceil(n/tile_n), k steps)."""
    axes = [ax("m", 1, 1), ax("n", extent_n or n, tile_n), ax("k", k, tile_k)]
    o = TileOp(
        name="L0.q_proj", kind="linear", axes=axes, flops_per_point=2,
        flops=arithmetic(2, [a.extent for a in axes]), charged_cost=0, bytes=0,
        plan=TileOpPlan(
            opcode=opcode,
            inputs=shapes[0] if shapes else [[1, 1, k], [n, k]],
            outputs=shapes[1] if shapes else [[1, 1, n]],
            merge_units=merge_units, tasks=tasks,
        ),
    )  # fmt: skip
    return o.model_copy(update={"charged_cost": padded_work(o)})


def check(*ops: TileOp) -> tuple[bool, str]:
    cert = run_checkpoint(
        "B", TilePayload(ops=list(ops), target=CPU, budget_ns=10**9, weight_bytes=0)
    )
    if cert.accepted:
        assert TASKS_TOP in cert.theorems and "Plow.Tilesproof.checkpoint_b_sound" in cert.theorems
    return cert.accepted, cert.reason or ""


def test_partition_accepted_and_theorems_named() -> None:
    ok, why = check(linear([task(0, 0, 2), task(1, 2, 2)]))
    assert ok, why


def test_without_tasks_only_the_tiling_is_claimed() -> None:
    o = linear([]).model_copy(update={"plan": None})
    cert = run_checkpoint("B", TilePayload(ops=[o], target=CPU, budget_ns=10**9))
    assert cert.accepted and TASKS_TOP not in cert.theorems


def test_skipped_tile_is_a_gap() -> None:
    ok, why = check(linear([task(0, 0, 1), task(1, 2, 2)]))
    assert not ok
    assert why == (
        'op "L0.q_proj" (linear): tiles 1..2 run by no task (task 1 (q#1) starts at 2, '
        "the task before it ends at 1)"
    )


def test_tile_run_twice_is_an_overlap() -> None:
    ok, why = check(linear([task(0, 0, 3), task(1, 2, 2)]))
    assert not ok and "tiles 2..3 run twice (task 1 (q#1) starts at 2" in why


def test_dropped_last_task_leaves_tiles_uncovered() -> None:
    ok, why = check(linear([task(0, 0, 2)]))
    assert not ok
    assert why == 'op "L0.q_proj" (linear): tiles 2..4 of 4 run by no task (the tasks end at 2)'


def test_task_past_the_tiles_and_empty_task() -> None:
    ok, why = check(linear([task(0, 0, 2), task(1, 2, 3)]))
    assert not ok and "task 1 (q#1): tiles 2..5 past the op's 4 tiles" in why
    ok, why = check(linear([task(0, 0, 0), task(1, 0, 4)]))
    assert not ok and "task 0 (q#0): empty unit range" in why


def test_shrunk_extent_is_not_the_tensor_shape() -> None:
    # n = 48 in the axes but the weight is [64, 32]: the tiling alone is consistent
    ok, why = check(linear([task(0, 0, 3)], extent_n=48))
    assert not ok
    assert why.startswith('op "L0.q_proj" axis 1 (n): extent 48 but the tensors\' shapes give 64')


def test_shapes_that_do_not_fit_the_kind() -> None:
    ok, why = check(linear([task(0, 0, 4)], shapes=([[1, 1, 32]], [[1, 1, 64]])))
    assert not ok and "do not fit the linear rule" in why


def test_opcodes_against_the_kind() -> None:
    ok, why = check(linear([task(0, 0, 4)], opcode=ROPE))
    assert not ok and "op table opcode 5 (rope), the kind's is 4 (linear)" in why
    ok, why = check(linear([task(0, 0, 2), task(1, 2, 2, opcode=ROPE)]))
    assert not ok and "task 1 (q#1): packet opcode 5 (rope) but the op computes 4 (linear)" in why


def test_masked_flag_against_overhanging_tiles() -> None:
    # n = 60 under tile 16: tile 3 (48..64) overhangs
    ok, why = check(linear([task(0, 0, 3), task(1, 3, 1)], extent_n=60, n=60))
    assert not ok and "task 1 (q#1): MASKED is not set but one of its tiles 3..4 overhangs" in why
    ok, why = check(linear([task(0, 0, 3), task(1, 3, 1, flags=MASKED)], extent_n=60, n=60))
    assert ok, why
    ok, why = check(
        linear([task(0, 0, 3, flags=MASKED), task(1, 3, 1, flags=MASKED)], extent_n=60, n=60)
    )
    assert not ok and "task 0 (q#0): MASKED is set but none of its tiles 0..3 overhangs" in why


def test_merges_partition_the_merge_units() -> None:
    # k = 64 in two steps of 32: split; 4 merge units
    ts = [task(0, 0, 8)]
    ms = [task(1, 0, 2, flags=ACCUMULATE), task(2, 2, 2, opcode=ALLREDUCE, flags=ACCUMULATE)]
    ok, why = check(linear([*ts, *ms], k=64, merge_units=4))
    assert ok, why
    ok, why = check(linear([*ts, ms[0]], k=64, merge_units=4))
    assert not ok and "merge units 2..4 of 4 run by no task" in why
    bad = task(2, 2, 2, opcode=ATTENTION_MERGE, flags=ACCUMULATE)
    ok, why = check(linear([*ts, ms[0], bad], k=64, merge_units=4))
    assert not ok and "packet opcode 7 (attention_merge) but the op computes 4" in why
    ok, why = check(linear([*ts, ms[0], task(2, 2, 2, flags=ACCUMULATE | MASKED)], k=64,
                           merge_units=4))  # fmt: skip
    assert not ok and "MASKED is set on a merge" in why


def test_loads_lie_within_the_tiles() -> None:
    ok, why = check(linear([task(9, 0, 4, opcode=LOAD), task(0, 0, 4)]))
    assert ok, why
    ok, why = check(linear([task(9, 2, 4, opcode=LOAD), task(0, 0, 4)]))
    assert not ok and "task 9 (q#9): tiles 2..6 past the op's 4 tiles" in why
    ok, why = check(linear([task(9, 0, 4, opcode=LOAD, flags=ACCUMULATE), task(0, 0, 4)]))
    assert not ok and "a load with ACCUMULATE set" in why


def test_unknown_kind_is_rejected() -> None:
    # a kind outside the op table's vocabulary (every emitted kind has a rule: router and the
    # ssm kinds got theirs)
    o = linear([task(0, 0, 4)]).model_copy(update={"kind": "conv2d"})
    ok, why = check(o)
    assert not ok and why == 'op "L0.q_proj" (conv2d): no shape rule for this kind'


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 300), tile=st.sampled_from([1, 8, 16, 32]), cuts=st.data(),
)  # fmt: skip
def test_random_partitions_accepted_and_a_moved_cut_rejected(
    n: int, tile: int, cuts: st.DataObject
) -> None:
    tiles = covering_steps(n, tile)
    bounds = sorted(set(cuts.draw(st.lists(st.integers(1, max(1, tiles - 1)), max_size=6))))
    bounds = [b for b in bounds if 0 < b < tiles]
    edges = [0, *bounds, tiles]
    masked = [(j + 1) * tile > n for j in range(tiles)]
    ts = [
        task(i, a, b - a, flags=MASKED if any(masked[a:b]) else 0)
        for i, (a, b) in enumerate(zip(edges, edges[1:], strict=False))
    ]
    op = linear(ts, n=n, tile_n=tile, extent_n=n)
    assert math.prod(a.steps for a in op.axes) == tiles
    ok, why = check(op)
    assert ok, why
    if len(ts) > 1:  # shift the second task's start by one: a gap or an overlap
        t1 = ts[1]
        moved = t1.model_copy(update={"start": t1.start + 1, "count": max(1, t1.count - 1)})
        ok, why = check(linear([ts[0], moved, *ts[2:]], n=n, tile_n=tile, extent_n=n))
        assert not ok and any(w in why for w in ("run by no task", "run twice", "past the op")), why
