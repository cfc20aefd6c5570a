"""DeepSeek-V3 (`deepseek_v3`, transformers' `DeepseekV3ForCausalLM`): multi-head latent
attention (MLA) in every layer, DeepSeekMoE feed-forwards after the first
`first_k_dense_replace` dense ones.

- Attention (`MlaSpec`): queries through the low-rank `q_a_proj` -> `q_a_layernorm` ->
  `q_b_proj` (or one `q_proj` when `q_lora_rank` is null); keys and values from
  `kv_a_proj_with_mqa`'s latent (`kv_lora_rank` columns, then the `qk_rope_head_dim` rope
  columns every head shares) -> `kv_a_layernorm` -> `kv_b_proj`; each head's query and key
  are `qk_nope_head_dim` unrotated then `qk_rope_head_dim` rotated columns (pairs interleaved
  when `rope_interleave`), its value `v_head_dim` columns; softmax scale
  `qk_head_dim ** -0.5`, times yarn's `mscale(factor, mscale_all_dim) ** 2` when the rope is
  yarn with `mscale_all_dim`.
- Feed-forward: `n_routed_experts` SiLU experts of width `moe_intermediate_size` behind a
  sigmoid router with `e_score_correction_bias`, group-limited top-k (`n_group`,
  `topk_group`), `norm_topk_prob`, `routed_scaling_factor`; plus `n_shared_experts` shared
  experts (one gated MLP `n_shared_experts * moe_intermediate_size` wide) on every token.

The graph reads MLA in the absorbed form through weights derived here from the checkpoint's
(`derive_weights`, called when the weights are opened): H query heads over one latent row
per token (the normalised latent then the shared rotated key, laid out by `head_columns`),
so the key-value cache holds the latent, not per-head keys and values. The query and output
projections absorb `kv_b_proj`'s key and value halves (products in float64, rounded once to
the checkpoint's dtype); the rest are row copies, de-interleaved rope rows, 0/1 placement
matrices and yarn's attention factor.

fp8 checkpoints as DeepSeek-V3 ships them (`quantization_config` fp8 e4m3 with
`weight_block_size`, each projection beside its `_scale_inv` blocks: `plow.checkpoint.fp8`)
are read like the other families'; the derived weights are products of the de-quantized
matrices, kept in float32 (rounding them to fp8 again would add a second quantization).

Multi-token-prediction layers (`num_nextn_predict_layers`, the released checkpoint's layer
61) serve speculative decoding only; the model's next-token distribution does not read them.
They are not run and their tensors are not read, as transformers' `DeepseekV3ForCausalLM`
skips them (`_keys_to_ignore_on_load_unexpected`); plow has no speculative decoding.

Refused, naming the field: quantization other than fp8 e4m3, `attention_bias`, activations
other than SiLU,
`num_key_value_heads` other than `num_attention_heads`, rope types other than default / yarn,
`topk_method` other than `noaux_tc`, `scoring_func` other than sigmoid, expert groups that do
not divide the experts or hold fewer than two.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from pydantic import Field

from plow.checkpoint.families.common import (
    DecoderConfig,
    HeadDim,
    Hidden,
    Intermediate,
    spec_fields,
)
from plow.checkpoint.spec import Activation, LayerSpec, MlaSpec, ModelSpec, MoeSpec, RopeSpec

MODEL_TYPES = ("deepseek_v3",)

MAX_EXPERTS = 1024


class DeepseekV3Config(DecoderConfig):
    # transformers' DeepseekV3Config defaults
    vocab_size: int = 129_280
    hidden_size: int = 7168
    intermediate_size: int = 18_432
    moe_intermediate_size: Intermediate = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = Field(default=1, ge=0, le=MAX_EXPERTS)
    n_routed_experts: int = Field(default=256, ge=1, le=MAX_EXPERTS)
    routed_scaling_factor: float = Field(default=2.5, gt=0)
    kv_lora_rank: Hidden = 512
    q_lora_rank: Hidden | None = 1536
    qk_rope_head_dim: HeadDim = 64
    v_head_dim: HeadDim = 128
    qk_nope_head_dim: HeadDim = 128
    n_group: int = Field(default=8, ge=1, le=MAX_EXPERTS)
    topk_group: int = Field(default=4, ge=1, le=MAX_EXPERTS)
    num_experts_per_tok: int = Field(default=8, ge=1, le=MAX_EXPERTS)
    first_k_dense_replace: int = Field(default=3, ge=0)
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 0
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(cfg: DeepseekV3Config) -> tuple[RopeSpec, float, float]:
    """The rope of the `qk_rope_head_dim` columns, its cos / sin gain (yarn's attention
    factor) and the softmax scale's factor (yarn's mscale_all_dim, squared)."""
    field = "rope_parameters" if cfg.rope_parameters is not None else "rope_scaling"
    params = cfg.rope_parameters if cfg.rope_parameters is not None else cfg.rope_scaling
    params = dict(params or {})
    theta = float(params.get("rope_theta", cfg.rope_theta if cfg.rope_theta else 10000.0))
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind == "default":
        return RopeSpec(theta=theta), 1.0, 1.0
    if kind != "yarn":
        raise ValueError(
            f"field {field!r}: rope type {kind!r} is not supported for deepseek_v3 (default, yarn)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"field {field!r}: partial_rotary_factor is not supported with yarn")
    original = int(params.get("original_max_position_embeddings", cfg.max_position_embeddings))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else cfg.max_position_embeddings / original
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    gain = params.get("attention_factor")
    if gain is None:
        if mscale and mscale_all:
            gain = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        else:
            gain = _yarn_mscale(factor, 1.0)
    softmax = _yarn_mscale(factor, float(mscale_all)) ** 2 if mscale_all else 1.0
    rope = RopeSpec(
        theta=theta,
        kind="yarn",
        factor=factor,
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
    )
    return rope, float(gain), softmax


class LatentMoeConfig(Protocol):
    """The fields a DeepSeek-style config (MLA attention, DeepSeekMoE feed-forwards) names
    alike: `DeepseekV3Config`, kimi_linear's `KimiLinearConfig` (whose routed experts are
    `num_local_experts`, not `n_routed_experts`)."""

    num_attention_heads: int
    num_key_value_heads: int | None
    attention_bias: bool
    hidden_act: str
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_shared_experts: int
    routed_scaling_factor: float
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool


def refuse_attention(cfg: LatentMoeConfig, family: str) -> None:
    """Refuse what the MLA lowering does not do: biases, activations other than SiLU, grouped
    key-value heads."""
    if cfg.attention_bias:
        raise ValueError(f"field 'attention_bias': biases are not supported for {family}")
    if cfg.hidden_act != "silu":
        raise ValueError(f"field 'hidden_act': {cfg.hidden_act!r} is not supported (silu)")
    if cfg.num_key_value_heads not in (None, cfg.num_attention_heads):
        raise ValueError(
            f"field 'num_key_value_heads': {cfg.num_key_value_heads} differs from "
            f"num_attention_heads {cfg.num_attention_heads} (latent attention has one key and "
            "value per head)"
        )


def refuse_groups(cfg: LatentMoeConfig, experts: int) -> None:
    """Refuse a group-limited top-k the router cannot take: groups that do not divide the
    `experts` or hold fewer than two, more groups picked than there are, more experts per
    token than the picked groups hold."""
    if experts % cfg.n_group or experts // cfg.n_group < 2:
        raise ValueError(
            f"field 'n_group': {cfg.n_group} groups of {experts} experts (each group needs at "
            "least two experts, all equal)"
        )
    if cfg.topk_group > cfg.n_group:
        raise ValueError(f"field 'topk_group': {cfg.topk_group} is more than n_group {cfg.n_group}")
    eligible = cfg.topk_group * (experts // cfg.n_group)
    if cfg.num_experts_per_tok > eligible:
        raise ValueError(
            f"field 'num_experts_per_tok': {cfg.num_experts_per_tok} is more than the "
            f"{eligible} experts of topk_group {cfg.topk_group} groups"
        )


def latent_width(cfg: LatentMoeConfig) -> int:
    """The absorbed form's row (plow/graph/mla.py): one latent row per token, the latent then
    the shared rope columns, rounded up to even so the rope pairs sit at (j, j + width / 2)."""
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return width + width % 2


def moe_spec(cfg: LatentMoeConfig, experts: int) -> MoeSpec:
    """DeepSeekMoE: `experts` routed SiLU experts behind a sigmoid router with group-limited
    top-k, plus `n_shared_experts` shared ones as one gated MLP."""
    return MoeSpec(
        experts=experts,
        top_k=cfg.num_experts_per_tok,
        intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        scoring="sigmoid",
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scale=cfg.routed_scaling_factor,
        shared_intermediate=cfg.n_shared_experts * cfg.moe_intermediate_size,
    )


def mla_spec(
    cfg: LatentMoeConfig, *, interleave: bool, rope_gain: float = 1.0, rotate: bool = True
) -> MlaSpec:
    """The MLA attention of `cfg`'s latent and head widths (`MlaSpec`)."""
    return MlaSpec(
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        nope=cfg.qk_nope_head_dim,
        rope=cfg.qk_rope_head_dim,
        v_dim=cfg.v_head_dim,
        interleave=interleave,
        rope_gain=rope_gain,
        rotate=rotate,
    )


