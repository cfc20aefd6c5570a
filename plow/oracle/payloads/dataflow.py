"""Checkpoint D from data flow (C10): what every task reads and writes, as arena byte ranges.

The oracle (`Plow.Flowsweep.check_checkpoint_d_sweep`) derives the dependencies itself from
the `dataflow` part of a D payload: two tasks conflict when they touch a common byte and one
of them writes it; every conflicting pair must be ordered by the counter protocol's
happens-before (waits and queue order, transitively) in program order. It sweeps the tasks in
a topological order (`sweep_order`) with a frontier per address block and a vector clock per
task, so every plan size is checked the same way. Nothing here reads the scheduler's edge list:
the accesses come from the op table (kind, operands, shapes, axes, attributes), the task's op,
stage and unit range (from its packets) and the arena offsets (the schedule file's arena map).

Program key of a task: `4 * op_index + stage` (load 0, compute 1, merge 2): the op table's
order is the sequential program, a split reduction's merges follow its tiles.

Access rules per unit (`docs/oracle.md`, "Checkpoint D: data flow"; the kernels' index rules
of `plow/runtime/cpu/kernels.py`, written again here from the op table alone). A tile's
ranges are row-major over the op's axes; views are `rows x cols` with `cols` the last dim:

- linear, lm_head: reads `x[m0:m1, k0:k1]`; writes `out[m0:m1, n0:n1]` (split: the partial
  `[k step, m, n]`); an lm_head with a third input (R19: its prologue norm's weight) reads
  whole rows `x[m0:m1, :]`;
- rmsnorm: reads groups `a..b`, cols `c0..c1` of `x` seen as `(numel / g) x g`; writes the
  same of `out` (split: the partial `[step, rows]`);
- rope: reads the rows of `x` with columns widened to whole heads, and `positions`; writes
  the rows x cols of `out`;
- gated_mlp, residual_add: read the same box of every input, write it of `out`;
- allreduce (tensor parallel, one op per device): reads the same box of every device's
  partial, writes it of the device's sum;
- fused ops (issue 15, `kernels/fused.h`): linear_glu as linear (its weight rows 2n, 2n + 1
  are column n's gate and up; split: columns `2 n0:2 n1` of the partial `[k step, m, 2N]`);
  linear_qkv reads `x[m0:m1, k0:k1]` and writes columns `n0:n1` of q, k, v side by side
  (q's columns first, then k's, then v's, each output's width its last dim; split: columns
  `n0:n1` of the partial `[k step, m, nq + nk + nv]`); add_rmsnorm reads the box of `a` and
  `b`, writes the box of the sum (output 0), then unsplit reads the sum's whole rows and
  writes the norm's (output 1), split writes the box's sums of squares (the partial
  `[step, rows]`);
- embedding: reads `ids[a:b]`; writes `out[a:b, c0:c1]`; with a third input (R18: the first
  norm's weight) it then reads those whole rows and writes them of its second output (the norm);
- attention: reads `q` of its rows (row `r` = batch, kv head, token, head in the group), this
  step's `k`/`v` of every token of its (batch, kv head) blocks, and `positions`; writes `out`
  of its rows (split: the partial `[step, rows, head_dim]`);
- sample: reads `logits` of every token of rows `a..b`, cols `c0..c1`, and `sample_index`;
  writes `out[a:b]` (split: the partial `[step, rows, 2]`);
- merge: reads its own box of every step's partial (linear, lm_head, expert_linear: its rows x
  columns; attention, add_rmsnorm: its rows), the whole partial otherwise (and `x` rows for
  rmsnorm; add_rmsnorm: its box of the sum); writes its chunk of `out` (add_rmsnorm: of the
  norm)
  (blocks and column chunks numbered as `plow verify`'s `merge_unit_count`);
- ssm_conv / ssm_scan (Mamba-2): read every token of their batch rows (in_proj's columns of
  their channels / the dt columns of their heads, every conv column for the scan, and
  `positions`); read AND write their rows' and channels' / heads' recurrent state (the
  `state` tensor, per batch row: a read-modify-write in place); write their box of `out`;
  ssm_norm: reads the box of y and the same columns of in_proj (the gate), writes it;
- kda (Kimi-Linear): reads every token of its batch rows: its heads' q, k, v columns of the
  conv output, f and gate columns, beta columns, and `positions`; reads AND writes its rows'
  heads' state; writes its box of `out`;
- load: nothing in the arena.

Not in the byte model (trusted, docs/oracle.md): weights (read-only; F keeps every live buffer
disjoint from them), the key-value cache (read and written only inside its layer's attention
op: a tile writes this step's key/value rows and reads older positions, so no tile of the op
depends on another's cache write; F keeps the cache disjoint from everything live), and the
buffers the runtime adds at load time (the attention partial's `.ml` rows, the page table).
The fused argmax buffers (`OpEntry.argmax`, plow/bundle/argmax.py) are in the byte model:
`_argmax_unit`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from plow.bundle.files import OpEntry, OpTable
from plow.target.model import dtype_bytes

LOAD, COMPUTE, MERGE = 0, 1, 2
BLOCK = 4096  # bytes per block of the oracle's write index (any positive value is sound)
REDUCTION_AXIS = {"linear": 2, "lm_head": 2, "attention": 1, "sample": 1, "rmsnorm": 1}
MATMUL: tuple[str, ...] = ("linear", "lm_head")
# Routed experts (issue 17): expert_linear is a matmul over (m, n, k) that also reads its
# tile's expert's column of the router weights; its down form sums over experts (k split).
REDUCTION_AXIS["expert_linear"] = 2
MATMUL = (*MATMUL, "expert_linear")
# Fused ops (issue 15, kernels/fused.h): add_rmsnorm's columns split as rmsnorm's do (its
# tiles write their sums and their sums of squares, merges write the norm); linear_glu is a
# matmul over (m, n, k) whose weight rows 2n and 2n + 1 are a column n's gate and up (the
# weight is not in the byte model). Both fused matmuls may split k: a k tile writes the fp32
# partial `[k step, m, 2 N]` of every weight row it reads (linear_glu: column n's gate at
# 2n, its up at 2n + 1; linear_qkv: `[k step, m, nq + nk + nv]`, q, k, v side by side).
REDUCTION_AXIS["add_rmsnorm"] = 1
REDUCTION_AXIS["linear_glu"] = 2
REDUCTION_AXIS["linear_qkv"] = 2
MATMUL = (*MATMUL, "linear_glu")
MERGED_MATMUL = (*MATMUL, "linear_qkv")  # merges read their box of every step's partial

Access = tuple[int, int, int]  # [lo, hi) bytes, write 1 / read 0


@dataclass(frozen=True, slots=True)
class TaskUnits:
    """One task as its packets say: op index, stage, unit range."""

    op: int
    stage: int
    start: int
    count: int


class _Space:
    """Element ranges of the op table's tensors, turned into arena byte ranges."""

    def __init__(self, ot: OpTable, offsets: dict[str, int]) -> None:
        self.ot = ot
        self.offsets = offsets
        # per tracked tensor: (arena offset, elements, bytes per element), computed once
        # (`elems` runs millions of times on a large plan); untracked tensors are absent
        self._info: dict[str, tuple[int, int, int]] = {
            name: (offsets[name], math.prod(t.shape), dtype_bytes(t.dtype))
            for name, t in ot.tensors.items()
            if t.role not in ("weight", "cache") and name in offsets
        }

    def tracked(self, name: str) -> bool:
        return name in self._info

    def elems(self, name: str, lo: int, hi: int, write: bool, out: list[Access]) -> None:
        """Elements [lo, hi) of tensor `name` (row-major), clipped to the tensor."""
        info = self._info.get(name)
        if info is None:
            return
        base, n, e = info
        if lo < 0:
            lo = 0
        if hi > n:
            hi = n
        if lo >= hi:
            return
        out.append((base + lo * e, base + hi * e, 1 if write else 0))

    def box(
        self, name: str, r0: int, r1: int, c0: int, c1: int, write: bool, out: list[Access]
    ) -> None:
        """Rows [r0, r1) x cols [c0, c1) of the tensor's `rows x cols` view."""
        if not self.tracked(name):
            return
        cols = _view(self.ot.tensors[name].shape)[1]
        c0, c1 = max(0, c0), min(cols, c1)
        if c0 >= c1 or r0 >= r1:
            return
        if c0 == 0 and c1 == cols:
            self.elems(name, r0 * cols, r1 * cols, write, out)
            return
        self.rows(name, r0 * cols + c0, cols, r1 - r0, c1 - c0, write, out)

    def rows(
        self, name: str, lo: int, stride: int, count: int, width: int, write: bool,
        out: list[Access],
    ) -> None:  # fmt: skip
        """`elems(name, lo + i * stride, lo + i * stride + width)` for i in 0..count (the
        same ranges, in that order; one call instead of `count` on a large plan)."""
        info = self._info.get(name)
        if info is None:
            return
        base, n, e = info
        w = 1 if write else 0
        append = out.append
        for i in range(count):
            a = lo + i * stride
            b = a + width
            if a < 0:
                a = 0
            if b > n:
                b = n
            if a < b:
                append((base + a * e, base + b * e, w))

    def whole(self, name: str, write: bool, out: list[Access]) -> None:
        if self.tracked(name):
            self.elems(name, 0, math.prod(self.ot.tensors[name].shape), write, out)


