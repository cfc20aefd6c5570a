"""Issue 19: what import refuses before anything plans or runs — config sizes beyond what the
machine can plan, a tensor missing from the safetensors, a tokenizer that does not load or
does not fit the vocabulary — each a one-line error naming the file and what is wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from plow.checkpoint import load_checkpoint, load_spec
from plow.checkpoint.loader import MAX_PARAMETERS, spec_from_config
from plow.checkpoint.weights import MissingTensor
from plow.errors import CheckpointError, ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plow.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _copy(src: Path, dst: Path, **config: Any) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _llama_config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    cfg.update(over)
    return cfg


@pytest.mark.parametrize(
    "field",
    [
        "num_hidden_layers",
        "hidden_size",
        "vocab_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ],
)
@pytest.mark.parametrize("value", [1e9, 2.5, 4.0, -3, 0, True, "4", 10**12])
def test_absurd_config_sizes_are_config_errors(field: str, value: object) -> None:
    """Floats (1e9 and even 4.0: a size is an integer), bools, strings, zero, negatives and
    sizes past the bound are refused at import, naming the field."""
    with pytest.raises(ConfigError, match=rf"config.json: field '{field}': must be"):
        spec_from_config(_llama_config(**{field: value}), "config.json")


def test_layers_at_the_bound_import_and_past_it_do_not() -> None:
    from plow.checkpoint.families.common import MAX_LAYERS

    assert len(spec_from_config(_llama_config(num_hidden_layers=MAX_LAYERS), "c").layers) == 1024
    with pytest.raises(ConfigError, match=r"must be in 1\.\.1024, got 1025"):
        spec_from_config(_llama_config(num_hidden_layers=MAX_LAYERS + 1), "c")


def test_too_many_parameters_are_refused() -> None:
    """Every field within its bound, the whole model not: the parameter bound names them."""
    cfg = _llama_config(
        num_hidden_layers=1024, hidden_size=65536, intermediate_size=1 << 18, vocab_size=1 << 20
    )
    with pytest.raises(ConfigError, match="parameters .*more than the 1e\\+12 this machine"):
        spec_from_config(cfg, "config.json")
    assert MAX_PARAMETERS >= 10**12


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.iterdir()))
def test_real_configs_are_within_the_bounds(name: str) -> None:
    """Every released config under tests/data/configs loads as published (DeepSeek-V3 with
    its fp8 blocks and its multi-token-prediction layer included)."""
    spec = load_spec(CONFIGS / name)
    assert 0 < spec.parameter_count() <= MAX_PARAMETERS


@pytest.mark.parametrize("command", ["compile", "generate"])
def test_cli_layers_1e9_is_a_prompt_one_line_error(
    command: str, tiny_llama: Path, tmp_path: Path
) -> None:
    """Before: import built 10^9 layer specs and hung. The timeout fails the test on a hang."""
    d = _copy(tiny_llama, tmp_path / "c", num_hidden_layers=1e9)
    args = ["-o", str(tmp_path / "out")] if command == "compile" else ["--prompt", "hi"]
    line = _one_line(_cli(command, str(d), *args, timeout=60), "config.json", "'num_hidden_layers'")
    assert "1000000000.0" in line
    assert not (tmp_path / "out").exists()


def test_weight_store_names_the_checkpoint_and_the_tensor(tiny_llama: Path) -> None:
    store = load_checkpoint(tiny_llama).weights
    assert "model.nope.weight" not in store
    with pytest.raises(MissingTensor, match=rf"{tiny_llama}: tensor 'model.nope.weight'") as e:
        store["model.nope.weight"]
    assert isinstance(e.value, KeyError) and isinstance(e.value, CheckpointError)
    assert store.get("model.nope.weight") is None  # still a Mapping
    with pytest.raises(CheckpointError, match="'model.nope.weight' is missing"):
        store.entry("model.nope.weight")


@pytest.mark.parametrize("command", ["compile", "generate"])
def test_cli_missing_tensor_names_checkpoint_and_tensor(
    command: str, tiny_llama: Path, tmp_path: Path
) -> None:
    """Before: `plow compile` died with a KeyError traceback from copying the weights."""
    from safetensors.numpy import load_file, save_file

    d = _copy(tiny_llama, tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    args = ["-o", str(tmp_path / "out")] if command == "compile" else ["--prompt", "hi"]
    line = _one_line(_cli(command, str(d), *args), "'model.layers.1.mlp.up_proj.weight'")
    assert line.startswith(f"plow: {d}: tensor ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("garbage", ["not json at all", "{}", '{"model": 3}'])
def test_compile_refuses_a_garbage_tokenizer_before_writing(
    garbage: str, tiny_llama: Path, tmp_path: Path
) -> None:
    """Before: `plow compile --verify` copied any bytes named tokenizer.json into the bundle."""
    d = _copy(tiny_llama, tmp_path / "c")
    (d / "tokenizer.json").write_text(garbage)
    out = tmp_path / "out"
    _one_line(
        _cli("compile", str(d), "-o", str(out), "--verify"),
        "tokenizer.json",
        "cannot read the tokenizer",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # nothing written, no partial


def test_tokenizer_larger_than_the_vocabulary_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    from plow.testing.fixtures import train_tokenizer

    d = _copy(tiny_llama, tmp_path / "c")
    big = train_tokenizer(1000)
    assert big.get_vocab_size() > load_spec(d).vocab_size
    big.save(str(d / "tokenizer.json"))
    with pytest.raises(CheckpointError, match=r"tokens, more than the model's vocab_size 317"):
        load_checkpoint(d)
    _one_line(_cli("compile", str(d), "-o", str(tmp_path / "out")), "tokenizer.json", "317")
    assert not (tmp_path / "out").exists()
