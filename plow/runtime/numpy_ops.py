"""The meaning of each op kind, in fp32 numpy. The reference executor applies these to whole
tensors; they are written to follow HuggingFace's definitions (docs/graph.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

F32 = np.float32


def rmsnorm(x: np.ndarray, w: np.ndarray | None, attrs: Mapping[str, Any]) -> np.ndarray:
    """x / rms(x) per group times (offset + w); with no weight (Gemma 4's v_norm), w is 0."""
    group = int(attrs.get("group", x.shape[-1]))
    shape = x.shape
    xg = x.reshape(*shape[:-1], shape[-1] // group, group)
    var = np.mean(xg * xg, axis=-1, keepdims=True, dtype=F32)
    y = xg / np.sqrt(var + F32(attrs["eps"]))
    w = np.zeros(group, dtype=F32) if w is None else w
    y = y * (F32(attrs.get("offset", 0.0)) + w.astype(F32))
    return y.reshape(shape).astype(F32)


def rope_inv_freq(attrs: Mapping[str, Any]) -> np.ndarray:
    """Inverse frequencies of a rope, with `linear` and `llama3` rescaling as in HF. With
    `rotary_dim` r (DeepSeek-V3's latent attention): the frequencies of an r-wide rope, then
    zeros up to head_dim / 2, so only the pairs (j, j + head_dim / 2), j < r / 2, rotate and
    every other column passes unchanged (cos 0 = 1, sin 0 = 0)."""
    if attrs.get("rotary_dim") is not None:
        inner = rope_inv_freq({**attrs, "head_dim": attrs["rotary_dim"], "rotary_dim": None})
        pad = np.zeros(int(attrs["head_dim"]) // 2 - inner.size, dtype=F32)
        return np.concatenate([inner, pad]).astype(F32)
    d = int(attrs["head_dim"])
    inv = 1.0 / (float(attrs["theta"]) ** (np.arange(0, d, 2, dtype=np.int64).astype(F32) / F32(d)))
    kind = attrs.get("kind", "default")
    if kind == "linear":
        inv = inv / F32(attrs["factor"])
    elif kind == "llama3":
        factor = float(attrs["factor"])
        lo, hi = float(attrs["low_freq_factor"]), float(attrs["high_freq_factor"])
        old = float(attrs["original_max_position"])
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif kind == "proportional":  # Gemma 4: the first angles rotate, the rest are 0
        angles = int(float(attrs["partial_rotary_factor"]) * d // 2)
        inv = np.where(np.arange(d // 2) < angles, inv, F32(0.0)) / F32(attrs["factor"])
    elif kind == "yarn":  # DeepSeek-V3 (transformers' _compute_yarn_parameters)
        inv = _yarn_inv_freq(attrs, d)
    return inv.astype(F32)


def _yarn_inv_freq(attrs: Mapping[str, Any], d: int) -> np.ndarray:
    """Yarn: the default frequencies where a band rotates more than `beta_fast` times in the
    original context, those divided by `factor` where it rotates less than `beta_slow`, a
    linear ramp between (the cos / sin gain is not here: the family folds it into weights)."""
    base, factor = float(attrs["theta"]), float(attrs["factor"])
    old = float(attrs["original_max_position"])

    def dim_of(rotations: float) -> float:
        return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(float(attrs["beta_fast"])), dim_of(float(attrs["beta_slow"]))
    if attrs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    pos = (F32(base) ** (np.arange(0, d, 2, dtype=np.int64).astype(F32) / F32(d))).astype(F32)
    extra, inter = (F32(1.0) / pos).astype(F32), (F32(1.0) / (F32(factor) * pos)).astype(F32)
    ramp = np.clip((np.arange(d // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1)
    keep = (F32(1.0) - ramp.astype(F32)).astype(F32)
    return (inter * (F32(1.0) - keep) + extra * keep).astype(F32)


def rope(x: np.ndarray, positions: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    heads, d = int(attrs["heads"]), int(attrs["head_dim"])
    inv = rope_inv_freq(attrs)
    freqs = np.maximum(positions, 0).astype(F32)[..., None] * inv  # [B,T,D/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[..., None, :], np.sin(emb)[..., None, :]
    xh = x.reshape(*x.shape[:-1], heads, d)
    rot = np.concatenate([-xh[..., d // 2 :], xh[..., : d // 2]], axis=-1)
    return (xh * cos + rot * sin).reshape(x.shape).astype(F32)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    attrs: Mapping[str, Any],
) -> np.ndarray:
    """Writes the new keys/values at their positions, then attends causally (and within
    `window` when set). Rows/slots with position −1 are padding: no write, zero output."""
    h, kvh, d = int(attrs["heads"]), int(attrs["kv_heads"]), int(attrs["head_dim"])
    b, t, _ = q.shape
    window, softcap, scale = attrs.get("window"), attrs.get("softcap"), F32(attrs["scale"])
    kh = k.reshape(b, t, kvh, d)
    vh = v.reshape(b, t, kvh, d)
    for bi in range(b):
        valid = positions[bi] >= 0
        p = positions[bi][valid]
        k_cache[bi][:, p, :] = kh[bi][valid].transpose(1, 0, 2)
        v_cache[bi][:, p, :] = vh[bi][valid].transpose(1, 0, 2)
    out = np.zeros((b, t, h, d), dtype=F32)
    group = h // kvh
    ctx = np.arange(k_cache.shape[2])
    for bi in range(b):
        pos = positions[bi]
        if not (pos >= 0).any():
            continue
        kv_len = int(pos.max()) + 1
        kc = k_cache[bi][:, :kv_len, :]  # [kvh, L, d]
        vc = v_cache[bi][:, :kv_len, :]
        qh = q[bi].reshape(t, kvh, group, d)
        s = np.einsum("tkgd,kld->tkgl", qh, kc, dtype=F32) * scale
        if softcap:
            s = np.tanh(s / F32(softcap)) * F32(softcap)
        allowed = ctx[None, :kv_len] <= pos[:, None]
        if window:
            allowed &= (pos[:, None] - ctx[None, :kv_len]) < int(window)
        s = np.where(allowed[:, None, None, :], s, -np.inf)
        s = s - s.max(axis=-1, keepdims=True)
        pexp = np.exp(s)
        pexp /= pexp.sum(axis=-1, keepdims=True)
        o = np.einsum("tkgl,kld->tkgd", pexp, vc, dtype=F32).reshape(t, h, d)
        o[pos < 0] = 0.0
        out[bi] = o
    return out.reshape(b, t, h * d)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return (
        F32(0.5)
        * x
        * (F32(1.0) + np.tanh(F32(math.sqrt(2 / math.pi)) * (x + F32(0.044715) * x**3)))
    ).astype(F32)


def silu(x: np.ndarray) -> np.ndarray:
    return (x / (F32(1.0) + np.exp(-x))).astype(F32)


def gated_mlp(gate: np.ndarray, up: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    act = silu if attrs["activation"] == "silu" else gelu_tanh
    return (act(gate) * up).astype(F32)


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    y = np.matmul(x, w.T).astype(F32)
    if bias is not None:
        y = y + bias
    return y


def lm_head(x: np.ndarray, w: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    y = linear(x, w)
    cap = attrs.get("softcap")
    if cap:
        y = (np.tanh(y / F32(cap)) * F32(cap)).astype(F32)
    return y


def greedy(logits: np.ndarray, index: np.ndarray) -> np.ndarray:
    rows = logits[np.arange(logits.shape[0]), index]
    return rows.argmax(axis=-1).astype(np.int32)


def residual_add(a: np.ndarray, b: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """a + b, times `scale` [1] when given (Gemma 4's layer_scalar)."""
    out = (a + b).astype(F32)
    return out if scale is None else (out * F32(np.asarray(scale, dtype=F32)[0])).astype(F32)


def router(
    logits: np.ndarray, attrs: Mapping[str, Any], expert_scale: np.ndarray | None = None
) -> np.ndarray:
    """Dense combine weights [.., E] from router logits (Qwen3-MoE's router): softmax over the
    experts in fp32, the `top_k` largest kept (ties: the lower expert index), divided by their
    sum when `norm_topk_prob`; every other expert's weight is exactly 0. Gemma 4: the logits
    times `logit_scale` first, the kept weights times `expert_scale[e]` last. DeepSeek-V3
    (`scoring` "sigmoid"): `grouped_router`, `expert_scale` is the correction bias."""
    x = np.asarray(logits, dtype=F32)
    if attrs.get("scoring") == "sigmoid":
        return grouped_router(x, attrs, expert_scale)
    if "logit_scale" in attrs:
        x = (x * F32(attrs["logit_scale"])).astype(F32)
    e = np.exp(x - x.max(axis=-1, keepdims=True)).astype(F32)
    p = (e / e.sum(axis=-1, keepdims=True, dtype=F32)).astype(F32)
    k = int(attrs["top_k"])
    top = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    val = np.take_along_axis(p, top, axis=-1)
    if attrs.get("norm_topk_prob"):
        val = (val / val.sum(axis=-1, keepdims=True, dtype=F32)).astype(F32)
    if expert_scale is not None:
        val = (val * np.asarray(expert_scale, dtype=F32)[top]).astype(F32)
    out = np.zeros_like(p)
    np.put_along_axis(out, top, val, axis=-1)
    return out


def grouped_router(x: np.ndarray, attrs: Mapping[str, Any], bias: np.ndarray | None) -> np.ndarray:
    """DeepSeek-V3's router (transformers' `DeepseekV3TopkRouter`): scores sigmoid(x); the
    choice reads scores + `bias` (e_score_correction_bias); the experts in `n_group` equal
    groups, a group's value the sum of its two best choice values, the `topk_group` best
    groups eligible; the `top_k` best eligible experts kept with their (unbiased) scores,
    divided by their sum (+1e-20) when `norm_topk_prob`, times `routed_scale`; 0 elsewhere.
    Ties go to the lower group / expert index (kernels/deepseek.h does the same)."""
    lead, n_exp = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n_exp)
    s = (F32(1.0) / (F32(1.0) + np.exp(-x2))).astype(F32)
    c = s if bias is None else (s + np.asarray(bias, dtype=F32)).astype(F32)
    g = int(attrs.get("n_group", 1))
    top_g, k = int(attrs.get("topk_group", 1)), int(attrs["top_k"])
    gs = n_exp // g
    grouped = np.sort(c.reshape(-1, g, gs), axis=-1)[..., ::-1]
    gscore = (grouped[..., 0] + grouped[..., 1]).astype(F32) if gs > 1 else grouped[..., 0]
    keep_g = np.argsort(-gscore, axis=-1, kind="stable")[:, :top_g]
    eligible = np.zeros((x2.shape[0], g), dtype=bool)
    np.put_along_axis(eligible, keep_g, True, axis=-1)
    masked = np.where(np.repeat(eligible, gs, axis=-1), c, -np.inf)
    top = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
    val = np.take_along_axis(s, top, axis=-1)
    if attrs.get("norm_topk_prob"):
        val = (val / (val.sum(axis=-1, keepdims=True, dtype=F32) + F32(1e-20))).astype(F32)
    val = (val * F32(attrs.get("routed_scale", 1.0))).astype(F32)
    out = np.zeros_like(s)
    np.put_along_axis(out, top, val, axis=-1)
    return out.reshape(*lead, n_exp)


def experts_gate_up(
    x: np.ndarray, route: np.ndarray, w: np.ndarray, attrs: Mapping[str, Any]
) -> np.ndarray:
    """act(x w_gate[e]^T) * (x w_up[e]^T) for every expert e ([.., E*N]; w [E, 2N, K], gate
    rows first); rows whose router weight for e is 0 get zeros in e's columns."""
    n_exp, two_n, _ = w.shape
    n = two_n // 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    r2 = route.reshape(-1, n_exp)
    out = np.zeros((x2.shape[0], n_exp * n), dtype=F32)
    for e in range(n_exp):
        rows = np.flatnonzero(r2[:, e] != 0)
        if rows.size:
            gu = np.matmul(x2[rows], np.asarray(w[e], dtype=F32).T).astype(F32)
            out[rows, e * n : (e + 1) * n] = gated_mlp(gu[:, :n], gu[:, n:], attrs)
    return out.reshape(*lead, n_exp * n)


def experts_down(x: np.ndarray, route: np.ndarray, w: np.ndarray) -> np.ndarray:
    """sum over experts e (ascending) of route[.., e] * (x_e w[e]^T), x_e = columns
    e*K .. of x ([.., N]; w [E, N, K])."""
    n_exp, n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n_exp * k)
    r2 = route.reshape(-1, n_exp)
    out = np.zeros((x2.shape[0], n), dtype=F32)
    for e in range(n_exp):
        rows = np.flatnonzero(r2[:, e] != 0)
        if rows.size:
            y = np.matmul(x2[rows, e * k : (e + 1) * k], np.asarray(w[e], dtype=F32).T)
            out[rows] = out[rows] + (y.astype(F32) * r2[rows, e : e + 1]).astype(F32)
    return out.reshape(*lead, n)


# -- Mamba-2 (transformers' Mamba2Mixer.torch_forward; recurrent state per batch row) --------
#
# A row's tokens are its positions >= 0 (a contiguous prefix of the step's tokens); a row whose
# first such position is 0 starts from a zero state (a new sequence), any other continues the
# state it holds. Padded tokens (position -1) read nothing, leave the state alone, output 0.
# Prefill (a row of more than one token) runs the chunked scan (`_ssm_chunk`, CHUNK tokens at
# a time), a decode step the recurrence; both fp32, equal up to rounding.


# Tokens of a row per chunk of the chunked forms (Mamba-2's scan, KDA). transformers' torch
# fallbacks take 64; 16 keeps KDA's [H, L, L, D] decay products small (at head_dim 128, 4
# heads, 256 tokens, on this loaded shared machine: chunk 16 ~45 ms, the recurrence 80-156 ms,
# chunk 64 0.9-1.9 s; Mamba-2's scan ~60 ms at any of them).
CHUNK = 16


def softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (threshold 20: x itself above it)."""
    with np.errstate(over="ignore"):
        return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, F32(20))))).astype(F32)


def ssm_conv_row(
    x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, state: np.ndarray, fresh: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One row: x [n, C] new inputs, w [C, 1, K], state [C, K-1] the previous K-1 inputs.
    Returns (silu(conv + bias) [n, C], the new state [C, K-1])."""
    k = w.shape[-1]
    prev = np.zeros_like(state) if fresh else state
    win = np.concatenate([prev, x.T.astype(F32)], axis=1)  # [C, K-1+n]
    n = x.shape[0]
    out = np.zeros((x.shape[1], n), dtype=F32)
    for j in range(k):  # tap order fixed: the same sum in every executor
        out = out + w[:, 0, j : j + 1].astype(F32) * win[:, j : j + n]
    if bias is not None:
        out = out + bias.astype(F32)[:, None]
    return silu(out).T, np.ascontiguousarray(win[:, n:]) if k > 1 else state


def ssm_scan_row(
    xbc: np.ndarray,
    dt_raw: np.ndarray,
    dt_bias: np.ndarray,
    a_log: np.ndarray,
    d: np.ndarray,
    state: np.ndarray,
    fresh: bool,
    attrs: Mapping[str, Any],
    chunk: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One row's heads: xbc [n, inner + 2GN] (conv output), dt_raw [n, H'] (in_proj's dt
    columns of the heads in `state`), state [H', P, N]. `attrs["head0"]` (default 0) is the
    first head of the slice, so a tile over heads picks its group of B and C. A row of more
    than one token runs the chunked scan over `chunk` tokens at a time (default CHUNK; 1:
    the recurrence), a decode step the recurrence."""
    hh, p, nn, g = (
        state.shape[0],
        int(attrs["head_dim"]),
        int(attrs["state_size"]),
        int(attrs["groups"]),
    )
    heads = int(attrs["heads"])
    h0 = int(attrs.get("head0", 0))
    inner = heads * p
    per_group = heads // g
    grp = (np.arange(h0, h0 + hh) // per_group).astype(np.int64)
    a = -np.exp(a_log.astype(F32))
    s = np.zeros_like(state) if fresh else state.astype(F32).copy()
    n = xbc.shape[0]
    x = xbc[:, h0 * p : (h0 + hh) * p].astype(F32).reshape(n, hh, p)
    bm = xbc[:, inner : inner + g * nn].astype(F32).reshape(n, g, nn)[:, grp]  # [n, H', N]
    cm = xbc[:, inner + g * nn : inner + 2 * g * nn].astype(F32).reshape(n, g, nn)[:, grp]
    dt = softplus((dt_raw + dt_bias.astype(F32)).astype(F32))
    hi = attrs.get("dt_max")  # None: no upper limit (JSON has no infinity)
    dt = np.clip(dt, F32(attrs["dt_min"]), F32("inf" if hi is None else hi)).astype(F32)
    step = CHUNK if chunk is None else chunk
    ys = np.zeros((n, hh, p), dtype=F32)
    if n > 1 and step > 1:
        for t0 in range(0, n, step):
            part = np.s_[t0 : t0 + step]
            ys[part], s = _ssm_chunk(x[part], bm[part], cm[part], dt[part], a, s)
    else:
        for i in range(n):
            da = np.exp(dt[i] * a).astype(F32)  # [H']
            s = (
                s * da[:, None, None] + (dt[i][:, None] * x[i])[:, :, None] * bm[i][:, None, :]
            ).astype(F32)
            ys[i] = np.einsum("hpn,hn->hp", s, cm[i], dtype=F32)
    ys = (ys + d.astype(F32)[None, :, None] * x).astype(F32)
    return ys.reshape(n, hh * p), s


def _ssm_chunk(
    x: np.ndarray, bm: np.ndarray, cm: np.ndarray, dt: np.ndarray, a: np.ndarray, s: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of L tokens of Mamba-2's scan in the chunked (SSD) form of transformers'
    `mamba2_chunk_scan`: x [L, H', P], bm / cm [L, H', N], dt [L, H'], a [H'], s [H', P, N]
    the state before the chunk. With G the running sum of dt * a over the chunk:
    y_l = exp(G_l) S c_l + sum_{s <= l} (c_l . b_s) exp(G_l - G_s) dt_s x_s (no D term);
    S' = exp(G_L) S + sum_s exp(G_L - G_s) dt_s x_s b_s^T."""
    n = x.shape[0]
    gc = np.cumsum((dt * a[None, :]).astype(F32), axis=0, dtype=F32)  # [L, H']
    low = np.tril(np.ones((n, n), dtype=bool))
    diff = gc[:, None, :] - gc[None, :, :]  # [l, s, H']
    lm = np.exp(np.where(low[:, :, None], diff, F32(-np.inf))).astype(F32)
    xd = (x * dt[:, :, None]).astype(F32)  # [L, H', P]
    m = (np.einsum("lhn,shn->lsh", cm, bm, dtype=F32) * lm).astype(F32)
    y = np.einsum("lsh,shp->lhp", m, xd, dtype=F32)
    y = y + np.einsum("hpn,lhn->lhp", s, cm, dtype=F32) * np.exp(gc)[:, :, None]
    dec = np.exp(gc[-1][None, :] - gc).astype(F32)  # [L, H']
    s = (
        s * np.exp(gc[-1])[:, None, None]
        + np.einsum("lhp,lhn->hpn", xd * dec[:, :, None], bm, dtype=F32)
    ).astype(F32)
    return y.astype(F32), s


def ssm_norm(y: np.ndarray, z: np.ndarray, w: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    """MambaRMSNormGated: (y * silu(z)) normalised per group, times the weight."""
    group = int(attrs["group"])
    h = (y * silu(z)).astype(F32)
    hg = h.reshape(*h.shape[:-1], h.shape[-1] // group, group)
    var = np.mean(hg * hg, axis=-1, keepdims=True, dtype=F32)
    out = (hg / np.sqrt(var + F32(attrs["eps"]))).reshape(h.shape)
    return (w.astype(F32) * out).astype(F32)


def _row_tokens(pos: np.ndarray) -> tuple[np.ndarray, bool]:
    """The valid tokens of a row and whether they start a new sequence."""
    valid = np.flatnonzero(pos >= 0)
    return valid, bool(valid.size and pos[valid[0]] == 0)


def ssm_conv(
    proj: np.ndarray,
    w: np.ndarray,
    bias: np.ndarray | None,
    state: np.ndarray,
    pos: np.ndarray,
    attrs: Mapping[str, Any],
) -> np.ndarray:
    """Whole tensors: proj [B, T, P], state [B, C, K-1] (updated in place) -> [B, T, C]."""
    c, off = int(attrs["channels"]), int(attrs["offset"])
    out = np.zeros((*proj.shape[:2], c), dtype=F32)
    for b in range(proj.shape[0]):
        valid, fresh = _row_tokens(pos[b])
        if valid.size == 0:
            continue
        out[b, valid], state[b] = ssm_conv_row(
            proj[b, valid, off : off + c], w, bias, state[b], fresh
        )
    return out


def ssm_scan(
    xbc: np.ndarray,
    proj: np.ndarray,
    dt_bias: np.ndarray,
    a_log: np.ndarray,
    d: np.ndarray,
    state: np.ndarray,
    pos: np.ndarray,
    attrs: Mapping[str, Any],
) -> np.ndarray:
    """Whole tensors: state [B, H, P, N] (updated in place) -> y [B, T, H * P]."""
    h, off = int(attrs["heads"]), int(attrs["dt_offset"])
    out = np.zeros((*xbc.shape[:2], h * int(attrs["head_dim"])), dtype=F32)
    for b in range(xbc.shape[0]):
        valid, fresh = _row_tokens(pos[b])
        if valid.size == 0:
            continue
        out[b, valid], state[b] = ssm_scan_row(
            xbc[b, valid], proj[b, valid, off : off + h], dt_bias, a_log, d, state[b], fresh, attrs
        )
    return out


# -- Kimi Delta Attention (plow/graph/kda.py) ---------------------------------------------------
# The same row / slot / fresh rules as Mamba-2's ops above; fp32 throughout.


# Prefill (a row with more than one token) runs the chunked form (transformers'
# `chunk_kimi_delta_attention`, fla's chunk_kda) over chunks of CHUNK tokens of the row; a
# decode step (one token) the recurrence. Both are exact rewrites of the same recurrence in
# fp32: they differ by rounding only (the tests hold both to transformers' 1e-4). CHUNK is
# the Mamba-2 section's.


def kda_row(
    x: np.ndarray,
    f: np.ndarray,
    beta: np.ndarray,
    gate: np.ndarray,
    dt_bias: np.ndarray,
    a_log: np.ndarray,
    w: np.ndarray,
    state: np.ndarray,
    fresh: bool,
    attrs: Mapping[str, Any],
    chunk: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One row's heads h0 .. h0 + H' (`attrs["head0"]`, default 0): x [n, 3C] (the conv
    output q | k | v of all heads), f / gate [n, H'*D], beta [n, H'] (this slice's columns),
    dt_bias [H'*D], a_log [H'], w [D], state [H', D, D]. Returns (out [n, H'*D], state).
    `chunk` tokens at a time (default CHUNK) in the chunked form when n > 1 (1: the
    recurrence)."""
    hh, d = state.shape[0], int(attrs["head_dim"])
    c = int(attrs["heads"]) * d
    h0 = int(attrs.get("head0", 0))
    lo, hi = h0 * d, (h0 + hh) * d
    n = x.shape[0]
    decay = np.exp(a_log.astype(F32)).astype(F32)[:, None]  # [H', 1]
    s = np.zeros_like(state, dtype=F32) if fresh else state.astype(F32).copy()
    eps, scale = F32(attrs["eps"]), F32(d**-0.5)
    q0 = x[:, lo:hi].astype(F32).reshape(n, hh, d)
    k0 = x[:, c + lo : c + hi].astype(F32).reshape(n, hh, d)
    v = x[:, 2 * c + lo : 2 * c + hi].astype(F32).reshape(n, hh, d)
    q = q0 / np.sqrt(np.sum(q0 * q0, axis=-1, keepdims=True, dtype=F32) + F32(1e-6)) * scale
    k = k0 / np.sqrt(np.sum(k0 * k0, axis=-1, keepdims=True, dtype=F32) + F32(1e-6))
    g = -decay * softplus((f + dt_bias.astype(F32)).astype(F32).reshape(n, hh, d))
    b = (F32(1) / (F32(1) + np.exp(-beta.astype(F32)))).astype(F32)  # [n, H']
    step = CHUNK if chunk is None else chunk
    if n > 1 and step > 1:
        ys = np.zeros((n, hh, d), dtype=F32)
        for t0 in range(0, n, step):
            part = np.s_[t0 : t0 + step]
            ys[part], s = _kda_chunk(q[part], k[part], v[part], g[part], b[part], s)
    else:
        ys = np.zeros((n, hh, d), dtype=F32)
        for i in range(n):
            s = (s * np.exp(g[i].astype(F32))[:, :, None]).astype(F32)
            mem = np.einsum("hkv,hk->hv", s, k[i], dtype=F32)
            delta = ((v[i] - mem) * b[i][:, None]).astype(F32)
            s = (s + k[i][:, :, None] * delta[:, None, :]).astype(F32)
            ys[i] = np.einsum("hkv,hk->hv", s, q[i], dtype=F32)
    var = np.mean(ys * ys, axis=-1, keepdims=True, dtype=F32)
    y = ys / np.sqrt(var + eps) * w.astype(F32)
    gt = gate.astype(F32).reshape(n, hh, d)
    out = (y * (F32(1) / (F32(1) + np.exp(-gt)))).reshape(n, hh * d).astype(F32)
    return out, s


def _kda_chunk(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, b: np.ndarray, s: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of L tokens in the chunked (WY) form: q, k, v, g [L, H', D] (q l2-normed and
    scaled, k l2-normed, g the log decays), b [L, H'] (beta after its sigmoid), s [H', D, D]
    the state before the chunk. Returns (y [L, H', D] = S_t^T q_t, the state after it).

    With G the decays' running sum over the chunk, the chunk's updates are the rank-L
    correction (I + A)^-1 of the strictly lower A[i, j] = beta_i k_i . (k_j exp(G_i - G_j)),
    solved by forward substitution: u = T (beta v), w = T (beta k exp(G)); the new values
    v' = u - w S; y_i = (q_i exp(G_i)) S + sum_{j <= i} (q_i . k_j exp(G_i - G_j)) v'_j;
    S' = exp(G_L) S + sum_j (k_j exp(G_L - G_j)) v'_j^T."""
    q, k, v, g = (np.swapaxes(a, 0, 1).astype(F32) for a in (q, k, v, g))  # [H', L, D]
    bt = np.swapaxes(b, 0, 1).astype(F32)[..., None]  # [H', L, 1]
    n = q.shape[1]
    gc = np.cumsum(g, axis=1, dtype=F32)
    low = np.tril(np.ones((n, n), dtype=bool))  # j <= i
    diff = gc[:, :, None, :] - gc[:, None, :, :]  # [H', i, j, D]
    dm = np.exp(np.where(low[None, :, :, None], diff, F32(-np.inf))).astype(F32)
    kb = (k * bt).astype(F32)
    a = -np.einsum("hid,hjd,hijd->hij", kb, k, dm, dtype=F32)
    a = np.where(np.tril(low, -1)[None], a, F32(0)).astype(F32)
    for i in range(1, n):
        a[:, i, :i] = a[:, i, :i] + np.einsum("hm,hmj->hj", a[:, i, :i], a[:, :i, :i], dtype=F32)
    t = (a + np.eye(n, dtype=F32)[None]).astype(F32)
    u = np.matmul(t, (v * bt).astype(F32)).astype(F32)
    wk = np.matmul(t, (kb * np.exp(gc)).astype(F32)).astype(F32)
    vn = (u - np.matmul(wk, s)).astype(F32)
    intra = np.einsum("hid,hjd,hijd->hij", q, k, dm, dtype=F32)
    y = (np.matmul((q * np.exp(gc)).astype(F32), s) + np.matmul(intra, vn)).astype(F32)
    last = gc[:, -1, :]  # [H', D]
    kd = (k * np.exp(last[:, None, :] - gc)).astype(F32)
    s = (s * np.exp(last)[:, :, None] + np.matmul(np.swapaxes(kd, 1, 2), vn)).astype(F32)
    return np.swapaxes(y, 0, 1), s


def kda(
    x: np.ndarray,
    f: np.ndarray,
    beta: np.ndarray,
    gate: np.ndarray,
    dt_bias: np.ndarray,
    a_log: np.ndarray,
    w: np.ndarray,
    state: np.ndarray,
    pos: np.ndarray,
    attrs: Mapping[str, Any],
) -> np.ndarray:
    """Whole tensors: state [B, H, D, D] (updated in place) -> out [B, T, H * D]."""
    h, d = int(attrs["heads"]), int(attrs["head_dim"])
    out = np.zeros((*x.shape[:2], h * d), dtype=F32)
    for b in range(x.shape[0]):
        valid, fresh = _row_tokens(pos[b])
        if valid.size == 0:
            continue
        out[b, valid], state[b] = kda_row(
            x[b, valid], f[b, valid], beta[b, valid], gate[b, valid], dt_bias,
            a_log.reshape(-1), w, state[b], fresh, attrs,
        )  # fmt: skip
    return out
