"""4-bit routed experts as Kimi K2/K3 ship them (compressed-tensors "pack-quantized": int32
`weight_packed`, bf16 `weight_scale` per group of 32, `weight_shape`; attention and dense
layers left unquantized through `ignore`), repacked into q4_0 blocks at load time
(`plow.checkpoint.int4`): a certified bundle keeps the experts as q4_0 blocks, the `cpu` and
`native` executors give transformers' greedy tokens on the de-quantized weights, logits within
1e-4, and what plow cannot read is refused naming the field or the tensor."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from plow.checkpoint import load_checkpoint
from plow.checkpoint.int4 import dequantize_int4, quantize_int4_pack, to_q4_0
from plow.checkpoint.quant import QuantTensor
from plow.checkpoint.weights import read_header, write_safetensors
from plow.emit.bundle import compile_bundle
from plow.errors import CheckpointError, ConfigError
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.native import open_native
from plow.target import load_target
from plow.testing import make_tiny_checkpoint
from plow.testing.fixtures import make_tiny_deepseek_v3
from tests.runtime.helpers import model_greedy

PROFILE = CompileProfile(name="int4", decode_batches=(1, 4), prefill_seqs=(16,), context=64)
NEW = 16
# routed experts' projections: qwen3_moe / deepseek_v3 names, and Kimi-Linear's w1 / w3 / w2
_EXPERT = re.compile(
    r"\.(mlp\.experts\.\d+\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)
QCFG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 32, "dynamic": False, "observer": "minmax"},
            "input_activations": None,
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$", "re:.*layers.1.mlp.*"],
}  # fmt: skip


def _int4_copy(src: Path, dst: Path) -> Path:
    """`src` with every routed expert's projection stored pack-quantized."""
    shutil.copytree(src, dst)
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if _EXPERT.search(name):
            p, s, shp = quantize_int4_pack(w)
            out[name + "_packed"], out[name + "_scale"] = ("I32", p), ("BF16", s)
            out[name + "_shape"] = ("I32", shp)
        else:
            out[name] = ("F32", np.asarray(w, dtype=np.float32))
    assert sum(n.endswith("_packed") for n in out) > 0
    (dst / "model.safetensors").unlink()
    write_safetensors(dst / "model.safetensors", out, {"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = QCFG
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _setup(src: Path, root: Path, stacked: int, greedy: object = model_greedy) -> dict[str, object]:
    """`src` with int4 experts, its certified bundle, transformers on the de-quantized
    weights (the source model with the experts' stacked de-quantizations copied in) and
    its greedy tokens (`greedy(hf, ids, NEW)`)."""
    path = _int4_copy(src, root / "int4")
    ckpt = load_checkpoint(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    copied = 0
    with torch.no_grad():
        for hf_name, p in hf.named_parameters():
            # Kimi-Linear's checkpoint says block_sparse_moe where transformers says mlp
            kimi = hf_name.replace(".mlp.", ".block_sparse_moe.")
            name = hf_name if hf_name in ckpt.weights else kimi
            if name in ckpt.weights and isinstance(ckpt.weights[name], QuantTensor):
                w = np.asarray(ckpt.weights[name], dtype=np.float32)
                assert tuple(p.shape) == w.shape, name
                p.copy_(torch.from_numpy(w))
                copied += 1
    assert copied == stacked  # gate_up and down of every routed layer
    bundle = root / "bundle"
    compile_bundle(path, bundle, load_target("cpu"), PROFILE, verify=True)
    ids = [ckpt.tokenizer.encode(p) for p in ("The quick brown fox.", "A counter is a small")]
    refs = greedy(hf, ids, NEW)  # type: ignore[operator]
    return {"ckpt": ckpt, "hf": hf, "bundle": bundle, "ids": ids, "refs": refs, "src": src,
            "path": path}  # fmt: skip


@pytest.fixture(scope="module")
def int4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("int4")
    return _setup(make_tiny_checkpoint("qwen3_moe", 0, root / "src"), root, 4)


def test_repack_is_the_exact_dequantization() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 96)).astype(np.float32)
    p, s, shp = quantize_int4_pack(w)
    assert p.dtype == np.int32 and p.shape == (5, 12) and s.shape == (5, 3)
    # compressed-tensors' packing: element j at bits 4*(j%8) of int32 j//8, stored as q + 8
    q = np.clip(np.rint(w / np.repeat(s.astype(np.float32), 32, axis=1)), -8, 7)
    assert ((p.view(np.uint32)[1, 2] >> 12) & 0xF) == int(q[1, 19]) + 8
    blocks = to_q4_0(p, s, shp, "t")
    assert blocks.shape == (5, 3 * 18)
    t = QuantTensor("q4_0", (5, 96), blocks)
    want = dequantize_int4(p, s, shp)
    assert np.array_equal(np.asarray(t, dtype=np.float32), want)
    assert float(np.abs(want - w).max()) < 0.3  # and it is a quantization of w


def test_experts_are_stacked_q4_0_blocks_in_the_bundle(int4: dict) -> None:
    ckpt = int4["ckpt"]
    gu = ckpt.weights["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(gu, QuantTensor) and gu.format == "q4_0" and gu.shape == (8, 64, 64)
    assert gu.nbytes == 8 * 64 * 64 * 18 // 32  # 18 bytes per 32 weights
    dn = ckpt.weights["model.layers.2.mlp.experts.down_proj"]
    assert isinstance(dn, QuantTensor) and dn.shape == (8, 64, 32)
    # expert 3's down weight is its pack-quantized tensors' de-quantization
    raw = load_file(str(Path(int4["path"]) / "model.safetensors"))
    n = "model.layers.2.mlp.experts.3.down_proj.weight"
    want = dequantize_int4(raw[n + "_packed"], raw[n + "_scale"], raw[n + "_shape"])
    assert np.array_equal(np.asarray(dn, dtype=np.float32)[3], want)
    # attention and the dense layer stay float
    assert not isinstance(ckpt.weights["model.layers.0.self_attn.q_proj.weight"], QuantTensor)
    header = read_header(Path(int4["bundle"]) / "weights.safetensors")
    e = header["model.layers.0.mlp.experts.gate_up_proj"]
    assert e.quant == ("q4_0", (8, 64, 64)) and e.nbytes == 8 * 64 * 64 * 18 // 32
    attn = [n for n in header if "self_attn" in n]
    assert attn and all(header[n].quant is None for n in attn)


def _assert_transformers_tokens(fx: dict, experts: str) -> None:
    """cpu and native bundles give transformers' greedy tokens, the native kernel reading
    the experts as q4_0 blocks (kernels/blocks.h dot_w), not floats."""
    reqs = [Request(tuple(p), NEW) for p in fx["ids"]]
    assert generate(CpuModel.from_bundle(fx["bundle"], max_batch=4), reqs) == fx["refs"]
    native = open_native(fx["bundle"], max_batch=4)
    assert generate(native, reqs) == fx["refs"]
    w = native.weights[experts]
    assert isinstance(w, QuantTensor) and w.format == "q4_0"


def _assert_transformers_logits(fx: dict) -> None:
    """Logits within 1e-4 of transformers' on the de-quantized weights, and far from the
    float source's (the experts really are 4-bit)."""
    from plow.runtime.reference import forward_logits

    ids = fx["ids"][0]
    with torch.no_grad():
        want = fx["hf"](torch.tensor([ids])).logits[0].numpy()
    got = forward_logits(fx["ckpt"], ids)
    tol = 1e-4 * max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= tol
    src = forward_logits(load_checkpoint(fx["src"]), ids)
    assert float(np.abs(src - want).max()) > 10 * tol


def test_cpu_and_native_bundles_give_transformers_tokens(int4: dict) -> None:
    _assert_transformers_tokens(int4, "model.layers.2.mlp.experts.gate_up_proj")


def test_logits_within_1e_4_of_transformers(int4: dict) -> None:
    _assert_transformers_logits(int4)


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("num_bits", 8, "weights.num_bits 8"),
        ("symmetric", False, "weights.symmetric false"),
        ("group_size", 128, "weights.group_size 128"),
        ("format", "float-quantized", "format 'float-quantized'"),
    ],
)
def test_config_refusals_name_the_field(
    int4: dict, tmp_path: Path, key: str, value: object, needle: str
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((Path(int4["path"]) / "config.json").read_text())
    q = json.loads(json.dumps(QCFG))
    if key == "format":
        q["format"] = value
    else:
        q["config_groups"]["group_0"]["weights"][key] = value
    cfg["quantization_config"] = q
    (bad / "config.json").write_text(json.dumps(cfg))
    from plow.checkpoint.loader import load_spec

    with pytest.raises(ConfigError, match="quantization_config") as ei:
        load_spec(bad)
    assert needle in str(ei.value)


def test_a_scale_fp16_cannot_hold_is_refused_naming_the_tensor(int4: dict, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(Path(int4["path"]), bad)
    raw = load_file(str(bad / "model.safetensors"))
    n = "model.layers.0.mlp.experts.5.up_proj.weight_scale"
    s = raw[n].astype(np.float32)
    s[2, 1] = 1e-30  # a bf16 value below fp16's range
    raw[n] = s.astype(ml_dtypes.bfloat16)
    st = {"int32": "I32", "bfloat16": "BF16", "float32": "F32"}
    (bad / "model.safetensors").unlink()
    write_safetensors(
        bad / "model.safetensors", {k: (st[v.dtype.name], v) for k, v in raw.items()}, {}
    )
    with pytest.raises(
        CheckpointError, match=r"experts\.5\.up_proj\.weight_packed.*\[2, 1\].*float16"
    ):
        load_checkpoint(bad)


def test_deepseek_v3_int4_experts_give_transformers_tokens(tmp_path: Path) -> None:
    # DeepSeek-V3's routed experts (Kimi K2's layout): groups of 32 need an expert width of 32
    src = make_tiny_deepseek_v3(0, tmp_path / "src", moe_intermediate_size=32)
    ds: dict = _setup(src, tmp_path, 4)
    reqs = [Request(tuple(p), NEW) for p in ds["ids"]]
    assert generate(CpuModel.from_bundle(ds["bundle"], max_batch=4), reqs) == ds["refs"]
    assert generate(open_native(ds["bundle"], max_batch=4), reqs) == ds["refs"]


def _forward_greedy(hf: object, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy tokens by one forward per new token of the whole sequence
    (Kimi-Linear's `generate` runs the torch fallbacks' slow cached path)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(new):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))  # type: ignore[operator]
            out.append(seq[len(p) :])
    return out


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    # Kimi-Linear (KDA / MLA / KDA, layers 1-2 MoE): groups of 32 need an expert width of 32
    from plow.testing.fixtures import make_tiny_kimi_linear

    root = tmp_path_factory.mktemp("kimi_int4")
    src = make_tiny_kimi_linear(0, root / "src", moe_intermediate_size=32)
    return _setup(src, root, 4, _forward_greedy)


def test_kimi_linear_experts_stay_q4_0_blocks_in_the_bundle(kimi: dict) -> None:
    ckpt = kimi["ckpt"]
    assert [lay.mixer for lay in ckpt.spec.layers] == ["kda", "attention", "kda"]
    gu = ckpt.weights["model.layers.1.block_sparse_moe.experts.gate_up_proj"]
    assert isinstance(gu, QuantTensor) and gu.format == "q4_0" and gu.shape == (8, 64, 64)
    assert gu.nbytes == 8 * 64 * 64 * 18 // 32  # 18 bytes per 32 weights: stacked as blocks
    dn = ckpt.weights["model.layers.2.block_sparse_moe.experts.down_proj"]
    assert isinstance(dn, QuantTensor) and dn.shape == (8, 64, 32)
    raw = load_file(str(Path(kimi["path"]) / "model.safetensors"))
    n = "model.layers.2.block_sparse_moe.experts.5.w2.weight"
    want = dequantize_int4(raw[n + "_packed"], raw[n + "_scale"], raw[n + "_shape"])
    assert np.array_equal(np.asarray(dn, dtype=np.float32)[5], want)
    n = "model.layers.1.block_sparse_moe.experts.3.w3.weight"  # up: gate_up's second half
    want = dequantize_int4(raw[n + "_packed"], raw[n + "_scale"], raw[n + "_shape"])
    assert np.array_equal(np.asarray(gu, dtype=np.float32)[3, 32:], want)
    header = read_header(Path(kimi["bundle"]) / "weights.safetensors")
    for layer in (1, 2):
        e = header[f"model.layers.{layer}.block_sparse_moe.experts.gate_up_proj"]
        assert e.quant == ("q4_0", (8, 64, 64)) and e.nbytes == 8 * 64 * 64 * 18 // 32
        d = header[f"model.layers.{layer}.block_sparse_moe.experts.down_proj"]
        assert d.quant == ("q4_0", (8, 64, 32)) and d.nbytes == 8 * 64 * 32 * 18 // 32
    kda = [n for n in header if ".self_attn." in n]
    assert kda and all(header[n].quant is None for n in kda)  # attention and KDA stay float


def test_kimi_linear_cpu_and_native_give_transformers_tokens_and_logits(kimi: dict) -> None:
    _assert_transformers_tokens(kimi, "model.layers.2.block_sparse_moe.experts.down_proj")
    _assert_transformers_logits(kimi)


@pytest.mark.parametrize(
    ("q", "needle"),
    [
        ({"quant_method": "fp8"}, "quant_method 'fp8'"),
        ({**QCFG, "format": "int-quantized"}, "format 'int-quantized'"),
        (
            {**QCFG, "config_groups": {"group_0": {"weights": {
                **QCFG["config_groups"]["group_0"]["weights"], "group_size": 64}}}},  # type: ignore[index]
            "weights.group_size 64",
        ),
    ],
)  # fmt: skip
def test_kimi_linear_refusals_name_the_field(
    kimi: dict, tmp_path: Path, q: dict, needle: str
) -> None:
    from plow.checkpoint.loader import load_spec

    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((Path(kimi["path"]) / "config.json").read_text())
    cfg["quantization_config"] = q
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="quantization_config") as ei:
        load_spec(bad)
    assert needle in str(ei.value)


def test_kimi_linear_a_missing_expert_tensor_is_named_by_its_own_name(
    kimi: dict, tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(Path(kimi["path"]), bad)
    raw = load_file(str(bad / "model.safetensors"))
    for suffix in ("_packed", "_scale", "_shape"):
        del raw["model.layers.2.block_sparse_moe.experts.6.w3.weight" + suffix]
    st = {"int32": "I32", "bfloat16": "BF16", "float32": "F32"}
    (bad / "model.safetensors").unlink()
    write_safetensors(
        bad / "model.safetensors", {k: (st[v.dtype.name], v) for k, v in raw.items()}, {}
    )
    with pytest.raises(CheckpointError, match=r"experts\.6\.w3\.weight' is missing"):
        load_checkpoint(bad)