def _view(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    return (math.prod(shape[:-1]), shape[-1])


def _qkv_writes(
    sp: _Space, ot: OpTable, outputs: Sequence[str], r0: int, r1: int, c0: int, c1: int,
    out: list[Access],
) -> None:  # fmt: skip
    """A linear_qkv's columns c0..c1 of cat3(q, k, v), rows r0..r1, written into q, k and v
    by their widths (its tasks without a k split, and its merges)."""
    at = 0
    for name in outputs:
        w = _view(ot.tensors[name].shape)[1]
        lo, hi = max(c0, at), min(c1, at + w)
        if lo < hi:
            sp.box(name, r0, r1, lo - at, hi - at, True, out)
        at += w


def _tile_ranges(o: OpEntry, j: int) -> list[tuple[int, int, int]]:
    """(start, end, step index) per axis of tile `j` (row-major, last axis fastest)."""
    out: list[tuple[int, int, int]] = []
    for a in reversed(o.axes):
        k = j % max(1, a.steps)
        j //= max(1, a.steps)
        out.append((k * a.tile, min((k + 1) * a.tile, a.extent), k))
    return out[::-1]


class _Attn:
    def __init__(self, ot: OpTable, o: OpEntry) -> None:
        q = ot.tensors[o.inputs[0]].shape
        self.B, self.T = q[0], q[1]
        self.H, self.KVH, self.D = (int(o.attrs[k]) for k in ("heads", "kv_heads", "head_dim"))
        self.grp = max(1, self.H // max(1, self.KVH))
        self.block = self.T * self.grp

    def coords(self, r: int) -> tuple[int, int, int, int]:
        """(batch, kv head, token, query head) of attention row `r`."""
        bi = r // (self.KVH * self.block)
        kv = (r // self.block) % self.KVH
        tok = (r // self.grp) % self.T
        return bi, kv, tok, kv * self.grp + r % self.grp

    def q_elem(self, r: int) -> int:
        bi, _, tok, h = self.coords(r)
        return ((bi * self.T + tok) * self.H + h) * self.D


def _split(o: OpEntry) -> bool:
    red = REDUCTION_AXIS.get(o.kind)
    return red is not None and red < len(o.axes) and o.axes[red].steps > 1


def _partial_row(o: OpEntry, ot: OpTable) -> int:
    """Elements of one reduction step of the op's partial buffer."""
    if o.partial is None or o.partial not in ot.tensors:
        return 0
    shape = ot.tensors[o.partial].shape
    return math.prod(shape[1:]) if shape else 0


def _partial_cols(o: OpEntry, ot: OpTable) -> int:
    """Columns of one row of the op's partial (its last dim; a linear's: its output's; no
    partial in the op table: its first output's)."""
    if o.partial is None or o.partial not in ot.tensors:
        return _view(ot.tensors[o.outputs[0]].shape)[1]
    return _view(ot.tensors[o.partial].shape[1:])[1]


def _compute_unit(sp: _Space, ot: OpTable, o: OpEntry, j: int, out: list[Access]) -> None:
    ax = _tile_ranges(o, j)
    k = o.kind
    split = _split(o)
    dst = o.partial if split and o.partial else o.outputs[0]
    if k == "expert_linear":  # the expert's router column (gate_up: n expert-major; down: k)
        (m0, m1, _), (n0, n1, _), (k0, k1, _) = ax
        _, wn, kin = ot.tensors[o.inputs[2]].shape
        gate_up = o.attrs.get("mode") == "gate_up"
        e = n0 // max(1, wn // 2) if gate_up else k0 // max(1, kin)
        sp.box(o.inputs[1], m0, m1, e, e + 1, False, out)
    if k == "linear_qkv" and not split:  # columns n of cat3(q, k, v)'s rows go to q, k, v
        (m0, m1, _), (n0, n1, _), (k0, k1, _) = ax  # by their widths
        sp.box(o.inputs[0], m0, m1, k0, k1, False, out)
        _qkv_writes(sp, ot, o.outputs, m0, m1, n0, n1, out)
        return
    if k in MERGED_MATMUL:
        (m0, m1, _), (n0, n1, _), (k0, k1, ks) = ax
        if k == "lm_head" and len(o.inputs) == 3:  # R19: the prologue norm reads whole rows
            k0, k1 = 0, ot.tensors[o.inputs[0]].shape[-1]
        sp.box(o.inputs[0], m0, m1, k0, k1, False, out)
        if split:
            per, ncols = _partial_row(o, ot), _partial_cols(o, ot)
            if k == "linear_glu":  # column n's gate and up: partial columns 2n, 2n + 1
                n0, n1 = 2 * n0, 2 * n1
            for m in range(m0, m1):
                lo = ks * per + m * ncols
                sp.elems(dst, lo + n0, lo + n1, True, out)
        else:
            sp.box(dst, m0, m1, n0, n1, True, out)
        return
    if k == "attention":
        g = _Attn(ot, o)
        (a, b, _), (_, _, ss), _ = ax[0], ax[1], ax[2]
        d0, d1, _ = ax[2]
        seen: set[tuple[int, int]] = set()
        for r in range(a, b):
            e = g.q_elem(r)
            sp.elems(o.inputs[0], e + d0, e + d1, False, out)
            bi, kv, _, _ = g.coords(r)
            if (bi, kv) not in seen:
                seen.add((bi, kv))
                for name in o.inputs[1:3]:
                    if sp.tracked(name):
                        for t in range(g.T):
                            lo = ((bi * g.T + t) * g.KVH + kv) * g.D
                            sp.elems(name, lo, lo + g.D, False, out)
            if split and sp.tracked(dst):
                lo = ss * _partial_row(o, ot) + r * g.D
                sp.elems(dst, lo + d0, lo + d1, True, out)
            elif not split and sp.tracked(dst):
                sp.elems(dst, e + d0, e + d1, True, out)
        for name in o.inputs[5:6]:
            sp.whole(name, False, out)
        return
    (a, b, _), (c0, c1, cs) = ax[0], ax[1]
    if k == "rmsnorm":
        shape = ot.tensors[o.inputs[0]].shape
        gw = int(o.attrs.get("group") or _view(shape)[1])
        for r in range(a, b):
            if sp.tracked(o.inputs[0]):
                sp.elems(o.inputs[0], r * gw + c0, r * gw + c1, False, out)
            if not split and sp.tracked(dst):
                sp.elems(dst, r * gw + c0, r * gw + c1, True, out)
        if split and sp.tracked(dst):
            per = _partial_row(o, ot)
            sp.elems(dst, cs * per + a, cs * per + b, True, out)
        return
    if k == "add_rmsnorm":  # a + b of its box into the sum; then (unsplit) the norm of its
        for name in o.inputs[:2]:  # whole rows, or (split) the box's sums of squares into
            sp.box(name, a, b, c0, c1, False, out)  # the partial [step, rows]
        sp.box(o.outputs[0], a, b, c0, c1, True, out)
        if split and sp.tracked(dst):
            per = _partial_row(o, ot)
            sp.elems(dst, cs * per + a, cs * per + b, True, out)
        elif not split:
            ncols = _view(ot.tensors[o.outputs[0]].shape)[1]
            sp.box(o.outputs[0], a, b, 0, ncols, False, out)
            sp.box(o.outputs[1], a, b, 0, ncols, True, out)
        return
    if k == "rope":
        hd = max(1, int(o.attrs.get("head_dim") or 1))
        sp.box(o.inputs[0], a, b, (c0 // hd) * hd, -(-c1 // hd) * hd, False, out)
        for name in o.inputs[1:]:
            sp.whole(name, False, out)
        sp.box(dst, a, b, c0, c1, True, out)
        return
    if k == "router":  # top-k reads every expert of its rows
        sp.box(o.inputs[0], a, b, 0, _view(ot.tensors[o.inputs[0]].shape)[1], False, out)
        sp.box(dst, a, b, c0, c1, True, out)
        return
    # allreduce (tensor parallel): the box of every device's partial, the box of its sum
    if k in ("gated_mlp", "residual_add", "allreduce"):
        for name in o.inputs:
            sp.box(name, a, b, c0, c1, False, out)
        sp.box(dst, a, b, c0, c1, True, out)
        return
    if k == "embedding":
        if sp.tracked(o.inputs[0]):
            sp.elems(o.inputs[0], a, b, False, out)
        sp.box(dst, a, b, c0, c1, True, out)
        if len(o.outputs) == 2:  # R18: then the norm of its rows (whole rows: cols unsplit)
            ncols = _view(ot.tensors[o.outputs[0]].shape)[1]
            sp.box(o.outputs[0], a, b, 0, ncols, False, out)
            sp.box(o.outputs[1], a, b, 0, ncols, True, out)
        return
    if k == "sample":
        t = ot.tensors[o.inputs[0]].shape[1] if len(ot.tensors[o.inputs[0]].shape) > 2 else 1
        sp.box(o.inputs[0], a * t, b * t, c0, c1, False, out)
        for name in o.inputs[1:]:
            sp.whole(name, False, out)
        if split and sp.tracked(dst):
            per = _partial_row(o, ot)
            w = per // max(1, o.axes[0].extent)
            sp.elems(dst, cs * per + a * w, cs * per + b * w, True, out)
        elif not split and sp.tracked(dst):
            sp.elems(dst, a, b, True, out)
        return
    if k in ("ssm_conv", "ssm_scan", "ssm_norm"):
        _ssm_unit(sp, ot, o, a, b, c0, c1, dst, out)
        return
    if k == "kda":
        _kda_unit(sp, ot, o, a, b, c0, c1, dst, out)
        return
    raise ValueError(f"op {o.name!r}: no data-flow rule for kind {k!r}")


def _kda_unit(
    sp: _Space,
    ot: OpTable,
    o: OpEntry,
    a: int,
    b: int,
    h0: int,
    h1: int,
    dst: str,
    out: list[Access],
) -> None:
    """Kimi-Linear's kda tile (kernels/kda.h): batch rows a..b x heads h0..h1."""
    t = ot.tensors[o.outputs[0]].shape[1]
    h, d = int(o.attrs["heads"]), int(o.attrs["head_dim"])
    h1 = min(h1, h)
    r0, r1, lo, hi = a * t, b * t, h0 * d, h1 * d
    x, f, beta, gate = o.inputs[:4]
    for j in range(3):  # its heads' q, k, v columns of the conv output
        sp.box(x, r0, r1, j * h * d + lo, j * h * d + hi, False, out)
    sp.box(f, r0, r1, lo, hi, False, out)
    sp.box(beta, r0, r1, h0, h1, False, out)
    sp.box(gate, r0, r1, lo, hi, False, out)
    sp.whole(o.inputs[-1], False, out)
    state = o.inputs[-2]
    ncols = _view(ot.tensors[state].shape)[1]
    for r in range(a, b):  # the row's heads' state rows: read, then written
        for write in (False, True):
            sp.box(state, (r * h + h0) * d, (r * h + h1) * d, 0, ncols, write, out)
    sp.box(dst, r0, r1, lo, hi, True, out)


def _ssm_unit(
    sp: _Space,
    ot: OpTable,
    o: OpEntry,
    a: int,
    b: int,
    c0: int,
    c1: int,
    dst: str,
    out: list[Access],
) -> None:
    """Mamba-2's tiles (module docstring): rows a..b are batch rows (ssm_norm: token rows)."""
    if o.kind == "ssm_norm":
        gs = int(o.attrs["group"])
        ncols = _view(ot.tensors[o.outputs[0]].shape)[1]
        lo, hi = c0 * gs, min(ncols, c1 * gs)
        for name in (o.inputs[0], o.inputs[1]):
            sp.box(name, a, b, lo, hi, False, out)
        sp.box(dst, a, b, lo, hi, True, out)
        return
    t = ot.tensors[o.outputs[0]].shape[1]
    state, per = o.inputs[-2], 1
    if o.kind == "ssm_conv":
        lo, hi = int(o.attrs["offset"]) + c0, int(o.attrs["offset"]) + c1
        sp.box(o.inputs[0], a * t, b * t, lo, hi, False, out)
        wide = int(o.attrs["channels"])
        out_lo, out_hi = c0, c1
    else:
        xbc = o.inputs[0]
        sp.box(xbc, a * t, b * t, 0, _view(ot.tensors[xbc].shape)[1], False, out)
        dt = int(o.attrs["dt_offset"])
        sp.box(o.inputs[1], a * t, b * t, dt + c0, dt + c1, False, out)
        wide, per = int(o.attrs["heads"]), int(o.attrs["head_dim"])
        out_lo, out_hi = c0 * per, c1 * per
    sp.whole(o.inputs[-1], False, out)
    ncols = _view(ot.tensors[state].shape)[1]
    for r in range(a, b):  # the row's state rows of its channels / heads: read, then written
        for write in (False, True):
            sp.box(state, (r * wide + c0) * per, (r * wide + c1) * per, 0, ncols, write, out)
    sp.box(dst, a * t, b * t, out_lo, out_hi, True, out)


def _chunks(c0: int, c1: int, per_block: int) -> list[tuple[int, int]]:
    width = c1 - c0
    if width <= 0:
        return []
    k = max(1, min(per_block, width // 16))
    step = -(-width // k)
    return [(c, min(c1, c + step)) for c in range(c0, c1, step)]


def merge_boxes(ot: OpTable, o: OpEntry, workers: int) -> list[tuple[int, int, int, int]]:
    """The merge units of a split op as boxes (rows r0..r1 of the unit's block, output
    columns c0..c1): blocks = distinct tile ranges off the reduction axis in tile order, each
    the bounding box of its tiles' output boxes, cut into column chunks (the numbering of
    `plow verify`'s `merge_unit_count`). Rows are attention rows for attention, output-view
    rows otherwise."""
    red = REDUCTION_AXIS[o.kind]
    ntiles = math.prod(a.steps for a in o.axes)
    blocks: dict[tuple[tuple[int, int], ...], list[int]] = {}
    ncols_out = _view(ot.tensors[o.outputs[0]].shape)[1]
    for j in range(ntiles):
        ax = _tile_ranges(o, j)
        key = tuple((s, e) for i, (s, e, _) in enumerate(ax) if i != red)
        if o.kind in MERGED_MATMUL:
            box = [ax[0][0], ax[0][1], ax[1][0], ax[1][1]]
        elif o.kind == "attention":
            g = _Attn(ot, o)
            a, b = ax[0][0], ax[0][1]
            heads = [g.coords(r)[3] for r in range(a, b)]
            b0, b1 = g.coords(a)[0], g.coords(b - 1)[0]
            if b0 == b1:
                kv0, kv1 = g.coords(a)[1], g.coords(b - 1)[1]
                box = [a, b, kv0 * g.grp * g.D, (kv1 + 1) * g.grp * g.D]
            else:
                box = [a, b, 0, g.H * g.D]
            del heads
        elif o.kind == "sample":
            box = [ax[0][0], ax[0][1], 0, 1]
        else:  # rmsnorm: the whole rows of its groups
            box = [ax[0][0], ax[0][1], 0, ncols_out]
        cur = blocks.get(key)
        if cur is not None:
            box = [
                min(cur[0], box[0]),
                max(cur[1], box[1]),
                min(cur[2], box[2]),
                max(cur[3], box[3]),
            ]
        blocks[key] = box
    per_block = max(1, workers // max(1, len(blocks)))
    out: list[tuple[int, int, int, int]] = []
    for r0, r1, c0, c1 in blocks.values():
        out.extend((r0, r1, a, b) for a, b in _chunks(c0, c1, per_block))
    return out


def _merge_unit(
    sp: _Space, ot: OpTable, o: OpEntry, box: tuple[int, int, int, int], out: list[Access]
) -> None:
    r0, r1, c0, c1 = box
    dst = o.outputs[0]
    part = o.partial if o.partial and o.partial in ot.tensors else None
    steps = ot.tensors[part].shape[0] if part and ot.tensors[part].shape else 0
    if part and o.kind in MERGED_MATMUL:
        # the unit's own box of every step's partial ([step, M, N]): its columns, not the
        # whole buffer (other units' columns are written by tiles this unit never waits for)
        per, ncols = _partial_row(o, ot), _partial_cols(o, ot)
        p0, p1 = (2 * c0, 2 * c1) if o.kind == "linear_glu" else (c0, c1)  # gate/up pairs
        for ks in range(steps):
            sp.rows(part, ks * per + r0 * ncols + p0, ncols, r1 - r0, p1 - p0, False, out)
    elif part and o.kind == "add_rmsnorm":  # its rows of every step's partial [step, rows]
        per = _partial_row(o, ot)
        sp.rows(part, r0, per, steps, r1 - r0, False, out)
    elif part and o.kind == "attention":
        g = _Attn(ot, o)  # rows [r0, r1) of every step's partial ([step, rows, head_dim])
        per = _partial_row(o, ot)
        sp.rows(part, r0 * g.D, per, steps, (r1 - r0) * g.D, False, out)
    elif part:
        sp.whole(part, False, out)
    if o.kind == "attention":
        g = _Attn(ot, o)
        for r in range(r0, r1):
            h = g.coords(r)[3]
            lo, hi = max(c0, h * g.D), min(c1, (h + 1) * g.D)
            if lo < hi and sp.tracked(dst):
                e = g.q_elem(r)
                sp.elems(dst, e + lo - h * g.D, e + hi - h * g.D, True, out)
        return
    if o.kind == "sample":
        if sp.tracked(dst):
            sp.elems(dst, r0, r1, True, out)
        for name in o.inputs[1:]:
            sp.whole(name, False, out)
        return
    if o.kind == "linear_qkv":  # columns c0..c1 of q, k, v side by side
        _qkv_writes(sp, ot, o.outputs, r0, r1, c0, c1, out)
        return
    if o.kind == "add_rmsnorm":  # the sums of its box in, the norm of the same box out
        sp.box(o.outputs[0], r0, r1, c0, c1, False, out)
        sp.box(o.outputs[1], r0, r1, c0, c1, True, out)
        return
    if o.kind == "rmsnorm":
        shape = ot.tensors[o.inputs[0]].shape
        gw = int(o.attrs.get("group") or _view(shape)[1])
        ncols = _view(shape)[1]
        per = max(1, ncols // max(1, gw))
        # groups r0..r1 -> tensor elements [r0*gw, r1*gw), columns c0..c1 of the tensor view
        for r in range(r0 // per, -(-r1 // per)):
            lo, hi = max(r0 * gw, r * ncols + c0), min(r1 * gw, r * ncols + c1)
            if lo < hi:
                if sp.tracked(o.inputs[0]):
                    sp.elems(o.inputs[0], lo, hi, False, out)
                if sp.tracked(dst):
                    sp.elems(dst, lo, hi, True, out)
        return
    sp.box(dst, r0, r1, c0, c1, True, out)


def _coalesce(acc: list[Access]) -> list[Access]:
    """Sorted, adjacent ranges of one kind merged, each cut at BLOCK boundaries."""
    out: list[Access] = []
    writes: list[tuple[int, int]] = []
    reads: list[tuple[int, int]] = []
    for lo, hi, x in acc:
        (writes if x == 1 else reads).append((lo, hi))
    for w, rs in ((1, writes), (0, reads)):
        if not rs:
            continue
        rs.sort()
        runs: list[tuple[int, int]] = []
        clo, chi = rs[0]
        for lo, hi in rs:
            if lo <= chi:
                if hi > chi:
                    chi = hi
            else:
                runs.append((clo, chi))
                clo, chi = lo, hi
        runs.append((clo, chi))
        for lo, hi in runs:
            while lo < hi:
                end = (lo // BLOCK + 1) * BLOCK
                if end > hi:
                    end = hi
                out.append((lo, end, w))
                lo = end
    return out


def task_accesses(
    ot: OpTable, offsets: dict[str, int], tasks: Sequence[TaskUnits], workers: int
) -> list[list[Access]]:
    """Per task, its arena accesses (module doc), sorted, coalesced, cut at blocks."""
    sp = _Space(ot, offsets)
    merges: dict[int, list[tuple[int, int, int, int]]] = {}
    argmax: dict[str, tuple[tuple[int, ...], int] | None] = {}  # fused: (bounds, rows)
    result: list[list[Access]] = []
    for t in tasks:
        acc: list[Access] = []
        o = ot.ops[t.op]
        if t.stage == COMPUTE:
            for j in range(t.start, t.start + t.count):
                _compute_unit(sp, ot, o, j, acc)
        elif t.stage == MERGE and _split(o):
            boxes = merges.get(t.op)
            if boxes is None:
                boxes = merges[t.op] = merge_boxes(ot, o, workers)
            for j in range(t.start, min(len(boxes), t.start + t.count)):
                _merge_unit(sp, ot, o, boxes[j], acc)
        if o.argmax is not None and t.stage in (COMPUTE, MERGE):
            if o.argmax not in argmax:
                argmax[o.argmax] = _argmax_space(ot, o.argmax, workers)
            space = argmax[o.argmax]
            if space is not None:  # else no lm_head writes it: `plow verify` rejects the table
                _argmax_unit(sp, ot, o, t, space, merges, workers, acc)
        result.append(_coalesce(acc))
    return result


def _argmax_space(ot: OpTable, name: str, workers: int) -> tuple[tuple[int, ...], int] | None:
    """(chunk bounds, rows M) of the fused argmax buffer `name` (plow/bundle/argmax.py); None
    when no lm_head names it."""
    from plow.bundle.argmax import argmax_bounds, argmax_rows

    lm = next((o for o in ot.ops if o.kind == "lm_head" and o.argmax == name), None)
    if lm is None or len(lm.axes) < 3:
        return None
    return argmax_bounds(ot, lm, workers), argmax_rows(lm)


def _argmax_unit(
    sp: _Space,
    ot: OpTable,
    o: OpEntry,
    t: TaskUnits,
    space: tuple[tuple[int, ...], int],
    merges: dict[int, list[tuple[int, int, int, int]]],
    workers: int,
    out: list[Access],
) -> None:
    """Greedy fused into lm_head (op table `argmax`, packets FUSED_ARGMAX), on top of the
    op's own accesses (kept: a superset is sound): a task writing logits rows `m0..m1`,
    columns `n0..n1` (an unsplit lm_head's tiles, a k-split one's merges) writes rows
    `m0..m1` of every chunk inside those columns, in both the values and the index buffer
    `[chunks, M]`; the sample's merge (or its one unsplit task) reads every chunk of the
    logits rows of its batch rows. A split sample's partial tasks do no work."""
    bounds, rows = space
    assert o.argmax is not None
    names = (o.argmax, f"{o.argmax}.index")
    split = _split(o)
    units: list[tuple[int, int, int, int]] = []
    if t.stage == MERGE and split:
        boxes = merges.get(t.op)
        if boxes is None:
            boxes = merges[t.op] = merge_boxes(ot, o, workers)
        units = boxes[t.start : min(len(boxes), t.start + t.count)]
    elif t.stage == COMPUTE and not split:
        for j in range(t.start, t.start + t.count):
            ax = _tile_ranges(o, j)
            c0, c1 = (ax[1][0], ax[1][1]) if len(ax) > 1 else (0, 1)
            units.append((ax[0][0], ax[0][1], c0, c1))
    if o.kind == "lm_head":
        for m0, m1, n0, n1 in units:
            for i in range(len(bounds) - 1):
                if n0 <= bounds[i] and bounds[i + 1] <= n1:
                    for name in names:
                        sp.elems(name, i * rows + m0, i * rows + m1, True, out)
    elif o.kind == "sample":
        shape = ot.tensors[o.inputs[0]].shape
        per = shape[1] if len(shape) > 2 else 1
        for a, b, _, _ in units:
            for i in range(len(bounds) - 1):
                for name in names:
                    sp.elems(name, i * rows + a * per, i * rows + b * per, False, out)


def sweep_order(
    waits: Sequence[Sequence[int]],
    signals: Sequence[Sequence[int]],
    queues: Sequence[Sequence[int]],
) -> list[int]:
    """A topological order of the counter protocol's must-precede (Kahn's algorithm: a task
    is next once it heads its worker's queue and every counter it waits on has had all its
    signallers). The oracle sweeps in this order; it is an untrusted witness (any order is
    sound, a non-topological one only rejects). Tasks left over (a cycle, a task in no
    queue) go last, in index order."""
    n = len(waits)
    left: dict[int, int] = {}
    for si in signals:
        for c in set(si):
            left[c] = left.get(c, 0) + 1
    waiters: dict[int, list[int]] = {}
    pending = [0] * n
    for t, wa in enumerate(waits):
        for c in set(wa):
            waiters.setdefault(c, []).append(t)
            pending[t] += 1
    where: dict[int, tuple[int, int]] = {}
    for w, q in enumerate(queues):
        for i, t in enumerate(q):
            where[t] = (w, i)
    head = [0] * len(queues)
    ready = deque(q[0] for q in queues if q and pending[q[0]] == 0)
    order: list[int] = []
    done = [False] * n
    while ready:
        t = ready.popleft()
        done[t] = True
        order.append(t)
        for c in set(signals[t]):
            left[c] -= 1
            if left[c] == 0:
                for x in waiters.get(c, ()):
                    pending[x] -= 1
                    if pending[x] == 0 and x in where and head[where[x][0]] == where[x][1]:
                        ready.append(x)
        w, i = where[t]
        head[w] = i + 1
        q = queues[w]
        if i + 1 < len(q) and pending[q[i + 1]] == 0:
            ready.append(q[i + 1])
    order.extend(t for t in range(n) if not done[t])
    return order


def dataflow_payload(
    keys: Sequence[int],
    accs: Sequence[Sequence[Access]],
    waits: Sequence[Sequence[int]],
    signals: Sequence[Sequence[int]],
    queues: Sequence[Sequence[int]],
    order: Sequence[int] | None = None,
) -> dict[str, object]:
    """The `dataflow` field of a D payload for the oracle's sweep (`Plow.Flowsweep`): keys,
    accesses, block size and the sweep order (`order` when given: `sweep_order` of the same
    protocol, computed once for D and F); no pairs and no chains (the oracle finds the
    conflicts and decides their order itself)."""
    return {
        "keys": list(keys),
        "accesses": [[list(a) for a in acc] for acc in accs],
        "block": BLOCK,
        "order": sweep_order(waits, signals, queues) if order is None else list(order),
    }
