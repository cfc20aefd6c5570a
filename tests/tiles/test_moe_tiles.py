"""Routed experts in the tiler: every expert_linear tile lies in one expert (so one router
weight gates it), router tiles hold whole rows, the charge covers the arithmetic, checkpoint
B certifies the tiling of the real Qwen3-30B-A3B shapes, and an expert narrower than the
target's minimum tile is refused naming the op."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plow.checkpoint.loader import spec_from_config
from plow.errors import GraphError, PlanRejected
from plow.graph import Bucket, build_graph
from plow.graph.ops import OpKind, infer_shapes
from plow.target import load_target
from plow.tiles import certify_tiles, tile_graph

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def _config(layers: int = 2, **change: Any) -> dict[str, Any]:
    cfg = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    return {**cfg, "num_hidden_layers": layers, **change}


@pytest.mark.parametrize("target", ["h200", "cpu"])
@pytest.mark.parametrize("bucket", [Bucket.decode(8, 4096), Bucket.prefill(1, 64, 4096)])
def test_every_expert_tile_lies_in_one_expert(target: str, bucket: Bucket) -> None:
    spec = spec_from_config(_config(), "qwen3-30b-a3b")
    assert spec.moe is not None
    E, W, H = spec.moe.experts, spec.moe.intermediate_size, spec.hidden_size
    tg = tile_graph(build_graph(spec, bucket), load_target(target))
    seen = 0
    for top in tg.ops:
        if top.kind == "router":
            assert top.axes[1].steps == 1 and top.axes[1].extent == E
        if top.kind != "expert_linear":
            continue
        gate_up = top.name.endswith("gate_up")
        assert [a.extent for a in top.axes][1:] == ([E * W, H] if gate_up else [H, E * W])
        for t in top.tiles:
            (n0, n1), (k0, k1) = t.ranges[1], t.ranges[2]
            if gate_up:
                assert n0 // W == (n1 - 1) // W and (k0, k1) == (0, H)
            else:
                assert k1 - k0 == W and k0 % W == 0
        assert top.charged_cost >= top.flops
        seen += 1
    assert seen == 2 * sum(lay.moe for lay in spec.layers)


def test_checkpoint_b_certifies_the_moe_tiling() -> None:
    h200 = load_target("h200")
    tg = tile_graph(build_graph(spec_from_config(_config(), "c"), Bucket.decode(1, 4096)), h200)
    payload, cert = certify_tiles(tg, h200, 50_000_000)
    assert cert.verdict == "accept", cert.reason
    assert {o.kind for o in payload.ops} >= {"router", "expert_linear"}


def test_an_expert_narrower_than_the_minimum_tile_is_refused() -> None:
    spec = spec_from_config(_config(moe_intermediate_size=8), "c")
    with pytest.raises(
        PlanRejected, match=r"experts_gate_up.*width 8 is below the minimum tile 16"
    ):
        tile_graph(build_graph(spec, Bucket.decode(1, 256)), load_target("h200"))


def test_expert_linear_shape_rules_refuse_a_mismatch() -> None:
    gate_up = {"mode": "gate_up", "activation": "silu"}
    assert infer_shapes(
        OpKind.expert_linear, "e", [(2, 1, 16), (2, 1, 4), (4, 12, 16)], gate_up
    ) == [(2, 1, 24)]
    down = {"mode": "down"}
    assert infer_shapes(OpKind.expert_linear, "e", [(2, 1, 24), (2, 1, 4), (4, 16, 6)], down) == [
        (2, 1, 16)
    ]
    with pytest.raises(GraphError, match="router weights"):
        infer_shapes(OpKind.expert_linear, "e", [(2, 1, 16), (2, 1, 5), (4, 12, 16)], gate_up)
    with pytest.raises(GraphError, match="4 experts x 6 columns"):
        infer_shapes(OpKind.expert_linear, "e", [(2, 1, 16), (2, 1, 4), (4, 16, 6)], down)
    with pytest.raises(GraphError, match="top_k 9 outside 1..8"):
        infer_shapes(OpKind.router, "r", [(1, 1, 8)], {"top_k": 9})


def test_the_graph_routes_moe_layers_and_keeps_dense_ones_dense() -> None:
    spec = spec_from_config(_config(layers=3, mlp_only_layers=[1]), "c")
    g = build_graph(spec, Bucket.decode(1, 256))
    kinds = {n: {op.kind for op in g.ops if op.layer == n} for n in range(3)}
    for n in (0, 2):
        assert {OpKind.router, OpKind.expert_linear} <= kinds[n]
        assert OpKind.gated_mlp not in kinds[n]
    assert OpKind.gated_mlp in kinds[1] and OpKind.router not in kinds[1]


@pytest.mark.parametrize("batch", [1, 8])
def test_expected_load_is_the_chance_a_tiles_rows_chose_its_expert(batch: int) -> None:
    spec = spec_from_config(_config(layers=1), "c")
    tg = tile_graph(build_graph(spec, Bucket.decode(batch, 4096)), load_target("h200"))
    experts = [o for o in tg.ops if o.kind == "expert_linear"]
    assert len(experts) == 2
    for o in experts:
        assert o.axes[0].steps == 1  # every row of the bucket in each tile's row range
        want = 1 - (1 - 8 / 128) ** batch  # top-8 of 128 experts, `batch` rows per tile
        assert abs(o.expected_busy - want) < 1e-12
        assert o.expected_ns is not None and o.expected_ns < o.time_ns


def _expert_op(mode: str, extents: list[int], shapes: tuple[list, list]) -> Any:
    from plow.oracle.payloads.tiles import (
        TileAxis,
        TileOp,
        TileOpPlan,
        TileTask,
        arithmetic,
        padded_work,
    )

    axes = [
        TileAxis(name=n, extent=e, tile=e, steps=1) for n, e in zip("mnk", extents, strict=True)
    ]
    o = TileOp(
        name=f"L0.experts_{mode}", kind="expert_linear", axes=axes, flops_per_point=2,
        flops=arithmetic(2, extents), charged_cost=0, bytes=0,
        plan=TileOpPlan(
            opcode=14, inputs=shapes[0], outputs=shapes[1], merge_units=0,
            tasks=[TileTask(task=0, name="t#0", start=0, count=1, opcode=14, flags=0)],
        ),
    )  # fmt: skip
    return o.model_copy(update={"charged_cost": padded_work(o)})


def test_checkpoint_b_holds_expert_linear_extents_to_its_shape_rule() -> None:
    from plow.oracle import run_checkpoint
    from plow.oracle.payloads.tiles import TilePayload, TileTarget

    cpu = TileTarget(
        name="cpu", bandwidth_bytes_per_s=10**10, peak_flops_per_s=5 * 10**10, min_tile=1
    )

    def check(op: Any) -> tuple[bool, str]:
        cert = run_checkpoint(
            "B", TilePayload(ops=[op], target=cpu, budget_ns=10**9, weight_bytes=0)
        )
        return cert.verdict == "accept", cert.reason or ""

    # x [2, 1, 16], router [2, 1, 4], experts [4, 2*6, 16] -> [2, 1, 24]: axes [2, 24, 16]
    up = ([[2, 1, 16], [2, 1, 4], [4, 12, 16]], [[2, 1, 24]])
    assert check(_expert_op("gate_up", [2, 24, 16], up)) == (True, "")
    ok, why = check(_expert_op("gate_up", [2, 12, 16], up))  # one expert's width only
    assert not ok and "extent 12 but the tensors' shapes give 24" in why
    # x [2, 1, 24] (4 experts x 6), experts [4, 16, 6] -> [2, 1, 16]: axes [2, 16, 24]
    down = ([[2, 1, 24], [2, 1, 4], [4, 16, 6]], [[2, 1, 16]])
    assert check(_expert_op("down", [2, 16, 24], down)) == (True, "")
    ok, why = check(_expert_op("down", [2, 16, 6], down))  # the reduction over one expert
    assert not ok and "extent 6 but the tensors' shapes give 24" in why
