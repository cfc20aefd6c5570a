"""Llama-3.x (and Llama-2 layouts): GQA, SiLU gated MLP, optional `llama3` rope scaling."""

from __future__ import annotations

from typing import Any

from plow.checkpoint.families.common import DecoderConfig, global_rope, spec_fields
from plow.checkpoint.spec import Activation, LayerSpec, ModelSpec

MODEL_TYPES = ("llama",)


class LlamaConfig(DecoderConfig):
    hidden_act: str = "silu"
    mlp_bias: bool = False


def to_spec(config: dict[str, Any]) -> ModelSpec:
    cfg = LlamaConfig.model_validate(config)
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for llama (silu)")
    if cfg.mlp_bias:
        raise ValueError("mlp_bias = true is not supported")
    rope = global_rope(cfg, default_theta=10000.0)
    return ModelSpec(
        family="llama",
        **spec_fields(cfg),
        layers=tuple(LayerSpec(rope=rope) for _ in range(cfg.num_hidden_layers)),
        activation=Activation.silu,
    )
