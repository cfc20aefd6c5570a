"""Qwen3 (dense): explicit head_dim, RMSNorm on each query/key head before rope."""

from __future__ import annotations

from typing import Any

from plow.checkpoint.families.common import DecoderConfig, global_rope
from plow.checkpoint.spec import Activation, LayerSpec, ModelSpec

MODEL_TYPES = ("qwen3",)


class Qwen3Config(DecoderConfig):
    hidden_act: str = "silu"
    use_sliding_window: bool = False
    sliding_window: int | None = None
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
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.kv_heads(),
        head_dim=cfg.head_size(),
        norm_eps=cfg.rms_norm_eps,
        layers=tuple(layers),
        activation=Activation.silu,
        qk_norm=True,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        max_position=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_ids=cfg.eos_ids(),
        dtype=cfg.dtype_name(),
    )
