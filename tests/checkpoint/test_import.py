"""Checkpoint import: families, shards, dtypes, memory mapping, and one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from plow.checkpoint import load_checkpoint, load_spec
from plow.errors import CheckpointError, ConfigError
from plow.testing import make_tiny_checkpoint


def test_each_family_maps_to_its_spec(tiny_checkpoints: dict[str, Path]) -> None:
    llama = load_checkpoint(tiny_checkpoints["llama"]).spec
    assert (llama.family, llama.num_heads, llama.num_kv_heads, llama.tie_word_embeddings) == (
        "llama",
        4,
        2,
        False,
    )
    assert llama.layers[0].rope.kind == "llama3" and llama.layers[0].rope.factor == 8.0
    qwen = load_checkpoint(tiny_checkpoints["qwen3"]).spec
    assert (
        qwen.qk_norm and qwen.head_dim == 24 and qwen.head_dim * qwen.num_heads != qwen.hidden_size
    )
    gemma = load_checkpoint(tiny_checkpoints["gemma3"]).spec
    assert [layer.window for layer in gemma.layers] == [8, 8, None]
    assert [layer.rope.theta for layer in gemma.layers] == [10000.0, 10000.0, 1000000.0]
    assert gemma.norm_offset == 1.0 and gemma.embed_scale == pytest.approx(8.0)
    assert gemma.attention_scale == pytest.approx(16**-0.5)


def test_old_style_rope_and_pattern_fields_are_read() -> None:
    """Configs written before transformers 5 carry rope_theta/rope_scaling and a pattern."""
    from plow.checkpoint.loader import spec_from_config

    gemma = spec_from_config(
        {
            "model_type": "gemma3_text",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 6,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 4,
            "sliding_window_pattern": 3,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window": 512,
        },
        "config.json",
    )
    assert [layer.window for layer in gemma.layers] == [512, 512, None, 512, 512, None]
    assert gemma.layers[2].rope.kind == "linear" and gemma.layers[0].rope.kind == "default"


def test_sharded_weights_are_all_found(tiny_checkpoints: dict[str, Path]) -> None:
    d = tiny_checkpoints["llama_tied_sharded"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ckpt = load_checkpoint(d)
    assert set(ckpt.weights) == set(index["weight_map"])


def test_weights_are_memory_mapped_and_keep_their_dtype(tmp_path: Path) -> None:
    d = make_tiny_checkpoint("llama", 3, tmp_path / "bf16", dtype="bfloat16")
    ckpt = load_checkpoint(d)
    w = ckpt.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(w, np.memmap)
    assert w.dtype == np.dtype(ml_dtypes.bfloat16)
    assert ckpt.spec.dtype == "bfloat16"


def test_config_alone_is_enough_to_plan(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    shutil.copy(tiny_checkpoints["qwen3"] / "config.json", tmp_path / "config.json")
    assert load_spec(tmp_path).family == "qwen3"


def _broken(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_config_is_a_checkpoint_error(tiny_llama: Path, tmp_path: Path) -> None:
    d = _broken(tiny_llama, tmp_path / "c")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        load_checkpoint(d)


def test_inconsistent_heads_are_a_config_error(tiny_llama: Path, tmp_path: Path) -> None:
    d = _broken(tiny_llama, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not a multiple of num_key_value_heads 3"):
        load_checkpoint(d)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plow.cli", *args], capture_output=True, text=True, timeout=120
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_missing_config(tiny_llama: Path, tmp_path: Path) -> None:
    d = _broken(tiny_llama, tmp_path / "c")
    (d / "config.json").unlink()
    _assert_one_line_error(
        _cli("generate", str(d), "--prompt", "hi"), "config.json", "file not found"
    )


def test_cli_missing_shard(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    d = _broken(tiny_checkpoints["llama_tied_sharded"], tmp_path / "c")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    _assert_one_line_error(
        _cli("generate", str(d), "--prompt", "hi"),
        shard.name,
        "shard named in model.safetensors.index.json is missing",
    )


def test_cli_unknown_model_type(tiny_llama: Path, tmp_path: Path) -> None:
    d = _broken(tiny_llama, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mystery"
    (d / "config.json").write_text(json.dumps(cfg))
    _assert_one_line_error(
        _cli("generate", str(d), "--prompt", "hi"),
        "config.json",
        "unsupported model_type 'mystery'",
    )


def test_cli_wrong_tensor_shape(tiny_llama: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    d = _broken(tiny_llama, tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    _assert_one_line_error(
        _cli("generate", str(d), "--prompt", "hi"),
        "model.safetensors",
        "'model.layers.1.mlp.up_proj.weight' has shape [175, 64], expected [176, 64]",
    )


def test_cli_malformed_config_json(tiny_llama: Path, tmp_path: Path) -> None:
    d = _broken(tiny_llama, tmp_path / "c")
    (d / "config.json").write_text("{not json")
    _assert_one_line_error(
        _cli("generate", str(d), "--prompt", "hi"), "config.json", "malformed JSON"
    )


def test_cli_missing_required_field_names_it(tiny_llama: Path, tmp_path: Path) -> None:
    d = _broken(tiny_llama, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    _assert_one_line_error(
        _cli("generate", str(d), "--prompt", "hi"), "config.json", "'hidden_size'"
    )
