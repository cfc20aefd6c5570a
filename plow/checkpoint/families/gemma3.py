"""Gemma 3 text: sliding-window layers by pattern with a local rope base, (1 + w) RMSNorm,
sandwich norms, q/k norms, embeddings scaled by sqrt(hidden), query_pre_attn_scalar,
tied embeddings, optional logit soft-capping."""

from __future__ import annotations

import math
from typing import Any

from plow.checkpoint.families.common import (
    DecoderConfig,
    Layers,
    Positions,
    global_rope,
    rope_from_dict,
    spec_fields,
)
from plow.checkpoint.spec import Activation, LayerSpec, ModelSpec

MODEL_TYPES = ("gemma3_text",)


class Gemma3Config(DecoderConfig):
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window: Positions = 4096
    layer_types: list[str] | None = None
    sliding_window_pattern: Layers | None = None
    rope_local_base_freq: float = 10000.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None


def _layer_types(cfg: Gemma3Config) -> list[str]:
    if cfg.layer_types is not None:
        if len(cfg.layer_types) != cfg.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(cfg.layer_types)} entries for {cfg.num_hidden_layers} layers"
            )
        return cfg.layer_types
    # Older configs: every `pattern`-th layer is global, the rest slide.
    pattern = cfg.sliding_window_pattern or 6
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(cfg.num_hidden_layers)
    ]


def to_spec(config: dict[str, Any]) -> ModelSpec:
    cfg = Gemma3Config.model_validate(config)
    if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation {cfg.hidden_activation!r} is not supported")
    global_ = global_rope(cfg, default_theta=1000000.0)
    local_params = (cfg.rope_parameters or {}).get("sliding_attention")
    local = rope_from_dict(local_params, cfg.rope_local_base_freq)
    layers = []
    for t in _layer_types(cfg):
        if t == "sliding_attention":
            layers.append(LayerSpec(rope=local, window=cfg.sliding_window))
        elif t == "full_attention":
            layers.append(LayerSpec(rope=global_))
        else:
            raise ValueError(f"layer type {t!r} is not supported")
    return ModelSpec(
        family="gemma3",
        **spec_fields(cfg),
        layers=tuple(layers),
        activation=Activation.gelu_tanh,
        norm_offset=1.0,
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(cfg.hidden_size),
        query_scale=cfg.query_pre_attn_scalar**-0.5,
        attn_logit_softcap=cfg.attn_logit_softcapping,
        final_logit_softcap=cfg.final_logit_softcapping,
    )
