"""Block-quantized weights (GGML Q4_0 / Q4_1 / Q8_0) kept as blocks from the checkpoint to
the tile.

The blocks are made by gguf-py's quantizers; the reference is transformers on the exact
de-quantization (gguf-py's `dequantize`, the function transformers loads GGUF files with).
The native kernel decodes a block with the reference's float operations and accumulates in
the fp32 path's order, so a quantized bundle's logits equal, bit for bit, those of an fp32
bundle of the de-quantized weights — checked here on a plan that splits k at unaligned
offsets too. The real GGUF file of the embedded default model is imported with its blocks
(slow tier): every tensor equals transformers' own de-quantization of that file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from plow.checkpoint.quant import FORMATS, QuantTensor, dequantize
from plow.checkpoint.weights import WeightStore
from plow.emit.bundle import compile_bundle
from plow.errors import CheckpointError
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.native import open_native
from plow.target import load_target
from plow.testing.fixtures import make_tiny_checkpoint
from plow.testing.quantized import dequantized_checkpoint, quantize_checkpoint, quantized_names
from tests.runtime.helpers import prefill_logits

gguf = pytest.importorskip("gguf")

NEW = 12
PROMPTS = [[5, 17, 93, 2, 44, 8, 61, 30, 12, 7, 99, 14, 3, 150, 88, 21, 40, 9], [3, 250, 41], [9]]
PROFILE = CompileProfile(name="test", decode_batches=(1, 4), prefill_seqs=(16,), context=96)
# every format on the tensors the tiles read: linears, the embedding, the (untied) lm_head
FORMATS_BY_NAME = {
    "q_proj": "q4_1", "k_proj": "q4_0", "v_proj": "q8_0", "o_proj": "q4_1",
    "gate_proj": "q4_1", "up_proj": "q4_0", "down_proj": "q4_1",
    "embed_tokens": "q8_0", "lm_head": "q4_1",
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_equals_gguf_py_bit_for_bit(fmt: str) -> None:
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((6, 96)) * rng.uniform(1e-6, 30.0, (6, 1))).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, fmt.upper())
    blocks = gguf.quants.quantize(a, kind)
    got = dequantize(fmt, blocks, a.shape)
    want = gguf.quants.dequantize(blocks, kind)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(got, a)  # really quantized


def test_a_malformed_quantized_tensor_is_a_one_line_error(tmp_path: Path) -> None:
    header = {
        "__metadata__": {"plow.quant": json.dumps({"w": {"format": "q4_1", "shape": [2, 64]}})},
        "w": {"dtype": "U8", "shape": [2, 39], "data_offsets": [0, 78]},  # 40 bytes a row
    }
    raw = json.dumps(header).encode()
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(78))
    with pytest.raises(CheckpointError, match=r"'w'.*q4_1 \[2, 64\] needs uint8 blocks \[2, 40\]"):
        WeightStore.open([p])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant")
    src = make_tiny_checkpoint("llama", 4, root / "src", intermediate_size=192)
    q = quantize_checkpoint(src, root / "q", FORMATS_BY_NAME)
    deq = dequantized_checkpoint(q, root / "deq")
    split = load_target("cpu").model_copy(update={"workers": 16, "tile_overhead_ns": 50})
    out = {"q": q, "deq": deq}
    import plow.compile

    priced = plow.compile._stored_bytes
    for name, ck in (("q", q), ("deq", deq)):
        for tname, tgt in (("cpu", load_target("cpu")), ("split", split)):
            out[f"{name}-{tname}"] = root / f"b-{name}-{tname}"
            # q, k, v and gate, up have mixed block formats, so the quantized bundles keep
            # them canonical (they cannot be re-laid-out); the dequantized ones alike, and
            # tiled as if their weights were the blocks (the tiler prices weights at their
            # stored bytes, plow/tiles/storage.py), for the bit-for-bit comparison of one
            # plan: unverified, as B rejects a plan priced below its weights' bytes
            prof = PROFILE.model_copy(update={"fuse": False})
            with pytest.MonkeyPatch.context() as mp:
                if name == "deq":
                    mp.setattr(plow.compile, "_stored_bytes", lambda _s, g, a: priced(q, g, a))
                compile_bundle(ck, out[f"{name}-{tname}"], tgt, prof, verify=name == "q")
    return out


def test_default_fusion_keeps_weights_it_cannot_relay_canonical(
    quantized: dict[str, Path], tmp_path: Path
) -> None:
    """Fused by default, the quantized checkpoint's q/k/v (q4_1, q4_0, q8_0) and gate/up
    (q4_1, q4_0) have no common block format to concatenate or interleave: those linears stay
    canonical, the residual add + rmsnorm (no weight re-laid) is still fused."""
    from plow.bundle.files import OpTable

    out = tmp_path / "b"
    prof = CompileProfile(decode_batches=(1,), context=32)
    assert prof.fuse
    compile_bundle(quantized["q"], out, load_target("cpu"), prof, plan_only=True)
    kinds = {o.kind for o in OpTable.model_validate_json(
        (out / "plan" / "decode_b1_s32.ops.json").read_bytes()).ops}  # fmt: skip
    assert "add_rmsnorm" in kinds and not kinds & {"linear_qkv", "linear_glu"}
    assert kinds >= {"linear", "gated_mlp"}


def test_the_bundle_keeps_the_checkpoints_blocks(quantized: dict[str, Path]) -> None:
    names = quantized_names(quantized["q"])
    assert set(names.values()) == set(FORMATS)  # every format is in the model
    src = WeightStore.open([quantized["q"] / "model.safetensors"])
    bundled = WeightStore.open([quantized["q-cpu"] / "weights.safetensors"])
    for n, fmt in names.items():
        t = bundled[n]
        assert isinstance(t, QuantTensor) and t.format == fmt
        assert np.array_equal(np.asarray(t.blocks), np.asarray(src[n].blocks))  # type: ignore[union-attr]
    q_bytes = (quantized["q-cpu"] / "weights.safetensors").stat().st_size
    f_bytes = (quantized["deq-cpu"] / "weights.safetensors").stat().st_size
    assert q_bytes < 0.45 * f_bytes


def test_quantized_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    quantized: dict[str, Path],
) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        quantized["deq"], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    want = []
    for p in PROMPTS:
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)  # fmt: skip
        want.append(g[0, len(p) :].tolist())
    reqs = [Request(tuple(p), NEW) for p in PROMPTS]
    for tname in ("cpu", "split"):
        assert generate(open_native(quantized[f"q-{tname}"], max_batch=4), reqs) == want, tname
    assert generate(CpuModel.from_bundle(quantized["q-cpu"], max_batch=4), reqs) == want


@pytest.mark.parametrize("tname", ["cpu", "split"])
def test_quantized_logits_are_the_fp32_logits_of_the_dequantized_weights_bit_for_bit(
    quantized: dict[str, Path], tname: str
) -> None:
    ids = PROMPTS[0]  # 18 tokens: a 16-token prefill (4-row dot blocks) then a 2-token one
    got = prefill_logits(open_native(quantized[f"q-{tname}"]), ids)
    want = prefill_logits(open_native(quantized[f"deq-{tname}"], verify=False), ids)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.slow
def test_the_default_models_gguf_imports_with_its_blocks_and_runs(tmp_path: Path) -> None:
    """Every tensor of the imported Q4_1 file equals transformers' own de-quantization of the
    same file (the embedded default model, converted by transformers), and the quantized
    bundle runs on the native executor with the fp32 bundle's greedy tokens."""
    from plow.checkpoint.gguf import gguf_checkpoint
    from plow.default_model import ensure_default_model, gguf_path
    from plow.runtime.cpu.bundle import NO_BUDGET_NS

    ref_dir = ensure_default_model()
    q = gguf_checkpoint(gguf_path(), tmp_path)  # what plow generate / serve do with a .gguf
    assert q.parent == tmp_path / "gguf" and gguf_checkpoint(gguf_path(), tmp_path) == q
    have = WeightStore.open([q / "model.safetensors"])
    ref = WeightStore.open(sorted(ref_dir.glob("*.safetensors")))
    kinds = {type(have[n]).__name__ for n in have}
    assert kinds == {"QuantTensor", "memmap"}
    assert {t.format for n in have if isinstance(t := have[n], QuantTensor)} == {"q4_1", "q8_0"}
    for n in ref:
        assert np.array_equal(np.asarray(have[n], dtype=np.float32), np.asarray(ref[n])), n
    prof = CompileProfile(
        name="test", decode_batches=(1,), prefill_seqs=(16,), context=64,
        decode_budget_ns=NO_BUDGET_NS, prefill_budget_ns_per_token=NO_BUDGET_NS,
    )  # fmt: skip
    compile_bundle(q, tmp_path / "bq", load_target("cpu"), prof, verify=True)
    mq = open_native(tmp_path / "bq")
    assert mq.weight_bytes < 110e6  # the blocks, not 540 MB of fp32
    ids = [1, 504, 3458, 282, 4649, 314]
    reqs = [Request(tuple(ids), 16)]
    compile_bundle(ref_dir, tmp_path / "bf", load_target("cpu"), prof, verify=True)
    assert generate(mq, reqs) == generate(open_native(tmp_path / "bf"), reqs)


