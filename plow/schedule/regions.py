"""What each tile reads and writes, as boxes on 2-D views of the activation tensors.

Every tensor of shape `(d0, ..., dn)` is viewed as `rows x cols` = `(d0*...*d(n-1)) x dn`
(a 1-D tensor `(d0,)` as `d0 x 1`). A box is `(r0, r1, c0, c1)`, half-open. The rules are
conservative (docs/schedule.md "Dependencies"): a box may over-approximate what a tile
touches, never under-approximate it, so a consumer tile depends on at least every producer
tile whose output it reads.

| kind | reads (input 0 / activations) | writes |
| --- | --- | --- |
| linear, lm_head | `x[m, k]` (a split `k` reads a slice of the reduction) | `out[m, n]` |
| rmsnorm | the tile's rows (groups) mapped back to tensor rows/cols | same box |
| rope | the tile's rows, columns widened to whole heads (rotation pairs) | the tile's box |
| attention | per batch row: query heads of the key-value heads its rows touch, and those |
|   | key-value heads of the new keys/values (every `s` tile: the position is dynamic) | q box |
| gated_mlp, residual_add | the same box of both inputs | the box |
| embedding | nothing produced by an op (ids, table) | the box |
| sample | `logits[rows of the batch rows, cols]` | `index[rows]` |

Split reductions (the reduction axis has more than one step: linear/lm_head `k`,
attention `s`, sample and rmsnorm `cols`): tiles write fp32 partials of their output box
into the pseudo-tensor `<op>#partial`; a merge unit per distinct output box reads those
partials and writes the box of the real output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from plow.graph.ops import Op, OpGraph, TensorRole
from plow.tiles.ir import TiledOp

Box = tuple[int, int, int, int]

# Index of the reduction axis per op kind (None: no reduction across tiles).
REDUCTION_AXIS: dict[str, int] = {
    "linear": 2,
    "lm_head": 2,
    "attention": 1,
    "sample": 1,
    "rmsnorm": 1,
}


def view(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D `rows x cols` view of a tensor shape."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    return (math.prod(shape[:-1]), shape[-1])


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
        if k in ("linear", "lm_head"):
            (m0, m1), (n0, n1), (k0, k1) = ranges
            return [(op.inputs[0], (m0, m1, k0, k1))], (m0, m1, n0, n1)
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
        if k in ("gated_mlp", "residual_add"):
            (a, b), (c0, c1) = ranges
            box = (a, b, c0, c1)
            return [(t, box) for t in op.inputs], box
        if k == "embedding":
            (a, b), (c0, c1) = ranges
            return [], (a, b, c0, c1)
        if k == "sample":
            (a, b), (c0, c1) = ranges
            t = self.shape(op.inputs[0])[1]
            return [(op.inputs[0], (a * t, b * t, c0, c1))], (a, b, 0, 1)
        raise ValueError(f"no region rule for op kind {k!r} ({top.name})")

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
        wb = top.weight_bytes // max(1, len(top.tiles)) if top.kind in ("linear", "lm_head") else 0
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
                read = box if top.kind == "rmsnorm" else chunk
                stripe = min(((chunk[2] + chunk[3]) / 2) / ncols, 0.999999)
                merges.append(
                    Unit(
                        top.name,
                        True,
                        len(merges),
                        ((partial_name(top.name), read),),
                        (out, chunk),
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
