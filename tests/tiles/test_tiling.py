"""Tiling: exact coverage, charged cost >= arithmetic, minimum tile, determinism, the
cost-model choice, and checkpoint B on tiny fixtures and real-size configs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.checkpoint import load_spec
from plow.graph import Bucket, OpGraph, build_graph
from plow.graph.ops import Op, OpKind, Tensor, TensorRole
from plow.oracle import run_checkpoint
from plow.oracle.payloads.tiles import padded_work
from plow.target import MinTile, Target, load_target
from plow.tiles import TiledOp, TileGraph, certify_tiles, tile_graph, tile_payload
from plow.tiles.tiler import axis_sizes

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
REAL_CONFIGS = ["llama-3.1-8b", "qwen3-8b", "gemma-3-12b", "gemma-3-27b"]

TOP = "Plow.Tilesproof.checkpoint_b_sound"


def graph_of(ops: list[Op], tensors: list[Tensor]) -> OpGraph:
    g = OpGraph(tuple(ops), {t.name: t for t in tensors}, "synthetic")
    g.validate()
    return g


def linear_graph(m: int, n: int, k: int, dtype: str = "bfloat16") -> OpGraph:
    return graph_of(
        [Op("router", OpKind.linear, ("x", "w"), ("y",))],
        [
            Tensor("x", (1, m, k), TensorRole.input),
            Tensor("w", (n, k), TensorRole.weight, dtype),
            Tensor("y", (1, m, n), TensorRole.activation),
        ],
    )


def attention_graph(
    b: int, t: int, kvh: int, group: int, d: int, ctx: int, window: int | None
) -> OpGraph:
    h = kvh * group
    return graph_of(
        [
            Op(
                "attn",
                OpKind.attention,
                ("q", "k", "v", "kc", "vc", "pos"),
                ("o",),
                {"heads": h, "kv_heads": kvh, "head_dim": d, "window": window},
            )
        ],
        [
            Tensor("q", (b, t, h * d), TensorRole.input),
            Tensor("k", (b, t, kvh * d), TensorRole.input),
            Tensor("v", (b, t, kvh * d), TensorRole.input),
            Tensor("kc", (b, kvh, ctx, d), TensorRole.cache),
            Tensor("vc", (b, kvh, ctx, d), TensorRole.cache),
            Tensor("pos", (b, t), TensorRole.input),
            Tensor("o", (b, t, h * d), TensorRole.activation),
            Tensor("w0", (1, 1), TensorRole.weight, "bfloat16"),
        ],
    )


def rowwise_graph(kind: OpKind, rows: int, cols: int) -> OpGraph:
    x = Tensor("x", (1, rows, cols), TensorRole.input)
    if kind is OpKind.rmsnorm:
        return graph_of(
            [Op("norm", kind, ("x", "g"), ("y",))],
            [
                x,
                Tensor("g", (cols,), TensorRole.weight, "bfloat16"),
                Tensor("y", (1, rows, cols), TensorRole.activation),
            ],
        )
    return graph_of(
        [Op("add", OpKind.residual_add, ("x", "x2"), ("y",))],
        [
            x,
            Tensor("x2", (1, rows, cols), TensorRole.input),
            Tensor("y", (1, rows, cols), TensorRole.activation),
        ],
    )


def target_of(**kw: Any) -> Target:
    base = load_target("h100")
    mt = kw.pop("min_tile", None)
    if mt is not None:
        kw["min_tile"] = MinTile(rows=mt[0], cols=mt[1])
    return base.model_copy(update=kw)


targets = st.builds(
    lambda w, r, c, bw, pk, ov: target_of(
        name="rand",
        workers=w,
        min_tile=(r, c),
        bandwidth_bytes_per_s=bw,
        peak_flops_per_s={"bf16": pk, "fp8": 2 * pk, "fp32": max(1, pk // 8)},
        tile_overhead_ns=ov,
    ),
    st.integers(1, 300),
    st.sampled_from([1, 8, 16, 32, 64]),
    st.sampled_from([1, 4, 8, 16, 32]),
    st.integers(10**9, 10**13),
    st.integers(10**10, 10**16),
    st.integers(0, 5000),
)


def assert_exact_cover(op: TiledOp) -> None:
    """Every point of the index space is in exactly one tile (enumerated ranges)."""
    extents = tuple(a.extent for a in op.axes)
    assert len(op.tiles) == math.prod(a.steps for a in op.axes)
    assert [t.index for t in op.tiles] == list(range(len(op.tiles)))
    if math.prod(extents) <= 300_000:
        count = np.zeros(extents, dtype=np.int32)
        for t in op.tiles:
            count[tuple(slice(a, b) for a, b in t.ranges)] += 1
        assert count.min() == 1 and count.max() == 1, f"{op.name}: hole or double count"
    else:  # per axis: the step ranges partition 0..extent, and tiles enumerate their product
        for j, ax in enumerate(op.axes):
            rs = sorted({t.ranges[j] for t in op.tiles})
            assert rs[0][0] == 0 and rs[-1][1] == ax.extent
            assert all(a[1] == b[0] for a, b in zip(rs, rs[1:], strict=False))
        assert len({t.ranges for t in op.tiles}) == len(op.tiles)
    assert sum(t.points for t in op.tiles) == math.prod(extents)
    for t in op.tiles:
        nominal = [(a.tile * 0, a.tile) for a in op.axes]
        assert t.masked == any(b - a < n[1] for (a, b), n in zip(t.ranges, nominal, strict=True))


def assert_costs(op: TiledOp, target: Target) -> None:
    for c in op.candidates:
        padded = op.flops_per_point * math.prod(t * s for t, s in zip(c.tile, c.steps, strict=True))
        assert c.padded_work == padded
        assert c.charged_cost >= c.padded_work >= op.flops
    assert op.flops == op.flops_per_point * math.prod(a.extent for a in op.axes)
    for ax in op.axes:
        minimum = target.min_tile.rows if ax.name in ("m", "rows") else target.min_tile.cols
        assert ax.tile >= minimum
        assert ax.steps * ax.tile >= ax.extent > (ax.steps - 1) * ax.tile
    # the choice is the cheapest feasible candidate (time, then charge, then order)
    feasible = [(c.time_ns, c.charged_cost, i) for i, c in enumerate(op.candidates) if c.feasible]
    assert min(feasible)[2] == op.chosen


def check_graph(tg: TileGraph, target: Target) -> None:
    for op in tg.ops:
        assert_exact_cover(op)
        assert_costs(op, target)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 300), n=st.integers(1, 3000), k=st.integers(1, 3000), target=targets)
def test_linear_tiling_covers_once_and_charges_at_least_arithmetic(
    m: int, n: int, k: int, target: Target
) -> None:
    check_graph(tile_graph(linear_graph(m, n, k), target), target)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 40),
    kvh=st.integers(1, 4),
    group=st.integers(1, 4),
    d=st.sampled_from([8, 16, 64, 128]),
    extra=st.integers(0, 600),
    window=st.one_of(st.none(), st.integers(1, 300)),
    target=targets,
)
def test_attention_tiling_covers_once(
    b: int, t: int, kvh: int, group: int, d: int, extra: int, window: int | None, target: Target
) -> None:
    g = attention_graph(b, t, kvh, group, d, t + extra, window)
    check_graph(tile_graph(g, target), target)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from([OpKind.rmsnorm, OpKind.residual_add]),
    rows=st.integers(1, 500),
    cols=st.integers(1, 5000),
    target=targets,
)
def test_rowwise_tiling_covers_once(kind: OpKind, rows: int, cols: int, target: Target) -> None:
    check_graph(tile_graph(rowwise_graph(kind, rows, cols), target), target)


@settings(max_examples=40, deadline=None)
@given(
    extent=st.integers(1, 10**6),
    minimum=st.sampled_from([1, 8, 16, 32]),
    limit=st.integers(1, 4096),
)
def test_axis_sizes_honour_minimum_and_cover(extent: int, minimum: int, limit: int) -> None:
    sizes = axis_sizes(extent, minimum, limit)
    assert sizes and all(s >= minimum for s in sizes)
    assert sorted(set(sizes)) == list(sizes)
    assert all(s < extent or s == max(minimum, -(-extent // minimum) * minimum) for s in sizes)


def test_router_with_8_columns_gets_one_masked_tile_under_min_width_16() -> None:
    h100 = load_target("h100")
    op = tile_graph(linear_graph(1, 8, 2048), h100).ops[0]
    n = op.axes[1]
    assert (n.extent, n.tile, n.steps) == (8, 16, 1)
    assert all(t.masked for t in op.tiles)
    assert all(c.tile[1] == 16 for c in op.candidates)  # no other width is a candidate
    assert op.charged_cost >= op.padded_work > op.flops  # the masked lanes are charged
    cert = run_checkpoint(
        "B", tile_payload(tile_graph(linear_graph(1, 8, 2048), h100), h100, 10**9)
    )
    assert cert.accepted, cert.reason


def test_decode_linear_fills_the_workers() -> None:
    h200 = load_target("h200")
    op = tile_graph(linear_graph(1, 4096, 4096), h200).ops[0]
    assert len(op.tiles) >= h200.workers // 2
    # it is the cheapest in time of all candidates considered
    assert op.time_ns == min(c.time_ns for c in op.candidates if c.feasible)
    # bandwidth-bound: no candidate beats the whole device streaming the weights once
    assert op.time_ns >= 4096 * 4096 * 2 * 1e9 / h200.bandwidth_bytes_per_s


def test_tile_graph_is_deterministic_and_keeps_edges() -> None:
    spec = load_spec(CONFIGS / "llama-3.1-8b")
    g = build_graph(spec, Bucket.decode(1, 1024))
    h100 = load_target("h100")
    a, b = tile_graph(g, h100), tile_graph(g, h100)
    assert a == b
    assert a.edges == tuple(g.edges())
    assert [o.name for o in a.ops] == [o.name for o in g.ops]


def test_infeasible_on_chip_memory_rejects_with_the_op() -> None:
    from plow.errors import PlanRejected

    tiny = target_of(name="tiny", onchip_bytes_per_worker=1024, page_bytes=512)
    with pytest.raises(PlanRejected) as e:
        tile_graph(linear_graph(64, 64, 64), tiny)
    assert "'router'" in str(e.value) and "on-chip" in str(e.value)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("target", ["cpu", "h100", "mi350x"])
def test_oracle_accepts_tiny_fixtures(
    tiny_checkpoints: dict[str, Path], family: str, target: str
) -> None:
    tgt = load_target(target)
    spec = load_spec(tiny_checkpoints[family])
    for bucket in (Bucket.decode(1, 64), Bucket.decode(3, 64), Bucket.prefill(2, 16, 64)):
        tg = tile_graph(build_graph(spec, bucket), tgt)
        check_graph(tg, tgt)
        payload, cert = certify_tiles(tg, tgt, 10**9)
        assert cert.accepted, cert.reason
        assert TOP in cert.theorems
        assert all(o.charged_cost >= padded_work(o) for o in payload.ops)


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_oracle_accepts_real_size_configs(name: str) -> None:
    h200 = load_target("h200")
    spec = load_spec(CONFIGS / name)
    tg = tile_graph(build_graph(spec, Bucket.decode(1, 4096)), h200)
    for op in tg.ops:
        assert_costs(op, h200)
    payload, cert = certify_tiles(tg, h200, 50_000_000)
    assert cert.accepted, cert.reason
    # T6: the step reads every weight in full once (bf16, 2 bytes per parameter), except an
    # untied embedding table, of which it gathers only the rows of its tokens
    gathered = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    assert payload.weight_bytes == 2 * (spec.parameter_count() - gathered)


def test_real_size_config_shapes() -> None:
    s = load_spec(CONFIGS / "gemma-3-12b")
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (
        48,
        3840,
        16,
        8,
        256,
    )
    assert (s.intermediate_size, s.vocab_size) == (15360, 262208)
    assert sum(1 for lay in s.layers if lay.window == 1024) == 40
    s27 = load_spec(CONFIGS / "gemma-3-27b")
    assert (s27.num_layers, s27.hidden_size, s27.num_heads, s27.num_kv_heads) == (62, 5376, 32, 16)
    assert 26e9 < s27.parameter_count() < 28e9
    assert 7.9e9 < load_spec(CONFIGS / "llama-3.1-8b").parameter_count() < 8.1e9
