"""Checkpoint B (tile coverage, cost, bounds): the extracted checker against hand-made plans
and random tilings computed in Python."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.oracle import run_checkpoint
from plow.oracle.payloads.tiles import (
    TileAxis,
    TileOp,
    TilePayload,
    TileTarget,
    arithmetic,
    covering_steps,
    padded_work,
)

TOP = "Plow.Tilesproof.checkpoint_b_sound"
H100 = TileTarget(
    name="h100", bandwidth_bytes_per_s=3_350_000_000_000, peak_flops_per_s=989_000_000_000_000,
    min_tile=16,
)


def axis(name: str, extent: int, tile: int, steps: int | None = None) -> TileAxis:
    return TileAxis(
        name=name, extent=extent, tile=tile,
        steps=covering_steps(extent, tile) if steps is None else steps,
    )


def op(
    name: str, axes: list[TileAxis], *, kind: str = "linear", fpp: int = 2,
    charged: int | None = None, flops: int | None = None, bytes_: int = 0,
) -> TileOp:
    o = TileOp(
        name=name, kind=kind, axes=axes, flops_per_point=fpp,
        flops=arithmetic(fpp, [a.extent for a in axes]) if flops is None else flops,
        charged_cost=0, bytes=bytes_,
    )
    return o.model_copy(update={"charged_cost": padded_work(o) if charged is None else charged})


def plan(*ops: TileOp, budget_ns: int = 10_000_000, target: TileTarget = H100,
         weight_bytes: int = 0) -> TilePayload:
    return TilePayload(ops=list(ops), target=target, budget_ns=budget_ns, weight_bytes=weight_bytes)


def router() -> TileOp:
    # 8 router columns under a minimum tile width of 16: one masked tile (T1).
    return op("router", [axis("m", 4, 16), axis("n", 8, 16), axis("k", 2048, 64)],
              bytes_=8 * 2048 * 2)


def down() -> TileOp:
    return op("layers.3.mlp.down", [axis("m", 4, 16), axis("n", 2048, 128), axis("k", 8192, 64)],
              bytes_=2048 * 8192 * 2)


def test_accepts_plan_with_masked_router_tile() -> None:
    r = router()
    assert r.axes[1].steps == 1 and r.axes[1].tile == 16 and r.axes[1].extent == 8
    cert = run_checkpoint("B", plan(r, down(), weight_bytes=(8 + 2048) * 8192 * 2 // 4))
    assert cert.accepted, cert.reason
    assert TOP in cert.theorems
    assert cert.checkpoint == "B"


def test_accepts_empty_plan() -> None:
    assert run_checkpoint("B", plan()).accepted


def test_rejects_hole_naming_op_and_axis() -> None:
    d = down()
    bad = d.model_copy(update={"axes": [d.axes[0], axis("n", 100, 16, steps=6), d.axes[2]]})
    bad = bad.model_copy(update={"flops": arithmetic(2, [4, 100, 8192]), "charged_cost": 10**12})
    cert = run_checkpoint("B", plan(router(), bad))
    assert not cert.accepted
    assert cert.reason == 'op "layers.3.mlp.down" axis 1 (n): tiles cover 0..96 of 100 (hole at 96)'
    assert cert.theorems == []


def test_rejects_zero_width_tile() -> None:
    r = router()
    bad = r.model_copy(update={"axes": [r.axes[0], axis("n", 8, 0, steps=1), r.axes[2]]})
    cert = run_checkpoint("B", plan(bad))
    assert not cert.accepted
    assert cert.reason == 'op "router" axis 1 (n): zero-width tile'


def test_rejects_tile_below_minimum() -> None:
    r = router()
    bad = r.model_copy(update={"axes": [r.axes[0], axis("n", 8, 8), r.axes[2]]})
    cert = run_checkpoint("B", plan(bad))
    assert not cert.accepted
    assert cert.reason is not None
    assert 'op "router" axis 1 (n)' in cert.reason and "minimum tile 16" in cert.reason


def test_rejects_empty_step() -> None:
    bad = op("qkv", [axis("m", 4, 16), axis("n", 40, 16, steps=4)])
    cert = run_checkpoint("B", plan(bad))
    assert not cert.accepted
    assert cert.reason is not None
    assert 'op "qkv" axis 1 (n): step 3 starts at 48' in cert.reason
    assert "empty tile step" in cert.reason


def test_rejects_charged_below_arithmetic() -> None:
    o = op("lm_head", [axis("m", 1, 16), axis("n", 32, 16), axis("k", 16, 16)], charged=1000)
    assert o.flops == 1024
    cert = run_checkpoint("B", plan(o))
    assert not cert.accepted
    assert cert.reason == 'op "lm_head": charged cost 1000 below arithmetic 1024'


def test_rejects_uncharged_padding() -> None:
    # charged covers the arithmetic (2*1*32*16 = 1024) but not the padded tile (2*16*32*16).
    o = op("lm_head", [axis("m", 1, 16), axis("n", 32, 16), axis("k", 16, 16)], charged=1024)
    cert = run_checkpoint("B", plan(o))
    assert not cert.accepted
    assert cert.reason == (
        'op "lm_head": charged cost 1024 below padded work 16384 (padding must be charged)'
    )


def test_rejects_misdeclared_flops() -> None:
    o = op("lm_head", [axis("m", 1, 16), axis("n", 32, 16)], flops=10)
    cert = run_checkpoint("B", plan(o))
    assert not cert.accepted
    assert cert.reason is not None
    assert 'op "lm_head": declared flops 10' in cert.reason and "2 x 1 x 32 = 64" in cert.reason


def test_rejects_plan_needing_more_bandwidth() -> None:
    # 12e9 bytes at 3.35e12 B/s take at least 3.58 ms; budget 1 ms.
    big = op("layers.0.mlp.up", [axis("m", 1, 16), axis("n", 16, 16)], bytes_=12 * 10**9)
    cert = run_checkpoint("B", plan(router(), big, budget_ns=1_000_000))
    assert not cert.accepted
    assert cert.reason == (
        "plan: memory-bandwidth bound 3.58 ms exceeds budget 1 ms (bytes 1.2e10 at 3.35e12 B/s "
        'on h100; largest op "layers.0.mlp.up" moves 1.2e10 bytes)'
    )


def test_bandwidth_bound_is_exact_at_the_boundary() -> None:
    # bytes * 1e9 == budget * bandwidth is within budget; one byte more is not.
    tgt = H100.model_copy(update={"bandwidth_bytes_per_s": 1_000_000_000})
    ok = op("x", [axis("n", 16, 16)], bytes_=1000)
    assert run_checkpoint("B", plan(ok, budget_ns=1000, target=tgt)).accepted
    over = ok.model_copy(update={"bytes": 1001})
    cert = run_checkpoint("B", plan(over, budget_ns=1000, target=tgt))
    assert not cert.accepted
    assert cert.reason is not None and "memory-bandwidth bound" in cert.reason


def test_rejects_plan_needing_more_compute() -> None:
    tgt = H100.model_copy(update={"peak_flops_per_s": 1_000_000})
    o = op("attn", [axis("q", 64, 64), axis("kv", 64, 64)], kind="attention", fpp=4)
    cert = run_checkpoint("B", plan(o, budget_ns=1_000, target=tgt))
    assert not cert.accepted
    assert cert.reason is not None
    assert cert.reason.startswith("plan: compute bound")
    assert '"attn"' in cert.reason


def test_rejects_undercounted_weight_bytes() -> None:
    cert = run_checkpoint("B", plan(router(), weight_bytes=16_060_000_000))
    assert not cert.accepted
    assert cert.reason is not None
    assert "below the weight bytes 1.61e10" in cert.reason


axis_shape = st.tuples(st.integers(1, 5000), st.sampled_from([16, 32, 64, 128, 256]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(axis_shape, min_size=1, max_size=3), data=st.data())
def test_covering_tiling_accepted_and_dropping_a_step_rejected(
    shapes: list[tuple[int, int]], data: st.DataObject
) -> None:
    axes = [axis(f"a{j}", e, t) for j, (e, t) in enumerate(shapes)]
    o = op("rand", axes, bytes_=100)
    cert = run_checkpoint("B", plan(o, budget_ns=10**12))
    assert cert.accepted, cert.reason
    j = data.draw(st.integers(0, len(axes) - 1))
    dropped = axes[j].model_copy(update={"steps": axes[j].steps - 1})
    bad = o.model_copy(update={"axes": [*axes[:j], dropped, *axes[j + 1 :]]})
    cert = run_checkpoint("B", plan(bad, budget_ns=10**12))
    assert not cert.accepted
    e, t = shapes[j]
    covered = (covering_steps(e, t) - 1) * t
    assert cert.reason == (
        f'op "rand" axis {j} (a{j}): tiles cover 0..{covered} of {e} (hole at {covered})'
    )
