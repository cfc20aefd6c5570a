"""Shared fixtures: tiny real HuggingFace checkpoints, made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from plow.testing import make_tiny_checkpoint

# (family, seed, overrides, shards): each variant covers something the differential tests need.
CHECKPOINT_VARIANTS: dict[str, tuple[str, int, dict[str, object], int]] = {
    "llama": ("llama", 0, {}, 1),  # GQA 4/2, untied, llama3 rope scaling
    "llama_tied_sharded": ("llama", 1, {"tie_word_embeddings": True, "num_key_value_heads": 4}, 3),
    "qwen3": ("qwen3", 0, {}, 1),  # q/k norms, explicit head_dim, GQA 4/1, tied
    "gemma3": ("gemma3", 0, {}, 1),  # sliding + global layers, (1+w) norms, scaled embeddings
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: make_tiny_checkpoint(family, seed, root / name, shards=shards, **overrides)
        for name, (family, seed, overrides, shards) in CHECKPOINT_VARIANTS.items()
    }


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama"]
