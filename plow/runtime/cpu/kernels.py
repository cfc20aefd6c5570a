"""Tile kernels: what one packet computes, in numpy, on views of the arena.

`run_packet(plan, packet, acc)` computes exactly the output region of the packet's units. Every
read and write goes through `acc` (`Access`), so the checking mode sees each word a kernel
touches. A kernel's result depends only on the words it reads — never on which other packets
ran before it — and a merge reduces its partials in ascending step order, so a step's outputs
are bitwise identical under every interleaving the counters allow.

The arithmetic is `plow.runtime.numpy_ops` (the reference's HF-faithful formulas) applied to
sub-blocks; split reductions combine per-tile fp32 partials:

| kind | tile | partial (split reduction) | merge |
| --- | --- | --- | --- |
| embedding | rows of ids x hidden cols | - | - |
| embedding + norm (R18) | rows (whole): gathered, then their norm | - | - |
| rmsnorm | whole groups of rows | sum of squares of its cols | normalise the rows |
| rope | rows x cols (reads whole heads) | - | - |
| linear, lm_head | x[m, k] @ w[n, k]^T (+ bias, cap) | its k-slice product | sum, bias, cap |
| lm_head + norm (R19) | rmsnorm(x[m, :])[:, k] @ w[n, k]^T | its k-slice product | sum |
| linear_glu (R2+R3+R13) | act(x w[2n]^T) * (x w[2n+1]^T) | gate, up | sums, act(g) * u |
| linear_qkv (R4) | x @ cat3(wq, wk, wv)^T, columns to q, k, v | its product | sum, to q, k, v |
| attention | rows (by kv head) over a key range | (o, max, sum) over its keys | rescale, sum |
| gated_mlp, residual_add | element-wise box | - | - |
| add_rmsnorm (R1) | a + b (written), then its norm | its sums' squares | normalise rows |
| sample | greedy argmax of the sampled row, cols | (max, index) of its cols | first maximum |
| router | whole rows: softmax, top-k, renormalise | - | - |
| expert_linear | one expert: its rows (others 0) | down: weighted k-slice | sum, ascending |

With `plan.fused` (`plow.runtime.cpu.plan.FusedArgmax`) greedy is fused into lm_head: each
task writing logits columns also writes per-chunk (max, argmax) partials, the sample partial
tasks skip their scan, and the sample merge reduces the lm_head chunks instead.
Kernels count their work through `Access.count` (`sample.scan`: logits elements the sample
op scanned; `lm_head.argmax`: logits elements reduced inside lm_head tasks; ...).

Attention writes the step's new keys and values at their destination in the paged pool
(page table → block, slot; head-major) inside the op: the tile holding a token's first query
head of a key-value head, and whose key range covers the token's position, writes it. A tile
reads the keys of this step from the op's key/value inputs and older keys from the pool, so
no tile of the op depends on another's cache write.

The pool's dtype is `plan.kv.dtype`: float32 (default, exact), or opt-in and lossy bfloat16 /
fp8_e4m3. A narrow pool stores rounded rows and older keys are read back dequantised; this
step's keys still come from the op's fp32 inputs. fp8 rows carry one power-of-two scale each
(`KV_SCALE`: per layer, K/V, block, head and slot), not one per (block, head) group as
`PagedKVCache` keeps: several tasks write one block in a prefill step, and a shared group
scale would make the stored bytes depend on which of them ran first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from plow.graph.mla import values_are_keys
from plow.runtime import numpy_ops as K
from plow.runtime.cpu.arena import KV, KV_SCALE, KVShape
from plow.runtime.cpu.plan import PAGE_TABLE, STATE_SLOT, OpEntry, Packet, Plan, Ranges
from plow.runtime.kv_cache import _pow2_scale
from plow.schedule.regions import partial_name

F32 = np.float32
Index = Any  # a numpy index: tuple of slices / ints / int arrays


class Access(Protocol):
    """The arena as a kernel sees it. `shape` reshapes the tensor's words before indexing."""

    def get(self, name: str, shape: tuple[int, ...], idx: Index) -> np.ndarray: ...

    def put(self, name: str, shape: tuple[int, ...], idx: Index, value: np.ndarray) -> None: ...

    def weight(self, name: str) -> np.ndarray: ...

    def count(self, key: str, n: int) -> None:
        """Add `n` to the machine's per-op work counter `key` (e.g. `sample.scan`)."""
        ...


def _shape(plan: Plan, name: str) -> tuple[int, ...]:
    return plan.graph.tensor(name).shape


