"""Kimi-Linear (`kimi_linear`, transformers' `KimiLinearForCausalLM`): Kimi Delta Attention
(KDA, `KdaSpec`) in its linear-attention layers, multi-head latent attention (MLA, `MlaSpec`
with no rope: Kimi's MLA is "NoPE", the shared key columns pass unrotated) in its full
layers, DeepSeek-style MoE feed-forwards after the dense first layers.

Both config layouts are read:

- Moonshot's checkpoint layout: `linear_attn_config` {head_dim, num_heads,
  short_conv_kernel_size, kda_layers, full_attn_layers (1-indexed)}, `first_k_dense_replace`,
  and the MoE fields as `num_experts`, `num_experts_per_token`, `num_shared_experts`,
  `num_expert_group`, `moe_renormalize`, `model_max_length`;
- transformers 5's own names (`layer_types`, `mlp_layer_types`, `linear_num_heads`,
  `linear_head_dim`, `linear_conv_kernel_dim`, `num_local_experts`, `num_experts_per_tok`,
  `n_shared_experts`, `n_group`, `norm_topk_prob`, `max_position_embeddings`) where a config
  has them; `layer_types` wins over `linear_attn_config`'s lists, as in transformers.

The weights are read as the checkpoint stores them (`block_sparse_moe.*`, per-expert
`w1` / `w3` / `w2`, separate `q_conv1d` / `k_conv1d` / `v_conv1d`); `derive_weights` makes
exact copies the graph reads: the stacked experts, the concatenated q/k/v projection and
conv weights, and the MLA layers' `self_attn.mla.*` (`deepseek_v3.derive_weights`).

4-bit experts as Kimi ships them (compressed-tensors pack-quantized int4, group 32) are
repacked into q4_0 blocks at load (`plow.checkpoint.int4`) and stacked as blocks like the
other families' experts (`weights.stack_experts` reads `w1` / `w3` / `w2`): never de-quantized.

Refused, naming the field: quantized weights other than compressed-tensors int4
(`quantization_config`, and the int4 scheme's own fields), `attention_bias`,
activations other than SiLU, `num_key_value_heads` other than `num_attention_heads`, a rope
on the MLA (`mla_use_nope` false), router activations other than sigmoid
(`moe_router_activation_func`), `moe_layer_freq` other than 1, layer / mlp types other than
linear_attention / full_attention and dense / sparse, expert groups that do not divide the
experts or hold fewer than two, more experts per token than the eligible groups hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import Field

from plow.checkpoint.families import deepseek_v3
from plow.checkpoint.families.common import (
    DecoderConfig,
    HeadDim,
    Heads,
    Hidden,
    Intermediate,
    spec_fields,
)
from plow.checkpoint.spec import (
    Activation,
    KdaSpec,
    LayerSpec,
    ModelSpec,
    RopeSpec,
)

MODEL_TYPES = ("kimi_linear",)

MAX_EXPERTS = 1024
MAX_CONV = 64  # the native conv kernel's taps (kernels/ssm.h)

# transformers' KimiLinearConfig.attribute_map: its field -> the name its config.json holds
_ALIASES = {
    "max_position_embeddings": "model_max_length",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
}


class KimiLinearConfig(DecoderConfig):
    # transformers' KimiLinearConfig defaults
    vocab_size: int = 163_840
    hidden_size: int = 2304
    intermediate_size: int = 9216
    moe_intermediate_size: Intermediate = 1024
    num_hidden_layers: int = 27
    num_attention_heads: int = 32
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    max_position_embeddings: int = 1_048_576
    n_shared_experts: int = Field(default=1, ge=0, le=MAX_EXPERTS)
    num_local_experts: int = Field(default=256, ge=1, le=MAX_EXPERTS)
    routed_scaling_factor: float = Field(default=2.446, gt=0)
    kv_lora_rank: Hidden = 512
    q_lora_rank: Hidden | None = None
    qk_rope_head_dim: HeadDim = 64
    v_head_dim: HeadDim = 128
    qk_nope_head_dim: HeadDim = 128
    n_group: int = Field(default=1, ge=1, le=MAX_EXPERTS)
    topk_group: int = Field(default=1, ge=1, le=MAX_EXPERTS)
    num_experts_per_tok: int = Field(default=8, ge=1, le=MAX_EXPERTS)
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    first_k_dense_replace: int = Field(default=1, ge=0)
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    linear_attn_config: dict[str, Any] | None = None
    linear_head_dim: HeadDim = 128
    linear_num_heads: Heads = 32
    linear_conv_kernel_dim: int = Field(default=4, ge=1, le=MAX_CONV)
    # Moonshot's checkpoint fields, refused when they ask for what transformers does not do
    mla_use_nope: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_layer_freq: int = 1


def _read(config: dict[str, Any]) -> KimiLinearConfig:
    data = dict(config)
    for field, alias in _ALIASES.items():
        if field not in data and alias in data:
            data[field] = data[alias]
    lin = data.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ValueError("field 'linear_attn_config': not an object")
    for field, key in (
        ("linear_head_dim", "head_dim"),
        ("linear_num_heads", "num_heads"),
        ("linear_conv_kernel_dim", "short_conv_kernel_size"),
    ):
        if key in lin:
            data[field] = lin[key]
    return KimiLinearConfig.model_validate(data)


def _layer_types(cfg: KimiLinearConfig) -> list[str]:
    n = cfg.num_hidden_layers
    if cfg.layer_types is not None:
        types = list(cfg.layer_types)
        field = "layer_types"
    elif cfg.linear_attn_config and {"full_attn_layers", "kda_layers"} <= set(
        cfg.linear_attn_config
    ):
        field = "linear_attn_config"
        got: list[str | None] = [None] * n
        for key, kind in (
            ("full_attn_layers", "full_attention"),
            ("kda_layers", "linear_attention"),
        ):
            for layer in cfg.linear_attn_config[key]:
                if not isinstance(layer, int) or not 1 <= layer <= n:
                    raise ValueError(
                        f"field 'linear_attn_config': {key} entry {layer!r} is not in 1..{n}"
                    )
                got[layer - 1] = kind
        if None in got:
            raise ValueError(
                f"field 'linear_attn_config': layer {got.index(None) + 1} is in neither list"
            )
        types = [str(t) for t in got]
    else:
        return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"field {field!r}: {len(types)} layer types for {n} layers")
    for t in types:
        if t not in ("full_attention", "linear_attention"):
            raise ValueError(f"field {field!r}: layer type {t!r} is not supported")
    return types


def _mlp_types(cfg: KimiLinearConfig) -> list[bool]:
    n = cfg.num_hidden_layers
    if cfg.mlp_layer_types is None:
        return [i >= cfg.first_k_dense_replace for i in range(n)]
    if len(cfg.mlp_layer_types) != n:
        raise ValueError(
            f"field 'mlp_layer_types': {len(cfg.mlp_layer_types)} types for {n} layers"
        )
    for t in cfg.mlp_layer_types:
        if t not in ("dense", "sparse"):
            raise ValueError(f"field 'mlp_layer_types': {t!r} is not supported (dense, sparse)")
    return [t == "sparse" for t in cfg.mlp_layer_types]


def _refuse(cfg: KimiLinearConfig) -> None:
    q = cfg.quantization_config
    if q and q.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"field 'quantization_config': quant_method {q.get('quant_method')!r} is not "
            "supported for kimi_linear (compressed-tensors: int4 experts)"
        )
    cfg.weight_block()  # int4 pack-quantized, group 32, symmetric (`common.check_int4_pack`)
    deepseek_v3.refuse_attention(cfg, "kimi_linear")
    if not cfg.mla_use_nope:
        raise ValueError("field 'mla_use_nope': false (a rope on the MLA) is not supported (true)")
    if cfg.moe_router_activation_func != "sigmoid":
        raise ValueError(
            f"field 'moe_router_activation_func': {cfg.moe_router_activation_func!r} is not "
            "supported (sigmoid)"
        )
    if cfg.moe_layer_freq != 1:
        raise ValueError(f"field 'moe_layer_freq': {cfg.moe_layer_freq} is not supported (1)")
    deepseek_v3.refuse_groups(cfg, cfg.num_local_experts)


def to_spec(config: dict[str, Any]) -> ModelSpec:
    cfg = _read(config)
    _refuse(cfg)
    types = _layer_types(cfg)
    sparse = _mlp_types(cfg)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    width = deepseek_v3.latent_width(cfg)
    fields = spec_fields(cfg.model_copy(update={"head_dim": width, "num_key_value_heads": 1}))
    fields["weight_block"] = None
    no_rope = RopeSpec(theta=10000.0)  # unused: no layer rotates
    layers = tuple(
        LayerSpec(
            rope=no_rope, moe=sparse[i], mixer="kda" if t == "linear_attention" else "attention"
        )
        for i, t in enumerate(types)
    )
    return ModelSpec(
        family="kimi_linear",
        **fields,
        layers=layers,
        activation=Activation.silu,
        query_scale=qk**-0.5,
        moe=deepseek_v3.moe_spec(cfg, cfg.num_local_experts),
        mla=deepseek_v3.mla_spec(cfg, interleave=False, rotate=False),
        kda=KdaSpec(
            heads=cfg.linear_num_heads,
            head_dim=cfg.linear_head_dim,
            conv_kernel=cfg.linear_conv_kernel_dim,
        ),
        ffn="block_sparse_moe.",
    )


def derive_weights(
    spec: ModelSpec, read: Callable[[str], np.ndarray], missing: set[str]
) -> dict[str, np.ndarray]:
    """The tensors of `spec`'s weight shapes that are `missing`, as exact copies of the
    checkpoint's (`read` by name), in its dtype:

    - `block_sparse_moe.experts.gate_up_proj` [E, 2I, H] (each expert's `w1` rows, then its
      `w3` rows) and `.down_proj` [E, H, I] (`w2`), where the store has not stacked them
      already (`weights.stack_experts` does for every checkpoint it reads);
    - `self_attn.kda.qkv.weight` [3C, H]: `q_proj`, `k_proj`, `v_proj` rows in that order;
    - `self_attn.kda.conv.weight` [3C, 1, K]: `q_conv1d`, `k_conv1d`, `v_conv1d`;
    - the MLA layers' `self_attn.mla.*` (`deepseek_v3.derive_weights`).
    """
    moe = spec.moe
    out = deepseek_v3.derive_weights(spec, read, missing)
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        e = f"{p}{spec.ffn}experts."
        if moe is not None and e + "gate_up_proj" in missing:
            out[e + "gate_up_proj"] = np.stack(
                [
                    np.concatenate(
                        [
                            np.asarray(read(f"{e}{j}.w1.weight")),
                            np.asarray(read(f"{e}{j}.w3.weight")),
                        ]
                    )
                    for j in range(moe.experts)
                ]
            )
        if moe is not None and e + "down_proj" in missing:
            out[e + "down_proj"] = np.stack(
                [np.asarray(read(f"{e}{j}.w2.weight")) for j in range(moe.experts)]
            )
        a = p + "self_attn."
        for name, parts in (
            ("kda.qkv.weight", ("q_proj.weight", "k_proj.weight", "v_proj.weight")),
            ("kda.conv.weight", ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")),
        ):
            if a + name in missing:
                out[a + name] = np.ascontiguousarray(
                    np.concatenate([np.asarray(read(a + x)) for x in parts])
                )
    return out