def test_import_refuses_a_non_empty_destination_and_a_missing_file(tmp_path: Path) -> None:
    from plow.checkpoint.gguf import import_gguf

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not found"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "x")
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        import_gguf(f, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_the_device_image_uploads_the_blocks_as_they_are(
    quantized: dict[str, Path], tmp_path: Path
) -> None:
    """The CUDA loader moves a quantized weight's raw blocks (the device decodes them with the
    same blocks.h), not a widened copy."""
    import ctypes

    from plow.runtime.cuda.image import build_image
    from plow.runtime.native import NativeModel
    from plow.runtime.native.library import PlowOp
    from plow.runtime.native.lower import lower
    from tests.runtime.test_cuda import Recorder

    compile_bundle(quantized["q"], tmp_path / "h200", load_target("h200"), PROFILE, verify=True)
    m = NativeModel.from_bundle(tmp_path / "h200", max_batch=1)
    plan = m.plan(m.decode_bucket(1))
    bundle = m.bundle
    assert bundle is not None
    low = lower(plan, m.arena, m.weights, Path(plan.source), bundle.rung(plan.bucket))
    rec = Recorder()
    img = build_image(low, rec)
    host_ops = (PlowOp * low.plan.n_ops).from_address(low.plan.ops)
    src = WeightStore.open([quantized["q"] / "model.safetensors"])
    seen = set()
    for i, op in enumerate(plan.ops):
        if op.kind not in ("linear", "lm_head", "embedding"):
            continue
        t = src[op.inputs[1]]
        if not isinstance(t, QuantTensor):
            continue
        assert host_ops[i].w0_dtype == FORMATS[t.format].code
        blob = rec.blobs[img.ops_host[i].w0]
        assert blob == np.asarray(t.blocks).tobytes()
        assert ctypes.string_at(host_ops[i].w0, len(blob)) == blob
        seen.add(t.format)
    assert seen == set(FORMATS)