def _refuse(cfg: DeepseekV3Config) -> None:
    if cfg.num_nextn_predict_layers < 0:
        raise ValueError(
            f"field 'num_nextn_predict_layers': {cfg.num_nextn_predict_layers} is negative"
        )
    cfg.weight_block()  # quantization other than fp8 e4m3 is refused naming the field
    refuse_attention(cfg, "deepseek_v3")
    if cfg.topk_method != "noaux_tc":
        raise ValueError(f"field 'topk_method': {cfg.topk_method!r} is not supported (noaux_tc)")
    if cfg.scoring_func != "sigmoid":
        raise ValueError(f"field 'scoring_func': {cfg.scoring_func!r} is not supported (sigmoid)")
    refuse_groups(cfg, cfg.n_routed_experts)
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"field 'qk_rope_head_dim': {cfg.qk_rope_head_dim} is not even")


def to_spec(config: dict[str, Any]) -> ModelSpec:
    cfg = DeepseekV3Config.model_validate(config)
    _refuse(cfg)
    rope, gain, softmax = _rope(cfg)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    width = latent_width(cfg)
    fields = spec_fields(cfg.model_copy(update={"head_dim": width, "num_key_value_heads": 1}))
    dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    layers = tuple(LayerSpec(rope=rope, moe=i >= dense) for i in range(cfg.num_hidden_layers))
    return ModelSpec(
        family="deepseek_v3",
        **fields,
        layers=layers,
        activation=Activation.silu,
        query_scale=qk**-0.5 * softmax,
        moe=moe_spec(cfg, cfg.n_routed_experts),
        mla=mla_spec(cfg, interleave=cfg.rope_interleave, rope_gain=gain),
    )


