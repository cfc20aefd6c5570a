"""Llama-3.x (and Llama-2 layouts): GQA, SiLU gated MLP, optional `llama3` rope scaling."""

from __future__ import annotations

from typing import Any

from plow.checkpoint.families.common import DecoderConfig, global_rope
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
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.kv_heads(),
        head_dim=cfg.head_size(),
        norm_eps=cfg.rms_norm_eps,
        layers=tuple(LayerSpec(rope=rope) for _ in range(cfg.num_hidden_layers)),
        activation=Activation.silu,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        max_position=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_ids=cfg.eos_ids(),
        dtype=cfg.dtype_name(),
    )
