"""A numpy evaluator of an extracted `FusedGraph`, for the tests: every fused kind computed
in its kernel form from `plow.runtime.numpy_ops` (the functions the reference executor uses),
re-laid-out weights built from the checkpoint's tensors by the recorded layout. It is the
test oracle's second half: the canonical graph goes through `run_graph`, the fused one
through this, both against transformers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from plow.egraph.fused import FusedGraph, FusedOp
from plow.runtime import numpy_ops as K

F32 = np.float32
PAIRS = {"add_rmsnorm", "lm_head_argmax", "embedding_rmsnorm"}


def _norm_attrs(attrs: dict[str, Any], group: int) -> dict[str, Any]:
    return {**attrs, "group": group} if group else attrs


def _act(kind: str, x: np.ndarray) -> np.ndarray:
    return K.silu(x) if kind == "silu" else K.gelu_tanh(x)


def _lin(x: np.ndarray, w: np.ndarray, rest: list[np.ndarray]) -> np.ndarray:
    return K.linear(x, w, rest[0] if rest else None)


def _embed(ids: np.ndarray, table: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    return (table[ids] * F32(attrs["scale"])).astype(F32)


def _eval(op: FusedOp, a: list[np.ndarray]) -> list[np.ndarray]:
    k, p = op.kind, op.params
    if k == "embedding":
        return [_embed(a[0], a[1], p[0])]
    if k == "rmsnorm":
        return [K.rmsnorm(a[0], a[1], _norm_attrs(p[0], p[1]))]
    if k == "linear":
        return [_lin(a[0], a[1], a[2:])]
    if k == "rope":
        return [K.rope(a[0], a[1], p[0])]
    if k == "attention":
        return [K.attention(*a, p[0])]
    if k == "glu":
        return [(_act(p[0], a[0]) * a[1]).astype(F32)]
    if k == "add":
        return [(a[0] + a[1]).astype(F32)]
    if k == "lm_head":
        return [K.lm_head(a[0], a[1], p[0])]
    if k == "sample":
        return [K.greedy(a[0], a[1])]
    # fused kinds, each in the kernel form of Plow/Rewrites.v
    if k == "linear_glu":  # rows interleaved: output j reads rows 2j (gate) and 2j+1 (up)
        y = _lin(a[0], a[1], a[2:])
        return [(_act(p[0], y[..., 0::2]) * y[..., 1::2]).astype(F32)]
    if k == "glu_interleaved":
        return [(_act(p[0], a[0][..., 0::2]) * a[0][..., 1::2]).astype(F32)]
    if k == "rmsnorm_linear":
        return [_lin(K.rmsnorm(a[0], a[1], p[0]), a[2], a[3:])]
    if k == "rmsnorm_lm_head":
        return [K.lm_head(K.rmsnorm(a[0], a[1], p[0]), a[2], p[1])]
    if k == "attention_rope":
        q, kk = K.rope(a[0], a[5], p[1]), K.rope(a[1], a[5], p[2])
        return [K.attention(q, kk, a[2], a[3], a[4], a[5], p[0])]
    if k == "rmsnorm_residual":
        return [(a[0] + K.rmsnorm(a[1], a[2], p[0])).astype(F32)]
    if k == "linear_residual":
        return [(a[-1] + _lin(a[0], a[1], a[2:-1])).astype(F32)]
    if k == "linear_rope":
        return [K.rope(_lin(a[0], a[1], a[2:-1]), a[-1], p[0])]
    if k == "rmsnorm_rope":
        return [K.rope(K.rmsnorm(a[0], a[1], _norm_attrs(p[0], p[2])), a[2], p[1])]
    if k == "linear_act":
        return [_act(p[0], _lin(a[0], a[1], a[2:]))]
    if k == "add_rmsnorm":
        s = (a[0] + a[1]).astype(F32)
        return [s, K.rmsnorm(s, a[2], p[0])]
    if k == "embedding_rmsnorm":
        e = _embed(a[0], a[1], p[0])
        return [e, K.rmsnorm(e, a[2], p[1])]
    if k == "lm_head_argmax":
        logits = K.lm_head(a[0], a[1], p[0])
        return [logits, K.greedy(logits, a[2])]
    raise AssertionError(f"no numpy form for {k}")


def run_fused(
    fg: FusedGraph,
    weights: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    caches: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Evaluate the fused ops in order; every tensor any op writes is returned."""
    env: dict[str, np.ndarray] = {**inputs, **caches}
    rows: dict[str, int] = {}  # row count of each re-laid-out weight's sources
    for r in fg.relayouts:
        src = [np.asarray(weights[s], dtype=F32) for s in r.sources]
        if r.layout == "concat":
            env[r.name] = np.concatenate(src, axis=0)
        else:
            out = np.empty((2 * src[0].shape[0], *src[0].shape[1:]), dtype=F32)
            out[0::2], out[1::2] = src[0], src[1]
            env[r.name] = out
        for s, x in zip(r.sources, src, strict=True):
            rows[s] = x.shape[0]
    sources = {r.name: r.sources for r in fg.relayouts}

    def val(n: str) -> np.ndarray:
        if n not in env:
            env[n] = np.asarray(weights[n], dtype=F32)
        return env[n]

    for op in fg.ops:
        a = [val(n) for n in op.inputs]
        outs = _eval(op, a)
        if len(op.outputs) > 1 and op.kind not in PAIRS:
            # the concatenated projection read through its parts: split by the sources' rows
            w = next(n for n in op.inputs if n in sources)
            cuts = np.cumsum([rows[s] for s in sources[w]])[:-1]
            outs = np.split(outs[0], cuts, axis=-1)
        for n, v in zip(op.outputs, outs, strict=True):
            env[n] = v
    return env
