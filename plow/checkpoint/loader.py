"""Reads a checkpoint directory: config, (sharded) safetensors, tokenizer, generation config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from plow.checkpoint.families import FAMILIES, supported_model_types
from plow.checkpoint.spec import ModelSpec
from plow.checkpoint.tokenizer import Tokenizer
from plow.checkpoint.weights import WeightStore
from plow.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    spec: ModelSpec
    weights: WeightStore
    tokenizer: Tokenizer
    generation: dict[str, Any]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(path, f"malformed JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(path, "expected a JSON object")
    return data


# The largest model (in parameters) `spec_from_config` accepts: 2.5x Llama-3.1-405B, whose
# plan-only compile for h200 takes about 20 s; far larger configs would plan for hours.
MAX_PARAMETERS = 10**12


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "config"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"field {loc!r}: {msg}"


def spec_from_config(config: dict[str, Any], where: Path | str) -> ModelSpec:
    model_type = config.get("model_type")
    if model_type is None:
        raise ConfigError(where, "no 'model_type' field")
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise ConfigError(
            where,
            f"unsupported model_type {model_type!r} "
            f"(supported: {', '.join(supported_model_types())})",
        )
    try:
        spec = family(config)
    except ValidationError as e:
        raise ConfigError(where, _first_error(e)) from e
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(where, str(e)) from e
    n = spec.parameter_count()
    if n > MAX_PARAMETERS:
        raise ConfigError(
            where,
            f"{n:.3g} parameters (num_hidden_layers {spec.num_layers}, hidden_size "
            f"{spec.hidden_size}, intermediate_size {spec.intermediate_size}, vocab_size "
            f"{spec.vocab_size}): more than the {MAX_PARAMETERS:.0e} this machine can plan",
        )
    return spec


def load_spec(path: Path) -> ModelSpec:
    """The model spec from `config.json` alone (a directory or the file itself): enough to plan."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise CheckpointError(path, "no such file or directory")
    return spec_from_config(_read_json(config_path), config_path)


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(index, "no 'weight_map' object")
        files = []
        for shard in sorted(set(weight_map.values())):
            p = directory / shard
            if not p.is_file():
                raise CheckpointError(p, f"shard named in {index.name} is missing")
            files.append(p)
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise CheckpointError(directory, "no model.safetensors, no index, no *.safetensors files")
    return found


def check_fp8_blocks(weights: WeightStore, spec: ModelSpec, path: Path) -> None:
    """Every fp8 weight's scales tile it in the config's `weight_block_size` (when it has one
    and the scales say: a dimension with more than one block)."""
    if spec.weight_block is None:
        return
    for name in spec.weight_shapes():
        if weights.fp8_scale(name) is None:
            continue
        t = weights[name]
        have = getattr(t, "block", None)
        scale = getattr(t, "scale", None)
        if have is None or scale is None:
            continue
        for ax in (0, 1):
            if scale.shape[ax - 2] > 1 and have[ax] != spec.weight_block[ax]:
                raise CheckpointError(
                    path,
                    f"tensor {name!r}: fp8 scales of shape {list(scale.shape)} give blocks "
                    f"{list(have)}, config.json's weight_block_size is {list(spec.weight_block)}",
                )


def check_tokenizer(tokenizer: Tokenizer, spec: ModelSpec, path: Path) -> None:
    """The tokenizer fits the model: it has tokens, and every id it can produce is a row of
    the embedding (models often pad `vocab_size` past the tokenizer's, never the reverse)."""
    n = tokenizer.vocab_size
    if n == 0:
        raise CheckpointError(path, "the tokenizer has no tokens")
    if n > spec.vocab_size:
        raise CheckpointError(
            path,
            f"the tokenizer has {n} tokens, more than the model's vocab_size {spec.vocab_size} "
            "(config.json): its ids past the embedding could not be run",
        )


def load_checkpoint(path: Path | str) -> Checkpoint:
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(directory, "not a checkpoint directory")
    spec = load_spec(directory)
    weights = WeightStore.open(weight_files(directory), where=directory)
    weights.check_shapes(spec.weight_shapes())
    check_fp8_blocks(weights, spec, directory)
    tokenizer = Tokenizer.load(directory)
    check_tokenizer(tokenizer, spec, directory / "tokenizer.json")
    gen_path = directory / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
    return Checkpoint(directory, spec, weights, tokenizer, generation)