def _deinterleave(r: int) -> np.ndarray:
    """Row order that turns interleaved rope pairs (x0, x1), (x2, x3), .. into the halves
    layout (x0, x2, .. | x1, x3, ..) the rope op rotates: transformers'
    `apply_rotary_pos_emb_interleave` is exactly the halves rope of these rows."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


def head_columns(nope: int, rope: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Where a head's columns sit in its `width` (even) attention columns: the rope dims in
    halves order at 0 .. rope/2 and width/2 .. width/2 + rope/2 (the pairs a `rotary_dim`
    rope of head_dim `width` rotates), the `nope` other dims (the absorbed form: the latent)
    in the next free columns in order."""
    half, w2 = rope // 2, width // 2
    rope_cols = np.concatenate([np.arange(half), w2 + np.arange(half)])
    free = np.setdiff1d(np.arange(width), rope_cols)
    return rope_cols, free[:nope]


def derive_weights(
    spec: ModelSpec, read: Callable[[str], np.ndarray], missing: set[str]
) -> dict[str, np.ndarray]:
    """The `self_attn.mla.*` tensors of `spec`'s weight shapes that are `missing`, from the
    checkpoint's (`read` by name), in the checkpoint's dtype: the absorbed form of
    plow/graph/mla.py, H query heads over one latent row of D = `spec.head_dim` columns laid
    out by `head_columns(kv_lora, rope, D)`:

    - `q` [H*D, q_in]: head h's latent columns W_UK_h^T . W_qnope_h (`kv_b_proj`'s key rows
      of head h, transposed, times `q_b_proj`'s (or `q_proj`'s) nope rows), its rope columns
      `q_b_proj`'s rope rows (de-interleaved when `rope_interleave`), zeros in the spare ones;
    - `kv_a` [kv_lora, hidden] and `k_rope` [r, hidden]: `kv_a_proj_with_mqa`'s two parts;
    - `c_place` [D, kv_lora] and `k_place` [D, r]: 0/1, the latent and the rotated key into
      the row's columns;
    - `o` [hidden, H*D]: head h's latent columns `o_proj`'s columns of head h times W_UV_h
      (`kv_b_proj`'s value rows of head h), zeros at the rope and spare columns.

    The products are taken in float64 and rounded once to the checkpoint's dtype.
    """
    m = spec.mla
    assert m is not None
    heads, d, r, nope, vd = spec.num_heads, spec.head_dim, m.rope, m.nope, m.v_dim
    lat = m.kv_lora_rank
    qk = nope + r
    perm = _deinterleave(r) if m.interleave else np.arange(r)
    rope_cols, lat_cols = head_columns(lat, r, d)
    out: dict[str, np.ndarray] = {}
    for n in range(spec.num_layers):
        a = f"model.layers.{n}.self_attn."
        want = {k for k in missing if k.startswith(a + "mla.")}
        if not want:
            continue
        qb = np.asarray(read(a + ("q_b_proj.weight" if m.q_lora_rank else "q_proj.weight")))
        kva = np.asarray(read(a + "kv_a_proj_with_mqa.weight"))
        kvb = np.asarray(read(a + "kv_b_proj.weight"))
        o = np.asarray(read(a + "o_proj.weight"))
        dt = qb.dtype
        qh = qb.reshape(heads, qk, -1)
        q_rope = qh[:, nope:][:, perm]
        k_rope = kva[lat:][perm]
        if m.rope_gain != 1.0:  # yarn's cos / sin gain: rope is linear, so on the weights
            q_rope = (q_rope.astype(np.float32) * np.float32(m.rope_gain)).astype(dt)
            k_rope = (k_rope.astype(np.float32) * np.float32(m.rope_gain)).astype(dt)
        kvh = kvb.reshape(heads, nope + vd, lat).astype(np.float64)
        w_uk, w_uv = kvh[:, :nope], kvh[:, nope:]  # [H, nope, lat], [H, vd, lat]
        q = np.zeros((heads, d, qh.shape[-1]), dtype=dt)
        q[:, lat_cols] = np.einsum("hnl,hnq->hlq", w_uk, qh[:, :nope].astype(np.float64))
        q[:, rope_cols] = q_rope
        c_place = np.zeros((d, lat), dtype=dt)
        c_place[lat_cols, np.arange(lat)] = 1
        k_place = np.zeros((d, r), dtype=dt)
        k_place[rope_cols, np.arange(r)] = 1
        oh = o.reshape(o.shape[0], heads, vd).astype(np.float64)
        o_abs = np.zeros((o.shape[0], heads, d), dtype=o.dtype)
        o_abs[:, :, lat_cols] = np.einsum("ohv,hvl->ohl", oh, w_uv)
        derived = {
            "q": q.reshape(heads * d, -1),
            "kv_a": kva[:lat],
            "k_rope": k_rope,
            "c_place": c_place,
            "k_place": k_place,
            "o": o_abs.reshape(o.shape[0], heads * d),
        }
        for key, arr in derived.items():
            name = f"{a}mla.{key}.weight"
            if name in want:
                out[name] = np.ascontiguousarray(arr)
    return out
