"""Qwen3-MoE: Qwen3's attention (explicit head_dim, q/k RMSNorm) with routed experts.

A layer's feed-forward is routed (`moe`) unless it is in `mlp_only_layers` or
`(layer + 1) % decoder_sparse_step != 0`; routed layers have `num_experts` (transformers-4
name; transformers-5: `num_local_experts`) SiLU gated MLPs of width `moe_intermediate_size`
and a router keeping `num_experts_per_tok` of them (softmax, top-k, renormalised when
`norm_topk_prob`); the other layers are dense MLPs of width `intermediate_size`.

Fields plow cannot honour are refused with one line naming them, never ignored: a shared
expert (`shared_expert_intermediate_size`, Qwen2-MoE's), sliding-window attention, an
activation other than SiLU, top-k outside 1..experts. fp8 checkpoints (Qwen3-30B-A3B-FP8) are
read through `plow.checkpoint.fp8`: the experts' scales are stacked with their weights;
int4 experts (compressed-tensors pack-quantized) as q4_0 blocks through `plow.checkpoint.int4`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from plow.checkpoint.families.common import (
    DecoderConfig,
    Intermediate,
    Positions,
    global_rope,
    spec_fields,
)
from plow.checkpoint.spec import Activation, LayerSpec, ModelSpec, MoeSpec

MODEL_TYPES = ("qwen3_moe",)

# The most experts a layer may have (DeepSeek-V3 and Kimi-K2 route over 256 / 384).
MAX_EXPERTS = 1024


class Qwen3MoeConfig(DecoderConfig):
    hidden_act: str = "silu"
    num_experts: int | None = Field(default=None, ge=0, le=MAX_EXPERTS)
    num_local_experts: int | None = Field(default=None, ge=0, le=MAX_EXPERTS)
    num_experts_per_tok: int = Field(default=8, ge=1, le=MAX_EXPERTS)
    moe_intermediate_size: Intermediate = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = Field(default=1, ge=1)
    mlp_only_layers: list[int] = Field(default_factory=list)
    shared_expert_intermediate_size: int | None = None
    use_sliding_window: bool = False
    sliding_window: Positions | None = None
    layer_types: list[str] | None = None


def _experts(cfg: Qwen3MoeConfig) -> int:
    both = cfg.num_experts is not None and cfg.num_local_experts is not None
    if both and cfg.num_experts != cfg.num_local_experts:
        raise ValueError(
            f"field 'num_local_experts': {cfg.num_local_experts} disagrees with num_experts "
            f"{cfg.num_experts}"
        )
    n = cfg.num_experts if cfg.num_experts is not None else cfg.num_local_experts
    return 128 if n is None else n


def to_spec(config: dict[str, Any]) -> ModelSpec:
    cfg = Qwen3MoeConfig.model_validate(config)
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for qwen3_moe (silu)")
    if cfg.shared_expert_intermediate_size:
        raise ValueError(
            "field 'shared_expert_intermediate_size': shared experts are not supported for "
            "qwen3_moe"
        )
    if cfg.use_sliding_window:
        raise ValueError(
            "field 'use_sliding_window': sliding windows are not supported for qwen3_moe"
        )
    if any(t != "full_attention" for t in cfg.layer_types or []):
        raise ValueError(
            "field 'layer_types': only full_attention layers are supported for qwen3_moe"
        )
    experts = _experts(cfg)
    if experts and cfg.num_experts_per_tok > experts:
        raise ValueError(
            f"field 'num_experts_per_tok': {cfg.num_experts_per_tok} is more than the "
            f"{experts} experts"
        )
    bad = [i for i in cfg.mlp_only_layers if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ValueError(
            f"field 'mlp_only_layers': layer {bad[0]} outside 0..{cfg.num_hidden_layers - 1}"
        )
    rope = global_rope(cfg, default_theta=1000000.0)
    dense = set(cfg.mlp_only_layers)
    layers = tuple(
        LayerSpec(
            rope=rope,
            moe=experts > 0 and i not in dense and (i + 1) % cfg.decoder_sparse_step == 0,
        )
        for i in range(cfg.num_hidden_layers)
    )
    return ModelSpec(
        family="qwen3_moe",
        **spec_fields(cfg),
        layers=layers,
        activation=Activation.silu,
        qk_norm=True,
        moe=MoeSpec(
            experts=experts,
            top_k=cfg.num_experts_per_tok,
            intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
        )
        if experts
        else None,
    )
