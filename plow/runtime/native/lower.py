"""A bundle rung as the native kernel's `PlowPlan`: the plan file's records as they are, and
the op table as flat descriptors (arena word offsets, weight pointers, tile geometry).

Nothing is rewritten: the kernel reads opcode, flags, worker, counters, thresholds, op index
and unit range from the 64-byte records itself. What the loader adds is what the records point
into — every tensor's arena word (the executor's `Layout`, built from the bundle's offsets by
`plow.runtime.cpu.bundle`), the weights in their stored dtype, a rope's inverse frequencies,
and each split op's merge units in the numbering the records use (taken from the decoded
plan's merge packets, so the two executors cannot disagree on it).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from plow.bundle.files import OpTable
from plow.bundle.wire import read_plan
from plow.checkpoint.quant import FORMATS, QuantTensor
from plow.errors import PlowError
from plow.graph.mla import values_are_keys
from plow.runtime.cpu.arena import Arena
from plow.runtime.cpu.kernels import _view2
from plow.runtime.cpu.plan import PAGE_TABLE, STATE_SLOT, OpEntry, Plan
from plow.runtime.native.library import (
    ABI_VERSION,
    DTYPE_BF16,
    DTYPE_F32,
    DTYPE_NONE,
    KINDS,
    PlowOp,
    PlowPlan,
)
from plow.runtime.numpy_ops import rope_inv_freq
from plow.schedule.regions import partial_name

# Routed experts' kinds (kernels/moe.h `PlowMoeKind`), beside library.KINDS.
MOE_KINDS = {"router": 10, "expert_linear": 11}
# Mamba-2's kinds (kernels/ssm.h `PlowSsmKind`).
SSM_KINDS = {"ssm_conv": 20, "ssm_scan": 21, "ssm_norm": 22}
# Kimi-Linear's kind (kernels/kda.h `PlowKdaKind`).
KDA_KINDS = {"kda": 60}
# DeepSeek-V3's router (kernels/deepseek.h `PlowDeepseekKind`): op kind `router`, scoring sigmoid
GROUPED_ROUTER_KIND = 40
# Fused kinds of plow/egraph (kernels/fused.h `PlowFusedKind`).
FUSED_KINDS = {"add_rmsnorm": 30, "linear_glu": 31, "linear_qkv": 32}
# R19 (kernels/fused_lm.h): an lm_head with its prologue norm's weight as a third input
RMSNORM_LM_HEAD_KIND = 33
# R18 (kernels/fused_lm.h): an embedding with the first norm's weight, writing rows and norm
EMBEDDING_RMSNORM_KIND = 34
# Tensor parallel (kernels/collective.h `PlowCollectiveKind`).
COLLECTIVE_KINDS = {"allreduce": 50}
# Every kind number the kernels know, to name one in an error.
KIND_NAMES = {
    v: k
    for table in (KINDS, MOE_KINDS, SSM_KINDS, KDA_KINDS, FUSED_KINDS, COLLECTIVE_KINDS)
    for k, v in table.items()
} | {GROUPED_ROUTER_KIND: "router (grouped)"}


@dataclass
class Lowered:
    """A `PlowPlan` and every buffer it points into (kept alive with it)."""

    plan: PlowPlan
    keep: list[Any] = field(default_factory=list)
    records: int = 0


def weight_dtype(a: np.ndarray | QuantTensor) -> int:
    if isinstance(a, QuantTensor):
        return FORMATS[a.format].code
    if a.dtype == np.float32:
        return DTYPE_F32
    if a.dtype == ml_dtypes.bfloat16:
        return DTYPE_BF16
    return DTYPE_NONE


def stored(a: np.ndarray | QuantTensor) -> np.ndarray | QuantTensor:
    """A weight as the kernel reads it: fp32, bf16 and GGML blocks as stored (memory-mapped, no
    copy); other dtypes (fp16, fp8) widened to fp32 once."""
    if isinstance(a, QuantTensor):
        return QuantTensor(a.format, a.shape, np.ascontiguousarray(a.blocks))
    if weight_dtype(a) == DTYPE_NONE:
        return np.ascontiguousarray(np.asarray(a, dtype=np.float32))
    return np.ascontiguousarray(a)


def weight_pointer(a: np.ndarray | QuantTensor) -> int:
    return int((a.blocks if isinstance(a, QuantTensor) else a).ctypes.data)


def lower(
    plan: Plan, arena: Arena, weights: Mapping[str, np.ndarray], bundle: Path, rung: Any
) -> Lowered:
    """The `PlowPlan` of `plan` (a plan loaded from `bundle`'s rung `rung`)."""
    if arena.kv_shape.dtype not in ("float32", "bfloat16"):
        raise PlowError(
            "--kv-dtype",
            f"the native executor keeps the key-value cache in float32 or "
            f"bfloat16, not {arena.kv_shape.dtype} (fp8_e4m3 runs on --executor cpu)",
        )
    low = Lowered(PlowPlan())
    _, records = read_plan(bundle / rung.plan)
    records = np.ascontiguousarray(records)
    low.keep.append(records)
    low.records = len(records)
    ot = OpTable.model_validate_json((bundle / rung.ops).read_bytes())
    opcode = {o.name: int(o.opcode) for o in ot.ops}
    base = arena.kv_words

    state = arena.state_shape.offsets()  # Mamba-2's recurrent state: after the kv pool

    def word(name: str) -> int:
        if name in state:
            return arena.kv_shape.words + state[name][0]
        return base + plan.layout.slot(name).offset

    merges = _merge_tables(plan, records)
    ops = (PlowOp * max(1, len(plan.ops)))()
    for i, op in enumerate(plan.ops):
        _lower_op(ops[i], op, plan, weights, word, merges.get(i), low)
        ops[i].opcode = opcode[op.name]
    low.keep.append(ops)
    p = low.plan
    p.abi = ABI_VERSION
    p.n_workers = len(plan.stream.queues)
    p.n_records = len(records)
    p.records = records.ctypes.data
    p.n_ops = len(plan.ops)
    p.ops = ctypes.addressof(ops)
    p.n_counters = len(plan.stream.counter_names)
    kv = arena.kv_shape
    p.kv_off, p.kv_layers, p.kv_blocks = 0, kv.layers, kv.blocks
    p.kv_heads, p.kv_block, p.kv_dim = kv.kv_heads, kv.block_size, kv.head_dim
    p.kv_dtype = DTYPE_BF16 if kv.dtype == "bfloat16" else DTYPE_F32
    p.kv_halves = kv.halves  # 1: tile_attention reads every op's values from its key rows
    for op in plan.ops:
        if kv.halves == 1 and op.kind == "attention" and not values_are_keys(op.inputs):
            raise PlowError(op.name, "the key-value pool has no value half, the op reads values")
    p.page_table = word(PAGE_TABLE)
    p.page_cols = plan.layout.slot(PAGE_TABLE).shape[1]
    p.fused_lm = p.fused_sample = -1
    if plan.fused is not None:
        names = [o.name for o in plan.ops]
        p.fused_lm = names.index(plan.fused.lm_head)
        p.fused_sample = names.index(plan.fused.sample)
        bounds = np.asarray(plan.fused.bounds, dtype=np.int64)
        low.keep.append(bounds)
        p.n_chunks = plan.fused.chunks
        p.bounds = bounds.ctypes.data
        p.fused_values = word(plan.fused.values)
        p.fused_index = word(plan.fused.index)
    return low


def _lower_kda(
    o: PlowOp,
    op: OpEntry,
    plan: Plan,
    weights: Mapping[str, np.ndarray],
    word: Any,
    low: Lowered,
) -> None:
    """kernels/kda.h's `tile_kda` (its t / d / f / table layout)."""
    x, f, beta, gate, dtb, alog, nw, state, pos = op.inputs
    for j, name in enumerate((x, f, beta, gate, state, pos, STATE_SLOT, op.outputs[0])):
        o.t[j] = word(name)
    b, t, _ = plan.graph.tensor(x).shape
    h, d = int(op.attrs["heads"]), int(op.attrs["head_dim"])
    if d > 256:
        raise PlowError(op.name, f"kda head_dim {d} exceeds the native kernel's 256")
    o.d[0], o.d[1], o.d[2], o.d[3] = b, t, h, d
    o.f[0] = float(op.attrs["eps"])
    params = [np.asarray(weights[n], dtype=np.float32).reshape(-1) for n in (dtb, alog, nw)]
    table = np.ascontiguousarray(np.concatenate(params), dtype=np.float32)
    low.keep.append(table)
    o.table = table.ctypes.data


def _lower_ssm(
    o: PlowOp,
    op: OpEntry,
    plan: Plan,
    weights: Mapping[str, np.ndarray],
    weight: Any,
    word: Any,
    low: Lowered,
) -> None:
    shape = plan.graph.tensor
    k = op.kind
    if k == "ssm_norm":
        y, proj = shape(op.inputs[0]).shape, shape(op.inputs[1]).shape
        o.t[0], o.t[1], o.t[2] = word(op.inputs[0]), word(op.inputs[1]), word(op.outputs[0])
        o.d[0], o.d[1], o.d[2] = y[-1], proj[-1], int(op.attrs["group"])
        o.f[0] = float(op.attrs["eps"])
        o.w0, o.w0_dtype = weight(op.inputs[2])
        return
    state, pos = op.inputs[-2], op.inputs[-1]
    o.t[2], o.t[3], o.t[4] = word(state), word(pos), word(STATE_SLOT)
    if k == "ssm_conv":
        b, t, p = shape(op.inputs[0]).shape
        o.t[0], o.t[1] = word(op.inputs[0]), word(op.outputs[0])
        o.d[0], o.d[1], o.d[2] = b, t, p
        o.d[3], o.d[4], o.d[5] = (int(op.attrs[a]) for a in ("channels", "kernel", "offset"))
        if o.d[4] > 64:
            raise PlowError(op.name, f"conv kernel {o.d[4]} exceeds the native kernel's 64 taps")
        o.w0, o.w0_dtype = weight(op.inputs[1])
        if len(op.inputs) == 5:
            o.w1, o.w1_dtype = weight(op.inputs[2])
        return
    xbc, proj = shape(op.inputs[0]).shape, shape(op.inputs[1]).shape
    o.t[0], o.t[1], o.t[5] = word(op.inputs[0]), word(op.inputs[1]), word(op.outputs[0])
    o.d[0], o.d[1], o.d[2], o.d[3] = xbc[0], xbc[1], xbc[2], proj[2]
    o.d[4], o.d[5], o.d[6], o.d[7] = (
        int(op.attrs[a]) for a in ("heads", "head_dim", "state_size", "groups")
    )
    if int(op.attrs["dt_offset"]) != o.d[4] * o.d[5] + o.d[2]:
        raise PlowError(op.name, "dt columns are not in_proj's last heads columns")
    hi = op.attrs.get("dt_max")
    o.f[0], o.f[1] = float(op.attrs["dt_min"]), float("inf") if hi is None else float(hi)
    params = [np.asarray(weights[n], dtype=np.float32) for n in op.inputs[2:5]]
    table = np.ascontiguousarray(np.concatenate(params), dtype=np.float32)
    low.keep.append(table)
    o.table = table.ctypes.data


def _merge_tables(plan: Plan, records: np.ndarray) -> dict[int, np.ndarray]:
    """Per split op, its merge units [n, 8] (3 ranges + output columns) in the records'
    numbering: a merge packet's units are units `row_start ..` of its op."""
    st = plan.stream
    row_start = records["row_start"]
    out: dict[int, dict[int, tuple[int, ...]]] = {}
    for pk in plan.packets:
        if pk.work != "merge":
            continue
        rec = st.packet[st.main[pk.task]]
        start = int(row_start[rec])
        table = out.setdefault(pk.op, {})
        for k, (u, c) in enumerate(zip(pk.units, pk.cols, strict=True)):
            rs = [x for ax in u for x in ax] + [0, 1] * (3 - len(u))
            table[start + k] = (*rs, c[0], c[1])
    res: dict[int, np.ndarray] = {}
    for oi, table in out.items():
        arr = np.zeros((max(table) + 1, 8), dtype=np.int64)
        for j, row in table.items():
            arr[j] = row
        res[oi] = arr
    return res


def _lower_op(
    o: PlowOp,
    op: OpEntry,
    plan: Plan,
    weights: Mapping[str, np.ndarray],
    word: Any,
    merge: np.ndarray | None,
    low: Lowered,
) -> None:
    kind = KINDS.get(
        op.kind,
        MOE_KINDS.get(
            op.kind,
            SSM_KINDS.get(op.kind, FUSED_KINDS.get(op.kind, COLLECTIVE_KINDS.get(op.kind))),
        ),
    )
    kind = KDA_KINDS.get(op.kind) if kind is None else kind
    if op.kind == "lm_head" and len(op.inputs) == 3:
        kind = RMSNORM_LM_HEAD_KIND
    if op.kind == "embedding" and len(op.inputs) == 3:
        kind = EMBEDDING_RMSNORM_KIND
    if kind is None:
        raise PlowError(op.name, f"op kind {op.kind!r} is not supported by the native executor")
    o.kind = kind
    o.red_axis = -1 if op.reduction_axis is None else op.reduction_axis
    o.naxes = len(op.extents)
    for a, (e, t, s) in enumerate(zip(op.extents, op.tiles, op.steps, strict=True)):
        o.ext[a], o.tile[a], o.steps[a] = e, t, s
    for j in range(8):
        o.t[j] = -1
    shape = plan.graph.tensor
    pn = partial_name(op.name)
    part = word(pn) if op.reduction_axis is not None else -1

    def weight(name: str) -> tuple[int, int]:
        a = stored(weights[name])
        low.keep.append(a)
        return weight_pointer(a), weight_dtype(a)

    if merge is not None:
        low.keep.append(merge)
        o.merge, o.n_merge = merge.ctypes.data, merge.shape[0]
    k = op.kind
    if k == "embedding":
        o.t[0], o.t[1] = word(op.inputs[0]), word(op.outputs[0])
        o.d[0] = _view2(shape(op.outputs[0]).shape)[1]
        o.f[0] = float(op.attrs["scale"])
        o.w0, o.w0_dtype = weight(op.inputs[1])
        if len(op.inputs) == 3:  # R18 (kernels/fused_lm.h): t2 the norm, its weight in fp32
            nw = np.ascontiguousarray(
                np.asarray(stored(weights[op.inputs[2]]), dtype=np.float32).reshape(-1)
            )
            low.keep.append(nw)
            o.table, o.t[2] = nw.ctypes.data, word(op.outputs[1])
            norm = op.attrs["norm"]
            o.f[1], o.f[2] = float(norm["eps"]), float(norm.get("offset", 0.0))
    elif k == "rmsnorm":
        xs = shape(op.inputs[0]).shape
        g = int(op.attrs.get("group", xs[-1]))
        o.t[0], o.t[1], o.t[2] = word(op.inputs[0]), word(op.outputs[0]), part
        o.d[0], o.d[1] = g, math.prod(xs) // g
        o.d[2] = _view2(shape(op.outputs[0]).shape)[1]
        o.d[3] = op.steps[1]
        o.f[0], o.f[1] = float(op.attrs["eps"]), float(op.attrs.get("offset", 0.0))
        if len(op.inputs) > 1:
            o.w0, o.w0_dtype = weight(op.inputs[1])
        else:  # no weight (Gemma 4's v_norm): w = 0, the scale is the offset alone
            zero = np.zeros(g, dtype=np.float32)
            low.keep.append(zero)
            o.w0, o.w0_dtype = weight_pointer(zero), DTYPE_F32
    elif k == "rope":
        o.t[0], o.t[1], o.t[2] = word(op.inputs[0]), word(op.inputs[1]), word(op.outputs[0])
        o.d[0] = _view2(shape(op.inputs[0]).shape)[1]
        o.d[1] = int(op.attrs["head_dim"])
        inv = np.ascontiguousarray(rope_inv_freq(op.attrs), dtype=np.float32)
        low.keep.append(inv)
        o.table = inv.ctypes.data
    elif k in ("linear", "lm_head"):
        o.t[0], o.t[1], o.t[2] = word(op.inputs[0]), word(op.outputs[0]), part
        o.d[0], o.d[1], o.d[2] = op.extents
        o.d[3] = op.steps[2]
        o.f[0] = float(op.attrs.get("softcap") or 0.0) if k == "lm_head" else 0.0
        o.w0, o.w0_dtype = weight(op.inputs[1])
        if len(op.inputs) == 3 and k == "lm_head":  # R19: the norm's weight, widened to fp32
            nw = np.ascontiguousarray(
                np.asarray(stored(weights[op.inputs[2]]), dtype=np.float32).reshape(-1)
            )
            low.keep.append(nw)
            o.table = nw.ctypes.data
            o.f[1], o.f[2] = float(op.attrs["eps"]), float(op.attrs.get("offset", 0.0))
        elif len(op.inputs) == 3:
            o.w1, o.w1_dtype = weight(op.inputs[2])
    elif k == "attention":
        q = shape(op.inputs[0]).shape
        o.t[0], o.t[1], o.t[2] = word(op.inputs[0]), word(op.inputs[1]), word(op.inputs[2])
        o.t[3], o.t[4] = word(op.inputs[5]), word(op.outputs[0])
        if op.reduction_axis is not None:
            o.t[5], o.t[6] = part, word(pn + ".ml")
        o.d[0], o.d[1] = q[0], q[1]
        o.d[2], o.d[3] = int(op.attrs["heads"]), int(op.attrs["kv_heads"])
        o.d[4] = int(op.attrs["head_dim"])
        o.d[5] = int(op.layer) if op.layer is not None else 0
        o.d[5] = int(op.attrs.get("cache_layer", o.d[5]))  # tensor parallel: the device's
        o.d[6] = int(op.attrs.get("window") or 0)
        o.d[7] = op.steps[1]
        o.f[0] = float(op.attrs["scale"])
        o.f[1] = float(op.attrs.get("softcap") or 0.0)
    elif k in ("gated_mlp", "residual_add"):
        o.t[0], o.t[1], o.t[2] = word(op.inputs[0]), word(op.inputs[1]), word(op.outputs[0])
        o.d[0] = _view2(shape(op.inputs[0]).shape)[1]
        o.d[1] = 0 if op.attrs.get("activation", "silu") == "silu" else 1
        if len(op.inputs) > 2:  # residual_add's scale [1] (Gemma 4's layer_scalar)
            o.w0, o.w0_dtype = weight(op.inputs[2])
    elif k == "allreduce":  # kernels/collective.h: every device's partial, in device order
        if len(op.inputs) > 7:
            raise PlowError(op.name, f"allreduce over {len(op.inputs)} devices exceeds 7")
        for j, part_name in enumerate(op.inputs):
            o.t[j] = word(part_name)
        o.t[7] = word(op.outputs[0])
        o.d[0], o.d[1] = _view2(shape(op.outputs[0]).shape)[1], len(op.inputs)
    elif k == "router":  # kernels/moe.h
        o.t[0], o.t[1] = word(op.inputs[0]), word(op.outputs[0])
        o.d[0] = _view2(shape(op.inputs[0]).shape)[1]
        o.d[1] = int(op.attrs["top_k"])
        o.d[2] = 1 if op.attrs.get("norm_topk_prob") else 0
        if op.attrs.get("scoring") == "sigmoid":  # DeepSeek-V3: kernels/deepseek.h
            o.kind = GROUPED_ROUTER_KIND
            o.d[3], o.d[4] = int(op.attrs["n_group"]), int(op.attrs["topk_group"])
            o.f[0] = float(op.attrs["routed_scale"])
        if "logit_scale" in op.attrs:  # Gemma 4: logits scaled, kept weights per-expert scaled
            o.d[3], o.f[0] = 1, float(op.attrs["logit_scale"])
        if len(op.inputs) > 1:
            o.w0, o.w0_dtype = weight(op.inputs[1])
    elif k == "expert_linear":  # kernels/moe.h
        n_exp, wn, k_in = shape(op.inputs[2]).shape
        gate_up = op.attrs["mode"] == "gate_up"
        o.t[0], o.t[1], o.t[2] = word(op.inputs[0]), word(op.outputs[0]), part
        o.t[3] = word(op.inputs[1])
        o.d[0], o.d[1] = op.extents[0], op.extents[1]
        o.d[2] = _view2(shape(op.inputs[0]).shape)[1]
        o.d[3], o.d[4], o.d[5] = op.steps[2], 0 if gate_up else 1, n_exp
        o.d[6] = wn // 2 if gate_up else k_in
        o.d[7] = 0 if op.attrs.get("activation", "silu") == "silu" else 1
        o.w0, o.w0_dtype = weight(op.inputs[2])
    elif k == "add_rmsnorm":  # kernels/fused.h (R1)
        o.t[0], o.t[1] = word(op.inputs[0]), word(op.inputs[1])
        o.t[2], o.t[3], o.t[4] = word(op.outputs[0]), word(op.outputs[1]), part
        xs = _view2(shape(op.inputs[0]).shape)
        o.d[0], o.d[1], o.d[2], o.d[3] = xs[1], xs[0], xs[1], op.steps[1]
        o.f[0], o.f[1] = float(op.attrs["eps"]), float(op.attrs.get("offset", 0.0))
        o.w0, o.w0_dtype = weight(op.inputs[2])
    elif k == "linear_glu":  # kernels/fused.h (R2+R3+R13): the interleaved gate/up weight
        o.t[0], o.t[1], o.t[2] = word(op.inputs[0]), word(op.outputs[0]), part
        o.d[0], o.d[1], o.d[2] = op.extents
        o.d[3] = 0 if op.attrs.get("activation", "silu") == "silu" else 1
        o.d[4] = op.steps[2]  # split k: the partial's steps (gate, up pairs)
        o.w0, o.w0_dtype = weight(op.inputs[1])
    elif k == "linear_qkv":  # kernels/fused.h (R4): cat3(Wq, Wk, Wv), three outputs
        o.t[0] = word(op.inputs[0])
        o.t[1], o.t[2], o.t[3] = (word(t) for t in op.outputs)
        o.t[4] = part  # split k: the partial [steps, M, nq + nk + nv]
        o.d[0], o.d[1], o.d[2] = op.extents
        o.d[3] = op.steps[2]
        o.d[4], o.d[5], o.d[6] = (_view2(shape(t).shape)[1] for t in op.outputs)
        o.w0, o.w0_dtype = weight(op.inputs[1])
    elif k in SSM_KINDS:  # kernels/ssm.h; the state tensors are in the arena's state region
        _lower_ssm(o, op, plan, weights, weight, word, low)
    elif k in KDA_KINDS:  # kernels/kda.h; its state in the arena's state region too
        _lower_kda(o, op, plan, weights, word, low)
    elif k == "sample":
        b, t, v = shape(op.inputs[0]).shape
        o.t[0], o.t[1], o.t[2] = word(op.inputs[0]), word(op.inputs[1]), word(op.outputs[0])
        if op.reduction_axis is not None:
            o.t[3], o.t[4] = part, word(pn + ".index")
        o.d[0], o.d[1], o.d[2] = b, t, v
        o.d[3] = op.steps[1]
