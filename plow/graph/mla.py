"""Multi-head latent attention (DeepSeek-V3, `MlaSpec`) as ordinary ops, in the absorbed form.

No op kind of its own: linears, RMSNorm, rope, a residual add and the attention op, over the
derived weights of `plow.checkpoint.families.deepseek_v3.derive_weights`. The attention is
multi-query: H query heads over ONE key-value head per token, the latent row, D =
`ModelSpec.head_dim` = kv_lora + rope (rounded up to even) columns wide:

    q_lat  = q_a_layernorm(q_a_proj(h))            (or h when q_lora_rank is null)
    q      = rope_r(q(q_lat))                       [B,T,H*D]  absorbed: q_nope_h . W_UK_h
    c      = kv_a_layernorm(kv_a(h))                the latent [B,T,kv_lora]
    row    = c_place(c) + k_place(rope(k_rope(h)))  [B,T,D]    the one cached kv head
    out    = o(attention(q, row, row))              o = o_proj . W_UV_h per head

Keys and values are the same row (the value's rope columns meet zero columns of `o`), so
the cache holds the normalised latent and the shared rotated key per token and layer, once:
the attention op's value cache operand is its key cache tensor (`values_are_keys`), and the
pool of such a model has no value half (`kv_halves` 1: D per token and layer, not
2 x H x max(nope + rope, v)); every executor reads an op's values from its key rows.
A row's columns are laid out by `deepseek_v3.head_columns(kv_lora, rope, D)`: the rope dims
where a rope of head_dim D with `rotary_dim` r rotates (pairs (j, j + D/2), j < r/2, with an
r-wide rope's frequencies; every other column has frequency 0 and passes exactly), the latent
in the other columns, the same in q, so q . row is transformers' score. `c_place` and
`k_place` are 0/1 matrices (each output column one input column or 0: the sum is exact);
`q` and `o` are products of the checkpoint's matrices (W_UK / W_UV absorbed, in float64, then
the checkpoint's dtype), so the scores and outputs equal transformers' up to rounding.
Prefill runs the same graph (it writes the rows decode reads).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def values_are_keys(op_inputs: Sequence[str]) -> bool:
    """An attention op whose value cache operand (input 4) is its key cache (input 3): it
    stores each token's row once and reads its values from the key rows."""
    return len(op_inputs) > 4 and op_inputs[4] == op_inputs[3]


def kv_halves(spec: ModelSpec) -> int:
    """Halves of the key-value pool (`[layers, halves, blocks, ...]`): 1 when every attention
    layer's values are its keys (latent attention: `mla_attention` is the only attention a
    model with `spec.mla` builds), else 2 (keys, values)."""
    return 1 if spec.mla is not None else 2


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
    row = add("kv_row", linear("c_place", lat, "mla.c_place.weight"),
              linear("k_place", k_pe, "mla.k_place.weight"))  # fmt: skip
    # one cache tensor: the op's value cache is its key cache (values are the cached rows)
    kc = g.declare(p + "k_cache", (batch, 1, context, d), TensorRole.cache)
    att = g.op(
        p + "attn",
        OpKind.attention,
        [q, row, row, kc, kc, "positions"],
        {
            "heads": heads,
            "kv_heads": 1,
            "head_dim": d,
            "scale": spec.attention_scale,
            "window": lspec.window,
            "softcap": spec.attn_logit_softcap,
        },
        n,
    )
    return linear("o_proj", att, "mla.o.weight")
