"""Model families: each module maps one HuggingFace config layout to a `ModelSpec`.

A family module exposes `MODEL_TYPES` (the `model_type` strings it reads) and
`to_spec(config: dict) -> ModelSpec`. Adding a family is adding a module and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from plow.checkpoint.families import (
    deepseek_v3,
    gemma3,
    kimi_linear,
    llama,
    mamba2,
    qwen3,
    qwen3_moe,
)
from plow.checkpoint.families import gemma4 as _gemma4
from plow.checkpoint.spec import ModelSpec

_MODULES: tuple[ModuleType, ...] = (llama, qwen3, gemma3, qwen3_moe)
_MODULES += (mamba2,)
_MODULES += (_gemma4,)
_MODULES += (deepseek_v3,)
_MODULES += (kimi_linear,)

FAMILIES: dict[str, Callable[[dict[str, Any]], ModelSpec]] = {
    model_type: module.to_spec for module in _MODULES for model_type in module.MODEL_TYPES
}


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def derived_weights_hook(model_type: str) -> Callable[..., dict[str, Any]] | None:
    """The family's `derive_weights(spec, read, missing)` (weights the graph reads that are
    computed from the checkpoint's when they are opened: DeepSeek-V3's latent attention),
    None for a family that reads its checkpoint's tensors as they are."""
    for module in _MODULES:
        if model_type in module.MODEL_TYPES:
            return getattr(module, "derive_weights", None)
    return None
