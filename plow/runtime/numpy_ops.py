"""The meaning of each op kind, in fp32 numpy. The reference executor applies these to whole
tensors; they are written to follow HuggingFace's definitions (docs/graph.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

F32 = np.float32


def rmsnorm(x: np.ndarray, w: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    group = int(attrs.get("group", x.shape[-1]))
    shape = x.shape
    xg = x.reshape(*shape[:-1], shape[-1] // group, group)
    var = np.mean(xg * xg, axis=-1, keepdims=True, dtype=F32)
    y = xg / np.sqrt(var + F32(attrs["eps"]))
    y = y * (F32(attrs.get("offset", 0.0)) + w.astype(F32))
    return y.reshape(shape).astype(F32)


def rope_inv_freq(attrs: Mapping[str, Any]) -> np.ndarray:
    """Inverse frequencies of a rope, with `linear` and `llama3` rescaling as in HF."""
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
    return inv.astype(F32)


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


def router(logits: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    """Dense combine weights [.., E] from router logits (Qwen3-MoE's router): softmax over the
    experts in fp32, the `top_k` largest kept (ties: the lower expert index), divided by their
    sum when `norm_topk_prob`; every other expert's weight is exactly 0."""
    x = np.asarray(logits, dtype=F32)
    e = np.exp(x - x.max(axis=-1, keepdims=True)).astype(F32)
    p = (e / e.sum(axis=-1, keepdims=True, dtype=F32)).astype(F32)
    k = int(attrs["top_k"])
    top = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    val = np.take_along_axis(p, top, axis=-1)
    if attrs.get("norm_topk_prob"):
        val = (val / val.sum(axis=-1, keepdims=True, dtype=F32)).astype(F32)
    out = np.zeros_like(p)
    np.put_along_axis(out, top, val, axis=-1)
    return out


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
