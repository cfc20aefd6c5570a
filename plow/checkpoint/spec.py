"""The family-neutral description of a decoder-only transformer.

A family module (plow/checkpoint/families/) maps its HuggingFace config to a `ModelSpec`;
everything downstream (graph, tiling, reference) reads only the spec, so adding a family is
adding one file.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Activation(str, Enum):
    silu = "silu"
    gelu_tanh = "gelu_tanh"


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding of one attention layer.

    `kind` is "default", "linear" (positions divided by `factor`) or "llama3" (frequency
    bands rescaled as in Llama-3.1), or "proportional" (Gemma 4's full layers: the first
    `partial_rotary_factor * head_dim / 2` frequencies of the default rope over the whole
    head_dim, the rest 0 so those dims pass unrotated; all divided by `factor`).
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    partial_rotary_factor: float = 1.0
    # "yarn" (DeepSeek-V3): the default frequencies blended with those divided by `factor`
    # over the correction range of `beta_fast` / `beta_slow` rotations in
    # `original_max_position` positions (floored / ceiled when `truncate`), as transformers'
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """Per-layer attention shape: `window` is None for global attention. `moe`: the layer's
    feed-forward is the routed experts of `ModelSpec.moe` (else the dense gated MLP)."""

    rope: RopeSpec
    window: int | None = None
    moe: bool = False
    # "attention" (with the feed-forward above) or "ssm": the layer is one Mamba-2 mixer
    # (`ModelSpec.ssm`) between its norm and residual, with no feed-forward; "kda": Kimi
    # Delta Attention (`ModelSpec.kda`) in place of the attention, with the feed-forward
    mixer: str = "attention"
    # Gemma 4: this layer's own attention shape (None: the model's head_dim / num_kv_heads),
    # and `k_eq_v`: the values are the key projection (no v_proj), before k_norm and rope
    head_dim: int | None = None
    kv_heads: int | None = None
    k_eq_v: bool = False


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """Routed experts (Qwen3-MoE): a router linear `[experts, hidden]`, softmax over the
    experts, the `top_k` largest kept (renormalised to sum 1 when `norm_topk_prob`), and
    `experts` gated MLPs of width `intermediate_size`; a token's output is the
    router-weighted sum of its `top_k` experts' outputs."""

    experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    # "qwen3_moe": the experts are the layer's feed-forward (`mlp.gate`, `mlp.experts.*`).
    # "gemma4": the experts run beside the dense MLP (`router.*`, `experts.*`): the router
    # reads the residual stream through a weightless RMSNorm times `router.scale`, its logits
    # scaled by hidden ** -0.5, its kept weights times `router.per_expert_scale`; the experts
    # read `pre_feedforward_layernorm_2`; the MLP and expert outputs, each normed
    # (`post_feedforward_layernorm_1` / `_2`), are summed before `post_feedforward_layernorm`
    layout: str = "qwen3_moe"
    # DeepSeek-V3 (`plow.checkpoint.families.deepseek_v3`): "sigmoid" scores (else "softmax")
    # with `mlp.gate.e_score_correction_bias` added for the choice only, the experts split
    # into `n_group` groups of which the `topk_group` best (sum of each group's two best
    # biased scores) are eligible, the kept sigmoid scores renormalised when `norm_topk_prob`
    # and times `routed_scale`; `shared_intermediate` > 0: a shared gated MLP of that width
    # (`mlp.shared_experts.*`) runs on every token and is added to the experts' output
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    shared_intermediate: int = 0


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """DeepSeek's multi-head latent attention (transformers' `DeepseekV3Attention`), lowered
    to ordinary linears, norms, rope and attention (plow/graph/mla.py) over weights derived
    from the checkpoint's (`plow.checkpoint.families.deepseek_v3.derive_weights`): the
    queries from `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (or `q_proj` when `q_lora_rank`
    is None), the keys and values from `kv_a_proj_with_mqa`'s latent of `kv_lora_rank`
    columns -> `kv_a_layernorm` -> `kv_b_proj`, each head's key its `nope` columns then the
    one shared `rope` columns (rotated; pairs interleaved when `interleave`), values of
    `v_dim` columns. In the absorbed form: H query heads over one key-value head per token,
    the latent row of `ModelSpec.head_dim` = kv_lora_rank + rope (rounded up to even)
    columns (`ModelSpec.num_kv_heads` 1), so the key-value cache holds the latent."""

    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v_dim: int
    interleave: bool = True
    # yarn's attention factor (cos / sin scale), folded into the rope columns' weights
    rope_gain: float = 1.0
    # False (Kimi-Linear's MLA, "NoPE"): the `rope` columns are shared but never rotated
    rotate: bool = True


