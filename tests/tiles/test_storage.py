"""The tiler prices weights at the bytes the bundle stores them in (plow/tiles/storage.py):
a q4_1 weight at 20 bytes per 32 weights, not at the config's 4-byte float32. The q4_1
plan's tiles differ from what float32 pricing picks, and the difference is justified (the
float32-priced choice is slower under the true bytes); checkpoint B derives the weight
traffic from the bundle's own weights file, so the cheaper plan still certifies and an
under-priced one does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from plow.bundle.files import OpTable
from plow.bundle.manifest import WEIGHTS, read_manifest
from plow.checkpoint import load_spec
from plow.checkpoint.weights import read_header
from plow.emit.bundle import compile_bundle
from plow.emit.verify import declared_number_problems, expected_numbers
from plow.graph import Bucket, build_graph
from plow.profile import CompileProfile
from plow.target import load_target
from plow.testing.fixtures import make_tiny_checkpoint
from plow.tiles import TilingOptions, tile_graph
from plow.tiles.storage import header_weight_bytes, stored_weight_bytes

RUNG = "decode_b1_s64"


@pytest.fixture(scope="module")
def q41(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("gguf")  # the blocks are gguf-py's
    from plow.testing.quantized import quantize_checkpoint

    root = tmp_path_factory.mktemp("storage")
    src = make_tiny_checkpoint("llama", 4, root / "src", intermediate_size=192)
    q = quantize_checkpoint(src, root / "q", {"proj": "q4_1", "embed_tokens": "q4_1"})
    out = root / "b"
    prof = CompileProfile(name="q", decode_batches=(1,), prefill_seqs=(16,), context=64)
    compile_bundle(q, out, load_target("h100"), prof, verify=True)  # B accepts, else raises
    return {"q": q, "bundle": out}


def test_q4_1_weights_are_priced_at_their_blocks_and_pick_other_tiles(
    q41: dict[str, Path],
) -> None:
    """Stored bytes: a q4_1 [N, K] weight is N * K / 32 * 20 bytes. On h100 the float32
    pricing splits o_proj's k in 4 (bandwidth-bound: four tiles share the weight read); at
    the blocks' bytes one k step is cheaper (no partials, no merge) and is what the plan has.
    Re-costed at the true bytes, the float32-priced tiling is strictly slower."""
    q = q41["q"]
    graph = build_graph(load_spec(q), Bucket.decode(1, 64))
    names = [n for n, t in graph.tensors.items() if t.role.value == "weight"]
    stored = stored_weight_bytes(q, names)
    assert stored is not None
    wo = "model.layers.0.self_attn.o_proj.weight"
    n, k = graph.tensor(wo).shape
    assert stored[wo] == n * k // 32 * 20 and graph.tensor(wo).dtype == "float32"
    target = load_target("h100")
    fp32 = {o.name: o for o in tile_graph(graph, target, TilingOptions()).ops}
    blocks = {o.name: o for o in tile_graph(graph, target, TilingOptions(weight_bytes=stored)).ops}
    differ = [o for o in fp32 if fp32[o].axes != blocks[o].axes]
    assert "L0.o_proj" in differ, differ
    assert fp32["L0.o_proj"].axes[2].steps == 4 and blocks["L0.o_proj"].axes[2].steps == 1
    b, f = blocks["L0.o_proj"], fp32["L0.o_proj"]
    at_fp32_tiles = next(c for c in b.candidates if c.tile == f.candidates[f.chosen].tile)
    assert at_fp32_tiles.time_ns > b.candidates[b.chosen].time_ns
    # the bundle has the block-priced tiles
    ops = {
        o.name: o
        for o in OpTable.model_validate_json(
            (q41["bundle"] / "plan" / f"{RUNG}.ops.json").read_bytes()
        ).ops
    }
    assert [a.steps for a in ops["L0.o_proj"].axes] == [a.steps for a in b.axes]


def test_b_derives_the_weight_traffic_from_the_bundles_bytes(q41: dict[str, Path]) -> None:
    """Each linear's charged bytes contain its weight's bytes as the bundle's weights file
    stores them (o_proj's q4_1 blocks; the fused q/k/v's concatenated blocks), not 4 bytes a
    weight (6.4x); B's expected weight traffic is the
    file's bytes of the weights a step reads whole, which the plan's declared traffic meets;
    read at the op table's float32 it would exceed it (B would reject the plan), and a plan
    declaring less than the file's bytes is rejected."""
    bundle = q41["bundle"]
    ot = OpTable.model_validate_json((bundle / "plan" / f"{RUNG}.ops.json").read_bytes())
    stored = header_weight_bytes(read_header(bundle / WEIGHTS))
    for name in ("L0.o_proj", "L0.q_proj+L0.k_proj+L0.v_proj"):
        o = next(o for o in ot.ops if o.name == name)
        m, n, k = (a.extent for a in o.axes)
        w = ot.tensors[o.inputs[1]]
        assert stored[o.inputs[1]] == w.shape[0] * w.shape[1] // 32 * 20
        assert o.cost.bytes == m * k * 4 + stored[o.inputs[1]] + m * n * 4  # fp32 activations
    m_ = read_manifest(bundle)
    target = load_target("h100")
    prof = CompileProfile.model_validate(m_.profile)
    ex = expected_numbers(ot, target, prof, Bucket.decode(1, 64), stored)
    at_dtype = expected_numbers(ot, target, prof, Bucket.decode(1, 64))
    assert ot.tiling.weight_bytes >= ex.weight_bytes
    assert at_dtype.weight_bytes > ot.tiling.weight_bytes
    rung = next(r for r in m_.ladder if r.name == RUNG)
    from plow.bundle.files import ScheduleFile

    sf = ScheduleFile.model_validate_json((bundle / rung.schedule).read_bytes())
    assert declared_number_problems(rung, ot, sf, ex, target) == []
    low = ot.model_copy(
        update={"tiling": ot.tiling.model_copy(update={"weight_bytes": ex.weight_bytes - 1})}
    )
    (problem,) = declared_number_problems(rung, low, sf, ex, target)
    assert "below the" in problem and str(ex.weight_bytes) in problem


def test_fp8_weights_are_priced_at_one_byte_plus_their_scales(tmp_path: Path) -> None:
    """An fp8 [N, K] weight with [ceil(N/32), ceil(K/32)] fp32 block scales is stored in
    N * K + 4 * ceil(N/32) * ceil(K/32) bytes: what the compiler prices (from the checkpoint)
    is what the bundle's weights file holds (what B reads back), and the op's charged bytes
    contain exactly that (the op table's dtype says float32: 4 bytes a weight)."""
    from tests.runtime.test_fp8_weights import _fp8_copy

    src = make_tiny_checkpoint("qwen3", 0, tmp_path / "src")
    path = _fp8_copy(src, tmp_path / "fp8")
    out = tmp_path / "b"
    prof = CompileProfile(name="f", decode_batches=(1,), prefill_seqs=(16,), context=64)
    compile_bundle(path, out, load_target("cpu"), prof, verify=True)
    ot = OpTable.model_validate_json((out / "plan" / f"{RUNG}.ops.json").read_bytes())
    o = next(o for o in ot.ops if o.name == "L0.o_proj")
    w = o.inputs[1]
    n, k = ot.tensors[w].shape
    want = n * k + 4 * -(-n // 32) * -(-k // 32)
    assert stored_weight_bytes(path, [w]) == {w: want}
    assert header_weight_bytes(read_header(out / WEIGHTS))[w] == want
    m, nn, kk = (a.extent for a in o.axes)
    assert o.cost.bytes == m * kk * 4 + want + m * nn * 4
