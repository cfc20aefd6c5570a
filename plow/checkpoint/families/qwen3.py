"""Qwen3 (dense): explicit head_dim, RMSNorm on each query/key head before rope."""

from __future__ import annotations

from typing import Any

from plow.checkpoint.families.common import DecoderConfig, Positions, global_rope, spec_fields
from plow.checkpoint.spec import Activation, LayerSpec, ModelSpec

MODEL_TYPES = ("qwen3",)


class Qwen3Config(DecoderConfig):
    hidden_act: str = "silu"
    use_sliding_window: bool = False
    sliding_window: Positions | None = None
    max_window_layers: int | None = None
    layer_types: list[str] | None = None


def to_spec(config: dict[str, Any]) -> ModelSpec:
    cfg = Qwen3Config.model_validate(config)
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for qwen3 (silu)")
    rope = global_rope(cfg, default_theta=1000000.0)
    types = cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {cfg.num_hidden_layers} layers")
    layers = []
    for t in types:
        sliding = t == "sliding_attention" and cfg.use_sliding_window
        if sliding and not cfg.sliding_window:
            raise ValueError("a sliding_attention layer needs sliding_window")
        layers.append(LayerSpec(rope=rope, window=cfg.sliding_window if sliding else None))
    return ModelSpec(
        family="qwen3",
        **spec_fields(cfg),
        layers=tuple(layers),
        activation=Activation.silu,
        qk_norm=True,
    )
