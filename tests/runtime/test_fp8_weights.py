"""fp8 (e4m3) weights with block or per-channel scales, as fp8 checkpoints ship them
(`W` float8_e4m3fn + `W_scale_inv` [ceil(N/bn), ceil(K/bk)], `quantization_config` fp8 with
`weight_block_size`): the `cpu` and `native` executors of a certified bundle give
transformers' greedy tokens and logits on the de-quantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from plow.checkpoint import load_checkpoint
from plow.checkpoint.fp8 import FP8, Fp8Tensor, quantize
from plow.emit.bundle import compile_bundle
from plow.errors import CheckpointError, ConfigError
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.native import open_native
from plow.target import load_target
from plow.testing import make_tiny_checkpoint
from tests.runtime.helpers import model_greedy

BLOCK = (32, 32)
PROFILE = CompileProfile(name="fp8", decode_batches=(1, 4), prefill_seqs=(16,), context=64)
NEW = 16


def _fp8_copy(src: Path, dst: Path, block: tuple[int, int] = BLOCK, channel: bool = False) -> Path:
    """`src` with every projection of the decoder layers stored as fp8 + scales."""
    shutil.copytree(src, dst)
    t = load_file(str(src / "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    for name, w in t.items():
        if "layers." in name and name.endswith("proj.weight"):
            if channel:
                s = np.maximum(np.abs(w).max(axis=1, keepdims=True) / 448.0, 1e-12)
                out[name] = (w / s).astype(FP8)
                out[name + "_scale"] = s.astype(np.float32)
            else:
                out[name], out[name + "_scale_inv"] = quantize(w, block)
        else:
            out[name] = w
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if not channel:
        q["weight_block_size"] = list(block)
    cfg["quantization_config"] = q
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("fp8")
    # qwen3: hidden 64, q 96 (4 x 24), kv 24, intermediate 160: blocks of 32 with ragged edges
    src = make_tiny_checkpoint("qwen3", 0, root / "src")
    path = _fp8_copy(src, root / "fp8")
    ckpt = load_checkpoint(path)
    # transformers on the de-quantized weights: the source model with those weights put in
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in ckpt.weights and ckpt.weights.fp8_scale(name) is not None:
                p.copy_(torch.from_numpy(np.asarray(ckpt.weights[name], dtype=np.float32)))
    bundle = root / "bundle"
    compile_bundle(path, bundle, load_target("cpu"), PROFILE, verify=True)
    ids = [ckpt.tokenizer.encode(p) for p in ("The quick brown fox.", "A counter is a small")]
    refs = model_greedy(hf, ids, NEW)
    return {"ckpt": ckpt, "hf": hf, "bundle": bundle, "ids": ids, "refs": refs, "src": src}


def test_the_weights_are_fp8_and_dequantize_by_their_blocks(fp8: dict) -> None:
    ckpt = fp8["ckpt"]
    name = "model.layers.0.self_attn.q_proj.weight"
    t = ckpt.weights[name]  # type: ignore[attr-defined]
    assert isinstance(t, Fp8Tensor) and t.block == BLOCK and t.shape == (96, 64)
    e = ckpt.weights.entry(name)  # type: ignore[attr-defined]
    assert e.dtype == FP8  # the bytes in the file are fp8
    raw = np.memmap(e.file, dtype=FP8, mode="r", offset=e.offset, shape=e.shape)
    s = np.asarray(ckpt.weights[name + "_scale_inv"])  # type: ignore[attr-defined]
    assert s.shape == (3, 2)
    want = raw.astype(np.float32) * np.kron(s, np.ones(BLOCK, dtype=np.float32))[:96, :64]
    assert np.array_equal(np.asarray(t, dtype=np.float32), want)
    assert ckpt.spec.weight_block == BLOCK  # type: ignore[attr-defined]


@pytest.mark.slow
def test_cpu_and_native_bundles_give_transformers_tokens_on_the_dequantized_weights(
    fp8: dict,
) -> None:
    reqs = [Request(tuple(p), NEW) for p in fp8["ids"]]  # type: ignore[attr-defined]
    assert generate(CpuModel.from_bundle(fp8["bundle"], max_batch=4), reqs) == fp8["refs"]
    assert generate(open_native(fp8["bundle"], max_batch=4), reqs) == fp8["refs"]
    # the bundle keeps the fp8 bytes and their scales
    from plow.checkpoint.weights import read_header

    header = read_header(Path(fp8["bundle"]) / "weights.safetensors")  # type: ignore[arg-type]
    name = "model.layers.1.mlp.down_proj.weight"
    assert str(header[name].dtype) == "float8_e4m3fn" and name + "_scale_inv" in header


def test_logits_within_1e_4_of_transformers_on_the_dequantized_weights(fp8: dict) -> None:
    from plow.runtime.reference import forward_logits

    ids = fp8["ids"][0]  # type: ignore[index]
    with torch.no_grad():
        want = fp8["hf"](torch.tensor([ids])).logits[0].numpy()  # type: ignore[operator]
    got = forward_logits(fp8["ckpt"], ids)  # type: ignore[arg-type]
    tol = 1e-4 * max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= tol
    # and the weights really are lossy: the source model's logits differ
    src = forward_logits(load_checkpoint(fp8["src"]), ids)  # type: ignore[arg-type]
    assert float(np.abs(src - want).max()) > 10 * tol


def test_per_channel_scales_and_refusals(fp8: dict, tmp_path: Path) -> None:
    path = _fp8_copy(Path(fp8["src"]), tmp_path / "ch", channel=True)  # type: ignore[arg-type]
    ckpt = load_checkpoint(path)
    t = ckpt.weights["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(t, Fp8Tensor) and t.block == (1, 64)
    # a block size the scales contradict, and a method plow does not read
    bad = _fp8_copy(Path(fp8["src"]), tmp_path / "bad", block=(32, 32))  # type: ignore[arg-type]
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 32]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"give blocks \[32, 32\].*weight_block_size is \[64, 32\]"
    ):
        load_checkpoint(bad)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"field 'quantization_config': quant_method 'gptq'"):
        load_checkpoint(bad)


@pytest.mark.slow
def test_fp8_routed_experts_give_transformers_tokens(tmp_path: Path) -> None:
    """A tiny qwen3_moe stored as fp8 with 16x16 blocks, experts included (their scales are
    stacked with the stacked experts): the bundle's cpu and native executors against
    transformers on the de-quantized weights."""
    src = make_tiny_checkpoint("qwen3_moe", 0, tmp_path / "src")
    t = load_file(str(src / "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    for name, w in t.items():
        if "layers." in name and name.endswith("proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize(w, (16, 16))
        else:
            out[name] = w
    path = tmp_path / "fp8"
    shutil.copytree(src, path)
    save_file(out, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (path / "config.json").write_text(json.dumps(cfg))
    ckpt = load_checkpoint(path)
    gu = ckpt.weights["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(gu, Fp8Tensor) and gu.shape == (8, 64, 64) and gu.block == (16, 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    swapped = 0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in ckpt.weights and ckpt.weights.fp8_scale(name) is not None:
                p.copy_(torch.from_numpy(np.asarray(ckpt.weights[name], dtype=np.float32)))
                swapped += 1
    assert swapped == 4 * 3 + 2 * 2 + 3  # q, k, v, o x 3 layers; experts x 2 layers; dense MLP
    bundle = tmp_path / "bundle"
    compile_bundle(path, bundle, load_target("cpu"), PROFILE, verify=True)
    ids = [ckpt.tokenizer.encode(p) for p in ("The quick brown fox.", "A counter is a small")]
    refs = model_greedy(hf, ids, NEW)
    reqs = [Request(tuple(p), NEW) for p in ids]
    assert generate(CpuModel.from_bundle(bundle, max_batch=4), reqs) == refs
    assert generate(open_native(bundle, max_batch=4), reqs) == refs
