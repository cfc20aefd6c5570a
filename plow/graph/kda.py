"""Kimi Delta Attention (Kimi-Linear's linear-attention layers, `KdaSpec`) as graph ops.

Ordinary linears, Mamba-2's `ssm_conv` (a causal depthwise conv + SiLU with its conv window
as recurrent state) and one op of its own, `kda`, over C = heads * head_dim columns:

    qkv  = linear(h, kda.qkv)                      [B,T,3C] q | k | v (derived: concatenated)
    x    = ssm_conv(qkv, kda.conv, conv_state)     [B,T,3C] conv window per row's slot
    f    = f_b(f_a(h))                             [B,T,C]  forget gate before its activation
    b    = b_proj(h)                               [B,T,H]  beta before its sigmoid
    gate = g_b(g_a(h))                             [B,T,C]  output gate before its sigmoid
    o    = kda(x, f, b, gate, dt_bias, A_log, o_norm, kda_state)   [B,T,C]
    out  = o_proj(o)

`kda` per head and token (fp32, transformers' `recurrent_kimi_delta_attention` and
`KimiLinearRMSNormGated`): q, k l2-normed (eps 1e-6), q times head_dim ** -0.5;
g = -exp(A_log) * softplus(f + dt_bias); S = S * exp(g) (row k scaled by g_k);
S += k (beta (v - S^T k))^T; y = S^T q; out = rmsnorm(y) * w * sigmoid(gate). The state S
[B, H, D, D] is `TensorRole.state`: one block per row's slot, read and rewritten by the op
(a row whose first position is 0 starts from zeros). A row of more than one token (prefill)
runs the chunked form of the same recurrence on the cpu and native host executors
(`plow.runtime.numpy_ops._kda_chunk`, `kernels/kda.h`); the op and its tiles are the same.
"""

from __future__ import annotations

from plow.checkpoint.spec import ModelSpec
from plow.graph.mla import _Builder
from plow.graph.ops import OpKind, TensorRole


def kda_mixer(g: _Builder, spec: ModelSpec, n: int, h: str, batch: int) -> str:
    """Layer n's Kimi Delta Attention of the normed residual `h`; returns o_proj's output."""
    m = spec.kda
    assert m is not None
    p, a = f"L{n}.", f"model.layers.{n}.self_attn."
    b, c = batch, m.width

    def linear(name: str, x: str, w: str) -> str:
        return g.op(p + name, OpKind.linear, [x, g.weight(a + w)], {}, n)

    qkv = linear("qkv_proj", h, "kda.qkv.weight")
    cst = g.declare(p + "conv_state", (b, 3 * c, m.conv_kernel - 1), TensorRole.state)
    x = g.op(
        p + "kda_conv",
        OpKind.ssm_conv,
        [qkv, g.weight(a + "kda.conv.weight"), cst, "positions"],
        {"channels": 3 * c, "kernel": m.conv_kernel, "offset": 0},
        n,
    )
    f = linear("f_b_proj", linear("f_a_proj", h, "f_a_proj.weight"), "f_b_proj.weight")
    beta = linear("b_proj", h, "b_proj.weight")
    gate = linear("g_b_proj", linear("g_a_proj", h, "g_a_proj.weight"), "g_b_proj.weight")
    st = g.declare(p + "kda_state", (b, m.heads, m.head_dim, m.head_dim), TensorRole.state)
    o = g.op(
        p + "kda",
        OpKind.kda,
        [
            x,
            f,
            beta,
            gate,
            g.weight(a + "dt_bias"),
            g.weight(a + "A_log"),
            g.weight(a + "o_norm.weight"),
            st,
            "positions",
        ],
        {"heads": m.heads, "head_dim": m.head_dim, "eps": spec.norm_eps},
        n,
    )
    return linear("o_proj", o, "o_proj.weight")