def _view2(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 1:
        return (shape[0], 1)
    return (math.prod(shape[:-1]), shape[-1])


# -- row-wise ops ------------------------------------------------------------------------------


def _embedding(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (a, b), (c0, c1) = r
    ids_name, table = op.inputs[0], op.inputs[1]
    ids = acc.get(ids_name, (math.prod(_shape(plan, ids_name)),), np.s_[a:b])
    w = acc.weight(table)
    out = (w[ids, c0:c1] * F32(op.attrs["scale"])).astype(F32)
    v = _view2(_shape(plan, op.outputs[0]))
    acc.put(op.outputs[0], v, np.s_[a:b, c0:c1], out)
    if len(op.inputs) == 3:  # R18: the norm of the rows just written (a tile: whole rows)
        assert (c0, c1) == (0, v[1]), f"op {op.name}: R18's tiles hold whole rows"
        y = K.rmsnorm(out, acc.weight(op.inputs[2]), op.attrs["norm"])
        acc.put(op.outputs[1], v, np.s_[a:b, c0:c1], y)


def _norm_view(plan: Plan, op: OpEntry) -> tuple[int, int]:
    shape = _shape(plan, op.inputs[0])
    g = int(op.attrs.get("group", shape[-1]))
    return (math.prod(shape) // g, g)


def _rmsnorm(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (a, b), (c0, c1) = r
    v = _norm_view(plan, op)
    x = acc.get(op.inputs[0], v, np.s_[a:b, c0:c1])
    if step is not None:  # partial: this slice's sum of squares per row
        ss = np.asarray(np.sum(x * x, axis=-1, dtype=F32))
        acc.put(partial_name(op.name), (op.steps[1], v[0]), np.s_[step, a:b], ss)
        return
    w = acc.weight(op.inputs[1]) if len(op.inputs) > 1 else None  # none: Gemma 4's v_norm
    acc.put(op.outputs[0], v, np.s_[a:b, c0:c1], K.rmsnorm(x, w, {**op.attrs, "group": v[1]}))


def _rmsnorm_merge(plan: Plan, op: OpEntry, r: Ranges, cols: tuple[int, int], acc: Access) -> None:
    (a, b), _ = r
    v = _norm_view(plan, op)
    g = v[1]
    steps = op.steps[1]
    parts = acc.get(partial_name(op.name), (steps, v[0]), np.s_[:, a:b])
    total = parts[0].copy()
    for k in range(1, steps):
        total = total + parts[k]
    var = total / F32(g)
    # the unit writes the elements of norm rows [a, b) that fall in output columns `cols`
    ncols = _view2(_shape(plan, op.outputs[0]))[1]
    flat = np.arange(a * g, b * g)
    keep = (flat % ncols >= cols[0]) & (flat % ncols < cols[1])
    rows, j = flat[keep] // g, flat[keep] % g
    x = acc.get(op.inputs[0], v, (rows, j))
    w = acc.weight(op.inputs[1]).astype(F32) if len(op.inputs) > 1 else np.zeros(g, F32)
    y = x / np.sqrt(var[rows - a] + F32(op.attrs["eps"]))
    y = (y * (F32(op.attrs.get("offset", 0.0)) + w[j])).astype(F32)
    acc.put(op.outputs[0], v, (rows, j), y)


def _rope(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (a, b), (c0, c1) = r
    hd = int(op.attrs["head_dim"])
    v = _view2(_shape(plan, op.inputs[0]))
    h0, h1 = (c0 // hd) * hd, min(v[1], -(-c1 // hd) * hd)  # whole heads: rotation pairs
    x = acc.get(op.inputs[0], v, np.s_[a:b, h0:h1])
    pos = acc.get(op.inputs[1], (v[0],), np.s_[a:b])
    y = K.rope(x, pos, {**op.attrs, "heads": (h1 - h0) // hd})
    acc.put(op.outputs[0], v, np.s_[a:b, c0:c1], y[:, c0 - h0 : c1 - h0])


def _elementwise(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (a, b), (c0, c1) = r
    v = _view2(_shape(plan, op.inputs[0]))
    x = acc.get(op.inputs[0], v, np.s_[a:b, c0:c1])
    y = acc.get(op.inputs[1], v, np.s_[a:b, c0:c1])
    if op.kind == "gated_mlp":
        out = K.gated_mlp(x, y, op.attrs)
    else:  # a third input [1] scales the sum (Gemma 4's layer_scalar)
        out = K.residual_add(x, y, acc.weight(op.inputs[2]) if len(op.inputs) > 2 else None)
    acc.put(op.outputs[0], v, np.s_[a:b, c0:c1], out)


def _allreduce(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    """Tensor parallel (plow/graph/shard.py): the box of every device's partial summed in
    device order (the native kernel's order: kernels/collective.h), written to the sum."""
    (a, b), (c0, c1) = r
    v = _view2(_shape(plan, op.inputs[0]))
    out = np.array(acc.get(op.inputs[0], v, np.s_[a:b, c0:c1]), dtype=F32)
    for t in op.inputs[1:]:
        out = (out + acc.get(t, v, np.s_[a:b, c0:c1])).astype(F32)
    acc.put(op.outputs[0], v, np.s_[a:b, c0:c1], out)


def _add_rmsnorm(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    """R1 (plow/egraph): a + b of the tile's box, written; unsplit (whole rows) its
    full-width norm, written; split, the box's sums of squares per row (the partial)."""
    (a, b), (c0, c1) = r
    v = _view2(_shape(plan, op.inputs[0]))
    x = acc.get(op.inputs[0], v, np.s_[a:b, c0:c1])
    y = acc.get(op.inputs[1], v, np.s_[a:b, c0:c1])
    s = K.residual_add(x, y, None)
    acc.put(op.outputs[0], v, np.s_[a:b, c0:c1], s)
    if step is not None:  # as rmsnorm's partial, over the sums just written
        ss = np.asarray(np.sum(s * s, axis=-1, dtype=F32))
        acc.put(partial_name(op.name), (op.steps[1], v[0]), np.s_[step, a:b], ss)
        return
    w = acc.weight(op.inputs[2])
    acc.put(op.outputs[1], v, np.s_[a:b, :], K.rmsnorm(s, w, {**op.attrs, "group": v[1]}))


def _add_rmsnorm_merge(
    plan: Plan, op: OpEntry, r: Ranges, cols: tuple[int, int], acc: Access
) -> None:
    """A split add_rmsnorm's merge: rmsnorm's merge over the sums the tiles wrote, into the
    norm (the op's second output)."""
    (a, b), _ = r
    v = _view2(_shape(plan, op.inputs[0]))
    steps = op.steps[1]
    parts = acc.get(partial_name(op.name), (steps, v[0]), np.s_[:, a:b])
    total = parts[0].copy()
    for k in range(1, steps):
        total = total + parts[k]
    var = total / F32(v[1])
    c0, c1 = cols
    x = acc.get(op.outputs[0], v, np.s_[a:b, c0:c1])
    w = acc.weight(op.inputs[2]).astype(F32)[c0:c1]
    y = x / np.sqrt(var[:, None] + F32(op.attrs["eps"]))
    y = (y * (F32(op.attrs.get("offset", 0.0)) + w)).astype(F32)
    acc.put(op.outputs[1], v, np.s_[a:b, c0:c1], y)


# -- matmul ----------------------------------------------------------------------------------


def _norm_prologue(op: OpEntry) -> bool:
    """R19 (plow/egraph/apply.py): an lm_head whose third input is the final norm's weight
    normalises its input rows in its prologue (attrs the norm's: eps, offset)."""
    return op.kind == "lm_head" and len(op.inputs) == 3


def _softcap(y: np.ndarray, op: OpEntry) -> np.ndarray:
    cap = op.attrs.get("softcap") if op.kind == "lm_head" else None
    if cap:
        return (np.tanh(y / F32(cap)) * F32(cap)).astype(F32)
    return y


def _linear(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (m0, m1), (n0, n1), (k0, k1) = r
    M, N, Kd = op.extents
    if _norm_prologue(op):  # R19: the final norm of the tile's whole rows, then its k slice
        x = acc.get(op.inputs[0], (M, Kd), np.s_[m0:m1, 0:Kd])
        x = K.rmsnorm(x, acc.weight(op.inputs[2]), op.attrs)[:, k0:k1]
    else:
        x = acc.get(op.inputs[0], (M, Kd), np.s_[m0:m1, k0:k1])
    w = acc.weight(op.inputs[1])[n0:n1, k0:k1]
    y = np.matmul(x, w.T).astype(F32)
    if step is not None:
        acc.put(partial_name(op.name), (op.steps[2], M, N), np.s_[step, m0:m1, n0:n1], y)
        return
    if len(op.inputs) == 3 and not _norm_prologue(op):
        y = y + acc.weight(op.inputs[2])[n0:n1]
    y = _softcap(y, op)
    acc.put(op.outputs[0], (M, N), np.s_[m0:m1, n0:n1], y)
    if plan.fused is not None and plan.fused.lm_head == op.name:
        _argmax_chunks(plan, op, y, m0, n0, acc)


def _linear_glu(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    """R2+R3+R13 (plow/egraph): output column n is act(x . w[2n]) * (x . w[2n + 1]), the
    gate and up linears over the interleaved weight, then the gated MLP. Split k: the gate
    and up dots of the k slice into the partial `[step, M, 2N]` (gate at 2n, up at 2n + 1);
    the merge applies the gated MLP to the summed partials."""
    (m0, m1), (n0, n1), (k0, k1) = r
    M, N, Kd = op.extents
    x = acc.get(op.inputs[0], (M, Kd), np.s_[m0:m1, k0:k1])
    w = acc.weight(op.inputs[1])[2 * n0 : 2 * n1, k0:k1]
    g = np.matmul(x, np.ascontiguousarray(w[0::2]).T).astype(F32)
    u = np.matmul(x, np.ascontiguousarray(w[1::2]).T).astype(F32)
    if step is not None:
        pair = np.stack([g, u], axis=-1).reshape(g.shape[0], -1)
        pn = partial_name(op.name)
        acc.put(pn, (op.steps[2], M, 2 * N), np.s_[step, m0:m1, 2 * n0 : 2 * n1], pair)
        return
    acc.put(op.outputs[0], (M, N), np.s_[m0:m1, n0:n1], K.gated_mlp(g, u, op.attrs))


def _linear_glu_merge(
    plan: Plan, op: OpEntry, r: Ranges, cols: tuple[int, int], acc: Access
) -> None:
    """A split linear_glu's merge: its columns' gate and up partials, each summed in step
    order (the unfused split linears' merges), then the gated MLP."""
    (m0, m1), (n0, n1), _ = r
    n0, n1 = max(n0, cols[0]), min(n1, cols[1])
    M, N, _k = op.extents
    steps = op.steps[2]
    parts = acc.get(partial_name(op.name), (steps, M, 2 * N), np.s_[:, m0:m1, 2 * n0 : 2 * n1])
    g, u = parts[0, :, 0::2].copy(), parts[0, :, 1::2].copy()
    for k in range(1, steps):
        g = g + parts[k, :, 0::2]
        u = u + parts[k, :, 1::2]
    acc.put(op.outputs[0], (M, N), np.s_[m0:m1, n0:n1], K.gated_mlp(g, u, op.attrs))


def _linear_qkv(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    """R4 (plow/egraph): the linear over cat3(Wq, Wk, Wv); output column n is q's, k's or
    v's by where it falls in their widths (split k: a linear's partial `[step, M, N]`)."""
    (m0, m1), (n0, n1), (k0, k1) = r
    M, N, Kd = op.extents
    x = acc.get(op.inputs[0], (M, Kd), np.s_[m0:m1, k0:k1])
    y = np.matmul(x, acc.weight(op.inputs[1])[n0:n1, k0:k1].T).astype(F32)
    if step is not None:
        acc.put(partial_name(op.name), (op.steps[2], M, N), np.s_[step, m0:m1, n0:n1], y)
        return
    _qkv_put(plan, op, acc, y, m0, m1, n0, n1)


def _linear_qkv_merge(
    plan: Plan, op: OpEntry, r: Ranges, cols: tuple[int, int], acc: Access
) -> None:
    """A split linear_qkv's merge: the linear's ordered sums, to q, k or v."""
    y, m0, m1, n0, n1 = _summed_partials(op, r, cols, acc)
    _qkv_put(plan, op, acc, y.astype(F32), m0, m1, n0, n1)


def _qkv_put(
    plan: Plan, op: OpEntry, acc: Access, y: np.ndarray, m0: int, m1: int, n0: int, n1: int
) -> None:
    """Columns n0..n1 of q | k | v side by side (`y`: rows m0..m1) into their tensors."""
    M = op.extents[0]
    at = 0
    for t in op.outputs:
        w = _view2(_shape(plan, t))[1]
        a, b = max(n0, at), min(n1, at + w)
        if a < b:
            acc.put(t, (M, w), np.s_[m0:m1, a - at : b - at], y[:, a - n0 : b - n0])
        at += w


def _summed_partials(
    op: OpEntry, r: Ranges, cols: tuple[int, int], acc: Access
) -> tuple[np.ndarray, int, int, int, int]:
    """A merge unit's box of the split reduction's partials, summed in ascending step order
    (k chunks, or experts), and the box (m0, m1, n0, n1)."""
    (m0, m1), (n0, n1), _ = r
    n0, n1 = max(n0, cols[0]), min(n1, cols[1])
    M, N, _k = op.extents
    steps = op.steps[2]
    parts = acc.get(partial_name(op.name), (steps, M, N), np.s_[:, m0:m1, n0:n1])
    y = parts[0].copy()
    for k in range(1, steps):
        y = y + parts[k]
    return y, m0, m1, n0, n1


def _linear_merge(plan: Plan, op: OpEntry, r: Ranges, cols: tuple[int, int], acc: Access) -> None:
    y, m0, m1, n0, n1 = _summed_partials(op, r, cols, acc)
    M, N, _k = op.extents
    if len(op.inputs) == 3 and not _norm_prologue(op):
        y = y + acc.weight(op.inputs[2])[n0:n1]
    y = _softcap(y.astype(F32), op)
    acc.put(op.outputs[0], (M, N), np.s_[m0:m1, n0:n1], y)
    if plan.fused is not None and plan.fused.lm_head == op.name:
        _argmax_chunks(plan, op, y, m0, n0, acc)


def _argmax_chunks(plan: Plan, op: OpEntry, y: np.ndarray, m0: int, n0: int, acc: Access) -> None:
    """Fused greedy (`plan.fused`): the (max, lowest argmax) of each chunk of the logits block
    `y` (rows from `m0`, columns from `n0`) that this unit just wrote."""
    f = plan.fused
    assert f is not None
    if y.size == 0:
        return
    M = op.extents[0]
    n1 = n0 + y.shape[1]
    lo = f.bounds.index(n0)
    hi = f.bounds.index(n1)  # the unit's columns are whole chunks
    rows = np.arange(y.shape[0])
    m1 = m0 + y.shape[0]
    for c in range(lo, hi):
        sub = y[:, f.bounds[c] - n0 : f.bounds[c + 1] - n0]
        arg = sub.argmax(axis=-1)
        acc.put(f.values, (f.chunks, M), np.s_[c, m0:m1], sub[rows, arg])
        acc.put(f.index, (f.chunks, M), np.s_[c, m0:m1], (arg + f.bounds[c]).astype(np.int32))
    acc.count("lm_head.argmax", y.size)


# -- attention -------------------------------------------------------------------------------


def _kv_store(kv: KVShape, acc: Access, idx: tuple[Any, ...], vals: np.ndarray) -> None:
    """Write key or value rows `vals` [n, D] (fp32) into the pool at `idx` (layer, K/V, blocks,
    kv head, slots, :) in the pool's dtype. fp8: each row gets its own power-of-two scale
    (the smallest s with amax / s <= 448), written to `KV_SCALE` beside it, so a row's bytes
    depend only on the row (never on which task wrote the rest of its block)."""
    if kv.dtype == "float32":
        acc.put(KV, kv.shape, idx, vals)
        return
    if kv.dtype == "bfloat16":
        acc.put(KV, kv.shape, idx, vals.astype(kv.storage))
        return
    scale = _pow2_scale(np.abs(vals).max(axis=-1)).astype(F32)
    acc.put(KV, kv.shape, idx, (vals / scale[:, None]).astype(kv.storage))
    acc.put(KV_SCALE, kv.scale_shape, idx[:-1], scale)


def _kv_load(kv: KVShape, acc: Access, idx: tuple[Any, ...]) -> np.ndarray:
    """Rows of the pool at `idx`, dequantised to fp32 [n, D]."""
    x = acc.get(KV, kv.shape, idx)
    if kv.dtype == "float32":
        return x
    x = x.astype(F32)
    if kv.dtype == "fp8_e4m3":
        x = x * acc.get(KV_SCALE, kv.scale_shape, idx[:-1])[:, None]
    return x


class _AttnGeom:
    def __init__(self, plan: Plan, op: OpEntry) -> None:
        q = _shape(plan, op.inputs[0])
        self.B, self.T = q[0], q[1]
        self.H, self.KVH, self.D = (
            int(op.attrs["heads"]),
            int(op.attrs["kv_heads"]),
            int(op.attrs["head_dim"]),
        )
        self.grp = self.H // self.KVH
        self.block = self.T * self.grp  # rows sharing one (batch row, kv head)
        self.rows = self.B * self.KVH * self.block

    def row_coords(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(batch row, token, query head) of attention rows [a, b)."""
        r = np.arange(a, b)
        bi = r // (self.KVH * self.block)
        kv = (r // self.block) % self.KVH
        tok = (r // self.grp) % self.T
        head = kv * self.grp + r % self.grp
        return bi, tok, head


def _attention(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (ra, rb), (s0, s1), _ = r
    g = _AttnGeom(plan, op)
    q_name, k_name, v_name = op.inputs[0], op.inputs[1], op.inputs[2]
    pos_name = op.inputs[5]
    # values are keys (latent attention): the row is stored once, in the key half, and read
    # back as the value (plow.graph.mla.values_are_keys)
    shared = values_are_keys(op.inputs)
    if plan.kv.halves == 1 and not shared:
        raise ValueError(f"op {op.name!r}: the pool has no value half, the op reads values")
    layer = int(op.layer) if op.layer is not None else 0
    layer = int(op.attrs.get("cache_layer", layer))  # tensor parallel: the device's pool layer
    scale = F32(op.attrs["scale"])
    window = op.attrs.get("window")
    softcap = op.attrs.get("softcap")
    bs = plan.kv.block_size
    mb = plan.layout.slot(PAGE_TABLE).shape[1]
    n_rows = rb - ra
    o_out = np.zeros((n_rows, g.D), dtype=F32)
    m_out = np.full(n_rows, -np.inf, dtype=F32)
    l_out = np.zeros(n_rows, dtype=F32)
    qshape = (g.B, g.T, g.H, g.D)
    kshape = (g.B, g.T, g.KVH, g.D)
    # (batch row, kv head) blocks the tile's rows touch
    first, last = ra // g.block, (rb - 1) // g.block
    for blk in range(first, last + 1):
        bi, kv = divmod(blk, g.KVH)
        lo_r = max(ra, blk * g.block) - blk * g.block  # rows of the block inside the tile
        hi_r = min(rb, (blk + 1) * g.block) - blk * g.block
        pos = acc.get(pos_name, (g.B, g.T), np.s_[bi, :])
        valid = pos >= 0
        if not valid.any():
            continue
        p_min, p_max = int(pos[valid].min()), int(pos[valid].max())
        key_lo = max(0, p_min - int(window) + 1) if window else 0
        # a split's step k of S scores the k-th S-th of the live run (tiles.h: the steps
        # share the work at any length); the cache write below keeps the static key ranges
        n_live = min(p_max - key_lo + 1, op.extents[1])
        if step is None:
            j0, j1 = s0, min(s1, n_live)
        else:
            steps = op.steps[1]
            j0, j1 = step * n_live // steps, (step + 1) * n_live // steps
        t0, t1 = lo_r // g.grp, (hi_r - 1) // g.grp + 1  # tokens of the block inside the tile
        new_tok = np.flatnonzero(valid)
        new_pos = pos[new_tok].astype(np.int64)
        # cache write: tokens whose first query head of this kv head is in the tile and whose
        # key index falls in the tile's key range
        own = (new_tok * g.grp >= lo_r) & (new_tok * g.grp < hi_r)
        own &= (new_pos - key_lo >= s0) & (new_pos - key_lo < s1)
        if own.any():
            wt, wp = new_tok[own], new_pos[own]
            table = acc.get(PAGE_TABLE, (g.B, mb), np.s_[bi, wp // bs])
            for kind, src in ((0, k_name), (1, v_name))[: 1 if shared else 2]:
                vals = acc.get(src, kshape, np.s_[bi, wt, kv, :])
                _kv_store(plan.kv, acc, (layer, kind, table, kv, wp % bs, slice(0, g.D)), vals)
        if j1 <= j0:
            continue
        kpos = np.arange(key_lo + j0, key_lo + j1, dtype=np.int64)
        old = kpos < p_min
        keys = np.empty((kpos.shape[0], g.D), dtype=F32)
        vals_ = np.empty((kpos.shape[0], g.D), dtype=F32)
        if old.any():
            op_ = kpos[old]
            table = acc.get(PAGE_TABLE, (g.B, mb), np.s_[bi, op_ // bs])
            keys[old] = _kv_load(plan.kv, acc, (layer, 0, table, kv, op_ % bs, slice(0, g.D)))
            vals_[old] = (
                keys[old]
                if shared
                else _kv_load(plan.kv, acc, (layer, 1, table, kv, op_ % bs, slice(0, g.D)))
            )
        if (~old).any():
            tok_of = np.full(p_max - p_min + 1, -1, dtype=np.int64)
            tok_of[new_pos - p_min] = new_tok
            nt = tok_of[kpos[~old] - p_min]
            keys[~old] = acc.get(k_name, kshape, np.s_[bi, nt, kv, :])
            vals_[~old] = acc.get(v_name, kshape, np.s_[bi, nt, kv, :])
        heads = slice(kv * g.grp, (kv + 1) * g.grp)
        qv = acc.get(q_name, qshape, np.s_[bi, t0:t1, heads, :])  # [nt, grp, D]
        s = np.einsum("tgd,ld->tgl", qv, keys, dtype=F32) * scale
        if softcap:
            s = np.tanh(s / F32(softcap)) * F32(softcap)
        qpos = pos[t0:t1].astype(np.int64)
        allowed = (kpos[None, :] <= qpos[:, None]) & (qpos[:, None] >= 0)
        if window:
            allowed &= (qpos[:, None] - kpos[None, :]) < int(window)
        s = np.where(allowed[:, None, :], s, -np.inf).astype(F32)
        m = s.max(axis=-1)  # [nt, grp]
        m_safe = np.where(np.isfinite(m), m, F32(0.0))
        p = np.exp(s - m_safe[..., None]).astype(F32)
        lsum = p.sum(axis=-1, dtype=F32)
        o = np.einsum("tgl,ld->tgd", p, vals_, dtype=F32)
        sel = slice(lo_r - t0 * g.grp, hi_r - t0 * g.grp)
        dst = slice(blk * g.block + lo_r - ra, blk * g.block + hi_r - ra)
        o_out[dst] = o.reshape(-1, g.D)[sel]
        m_out[dst] = m.reshape(-1)[sel]
        l_out[dst] = lsum.reshape(-1)[sel]
    if step is not None:
        steps = op.steps[1]
        pn = partial_name(op.name)
        acc.put(pn, (steps, g.rows, g.D), np.s_[step, ra:rb, :], o_out)
        acc.put(pn + ".ml", (steps, g.rows, 2), np.s_[step, ra:rb, :], np.stack([m_out, l_out], 1))
        return
    _attn_write(plan, op, g, ra, rb, o_out, l_out, acc)


def _attn_write(
    plan: Plan,
    op: OpEntry,
    g: _AttnGeom,
    ra: int,
    rb: int,
    o: np.ndarray,
    lsum: np.ndarray,
    acc: Access,
    cols: tuple[int, int] | None = None,
) -> None:
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(lsum[:, None] > 0, o / lsum[:, None], F32(0.0)).astype(F32)
    bi, tok, head = _AttnGeom.row_coords(g, ra, rb)
    if cols is None:
        acc.put(op.outputs[0], (g.B, g.T, g.H, g.D), (bi, tok, head, slice(None)), out)
        return
    c = head[:, None] * g.D + np.arange(g.D)[None, :]  # output column of each element
    ri, di = np.nonzero((c >= cols[0]) & (c < cols[1]))
    acc.put(op.outputs[0], (g.B, g.T, g.H, g.D), (bi[ri], tok[ri], head[ri], di), out[ri, di])


def _attention_merge(
    plan: Plan, op: OpEntry, r: Ranges, cols: tuple[int, int], acc: Access
) -> None:
    (ra, rb), _, _ = r
    g = _AttnGeom(plan, op)
    # only rows whose head has columns in `cols`, and only those columns of the partials
    _, _, head = g.row_coords(ra, rb)
    live = np.flatnonzero((head * g.D < cols[1]) & ((head + 1) * g.D > cols[0]))
    if live.size == 0:
        return
    ra, rb = ra + int(live[0]), ra + int(live[-1]) + 1
    _, _, head = g.row_coords(ra, rb)
    d0 = max(0, cols[0] - int(head.max()) * g.D) if head.min() == head.max() else 0
    d1 = min(g.D, cols[1] - int(head.min()) * g.D) if head.min() == head.max() else g.D
    steps = op.steps[1]
    pn = partial_name(op.name)
    o = np.zeros((steps, rb - ra, g.D), dtype=F32)
    o[:, :, d0:d1] = acc.get(pn, (steps, g.rows, g.D), np.s_[:, ra:rb, d0:d1])
    ml = acc.get(pn + ".ml", (steps, g.rows, 2), np.s_[:, ra:rb, :])
    big = ml[:, :, 0].max(axis=0)
    big_safe = np.where(np.isfinite(big), big, F32(0.0))
    acc_o = np.zeros((rb - ra, g.D), dtype=F32)
    acc_l = np.zeros(rb - ra, dtype=F32)
    for k in range(steps):  # ascending: the result never depends on arrival order
        w = np.exp(ml[k, :, 0] - big_safe).astype(F32)
        acc_o = acc_o + o[k] * w[:, None]
        acc_l = acc_l + ml[k, :, 1] * w
    _attn_write(plan, op, g, ra, rb, acc_o, acc_l, acc, cols)


# -- sample ----------------------------------------------------------------------------------


def _sample(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (a, b), (c0, c1) = r
    if plan.fused is not None and plan.fused.sample == op.name:
        if step is None:  # unsplit: this task is the merge of the lm_head chunks
            _fused_pick(plan, op, a, b, acc)
        else:  # the lm_head tasks already reduced these columns: nothing to scan
            acc.count("sample.skipped", 1)
        return
    logits, index = op.inputs
    B, T, V = _shape(plan, logits)
    idx = acc.get(index, (B,), np.s_[a:b]).astype(np.int64)
    rows = acc.get(logits, (B, T, V), (np.arange(a, b), idx, slice(c0, c1)))
    acc.count("sample.scan", rows.size)
    arg = rows.argmax(axis=-1)
    if step is not None:
        pn = partial_name(op.name)
        steps = op.steps[1]
        acc.put(pn, (steps, B), np.s_[step, a:b], rows[np.arange(b - a), arg].astype(F32))
        acc.put(pn + ".index", (steps, B), np.s_[step, a:b], (arg + c0).astype(np.int32))
        return
    acc.put(op.outputs[0], (B,), np.s_[a:b], (arg + c0).astype(np.int32))


def _fused_pick(plan: Plan, op: OpEntry, a: int, b: int, acc: Access) -> None:
    """Fused greedy: rows [a, b) take the first maximum over the lm_head chunks of their
    sampled position, chunks in ascending order."""
    f = plan.fused
    assert f is not None
    logits, index = op.inputs
    B, T, _V = _shape(plan, logits)
    M = B * T
    m = np.arange(a, b) * T + acc.get(index, (B,), np.s_[a:b]).astype(np.int64)
    val = acc.get(f.values, (f.chunks, M), np.s_[:, m])
    ind = acc.get(f.index, (f.chunks, M), np.s_[:, m])
    best_v, best_i = val[0].copy(), ind[0].copy()
    for k in range(1, f.chunks):  # strict >: ties keep the earlier (lower-index) chunk
        better = val[k] > best_v
        best_v = np.where(better, val[k], best_v)
        best_i = np.where(better, ind[k], best_i)
    acc.put(op.outputs[0], (B,), np.s_[a:b], best_i.astype(np.int32))
    acc.count("sample.fused_merge", f.chunks * (b - a))


def _sample_merge(plan: Plan, op: OpEntry, r: Ranges, cols: tuple[int, int], acc: Access) -> None:
    (a, b), _ = r
    if plan.fused is not None and plan.fused.sample == op.name:
        _fused_pick(plan, op, a, b, acc)
        return
    B = _shape(plan, op.inputs[0])[0]
    steps = op.steps[1]
    pn = partial_name(op.name)
    val = acc.get(pn, (steps, B), np.s_[:, a:b])
    ind = acc.get(pn + ".index", (steps, B), np.s_[:, a:b])
    best_v, best_i = val[0].copy(), ind[0].copy()
    for k in range(1, steps):  # strict >: ties keep the earlier (lower-index) slice
        better = val[k] > best_v
        best_v = np.where(better, val[k], best_v)
        best_i = np.where(better, ind[k], best_i)
    acc.put(op.outputs[0], (B,), np.s_[a:b], best_i.astype(np.int32))


# -- routed experts -----------------------------------------------------------------------------


def _router(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (a, b), (c0, c1) = r
    v = _view2(_shape(plan, op.inputs[0]))
    x = acc.get(op.inputs[0], v, np.s_[a:b, :])  # top-k reads every expert of the row
    scale = acc.weight(op.inputs[1]) if len(op.inputs) > 1 else None  # Gemma 4's per-expert
    acc.put(op.outputs[0], v, np.s_[a:b, c0:c1], K.router(x, op.attrs, scale)[:, c0:c1])


def _routed_rows(plan: Plan, op: OpEntry, m0: int, m1: int, e: int, acc: Access) -> np.ndarray:
    """The router weights of rows [m0, m1) for expert `e` (0: the row did not choose it)."""
    route = op.inputs[1]
    wts = acc.get(route, _view2(_shape(plan, route)), np.s_[m0:m1, e])
    return wts


def _expert(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    """One tile of `expert_linear` for one expert: the rows whose router weight for that
    expert is non-zero are computed; the others (all of them when no row chose the
    expert: the tile does no arithmetic) get zeros, so every word of the box is written."""
    (m0, m1), (n0, n1), (k0, k1) = r
    M, N, Kd = op.extents
    n_exp, wn, k_in = _shape(plan, op.inputs[2])
    gate_up = op.attrs["mode"] == "gate_up"
    e = n0 // (wn // 2) if gate_up else k0 // k_in
    wts = _routed_rows(plan, op, m0, m1, e, acc)
    rows = np.flatnonzero(wts != 0)
    y = np.zeros((m1 - m0, n1 - n0), dtype=F32)
    if rows.size:
        x = acc.get(op.inputs[0], (M, Kd), (m0 + rows, slice(k0, k1)))
        w = acc.weight(op.inputs[2])[e]
        if gate_up:
            half = wn // 2
            a0, a1 = n0 - e * half, n1 - e * half
            g = np.matmul(x, w[a0:a1, k0:k1].T).astype(F32)
            u = np.matmul(x, w[half + a0 : half + a1, k0:k1].T).astype(F32)
            y[rows] = K.gated_mlp(g, u, op.attrs)
        else:
            part = np.matmul(x, w[n0:n1, k0 - e * k_in : k1 - e * k_in].T).astype(F32)
            y[rows] = (part * wts[rows, None]).astype(F32)
        acc.count("experts.rows", int(rows.size))
    else:
        acc.count("experts.idle_tiles", 1)
    if step is not None:
        acc.put(partial_name(op.name), (op.steps[2], M, N), np.s_[step, m0:m1, n0:n1], y)
        return
    acc.put(op.outputs[0], (M, N), np.s_[m0:m1, n0:n1], y)


def _expert_merge(plan: Plan, op: OpEntry, r: Ranges, cols: tuple[int, int], acc: Access) -> None:
    """The down projection's sum over experts: partials in ascending expert order."""
    y, m0, m1, n0, n1 = _summed_partials(op, r, cols, acc)
    M, N, _k = op.extents
    acc.put(op.outputs[0], (M, N), np.s_[m0:m1, n0:n1], y.astype(F32))


# -- Mamba-2 ------------------------------------------------------------------------------------
#
# A tile holds whole batch rows (every token: the recurrence runs through them in order) and
# a range of conv channels / heads / norm groups. The state tensors live in the arena's state
# region [slots, ...]; row b uses slot `STATE_SLOT[b]`, read and rewritten by the one tile
# covering its channels / heads (a row whose first position is 0 starts from zeros).


def _state_rows(plan: Plan, b0: int, b1: int, acc: Access) -> list[tuple[int, int]]:
    """(batch row, state slot) of rows [b0, b1)."""
    slots = acc.get(STATE_SLOT, (plan.batch,), np.s_[b0:b1])
    return [(b, int(s)) for b, s in zip(range(b0, b1), slots, strict=True)]


def _ssm_conv(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (b0, b1), (c0, c1) = r
    C, taps, off = int(op.attrs["channels"]), int(op.attrs["kernel"]), int(op.attrs["offset"])
    c1 = min(c1, C)
    proj, w_name, st_name, pos_name = op.inputs[0], op.inputs[1], op.inputs[-2], op.inputs[-1]
    B, T, P = _shape(plan, proj)
    slots = -1  # the state region's slot count (the arena's `StateShape`)
    w = acc.weight(w_name)[c0:c1]
    bias = acc.weight(op.inputs[2])[c0:c1] if len(op.inputs) == 5 else None
    out = np.zeros((b1 - b0, T, c1 - c0), dtype=F32)
    for b, slot in _state_rows(plan, b0, b1, acc):
        valid, fresh = K._row_tokens(acc.get(pos_name, (B, T), np.s_[b, :]))
        if valid.size == 0:
            continue
        x = acc.get(proj, (B, T, P), (b, valid, slice(off + c0, off + c1)))
        st = acc.get(st_name, (slots, C, taps - 1), np.s_[slot, c0:c1, :])
        y, new = K.ssm_conv_row(x, w, bias, st, fresh)
        out[b - b0, valid] = y
        acc.put(st_name, (slots, C, taps - 1), np.s_[slot, c0:c1, :], new)
    acc.put(op.outputs[0], (B, T, C), np.s_[b0:b1, :, c0:c1], out)


def _ssm_scan(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (b0, b1), (h0, h1) = r
    H, Pd, N = (int(op.attrs[a]) for a in ("heads", "head_dim", "state_size"))
    h1 = min(h1, H)
    xbc, proj, dtb, alog, dsk, st_name, pos_name = op.inputs
    B, T, C = _shape(plan, xbc)
    Pw = _shape(plan, proj)[2]
    dt0 = int(op.attrs["dt_offset"])
    slots = -1  # the state region's slot count (the arena's `StateShape`)
    sshape = (slots, H, Pd, N)
    attrs = {**op.attrs, "head0": h0}
    out = np.zeros((b1 - b0, T, (h1 - h0) * Pd), dtype=F32)
    for b, slot in _state_rows(plan, b0, b1, acc):
        valid, fresh = K._row_tokens(acc.get(pos_name, (B, T), np.s_[b, :]))
        if valid.size == 0:
            continue
        x = acc.get(xbc, (B, T, C), (b, valid, slice(None)))
        dt = acc.get(proj, (B, T, Pw), (b, valid, slice(dt0 + h0, dt0 + h1)))
        st = acc.get(st_name, sshape, np.s_[slot, h0:h1])
        y, new = K.ssm_scan_row(
            x,
            dt,
            acc.weight(dtb)[h0:h1],
            acc.weight(alog)[h0:h1],
            acc.weight(dsk)[h0:h1],
            st,
            fresh,
            attrs,
        )
        out[b - b0, valid] = y
        acc.put(st_name, sshape, np.s_[slot, h0:h1], new)
    acc.put(op.outputs[0], (B, T, H * Pd), np.s_[b0:b1, :, h0 * Pd : h1 * Pd], out)


def _kda(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    """Kimi-Linear's kda tile: batch rows x heads, its heads' state by the rows' slots."""
    (b0, b1), (h0, h1) = r
    H, D = int(op.attrs["heads"]), int(op.attrs["head_dim"])
    h1 = min(h1, H)
    x_name, f_name, b_name, g_name, dtb, alog, nw, st_name, pos_name = op.inputs
    B, T, X = _shape(plan, x_name)
    C, lo, hi = H * D, h0 * D, h1 * D
    sshape = (-1, H, D, D)  # the state region's slots (the arena's `StateShape`)
    attrs = {**op.attrs, "head0": h0}
    out = np.zeros((b1 - b0, T, hi - lo), dtype=F32)
    for b, slot in _state_rows(plan, b0, b1, acc):
        valid, fresh = K._row_tokens(acc.get(pos_name, (B, T), np.s_[b, :]))
        if valid.size == 0:
            continue
        xs = np.zeros((valid.size, X), dtype=F32)  # only its heads' q, k, v columns read
        for j in range(3):
            cs = slice(j * C + lo, j * C + hi)
            xs[:, cs] = acc.get(x_name, (B, T, X), (b, valid, cs))
        y, new = K.kda_row(
            xs,
            acc.get(f_name, (B, T, C), (b, valid, slice(lo, hi))),
            acc.get(b_name, (B, T, H), (b, valid, slice(h0, h1))),
            acc.get(g_name, (B, T, C), (b, valid, slice(lo, hi))),
            acc.weight(dtb)[lo:hi],
            acc.weight(alog).reshape(-1)[h0:h1],
            acc.weight(nw),
            acc.get(st_name, sshape, np.s_[slot, h0:h1]),
            fresh,
            attrs,
        )
        out[b - b0, valid] = y
        acc.put(st_name, sshape, np.s_[slot, h0:h1], new)
    acc.put(op.outputs[0], (B, T, C), np.s_[b0:b1, :, lo:hi], out)


def _ssm_norm(plan: Plan, op: OpEntry, r: Ranges, acc: Access, step: int | None) -> None:
    (a, b), (g0, g1) = r
    gs = int(op.attrs["group"])
    M, inner = _view2(_shape(plan, op.inputs[0]))
    Pw = _shape(plan, op.inputs[1])[-1]
    c0, c1 = g0 * gs, min(inner, g1 * gs)
    y = acc.get(op.inputs[0], (M, inner), np.s_[a:b, c0:c1])
    z = acc.get(op.inputs[1], (M, Pw), np.s_[a:b, c0:c1])
    w = acc.weight(op.inputs[2])[c0:c1]
    acc.put(op.outputs[0], (M, inner), np.s_[a:b, c0:c1], K.ssm_norm(y, z, w, op.attrs))


TileFn = Callable[[Plan, OpEntry, Ranges, Access, "int | None"], None]
MergeFn = Callable[[Plan, OpEntry, Ranges, tuple[int, int], Access], None]

TILE: dict[str, TileFn] = {
    "embedding": _embedding,
    "rmsnorm": _rmsnorm,
    "rope": _rope,
    "linear": _linear,
    "lm_head": _linear,
    "linear_glu": _linear_glu,
    "linear_qkv": _linear_qkv,
    "attention": _attention,
    "gated_mlp": _elementwise,
    "residual_add": _elementwise,
    "allreduce": _allreduce,
    "add_rmsnorm": _add_rmsnorm,
    "sample": _sample,
    "router": _router,
    "expert_linear": _expert,
    "ssm_conv": _ssm_conv,
    "ssm_scan": _ssm_scan,
    "ssm_norm": _ssm_norm,
    "kda": _kda,
}
MERGE: dict[str, MergeFn] = {
    "rmsnorm": _rmsnorm_merge,
    "add_rmsnorm": _add_rmsnorm_merge,
    "linear_glu": _linear_glu_merge,
    "linear_qkv": _linear_qkv_merge,
    "linear": _linear_merge,
    "lm_head": _linear_merge,
    "attention": _attention_merge,
    "sample": _sample_merge,
    "expert_linear": _expert_merge,
}


def run_packet(plan: Plan, packet: Packet, acc: Access) -> None:
    """Compute one packet's units (see the module docstring)."""
    op = plan.ops[packet.op]
    if packet.work == "load":
        return
    if packet.work == "merge":
        merge = MERGE[op.kind]
        for u, c in zip(packet.units, packet.cols, strict=True):
            merge(plan, op, u, c, acc)
        return
    tile = TILE[op.kind]
    if packet.work == "partial":
        for u, s in zip(packet.units, packet.steps, strict=True):
            tile(plan, op, u, acc, s)
    else:
        for u in packet.units:
            tile(plan, op, u, acc, None)