@dataclass(frozen=True, slots=True)
class SsmSpec:
    """A Mamba-2 mixer (transformers' `Mamba2Mixer`): `in_proj` to [z | xBC | dt] of widths
    `inner`, `conv_dim` = inner + 2 * groups * state, `heads`; a causal depthwise conv of
    `conv_kernel` taps over xBC, then SiLU; the selective scan per head (`head_dim` x `state`
    state, dt = softplus(dt + dt_bias) clamped to [dt_min, dt_max], A = -exp(A_log), D skip);
    the gated RMSNorm y * silu(z) normalised per group of inner / groups; `out_proj`."""

    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0
    dt_max: float = float("inf")

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state_size

    @property
    def proj_size(self) -> int:
        return self.inner + self.conv_dim + self.heads


@dataclass(frozen=True, slots=True)
class KdaSpec:
    """Kimi Delta Attention (transformers' `KimiLinearDeltaAttention`): q / k / v linears of
    `heads * head_dim` columns each, one causal depthwise conv of `conv_kernel` taps over the
    three (then SiLU); the forget gate g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)
    per key channel, beta = sigmoid(b_proj(x)) per head; the delta-rule recurrence per head
    over a head_dim x head_dim fp32 state with l2-normed q (times head_dim ** -0.5) and k;
    the output RMS-normed per head, times o_norm's weight and sigmoid(g_b(g_a(x))); o_proj.
    The graph reads the concatenated q/k/v and conv weights `self_attn.kda.qkv.weight` /
    `self_attn.kda.conv.weight`, derived from the checkpoint's (`families.kimi_linear`)."""

    heads: int
    head_dim: int
    conv_kernel: int

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True, slots=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    layers: tuple[LayerSpec, ...]
    activation: Activation = Activation.silu
    # RMSNorm multiplies by (norm_offset + w): 0 for Llama/Qwen, 1 for Gemma.
    norm_offset: float = 0.0
    qk_norm: bool = False
    # Gemma's sandwich norms: post-attention and pre/post-feedforward norms.
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_scale: float = 0.0  # 0 means head_dim ** -0.5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    max_position: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    moe: MoeSpec | None = None
    # fp8 checkpoints: the block of the weights' scales (plow.checkpoint.fp8); None otherwise
    weight_block: tuple[int, int] | None = None
    # Mamba-2: the mixer of the layers whose `mixer` is "ssm" (weights named backbone.*)
    ssm: SsmSpec | None = None
    # Gemma 4: values RMS-normed per head with no weight (`v_norm`); each layer's output
    # multiplied by its `layer_scalar` [1] tensor. With per-layer attention shapes
    # (`LayerSpec.head_dim` / `kv_heads`), `head_dim` / `num_kv_heads` are the largest of any
    # layer: the key-value pool's geometry (a layer uses its own heads and dims of it).
    v_norm: bool = False
    layer_scalar: bool = False
    # DeepSeek-V3: multi-head latent attention in every layer (weights under self_attn.mla.*)
    mla: MlaSpec | None = None
    # Kimi-Linear: the mixer of the layers whose `mixer` is "kda" (the others are `mla`'s)
    kda: KdaSpec | None = None
    # the feed-forward's weight prefix under a layer (Kimi-Linear: "block_sparse_moe.")
    ffn: str = "mlp."

    def layer_head_dim(self, n: int) -> int:
        return self.layers[n].head_dim or self.head_dim

    def layer_kv_heads(self, n: int) -> int:
        return self.layers[n].kv_heads or self.num_kv_heads

    @property
    def embed_weight(self) -> str:
        return "backbone.embeddings.weight" if self.ssm else "model.embed_tokens.weight"

    @property
    def final_norm_weight(self) -> str:
        return "backbone.norm_f.weight" if self.ssm else "model.norm.weight"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale else self.head_dim**-0.5

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward reads, by its HuggingFace name, with its shape."""
        h, v = self.hidden_size, self.vocab_size
        if self.ssm is not None:
            return self._ssm_weight_shapes(self.ssm)
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            hd = self.layer_head_dim(n)
            qs, kvs = self.num_heads * hd, self.layer_kv_heads(n) * hd
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.layers[n].mixer == "kda" and self.kda is not None:
                shapes.update(self._kda_weight_shapes(p, self.kda))
                self._ffn_weight_shapes(shapes, p, n)
                continue
            if self.mla is not None:
                shapes.update(self._mla_weight_shapes(p, self.mla))
                self._ffn_weight_shapes(shapes, p, n)
                continue
            shapes[p + "self_attn.q_proj.weight"] = (qs, h)
            shapes[p + "self_attn.k_proj.weight"] = (kvs, h)
            if not self.layers[n].k_eq_v:
                shapes[p + "self_attn.v_proj.weight"] = (kvs, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, qs)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (qs,)
                shapes[p + "self_attn.k_proj.bias"] = (kvs,)
                if not self.layers[n].k_eq_v:
                    shapes[p + "self_attn.v_proj.bias"] = (kvs,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (hd,)
                shapes[p + "self_attn.k_norm.weight"] = (hd,)
            if self.sandwich_norms:
                shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
                shapes[p + "post_feedforward_layernorm.weight"] = (h,)
            if self.layer_scalar:
                shapes[p + "layer_scalar"] = (1,)
            self._ffn_weight_shapes(shapes, p, n)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        return shapes

    def _ffn_weight_shapes(self, shapes: dict[str, tuple[int, ...]], p: str, n: int) -> None:
        """Layer n's feed-forward weights (dense, routed, or Gemma 4's both) into `shapes`."""
        h, i = self.hidden_size, self.intermediate_size
        f = p + self.ffn
        if self.layers[n].moe and self.moe is not None and self.moe.layout == "gemma4":
            e, mi = self.moe.experts, self.moe.intermediate_size
            shapes[p + "router.proj.weight"] = (e, h)
            shapes[p + "router.scale"] = (h,)
            shapes[p + "router.per_expert_scale"] = (e,)
            shapes[p + "experts.gate_up_proj"] = (e, 2 * mi, h)
            shapes[p + "experts.down_proj"] = (e, h, mi)
            for norm in (
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
            ):
                shapes[p + norm + ".weight"] = (h,)
        elif self.layers[n].moe and self.moe is not None:
            # experts stacked as transformers >= 5 holds them (plow.checkpoint.weights
            # stacks the per-expert tensors of the older layout under these names)
            e, mi = self.moe.experts, self.moe.intermediate_size
            shapes[f + "gate.weight"] = (e, h)
            shapes[f + "experts.gate_up_proj"] = (e, 2 * mi, h)
            shapes[f + "experts.down_proj"] = (e, h, mi)
            if self.moe.scoring == "sigmoid":
                shapes[f + "gate.e_score_correction_bias"] = (e,)
            si = self.moe.shared_intermediate
            if si:
                shapes[f + "shared_experts.gate_proj.weight"] = (si, h)
                shapes[f + "shared_experts.up_proj.weight"] = (si, h)
                shapes[f + "shared_experts.down_proj.weight"] = (h, si)
            return
        shapes[f + "gate_proj.weight"] = (i, h)
        shapes[f + "up_proj.weight"] = (i, h)
        shapes[f + "down_proj.weight"] = (h, i)

    def _mla_weight_shapes(self, p: str, m: MlaSpec) -> dict[str, tuple[int, ...]]:
        """A latent-attention layer's weights as the graph reads them (`self_attn.mla.*` are
        derived from the checkpoint's when the weights are opened, MlaSpec)."""
        h, heads, d = self.hidden_size, self.num_heads, self.head_dim
        a = p + "self_attn."
        shapes: dict[str, tuple[int, ...]] = {}
        q_in = h
        if m.q_lora_rank:
            q_in = m.q_lora_rank
            shapes[a + "q_a_proj.weight"] = (m.q_lora_rank, h)
            shapes[a + "q_a_layernorm.weight"] = (m.q_lora_rank,)
        shapes[a + "mla.q.weight"] = (heads * d, q_in)
        shapes[a + "mla.kv_a.weight"] = (m.kv_lora_rank, h)
        shapes[a + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
        shapes[a + "mla.k_rope.weight"] = (m.rope, h)
        shapes[a + "mla.c_place.weight"] = (d, m.kv_lora_rank)
        shapes[a + "mla.k_place.weight"] = (d, m.rope)
        shapes[a + "mla.o.weight"] = (h, heads * d)
        return shapes

    def _kda_weight_shapes(self, p: str, m: KdaSpec) -> dict[str, tuple[int, ...]]:
        """A Kimi Delta Attention layer's weights (`self_attn.kda.*` derived, KdaSpec)."""
        h, c, d, a = self.hidden_size, m.width, m.head_dim, p + "self_attn."
        return {
            a + "kda.qkv.weight": (3 * c, h),
            a + "kda.conv.weight": (3 * c, 1, m.conv_kernel),
            a + "f_a_proj.weight": (d, h),
            a + "f_b_proj.weight": (c, d),
            a + "dt_bias": (c,),
            a + "A_log": (1, 1, m.heads, 1),
            a + "b_proj.weight": (m.heads, h),
            a + "g_a_proj.weight": (d, h),
            a + "g_b_proj.weight": (c, d),
            a + "o_norm.weight": (d,),
            a + "o_proj.weight": (h, c),
        }

    def _ssm_weight_shapes(self, m: SsmSpec) -> dict[str, tuple[int, ...]]:
        h, v = self.hidden_size, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (v, h)}
        for n in range(self.num_layers):
            p = f"backbone.layers.{n}."
            shapes[p + "norm.weight"] = (h,)
            shapes[p + "mixer.in_proj.weight"] = (m.proj_size, h)
            shapes[p + "mixer.conv1d.weight"] = (m.conv_dim, 1, m.conv_kernel)
            if m.conv_bias:
                shapes[p + "mixer.conv1d.bias"] = (m.conv_dim,)
            if m.proj_bias:
                shapes[p + "mixer.in_proj.bias"] = (m.proj_size,)
                shapes[p + "mixer.out_proj.bias"] = (h,)
            shapes[p + "mixer.dt_bias"] = (m.heads,)
            shapes[p + "mixer.A_log"] = (m.heads,)
            shapes[p + "mixer.D"] = (m.heads,)
            shapes[p + "mixer.norm.weight"] = (m.inner,)
            shapes[p + "mixer.out_proj.weight"] = (h, m.inner)
        shapes["backbone.norm_f.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        return shapes

    @property
    def lm_head_weight(self) -> str:
        return self.embed_weight if self.tie_word_embeddings else "lm_head.weight"

    def active_parameter_count(self) -> int:
        """Parameters one token reads: a routed layer's experts count `top_k` of `experts`."""
        total = 0
        for name, shape in self.weight_shapes().items():
            n = 1
            for d in shape:
                n *= d
            if self.moe is not None and ".experts." in name:
                n = n * self.moe.top_k // self.moe.experts
            total += n
        return total

    def parameter_count(self) -> int:
        total = 0
        for shape in self.weight_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total
