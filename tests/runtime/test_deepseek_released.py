"""DeepSeek-V3 as it is released: fp8 (e4m3) projections with 128 x 128 block scales
(`quantization_config`), and a multi-token-prediction layer (`num_nextn_predict_layers: 1`,
the checkpoint's layer 61) that transformers does not run.

A tiny `DeepseekV3ForCausalLM` stored that way (fp8 blocks of 8 x 8 for every decoder
projection, experts and shared expert included, plus an MTP layer's tensors): the certified
bundle's `cpu` and `native` executors give transformers' greedy tokens on the de-quantized
weights, and the released config.json plans without edits."""

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
from plow.checkpoint.fp8 import Fp8Tensor, quantize
from plow.checkpoint.loader import spec_from_config
from plow.emit.bundle import compile_bundle
from plow.errors import ConfigError
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.native import open_native
from plow.target import load_target
from plow.testing.fixtures import make_tiny_deepseek_v3
from tests.runtime.helpers import model_greedy

NEW = 12
PROFILE = CompileProfile(name="dsv3-fp8", decode_batches=(1, 4), prefill_seqs=(16,), context=64)
RELEASED = Path(__file__).resolve().parents[1] / "data/configs/deepseek-v3/config.json"


def _as_released(src: Path, dst: Path) -> Path:
    """`src` stored as DeepSeek-V3 ships: decoder projections fp8 + `_scale_inv` blocks, and
    one MTP layer's tensors after the last decoder layer (never to be read)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    out: dict[str, np.ndarray] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if "layers." in name and name.endswith("proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize(w, (8, 8))
        else:
            out[name] = w
        if name.startswith(f"model.layers.{n - 1}."):  # the MTP layer: a decoder layer's shape
            mtp = name.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")
            out[mtp] = np.full_like(w, np.nan)  # NaN: any read of it would show in the tokens
    out[f"model.layers.{n}.eh_proj.weight"] = np.full((64, 128), np.nan, dtype=np.float32)
    save_file(out, str(dst / "model.safetensors"))
    cfg["num_nextn_predict_layers"] = 1
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [8, 8],
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_fp8_blocks_and_an_mtp_layer_give_transformers_tokens(tmp_path: Path) -> None:
    src = make_tiny_deepseek_v3(0, tmp_path / "src")
    path = _as_released(src, tmp_path / "released")
    ckpt = load_checkpoint(path)
    assert ckpt.spec.weight_block == (8, 8)
    kvb = ckpt.weights["model.layers.1.self_attn.kv_b_proj.weight"]
    assert isinstance(kvb, Fp8Tensor) and kvb.block == (8, 8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    swapped = 0
    with torch.no_grad():  # transformers on the de-quantized weights
        for name, p in hf.named_parameters():
            if name in ckpt.weights and ckpt.weights.fp8_scale(name) is not None:
                p.copy_(torch.from_numpy(np.asarray(ckpt.weights[name], dtype=np.float32)))
                swapped += 1
    assert swapped >= 3 * 5  # q_a, q_b, kv_a, kv_b, o in each layer, and the MLPs
    bundle = tmp_path / "bundle"
    compile_bundle(path, bundle, load_target("cpu"), PROFILE, verify=True)
    ids = [[5, 17, 93, 2, 44, 8, 61, 30], [3, 250, 41, 6, 77], [120, 9, 33]]
    refs = model_greedy(hf, ids, NEW)
    reqs = [Request(tuple(p), NEW) for p in ids]
    assert generate(CpuModel.from_bundle(bundle, max_batch=4), reqs) == refs
    assert generate(open_native(bundle, max_batch=4), reqs) == refs


def test_the_released_config_plans_as_published() -> None:
    """config.json exactly as released (fp8 blocks of 128 x 128, one MTP layer) is accepted:
    61 decoder layers, the MTP layer not among them; a quantization plow cannot read is still
    refused naming the field."""
    config = json.loads(RELEASED.read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["quantization_config"]
    spec = spec_from_config(config, "config.json")
    assert spec.weight_block == (128, 128)
    assert spec.num_layers == config["num_hidden_layers"] == 61
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with pytest.raises(ConfigError, match=r"field 'quantization_config'.*'awq'"):
        spec_from_config(config, "config.json")
