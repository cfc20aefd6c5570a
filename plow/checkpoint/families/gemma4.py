"""Gemma 4 text (`gemma4_text`, or the `text_config` of a `gemma4` config): Gemma 3's
sliding/global layers and sandwich norms with Gemma 4's changes.

- Norms multiply by `w` (not `1 + w`); queries are not scaled (`scaling = 1`); values are
  RMS-normed per head with no weight (`v_norm`); each layer's output is multiplied by its
  `layer_scalar` tensor.
- Full-attention layers have their own `global_head_dim` and, with `attention_k_eq_v`,
  `num_global_key_value_heads` and no `v_proj` (the values are the key projection before
  k_norm and rope); their rope is `proportional` (`partial_rotary_factor`).
- `enable_moe_block`: every layer runs routed experts (`num_experts`, `top_k_experts`,
  `moe_intermediate_size`) beside its dense MLP (`MoeSpec.layout == "gemma4"`).
- Final logit soft-capping; embeddings scaled by sqrt(hidden); tied embeddings.

Refused, naming the field: per-layer input embeddings (`hidden_size_per_layer_input` > 0),
key-value sharing (`num_kv_shared_layers` > 0), `use_bidirectional_attention: "all"`, rope
types other than default / proportional (/ linear), activations other than gelu-tanh.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from plow.checkpoint.families.common import (
    DecoderConfig,
    HeadDim,
    Heads,
    Intermediate,
    Positions,
    rope_from_dict,
    spec_fields,
)
from plow.checkpoint.spec import Activation, LayerSpec, ModelSpec, MoeSpec, RopeSpec

MODEL_TYPES = ("gemma4_text", "gemma4")

MAX_EXPERTS = 1024


class Gemma4Config(DecoderConfig):
    # transformers' Gemma4TextConfig defaults
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: HeadDim = 256
    max_position_embeddings: Positions = 131_072
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    sliding_window: Positions = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int | None = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int | None = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = Field(default=None, ge=0, le=MAX_EXPERTS)
    top_k_experts: int | None = Field(default=None, ge=1, le=MAX_EXPERTS)
    moe_intermediate_size: Intermediate | None = None
    global_head_dim: HeadDim = 512
    num_global_key_value_heads: Heads | None = None
    attn_logit_softcapping: float | None = None
    # what transformers 5.24 writes instead of global_head_dim / num_global_key_value_heads:
    # {"<layer>": {"head_dim": .., "num_key_value_heads": ..}} for the full-attention layers
    per_layer_config: dict[str, dict[str, Any]] | None = None


def _layer_types(cfg: Gemma4Config) -> list[str]:
    if cfg.layer_types is None:  # transformers: every 6th layer full attention
        types = [
            "sliding_attention" if (i + 1) % 6 else "full_attention"
            for i in range(cfg.num_hidden_layers)
        ]
    else:
        if len(cfg.layer_types) != cfg.num_hidden_layers:
            raise ValueError(
                f"field 'layer_types': {len(cfg.layer_types)} entries for "
                f"{cfg.num_hidden_layers} layers"
            )
        types = list(cfg.layer_types)
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if bad:
        raise ValueError(f"field 'layer_types': layer type {bad[0]!r} is not supported")
    types[-1] = "full_attention"  # transformers forces the last layer global
    return types


def _rope(params: Any, kind_name: str, default: dict[str, Any]) -> RopeSpec:
    p = default if params is None else params
    if not isinstance(p, dict):
        raise ValueError(f"field 'rope_parameters': {kind_name} is not an object")
    if str(p.get("rope_type", p.get("type", "default"))) == "proportional":
        return RopeSpec(
            theta=float(p.get("rope_theta", default["rope_theta"])),
            kind="proportional",
            factor=float(p.get("factor", 1.0)),
            partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)),
        )
    if "partial_rotary_factor" in p and float(p["partial_rotary_factor"]) != 1.0:
        raise ValueError(
            f"field 'rope_parameters': partial_rotary_factor on a {p.get('rope_type')!r} rope "
            f"({kind_name}) is not supported (proportional only)"
        )
    try:
        return rope_from_dict(p, float(default["rope_theta"]), "rope_parameters")
    except ValueError as e:
        raise ValueError(f"{e} ({kind_name}; gemma4 also reads proportional)") from None


def _per_layer(cfg: Gemma4Config, types: list[str], base: tuple[int, int]) -> list[tuple[int, int]]:
    """(head_dim, kv heads) per layer from `per_layer_config` (keys: a layer index or a
    layer type; values may set head_dim and num_key_value_heads, nothing else)."""
    assert cfg.per_layer_config is not None
    out = [base] * len(types)
    for key, over in cfg.per_layer_config.items():
        if key in ("sliding_attention", "full_attention"):
            idx = [i for i, t in enumerate(types) if t == key]
        elif key.isdigit() and int(key) < len(types):
            idx = [int(key)]
        else:
            raise ValueError(f"field 'per_layer_config': key {key!r} is not a layer or layer type")
        extra = set(over) - {"head_dim", "num_key_value_heads"}
        if extra:
            raise ValueError(
                f"field 'per_layer_config': {sorted(extra)[0]!r} of layer {key} is not supported "
                "(head_dim, num_key_value_heads)"
            )
        for i in idx:
            hd = over.get("head_dim", out[i][0])
            kvh = over.get("num_key_value_heads", out[i][1])
            ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hd, kvh))
            if not ok or cfg.num_attention_heads % kvh:
                raise ValueError(
                    f"field 'per_layer_config': layer {key}: head_dim {hd!r} / "
                    f"num_key_value_heads {kvh!r} do not fit {cfg.num_attention_heads} heads"
                )
            out[i] = (hd, kvh)
    return out


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("model_type") != "gemma4":
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("field 'text_config': a gemma4 config needs its text_config object")
    out = {**text, "model_type": "gemma4_text"}
    for k in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if k in config and k not in text:
            out[k] = config[k]
    return out


def to_spec(config: dict[str, Any]) -> ModelSpec:
    cfg = Gemma4Config.model_validate(_text_config(config))
    if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(
            f"field 'hidden_activation': {cfg.hidden_activation!r} is not supported "
            "(gelu_pytorch_tanh)"
        )
    if cfg.hidden_size_per_layer_input:
        raise ValueError(
            "field 'hidden_size_per_layer_input': per-layer input embeddings are not supported "
            "for gemma4 (0 only)"
        )
    if cfg.num_kv_shared_layers:
        raise ValueError(
            "field 'num_kv_shared_layers': key-value sharing across layers is not supported "
            "for gemma4 (0 only)"
        )
    if cfg.use_bidirectional_attention == "all":
        raise ValueError(
            "field 'use_bidirectional_attention': bidirectional attention is not supported"
        )
    if cfg.attn_logit_softcapping:
        raise ValueError("field 'attn_logit_softcapping': gemma4 has no attention soft-cap")
    if cfg.rope_theta is not None or cfg.rope_scaling is not None:
        raise ValueError("field 'rope_scaling': gemma4 configs give rope_parameters per layer type")
    params = cfg.rope_parameters or {}
    if params and not ({"full_attention", "sliding_attention"} & set(params)):
        raise ValueError(
            "field 'rope_parameters': gemma4 wants full_attention / sliding_attention entries"
        )
    local = _rope(
        params.get("sliding_attention"),
        "sliding_attention",
        {"rope_type": "default", "rope_theta": 10_000.0},
    )
    global_ = _rope(
        params.get("full_attention"),
        "full_attention",
        {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    )
    moe = None
    if cfg.enable_moe_block:
        experts, top = cfg.num_experts, cfg.top_k_experts
        if not experts or top is None or cfg.moe_intermediate_size is None:
            raise ValueError(
                "field 'enable_moe_block': needs num_experts, top_k_experts and "
                "moe_intermediate_size"
            )
        if top > experts:
            raise ValueError(f"field 'top_k_experts': {top} is more than the {experts} experts")
        moe = MoeSpec(
            experts=experts,
            top_k=top,
            intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=True,
            layout="gemma4",
        )
    fields = spec_fields(cfg)
    kvh, hd = fields["num_kv_heads"], fields["head_dim"]
    # transformers: the global kv-head override applies only with attention_k_eq_v
    g_kvh = (cfg.num_global_key_value_heads if cfg.attention_k_eq_v else None) or kvh
    if cfg.num_attention_heads % g_kvh:
        raise ValueError(
            f"field 'num_global_key_value_heads': num_attention_heads "
            f"{cfg.num_attention_heads} is not a multiple of {g_kvh}"
        )
    types = _layer_types(cfg)
    shapes = [
        (hd, kvh) if t == "sliding_attention" else (cfg.global_head_dim, g_kvh) for t in types
    ]
    if cfg.per_layer_config is not None:
        shapes = _per_layer(cfg, types, (hd, kvh))
    layers = []
    for t, (lhd, lkvh) in zip(types, shapes, strict=True):
        if t == "sliding_attention":
            layers.append(
                LayerSpec(
                    rope=local,
                    window=cfg.sliding_window,
                    moe=moe is not None,
                    head_dim=lhd,
                    kv_heads=lkvh,
                )
            )
        else:
            layers.append(
                LayerSpec(
                    rope=global_,
                    moe=moe is not None,
                    head_dim=lhd,
                    kv_heads=lkvh,
                    k_eq_v=cfg.attention_k_eq_v,
                )
            )
    # the key-value pool's geometry: the widest layer (ModelSpec.head_dim / num_kv_heads)
    fields["head_dim"] = max(lay.head_dim or hd for lay in layers)
    fields["num_kv_heads"] = max(lay.kv_heads or kvh for lay in layers)
    return ModelSpec(
        family="gemma4",
        **fields,
        layers=tuple(layers),
        activation=Activation.gelu_tanh,
        norm_offset=0.0,
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(cfg.hidden_size),
        query_scale=1.0,
        final_logit_softcap=cfg.final_logit_softcapping or None,
        moe=moe,
        v_norm=True,
        layer_scalar=True,
    )
