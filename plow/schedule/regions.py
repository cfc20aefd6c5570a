"""What each tile reads and writes, as boxes on 2-D views of the activation tensors.

Every tensor of shape `(d0, ..., dn)` is viewed as `rows x cols` = `(d0*...*d(n-1)) x dn`
(a 1-D tensor `(d0,)` as `d0 x 1`). A box is `(r0, r1, c0, c1)`, half-open. The rules are
conservative (docs/schedule.md "Dependencies"): a box may over-approximate what a tile
touches, never under-approximate it, so a consumer tile depends on at least every producer
tile whose output it reads.

| kind | reads (input 0 / activations) | writes |
| --- | --- | --- |
| linear, lm_head | `x[m, k]` (a split `k` reads a slice of the reduction) | `out[m, n]` |
| linear_glu (R2+R3+R13) | `x[m, k]` (split: the partial's gate and up of `n`) | `out[m, n]` |
| linear_qkv (R4) | `x[m, k]` | `n` of q, k, v side by side (`output_columns`) |
| rmsnorm | the tile's rows (groups) mapped back to tensor rows/cols | same box |
| rope | the tile's rows, columns widened to whole heads (rotation pairs) | the tile's box |
| attention | per batch row: query heads of the key-value heads its rows touch, and those |
|   | key-value heads of the new keys/values (every `s` tile: the position is dynamic) | q box |
| gated_mlp, residual_add, allreduce | the same box of every input | the box |
| add_rmsnorm (R1) | whole rows of both operands | the box of both outputs (sum, norm) |
| embedding | nothing produced by an op (ids, table) | the box |
| sample | `logits[rows of the batch rows, cols]` | `index[rows]` |
| router | the tile's rows, every expert column | the box |
| expert_linear | `x[m, k]` and the tile's expert's column of the router weights | `out[m, n]` |
| ssm_conv | every token of its batch rows, its channels of in_proj's xBC columns | the box |
| ssm_scan | its rows' tokens: every conv column (x, B, C), its heads' dt columns | its heads |
| ssm_norm | the box of y and the same columns of in_proj (the gate z) | the box |
| kda | its rows' tokens: its heads' q, k, v conv columns, f, beta and gate columns | its heads |

The ssm and kda ops' recurrent state (`TensorRole.state`) is not an activation: each tile reads and
rewrites only its own rows' and channels' / heads' state, so it orders nothing in a step.

Split reductions (the reduction axis has more than one step: linear/lm_head `k`,
attention `s`, sample and rmsnorm `cols`): tiles write fp32 partials of their output box
into the pseudo-tensor `<op>#partial`; a merge unit per distinct output box reads those
partials and writes the box of the real output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from plow.graph.ops import Op, OpGraph, TensorRole
from plow.tiles.ir import TiledOp

Box = tuple[int, int, int, int]

# Index of the reduction axis per op kind (None: no reduction across tiles).
REDUCTION_AXIS: dict[str, int] = {
    "linear": 2,
    "lm_head": 2,
    "expert_linear": 2,  # down: k runs over the experts (gate_up: one k step, never split)
    "attention": 1,
    "sample": 1,
    "rmsnorm": 1,
    "add_rmsnorm": 1,  # R1 split: tiles write sums + partials, merges write the norm
    "linear_glu": 2,  # R2+R3+R13 split: partials of gate and up, merges write act(g) * u
    "linear_qkv": 2,  # R4 split: partials of the q, k, v columns, merges route them
}


# Kinds whose tiles each stream a share of the op's weight bytes.
_WEIGHT_KINDS = ("linear", "lm_head", "expert_linear", "linear_glu", "linear_qkv")
_MATMUL = ("linear", "lm_head", "linear_glu", "linear_qkv")


def view(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D `rows x cols` view of a tensor shape."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    return (math.prod(shape[:-1]), shape[-1])


def output_columns(graph: OpGraph, op: Op) -> list[tuple[str, int, int]]:
    """(tensor, first column, width) of each output of `op` in the columns of its write box:
    R4's linear_qkv writes q, k, v side by side (its weight's rows are theirs, stacked); every
    other op writes the same box of each of its outputs."""
    if op.kind.value != "linear_qkv":
        return [(t, 0, view(graph.tensor(t).shape)[1]) for t in op.outputs]
    # (a split add_rmsnorm's tiles write the partials and the sums: `build.writes`)
    out, at = [], 0
    for t in op.outputs:
        w = view(graph.tensor(t).shape)[1]
        out.append((t, at, w))
        at += w
    return out


def partial_name(op: str) -> str:
    return f"{op}#partial"


def is_split(top: TiledOp) -> bool:
    ax = REDUCTION_AXIS.get(top.kind)
    return ax is not None and ax < len(top.axes) and top.axes[ax].steps > 1


@dataclass(frozen=True, slots=True)
class Unit:
    """One schedulable unit of work: a tile (compute) or a merge of one output block."""

    op: str
    merge: bool
    index: int  # tile index (compute) or block index (merge)
    reads: tuple[tuple[str, Box], ...]
    write: tuple[str, Box]
    est_ns: float
    partial: bool
    weight_bytes: int
    stripe: float  # column position of the output box in [0, 1): placement striping
    k_stripe: float  # column position of the reduction slice read (split linears), else stripe


BoxArray = npt.NDArray[np.int64]  # (n, 4): one box (r0, r1, c0, c1) per row


@dataclass(frozen=True, slots=True)
class UnitArrays:
    """The units of one stage of an op (`Regions.units`' compute or merge list) as columns:
    unit `i` has index `index[i]`, reads box `reads[t][i]` of each tensor `t` (every unit of
    a stage reads the same tensors), writes box `write[i]` of `write_name`."""

    n: int
    index: list[int]
    reads: dict[str, BoxArray]
    write_name: str
    write: BoxArray
    est_ns: list[float]
    partial: bool
    weight_bytes: list[int]
    stripe: list[float]
    k_stripe: list[float]

    @staticmethod
    def of(units: list[Unit]) -> UnitArrays | None:
        """Columns of a `Unit` list (None when empty)."""
        if not units:
            return None
        names = [tn for tn, _ in units[0].reads]
        if any([tn for tn, _ in u.reads] != names for u in units) or any(
            u.write[0] != units[0].write[0] or u.partial != units[0].partial for u in units
        ):
            raise ValueError(f"units of {units[0].op} read different tensors")
        reads: dict[str, BoxArray] = {}
        for j, tn in enumerate(names):
            arr = np.array([u.reads[j][1] for u in units], dtype=np.int64)
            if tn in reads:  # the same tensor read twice: the union of both boxes
                arr = _union(reads[tn], arr)
            reads[tn] = arr
        return UnitArrays(
            len(units),
            [u.index for u in units],
            reads,
            units[0].write[0],
            np.array([u.write[1] for u in units], dtype=np.int64),
            [u.est_ns for u in units],
            units[0].partial,
            [u.weight_bytes for u in units],
            [u.stripe for u in units],
            [u.k_stripe for u in units],
        )


def _union(a: BoxArray, b: BoxArray) -> BoxArray:
    return np.stack(
        [
            np.minimum(a[:, 0], b[:, 0]),
            np.maximum(a[:, 1], b[:, 1]),
            np.minimum(a[:, 2], b[:, 2]),
            np.maximum(a[:, 3], b[:, 3]),
        ],
        axis=1,
    )


def run_bboxes(arr: BoxArray, starts: list[int]) -> list[Box]:
    """The bounding box of each run `arr[starts[k]:starts[k + 1]]` (runs cover `arr`)."""
    out = np.stack(
        [
            np.minimum.reduceat(arr[:, 0], starts),
            np.maximum.reduceat(arr[:, 1], starts),
            np.minimum.reduceat(arr[:, 2], starts),
            np.maximum.reduceat(arr[:, 3], starts),
        ],
        axis=1,
    ).tolist()
    return [(r[0], r[1], r[2], r[3]) for r in out]


def tile_ranges(top: TiledOp) -> npt.NDArray[np.int64] | None:
    """`[t.ranges for t in top.tiles]` as an `(tiles, axes, 2)` array, computed from the
    axes when the tiles are the tiler's row-major enumeration (tile `i` has index `i`);
    None otherwise."""
    axes = top.axes
    steps = [a.steps for a in axes]
    n = math.prod(steps)
    tiles = top.tiles
    if not axes or n == 0 or len(tiles) != n:
        return None
    if tiles[0].index != 0 or tiles[-1].index != n - 1:
        return None
    idx = np.indices(steps, dtype=np.int64).reshape(len(steps), -1).T
    size = np.array([a.tile for a in axes], dtype=np.int64)
    ext = np.array([a.extent for a in axes], dtype=np.int64)
    start = idx * size
    r = np.stack([start, np.minimum(start + size, ext)], axis=-1)
    for k in (0, n - 1):
        if [tuple(x) for x in r[k].tolist()] != list(tiles[k].ranges):
            return None
    return r


def _rows_to_box(a: int, b: int, c0: int, c1: int, per: int, g: int, ncols: int) -> Box:
    """Op rows [a, b) of width-`g` groups (`per` groups per tensor row), group columns
    [c0, c1): the bounding box on the tensor view."""
    r0, r1 = a // per, (b - 1) // per + 1
    if r1 - r0 == 1:
        return (r0, r1, (a % per) * g + c0, ((b - 1) % per) * g + c1)
    return (r0, r1, 0, ncols)


class Regions:
    """Box rules of one graph (shapes and attributes come from the op graph)."""

    def __init__(self, graph: OpGraph) -> None:
        self.graph = graph
        self.produced = {t for op in graph.ops for t in op.outputs}
        self.ops = {op.name: op for op in graph.ops}

    def shape(self, t: str) -> tuple[int, ...]:
        return self.graph.tensor(t).shape

    def activation(self, t: str) -> bool:
        """Read dependencies only follow tensors some op of the graph writes."""
        return t in self.produced and self.graph.tensor(t).role is not TensorRole.weight

    def tile_boxes(
        self, top: TiledOp, ranges: tuple[tuple[int, int], ...]
    ) -> tuple[list[tuple[str, Box]], Box]:
        """(reads, write box on the op's output view) of one tile."""
        op = self.ops[top.name]
        k = top.kind
        out = op.outputs[0]
        if k in _MATMUL:
            (m0, m1), (n0, n1), (k0, k1) = ranges
            if k == "lm_head" and len(op.inputs) == 3:  # R19: its norm reads whole rows
                k0, k1 = 0, self.shape(op.inputs[0])[-1]
            return [(op.inputs[0], (m0, m1, k0, k1))], (m0, m1, n0, n1)
        if k == "expert_linear":
            (m0, m1), (n0, n1), (k0, k1) = ranges
            e = self.expert_of(op, n0, k0)
            return [(op.inputs[0], (m0, m1, k0, k1)), (op.inputs[1], (m0, m1, e, e + 1))], (
                m0,
                m1,
                n0,
                n1,
            )
        if k == "router":
            (a, b), (c0, c1) = ranges
            return [(op.inputs[0], (a, b, c0, c1))], (a, b, c0, c1)
        if k == "rmsnorm":
            (a, b), (c0, c1) = ranges
            ncols = view(self.shape(out))[1]
            g = int(op.attrs.get("group", ncols))
            box = _rows_to_box(a, b, c0, c1, ncols // g, g, ncols)
            return [(op.inputs[0], box)], box
        if k == "rope":
            (a, b), (c0, c1) = ranges
            hd = int(op.attrs["head_dim"])
            ncols = view(self.shape(out))[1]
            wide = ((c0 // hd) * hd, min(ncols, -(-c1 // hd) * hd))
            return [(op.inputs[0], (a, b, *wide))], (a, b, c0, c1)
        if k == "attention":
            return self._attention(op, ranges)
        if k in ("gated_mlp", "residual_add", "allreduce"):
            (a, b), (c0, c1) = ranges
            box = (a, b, c0, c1)
            return [(t, box) for t in op.inputs], box
        if k == "add_rmsnorm":  # R1: whole rows of a and b; the same box of both outputs
            (a, b), (c0, c1) = ranges
            box = (a, b, c0, c1)
            return [(t, box) for t in op.inputs[:2]], box
        if k == "embedding":
            (a, b), (c0, c1) = ranges
            return [], (a, b, c0, c1)
        if k == "sample":
            (a, b), (c0, c1) = ranges
            t = self.shape(op.inputs[0])[1]
            return [(op.inputs[0], (a * t, b * t, c0, c1))], (a, b, 0, 1)
        if k in ("ssm_conv", "ssm_scan", "ssm_norm"):
            return self._ssm(op, ranges)
        if k == "kda":
            return self._kda(op, ranges)
        raise ValueError(f"no region rule for op kind {k!r} ({top.name})")

    def _kda(
        self, op: Op, ranges: tuple[tuple[int, int], ...]
    ) -> tuple[list[tuple[str, Box]], Box]:
        """Kimi-Linear's `kda` tile (module table): batch rows a..b x heads h0..h1."""
        (a, b), (h0, h1) = ranges
        h, d = int(op.attrs["heads"]), int(op.attrs["head_dim"])
        h1 = min(h1, h)
        t = self.shape(op.outputs[0])[1]
        r0, r1, lo, hi = a * t, b * t, h0 * d, h1 * d
        x, f, beta, gate = op.inputs[:4]
        c = h * d
        reads = [(x, (r0, r1, j * c + lo, j * c + hi)) for j in range(3)]
        reads += [(f, (r0, r1, lo, hi)), (beta, (r0, r1, h0, h1)), (gate, (r0, r1, lo, hi))]
        return reads, (r0, r1, lo, hi)

    def _ssm(
        self, op: Op, ranges: tuple[tuple[int, int], ...]
    ) -> tuple[list[tuple[str, Box]], Box]:
        """Mamba-2's boxes (module table); columns clipped to the extents (masked tiles)."""
        (a, b), (c0, c1) = ranges
        if op.kind.value == "ssm_norm":
            gs = int(op.attrs["group"])
            ncols = view(self.shape(op.outputs[0]))[1]
            box = (a, b, c0 * gs, min(ncols, c1 * gs))
            return [(op.inputs[0], box), (op.inputs[1], box)], box
        t = self.shape(op.outputs[0])[1]
        r0, r1 = a * t, b * t
        if op.kind.value == "ssm_conv":
            ch, off = int(op.attrs["channels"]), int(op.attrs["offset"])
            c1 = min(c1, ch)
            return [(op.inputs[0], (r0, r1, off + c0, off + c1))], (r0, r1, c0, c1)
        h, p = int(op.attrs["heads"]), int(op.attrs["head_dim"])
        c1 = min(c1, h)
        xbc, proj = op.inputs[0], op.inputs[1]
        dt = int(op.attrs["dt_offset"])
        reads = [
            (xbc, (r0, r1, 0, view(self.shape(xbc))[1])),
            (proj, (r0, r1, dt + c0, dt + c1)),
        ]
        return reads, (r0, r1, c0 * p, c1 * p)

    def expert_of(self, op: Op, n0: int | np.ndarray, k0: int | np.ndarray) -> Any:
        """The expert of an `expert_linear` tile starting at output column `n0` / input
        column `k0` (gate_up: n is expert-major; down: k is)."""
        n_exp, wn, k_in = self.shape(op.inputs[2])
        if op.attrs["mode"] == "gate_up":
            return n0 // (wn // 2)
        return k0 // k_in

    def _attention(
        self, op: Op, ranges: tuple[tuple[int, int], ...]
    ) -> tuple[list[tuple[str, Box]], Box]:
        q, kk, v = op.inputs[0], op.inputs[1], op.inputs[2]
        b_, t = self.shape(q)[0], self.shape(q)[1]
        heads, kvh, hd = (
            int(op.attrs["heads"]),
            int(op.attrs["kv_heads"]),
            int(op.attrs["head_dim"]),
        )
        grp = heads // kvh
        per_batch = t * heads
        block = t * grp
        a, b = ranges[0]
        b0, b1 = a // per_batch, (b - 1) // per_batch
        if b0 == b1:
            kv0 = (a % per_batch) // block
            kv1 = ((b - 1) % per_batch) // block
            rows = (b0 * t, (b0 + 1) * t)
            qbox = (*rows, kv0 * grp * hd, (kv1 + 1) * grp * hd)
            kvbox = (*rows, kv0 * hd, (kv1 + 1) * hd)
        else:
            rows = (b0 * t, min(b_, b1 + 1) * t)
            qbox = (*rows, 0, heads * hd)
            kvbox = (*rows, 0, kvh * hd)
        return [(q, qbox), (kk, kvbox), (v, kvbox)], qbox

    def _box_arrays(
        self, top: TiledOp, r: npt.NDArray[np.int64]
    ) -> tuple[list[tuple[str, BoxArray]], BoxArray] | None:
        """`tile_boxes` of every tile at once (`r`: `tile_ranges`); None for a kind or
        axis count the vectorised rules do not cover (the caller uses `units`)."""
        op = self.ops[top.name]
        k = top.kind
        out = op.outputs[0]
        na = r.shape[1]

        def box(*cols: npt.NDArray[np.int64] | int) -> BoxArray:
            n = r.shape[0]
            return np.stack(
                [np.broadcast_to(np.asarray(c, dtype=np.int64), (n,)) for c in cols], axis=1
            )

        if k in _MATMUL and na == 3:
            m0, m1, n0, n1, k0, k1 = (r[:, i // 2, i % 2] for i in range(6))
            if k == "lm_head" and len(op.inputs) == 3:  # R19: its norm reads whole rows
                row = box(m0, m1, 0, self.shape(op.inputs[0])[-1])
                return [(op.inputs[0], row)], box(m0, m1, n0, n1)
            return [(op.inputs[0], box(m0, m1, k0, k1))], box(m0, m1, n0, n1)
        if k == "expert_linear" and na == 3:
            m0, m1, n0, n1, k0, k1 = (r[:, i // 2, i % 2] for i in range(6))
            e = self.expert_of(op, n0, k0)
            reads = [(op.inputs[0], box(m0, m1, k0, k1)), (op.inputs[1], box(m0, m1, e, e + 1))]
            return reads, box(m0, m1, n0, n1)
        if na != 2 and k != "attention":
            return None
        a, b = r[:, 0, 0], r[:, 0, 1]
        if k == "attention":
            return self._attention_arrays(op, a, b, box)
        c0, c1 = r[:, 1, 0], r[:, 1, 1]
        if k == "rmsnorm":
            ncols = view(self.shape(out))[1]
            g = int(op.attrs.get("group", ncols))
            per = ncols // g
            r0, r1 = a // per, (b - 1) // per + 1
            one = r1 - r0 == 1
            wb = box(
                r0,
                r1,
                np.where(one, (a % per) * g + c0, 0),
                np.where(one, ((b - 1) % per) * g + c1, ncols),
            )
            return [(op.inputs[0], wb)], wb
        if k == "rope":
            hd = int(op.attrs["head_dim"])
            ncols = view(self.shape(out))[1]
            lo, hi = (c0 // hd) * hd, np.minimum(ncols, -(-c1 // hd) * hd)
            return [(op.inputs[0], box(a, b, lo, hi))], box(a, b, c0, c1)
        if k in ("gated_mlp", "residual_add", "allreduce"):
            wb = box(a, b, c0, c1)
            return [(t, wb) for t in op.inputs], wb
        if k == "add_rmsnorm":
            wb = box(a, b, c0, c1)
            return [(t, wb) for t in op.inputs[:2]], wb
        if k == "embedding":
            return [], box(a, b, c0, c1)
        if k == "router":
            wb = box(a, b, c0, c1)
            return [(op.inputs[0], wb)], wb
        if k == "sample":
            t = self.shape(op.inputs[0])[1]
            return [(op.inputs[0], box(a * t, b * t, c0, c1))], box(a, b, 0, 1)
        return None

    def _attention_arrays(
        self,
        op: Op,
        a: npt.NDArray[np.int64],
        b: npt.NDArray[np.int64],
        box: Callable[..., BoxArray],
    ) -> tuple[list[tuple[str, BoxArray]], BoxArray]:
        """`_attention` of every tile at once (row ranges `[a, b)`)."""
        q, kk, v = op.inputs[0], op.inputs[1], op.inputs[2]
        b_, t = self.shape(q)[0], self.shape(q)[1]
        heads, kvh, hd = (
            int(op.attrs["heads"]),
            int(op.attrs["kv_heads"]),
            int(op.attrs["head_dim"]),
        )
        grp = heads // kvh
        per_batch = t * heads
        block = t * grp
        b0, b1 = a // per_batch, (b - 1) // per_batch
        same = b0 == b1
        kv0 = (a % per_batch) // block
        kv1 = ((b - 1) % per_batch) // block
        r0 = b0 * t
        r1 = np.where(same, (b0 + 1) * t, np.minimum(b_, b1 + 1) * t)
        qbox = box(
            r0,
            r1,
            np.where(same, kv0 * grp * hd, 0),
            np.where(same, (kv1 + 1) * grp * hd, heads * hd),
        )
        kvbox = box(r0, r1, np.where(same, kv0 * hd, 0), np.where(same, (kv1 + 1) * hd, kvh * hd))
        return [(q, qbox), (kk, kvbox), (v, kvbox)], qbox

    def unit_arrays(
        self,
        top: TiledOp,
        tile_ns: float,
        merge_total_ns: float = 0.0,
        merge_units: int = 1,
        overhead_ns: float = 0.0,
    ) -> tuple[UnitArrays | None, UnitArrays | None]:
        """`units(...)` as columns (None for an empty list), computed without a Python loop
        over the tiles when the tiles are the tiler's enumeration; the same values."""
        r = tile_ranges(top)
        boxes = self._box_arrays(top, r) if r is not None else None
        if r is None or boxes is None:
            cu, mu = self.units(top, tile_ns, merge_total_ns, merge_units, overhead_ns)
            return UnitArrays.of(cu), UnitArrays.of(mu)
        op = self.ops[top.name]
        out = op.outputs[0]
        n = r.shape[0]
        ncols = max(1, view(self.shape(out))[1])
        split = is_split(top)
        red = REDUCTION_AXIS.get(top.kind)
        wb = top.weight_bytes // max(1, n) if top.kind in _WEIGHT_KINDS else 0
        reads_l, wbox = boxes
        reads_l = [(tn, bx) for tn, bx in reads_l if self.activation(tn)]
        reads: dict[str, BoxArray] = {}
        for tn, bx in reads_l:
            reads[tn] = _union(reads[tn], bx) if tn in reads else bx
        stripe_a = np.minimum(((wbox[:, 2] + wbox[:, 3]) / 2) / ncols, 0.999999)
        k_stripe_a = stripe_a
        if split and top.kind in ("linear", "lm_head") and reads_l:
            kb = reads_l[0][1]
            kcols = view(self.shape(reads_l[0][0]))[1]
            k_stripe_a = np.minimum(((kb[:, 2] + kb[:, 3]) / 2) / max(1, kcols), 0.999999)
        stripe = stripe_a.tolist()
        compute = UnitArrays(
            n,
            list(range(n)),
            reads,
            partial_name(top.name) if split else out,
            wbox,
            [tile_ns] * n,
            split,
            [wb] * n,
            stripe,
            stripe if k_stripe_a is stripe_a else k_stripe_a.tolist(),
        )
        if not (split and red is not None):
            return compute, None
        # Output blocks in order of first appearance (key: the ranges off the reduction
        # axis), each the bounding box of its tiles' write boxes.
        key = np.delete(r, red, axis=1).reshape(n, -1)
        _, first, inv = np.unique(key, axis=0, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        order = np.argsort(first, kind="stable")
        nb = len(first)
        lo = np.full((nb, 2), np.iinfo(np.int64).max, dtype=np.int64)
        hi = np.full((nb, 2), np.iinfo(np.int64).min, dtype=np.int64)
        np.minimum.at(lo, inv, wbox[:, [0, 2]])
        np.maximum.at(hi, inv, wbox[:, [1, 3]])
        blocks = np.stack([lo[:, 0], hi[:, 0], lo[:, 1], hi[:, 1]], axis=1)[order]
        per_block = max(1, merge_units // max(1, nb))
        # Each block cut into column chunks of `step` (the last one clipped).
        bl = np.asarray(blocks, dtype=np.int64).reshape(-1, 4)
        width = bl[:, 3] - bl[:, 2]
        kk = np.maximum(1, np.minimum(per_block, width // 16))
        step = -(-width // kk)
        if (step <= 0).any():
            raise ValueError("range() arg 3 must not be zero")
        count = -(-width // step)  # len(range(c0, c1, step))
        bi = np.repeat(np.arange(nb), count)
        j = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        c0 = bl[bi, 2] + j * step[bi]
        c1 = np.minimum(bl[bi, 3], c0 + step[bi])
        chunks = np.stack([bl[bi, 0], bl[bi, 1], c0, c1], axis=1)
        mwrites = chunks
        mreads = bl[bi] if top.kind in ("rmsnorm", "add_rmsnorm") else chunks
        mstripe: list[float] = np.minimum(((c0 + c1) / 2) / ncols, 0.999999).tolist()
        m = len(mwrites)
        if not m:
            return compute, None
        each = merge_total_ns * merge_units / m + overhead_ns
        merges = UnitArrays(
            m,
            list(range(m)),
            {partial_name(top.name): mreads},
            op.outputs[-1] if top.kind == "add_rmsnorm" else out,  # R1: the norm
            mwrites,
            [each] * m,
            False,
            [0] * m,
            mstripe,
            mstripe,
        )
        return compute, merges

    def units(
        self,
        top: TiledOp,
        tile_ns: float,
        merge_total_ns: float = 0.0,
        merge_units: int = 1,
        overhead_ns: float = 0.0,
    ) -> tuple[list[Unit], list[Unit]]:
        """(compute units, merge units) of one op. Merge units exist for split reductions:
        `merge_total_ns` is the tiler's whole-device merge time, shared by up to
        `merge_units` workers (each unit costs its share of that worker time + overhead)."""
        op = self.ops[top.name]
        out = op.outputs[0]
        ncols = max(1, view(self.shape(out))[1])
        split = is_split(top)
        red = REDUCTION_AXIS.get(top.kind)
        wb = top.weight_bytes // max(1, len(top.tiles)) if top.kind in _WEIGHT_KINDS else 0
        compute: list[Unit] = []
        # Output block of a split reduction: the tile's ranges off the reduction axis. Its
        # merge reads every partial of the block (the whole reduction) and writes the union
        # of the block's tile boxes (rmsnorm: the whole row; linear: the (m, n) box).
        blocks: dict[tuple[tuple[int, int], ...], list[Box]] = {}
        for tile in top.tiles:
            reads, wbox = self.tile_boxes(top, tile.ranges)
            reads = [(tn, bx) for tn, bx in reads if self.activation(tn)]
            stripe = ((wbox[2] + wbox[3]) / 2) / ncols
            k_stripe = stripe
            if split and top.kind in ("linear", "lm_head") and reads:
                kb = reads[0][1]
                kcols = view(self.shape(reads[0][0]))[1]
                k_stripe = ((kb[2] + kb[3]) / 2) / max(1, kcols)
            target = partial_name(top.name) if split else out
            if split and red is not None:
                blocks.setdefault(tile.ranges[:red] + tile.ranges[red + 1 :], []).append(wbox)
            compute.append(
                Unit(
                    top.name,
                    False,
                    tile.index,
                    tuple(reads),
                    (target, wbox),
                    tile_ns,
                    split,
                    wb,
                    min(stripe, 0.999999),
                    min(k_stripe, 0.999999),
                )
            )
        # Each block's merge is cut into column chunks (at least 16 wide) so the merges of
        # an op can use up to `merge_units` workers; a chunk of a linear / attention / sample
        # merge reads its own columns of the partials, an rmsnorm chunk the whole row (its
        # partials are the row's sums of squares).
        merges: list[Unit] = []
        per_block = max(1, merge_units // max(1, len(blocks)))
        for boxes in blocks.values():
            box = (
                min(b[0] for b in boxes),
                max(b[1] for b in boxes),
                min(b[2] for b in boxes),
                max(b[3] for b in boxes),
            )
            width = box[3] - box[2]
            k = max(1, min(per_block, width // 16))
            step = -(-width // k)
            for c0 in range(box[2], box[3], step):
                chunk = (box[0], box[1], c0, min(box[3], c0 + step))
                read = box if top.kind in ("rmsnorm", "add_rmsnorm") else chunk
                stripe = min(((chunk[2] + chunk[3]) / 2) / ncols, 0.999999)
                merges.append(
                    Unit(
                        top.name,
                        True,
                        len(merges),
                        ((partial_name(top.name), read),),
                        (op.outputs[-1] if top.kind == "add_rmsnorm" else out, chunk),
                        0.0,
                        False,
                        0,
                        stripe,
                        stripe,
                    )
                )
        if merges:
            each = merge_total_ns * merge_units / len(merges) + overhead_ns
            merges = [replace(u, est_ns=each) for u in merges]
        return compute, merges
