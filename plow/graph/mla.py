"""Multi-head latent attention (DeepSeek-V3, `MlaSpec`) as ordinary ops.

No op kind of its own: linears, RMSNorm, rope, residual adds and the attention op, over the
derived weights of `plow.checkpoint.families.deepseek_v3.derive_weights` (H heads, each
D = `ModelSpec.head_dim` = max(nope + rope, v) columns wide in the attention):

    q_lat  = q_a_layernorm(q_a_proj(h))            (or h when q_lora_rank is null)
    q      = rope_r(q(q_lat))                                   [B,T,H*D]
    c      = kv_a_layernorm(kv_a(h))                            the latent [B,T,kv_lora]
    k      = k_nope(c) + k_place(rope(k_rope(h)))               [B,T,H*D]
    v      = v(c)                                               [B,T,H*D], zero past v_dim
    out    = o(attention(q, k, v))                              o's columns past v_dim zero

A head's columns are laid out by `deepseek_v3.head_columns`: its rope dims where a rope of
head_dim D with `rotary_dim` r rotates (`rope_r`: pairs (j, j + D/2), j < r/2, with an
r-wide rope's frequencies; every other column has frequency 0 and passes exactly), its nope
dims in the other columns, the same columns in q and k, so q . k is transformers' score.
`k_place` is a 0/1 matrix: each output column is one rotated key column or 0, so the sum is
exact. The key-value cache holds the decompressed k / v (H heads x D), not the latent
(docs/families.md says what that costs).
"""

from __future__ import annotations

from typing import Any, Protocol

from plow.checkpoint.spec import LayerSpec, ModelSpec
from plow.graph.ops import OpKind, TensorRole


class _Builder(Protocol):
    def weight(self, name: str) -> str: ...

    def declare(
        self, name: str, shape: tuple[int, ...], role: TensorRole, dtype: str = "float32"
    ) -> str: ...

    def op(
        self,
        name: str,
        kind: OpKind,
        inputs: list[str],
        attrs: dict[str, Any] | None = None,
        layer: int | None = None,
        role: TensorRole = TensorRole.activation,
    ) -> str: ...


def rope_attrs(lspec: LayerSpec, head_dim: int) -> dict[str, Any]:
    r = lspec.rope
    attrs: dict[str, Any] = {
        "theta": r.theta,
        "kind": r.kind,
        "factor": r.factor,
        "low_freq_factor": r.low_freq_factor,
        "high_freq_factor": r.high_freq_factor,
        "original_max_position": r.original_max_position,
        "head_dim": head_dim,
    }
    if r.kind == "yarn":
        attrs.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
    return attrs


def mla_attention(
    g: _Builder, spec: ModelSpec, lspec: LayerSpec, n: int, h: str, batch: int, context: int
) -> str:
    """Layer n's latent attention of the normed residual `h`; returns o_proj's output."""
    m = spec.mla
    assert m is not None
    p, a = f"L{n}.", f"model.layers.{n}.self_attn."
    heads, d = spec.num_heads, spec.head_dim
    norm = {"eps": spec.norm_eps, "offset": spec.norm_offset}

    def linear(name: str, x: str, w: str) -> str:
        return g.op(p + name, OpKind.linear, [x, g.weight(a + w)], {}, n)

    def add(name: str, x: str, y: str) -> str:
        return g.op(p + name, OpKind.residual_add, [x, y], {}, n)

    q_lat = h
    if m.q_lora_rank:
        q_lat = linear("q_a_proj", h, "q_a_proj.weight")
        q_lat = g.op(
            p + "q_a_norm", OpKind.rmsnorm, [q_lat, g.weight(a + "q_a_layernorm.weight")], norm, n
        )
    # the rope columns of every head rotate (rotary_dim), the others pass unchanged
    q = linear("q_proj", q_lat, "mla.q.weight")
    if m.rotate:  # Kimi-Linear's MLA is NoPE: its rope columns are never rotated
        q_rope = {**rope_attrs(lspec, d), "rotary_dim": m.rope, "heads": heads}
        q = g.op(p + "q_rope", OpKind.rope, [q, "positions"], q_rope, n)
    lat = linear("kv_a_proj", h, "mla.kv_a.weight")
    lat = g.op(
        p + "kv_a_norm", OpKind.rmsnorm, [lat, g.weight(a + "kv_a_layernorm.weight")], norm, n
    )
    k_pe = linear("k_rope_proj", h, "mla.k_rope.weight")
    if m.rotate:
        k_rope = {**rope_attrs(lspec, m.rope), "heads": 1}
        k_pe = g.op(p + "k_rope", OpKind.rope, [k_pe, "positions"], k_rope, n)
    k = add("k_join", linear("k_nope_proj", lat, "mla.k_nope.weight"),
            linear("k_place", k_pe, "mla.k_place.weight"))  # fmt: skip
    v = linear("v_proj", lat, "mla.v.weight")
    kc = g.declare(p + "k_cache", (batch, heads, context, d), TensorRole.cache)
    vc = g.declare(p + "v_cache", (batch, heads, context, d), TensorRole.cache)
    att = g.op(
        p + "attn",
        OpKind.attention,
        [q, k, v, kc, vc, "positions"],
        {
            "heads": heads,
            "kv_heads": heads,
            "head_dim": d,
            "scale": spec.attention_scale,
            "window": lspec.window,
            "softcap": spec.attn_logit_softcap,
        },
        n,
    )
    return linear("o_proj", att, "mla.o.weight")
