"""`tile_graph(graph, target)`: cut every op of a bucket into tiles chosen by the cost model.

Each op kind maps to an index space (axes with extents), arithmetic per point, the bytes a
tile of a given shape moves, and (for matmul-like ops) the on-chip memory a tile needs:

| kind | axes | flops/point |
| --- | --- | --- |
| linear, lm_head | m (tokens), n (out features), k (in features) | 2 |
| attention | rows (batch x tokens x query heads, by key-value head), s (keys), d | 4 (QK, PV) |
| rmsnorm, rope, gated_mlp, residual_add, embedding, sample | rows, cols | per kind |
| expert_linear | m, n, k (expert-major n for gate_up, k for down; a tile in one expert) | 4 / 2 |
| router | rows, cols (all experts of a row in one tile) | 8 |
| ssm_conv, ssm_scan, kda | batch rows, channels / heads (all a row's tokens in a tile) | per kind |
| ssm_norm | rows (tokens), norm groups | 6 x group |

Row-wise ops are tiled by rows and may also split their columns so that a one-token step
still occupies the workers; for the row reductions (rmsnorm's sum of squares, sample's
argmax) a split writes per-step partials that a merge pass reads (charged).

Candidates per axis: the target's minimum tile times powers of two below the extent (up to a
cap), a width that fills the workers in one wave (n), splits of the reduction (k; s for
attention: split-KV with a merge), and one covering tile (`extent` rounded up to the minimum —
a masked tile when the extent is below the minimum). Every combination is costed
(`plow.tiles.cost`); the feasible one with the lowest estimated time wins, ties broken by the
charge and then the candidate order, so the choice is deterministic. docs/tiling.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from plow.errors import GraphError
from plow.graph.ops import Op, OpGraph, OpKind, TensorRole
from plow.target.model import Target, dtype_bytes, rate_class
from plow.tiles.cost import CostModel, busy_probability, cdiv, round_up
from plow.tiles.ir import Axis, Candidate, Tile, TiledOp, TileGraph
from plow.tiles.storage import box_bytes


@dataclass(frozen=True, slots=True)
class TilingOptions:
    """Knobs of the tiler. `activation_dtype` None: activations are stored in the weights'
    dtype (the graph's float32 is the reference executor's); `cache_dtype` None: the
    activation dtype."""

    activation_dtype: str | None = None
    cache_dtype: str | None = None
    max_tile_rows: int = 128
    max_tile_cols: int = 1024
    max_tile_kv: int = 4096
    max_tile_elementwise: int = 16384
    k_splits: tuple[int, ...] = (1, 2, 4)
    # the bytes the bundle stores per weight (plow.tiles.storage.stored_weight_bytes: q4_1
    # blocks 20 per 32 weights, fp8 1 + scales); a weight not named is priced at its dtype
    weight_bytes: Mapping[str, int] | None = None
    # every rung of a bundle reduces a row in the same order: an op's reduction axis takes the
    # steps the tiler picks for one row (`_Tiler.reference_steps`), whatever the bucket
    rung_invariant: bool = True


# the reduction axis of each op kind whose tiles may split it (partials merged in step order)
REDUCTION_AXIS = {
    OpKind.linear: 2,
    OpKind.lm_head: 2,
    OpKind.attention: 1,
    OpKind.rmsnorm: 1,
    OpKind.sample: 1,
    OpKind.add_rmsnorm: 1,  # R1: column tiles write their sums and sums of squares; a merge
    # R2+R3+R13 / R4: k tiles write fp32 partials of every weight row they read (linear_glu:
    # the gate and the up of each output column; linear_qkv: the q, k, v columns side by
    # side); the merge sums them in step order, then applies act(gate) * up / routes q, k, v
    OpKind.linear_glu: 2,
    OpKind.linear_qkv: 2,
}


@dataclass(frozen=True, slots=True)
class _AxisSpec:
    name: str
    extent: int
    sizes: tuple[int, ...]


TileFn = Callable[[tuple[int, ...], tuple[int, ...]], int]


@dataclass(frozen=True, slots=True)
class _Space:
    """An op's index space and how its tiles are costed. The callables take (tile, steps)."""

    axes: tuple[_AxisSpec, ...]
    flops_per_point: int
    rate: str
    bytes: int  # compulsory traffic of the whole op
    weight_bytes: int
    tile_bytes: TileFn
    merge_bytes: TileFn  # traffic of the merge pass of a split reduction (0: none)
    onchip: TileFn  # on-chip bytes one tile needs (0: streams)


def axis_sizes(
    extent: int, minimum: int, limit: int, extra: tuple[int, ...] = ()
) -> tuple[int, ...]:
    """Candidate tile sizes for an axis: `minimum * 2**i` below the extent (up to `limit`),
    `extra` sizes in range, and the covering size (`extent` rounded up to `minimum`), which
    is one masked tile when `extent < minimum`. Sorted, distinct, all `>= minimum`."""
    limit = max(limit, minimum)
    full = round_up(max(extent, 1), minimum)
    sizes = set()
    t = minimum
    while t < extent and t <= limit:
        sizes.add(t)
        t *= 2
    sizes.update(e for e in extra if minimum <= e < extent and e <= limit)
    if full <= limit or not sizes:
        sizes.add(full)
    return tuple(sorted(sizes))


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


class _Tiler:
    def __init__(
        self,
        graph: OpGraph,
        target: Target,
        options: TilingOptions,
        one_row: tuple[int, int] | None = None,
    ) -> None:
        self.graph = graph
        self.one_row = one_row  # (batch, tokens) of the graph, seen as one row (one token)
        self._reference: _Tiler | None = None
        self.target = target
        self.opt = options
        weights = [t for t in graph.tensors.values() if t.role is TensorRole.weight]
        self.weight_dtype = weights[0].dtype if weights else "float32"
        self.act_dtype = options.activation_dtype or self.weight_dtype
        self.cache_dtype = options.cache_dtype or self.act_dtype
        try:
            self.w = dtype_bytes(self.weight_dtype)
            self.a = dtype_bytes(self.act_dtype)
            self.c = dtype_bytes(self.cache_dtype)
            self.mm_rate = rate_class(self.weight_dtype)
            self.attn_rate = rate_class(self.act_dtype)
        except ValueError as e:
            raise GraphError(graph.bucket_name or "graph", str(e)) from e
        self.rmin = target.min_tile.rows
        self.cmin = target.min_tile.cols
        self.stored = dict(options.weight_bytes or {})

    def wtotal(self, name: str) -> int:
        """Bytes of weight `name` as stored (plow.tiles.storage), else at the weights' dtype."""
        s = self.stored.get(name)
        return s if s is not None else _numel(self.shape(name)) * self.w

    def wbox(self, name: str, elems: int) -> int:
        """Bytes a tile reading `elems` elements of weight `name` moves."""
        s = self.stored.get(name)
        return box_bytes(s, _numel(self.shape(name)), elems) if s is not None else elems * self.w

    def shape(self, name: str) -> tuple[int, ...]:
        t = self.graph.tensor(name)
        if self.one_row is None or t.role is TensorRole.weight:
            return t.shape
        b, n = self.one_row  # the same tensor in a one-row, one-token bucket
        s = t.shape
        if t.role in (TensorRole.cache, TensorRole.state):
            return (1, *s[1:]) if s and s[0] == b else s
        if len(s) >= 2 and s[:2] == (b, n):
            return (1, 1, *s[2:])
        return (1,) if s == (b,) else s

    def reference_steps(self, op: Op, axis: int) -> int | None:
        """The steps of `op`'s reduction `axis` that the tiler picks for the op at one row of
        one token (decode batch 1): a rule that does not depend on the bucket, so every rung
        splits a row's reduction the same way (None: the graph has no `ids` input to scale)."""
        if self._reference is None:
            if "ids" not in self.graph.tensors or len(self.graph.tensor("ids").shape) != 2:
                return None
            b, n = self.graph.tensor("ids").shape
            self._reference = _Tiler(self.graph, self.target, self.opt, (b, n))
        ref = self._reference
        sp = ref.space(op)
        cands = ref.candidates(sp, ref.cost_model(sp))
        feasible = [i for i, c in enumerate(cands) if c.feasible]
        if not feasible:
            return None
        best = min(feasible, key=lambda i: (cands[i].time_ns, cands[i].charged_cost, i))
        return cands[best].steps[axis]

    def cost_model(self, sp: _Space) -> CostModel:
        return CostModel(
            workers=self.target.workers,
            bandwidth=self.target.bandwidth_bytes_per_s,
            peak=self.target.peak_flops_per_s[sp.rate],  # type: ignore[index]
            tile_overhead_ns=self.target.tile_overhead_ns,
        )

    # -- index spaces -------------------------------------------------------------------
    def space(self, op: Op) -> _Space:
        k = op.kind
        if k in (OpKind.linear, OpKind.lm_head, OpKind.linear_glu, OpKind.linear_qkv):
            return self.matmul(op)
        if k is OpKind.attention:
            return self.attention(op)
        if k is OpKind.expert_linear:
            return self.experts(op)
        if k is OpKind.router:
            return self.router(op)
        if k in (OpKind.ssm_conv, OpKind.ssm_scan, OpKind.ssm_norm, OpKind.kda):
            return self.ssm(op)
        if k in (
            OpKind.rmsnorm,
            OpKind.rope,
            OpKind.gated_mlp,
            OpKind.residual_add,
            OpKind.allreduce,
            OpKind.embedding,
            OpKind.sample,
            OpKind.add_rmsnorm,
        ):
            return self.rowwise(op)
        raise GraphError(op.name, f"no tiling rule for op kind {k.value!r}")

    def matmul(self, op: Op) -> _Space:
        x, wname = op.inputs[0], op.inputs[1]
        n_out, k_in = self.shape(wname)
        m = _numel(self.shape(x)) // k_in
        a, w, W = self.a, self.w, self.target.workers
        # R19 (plow/egraph/apply.py): an lm_head's third input is its prologue norm's weight
        # [k]; each tile normalises whole input rows (and multiplies its k slice of them)
        prologue = op.kind is OpKind.lm_head and len(op.inputs) == 3
        bias = n_out * w if len(op.inputs) == 3 and not prologue else 0
        weight = n_out * k_in * w + bias + (k_in * w if prologue else 0)
        # linear_glu (R2+R3+R13): output column n reads weight rows 2n and 2n + 1
        glu = 2 if op.kind is OpKind.linear_glu else 1
        n_out //= glu
        one_wave = round_up(cdiv(n_out, W), self.cmin)
        k_sizes = {round_up(k_in, self.cmin)}
        for s in self.opt.k_splits:
            if s > 1 and cdiv(k_in, s) >= self.cmin:
                t = round_up(cdiv(k_in, s), self.cmin)
                if cdiv(k_in, t) > 1:
                    k_sizes.add(t)
        # the weight as the bundle stores it (plow.tiles.storage: blocks, fp8 and its scales)
        weight += self.wtotal(wname) - glu * n_out * k_in * w
        axes = (
            _AxisSpec("m", m, axis_sizes(m, self.rmin, self.opt.max_tile_rows)),
            _AxisSpec(
                "n", n_out, axis_sizes(n_out, self.cmin, self.opt.max_tile_cols, (one_wave,))
            ),
            _AxisSpec("k", k_in, tuple(sorted(k_sizes, reverse=True))),
        )

        def tile_bytes(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            mt, nt, kt = t
            # a split reduction writes fp32 partials (linear_glu: a gate's and an up's)
            out = a if s[2] == 1 else 4 * glu
            ext = (k_in - kt) * mt * a if prologue else 0  # the rest of its rows, for the norm
            wt = self.wbox(wname, glu * nt * kt)
            return mt * kt * a + wt + mt * nt * out + (nt * w if bias else 0) + ext

        def merge_bytes(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            if s[2] == 1:
                return 0
            mp, np_ = t[0] * s[0], t[1] * s[1]
            return s[2] * mp * np_ * 4 * glu + mp * np_ * a

        def onchip(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            mt, nt, kt = t
            return glu * mt * nt * 4 + 2 * (mt + glu * nt) * min(kt, 64) * max(a, w)

        return _Space(
            axes=axes,
            flops_per_point=2 * glu,
            rate=self.mm_rate,
            bytes=m * k_in * a + weight + m * n_out * a,
            weight_bytes=weight,
            tile_bytes=tile_bytes,
            merge_bytes=merge_bytes,
            onchip=onchip,
        )

    def expert_sizes(self, op: Op, width: int, what: str) -> tuple[int, ...]:
        """Tile sizes along an expert-major axis: each tile lies in one expert's `width`
        columns (so the router's weight for that expert gates the whole tile): the
        minimum times powers of two dividing `width`, and `width` itself."""
        if width < self.cmin:
            from plow.errors import PlanRejected

            raise PlanRejected(
                f"op {op.name!r}",
                f"expert {what} {width} is below the minimum tile {self.cmin} of target "
                f"{self.target.name}: a tile would straddle two experts",
            )
        sizes = {width}
        t = self.cmin
        while t < width and t <= self.opt.max_tile_cols:
            if width % t == 0:
                sizes.add(t)
            t *= 2
        return tuple(sorted(sizes))

    def experts(self, op: Op) -> _Space:
        """`expert_linear`: axes (m, n, k) over every expert; a tile lies in one expert.

        gate_up: n = E*N output columns (expert-major), k = K unsplit, two products per point
        (gate and up rows of the stacked weight [E, 2N, K]); down: n = N, k = E*K with one
        step per expert (k tile = K): a split reduction over the experts whose merge sums
        the router-weighted expert outputs in ascending expert order. Costs are the worst
        case (every expert has a token: what the plan must fit); `plow.tiles.summary`
        reports the expected load beside it."""
        x, _route, wname = op.inputs
        n_exp, wn, k_in = self.shape(wname)
        gate_up = op.attrs["mode"] == "gate_up"
        n_out = n_exp * (wn // 2) if gate_up else wn
        m = _numel(self.shape(x)) // self.shape(x)[-1]
        a, w, W = self.a, self.w, self.target.workers
        weight = self.wtotal(wname)
        if gate_up:
            n_sizes = self.expert_sizes(op, wn // 2, "width")
            k_ext, k_sizes = k_in, (round_up(k_in, self.cmin),)
        else:
            one_wave = round_up(cdiv(n_out, W), self.cmin)
            n_sizes = axis_sizes(n_out, self.cmin, self.opt.max_tile_cols, (one_wave,))
            k_ext, k_sizes = n_exp * k_in, (self.expert_sizes(op, k_in, "input width")[-1],)
        axes = (
            _AxisSpec("m", m, axis_sizes(m, self.rmin, self.opt.max_tile_rows)),
            _AxisSpec("n", n_out, n_sizes),
            _AxisSpec("k", k_ext, k_sizes),
        )
        products = 2 if gate_up else 1

        def tile_bytes(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            mt, nt, kt = t
            out = a if s[2] == 1 else 4
            return mt * kt * a + self.wbox(wname, products * nt * kt) + mt * nt * out + mt * 4

        def merge_bytes(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            if s[2] == 1:
                return 0
            mp, np_ = t[0] * s[0], t[1] * s[1]
            return s[2] * mp * np_ * 4 + mp * np_ * a

        def onchip(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            mt, nt, kt = t
            return products * mt * nt * 4 + 2 * (mt + products * nt) * min(kt, 64) * max(a, w)

        return _Space(
            axes=axes,
            flops_per_point=2 * products,
            rate=self.mm_rate,
            bytes=m * k_ext * a + weight + m * n_exp * 4 + m * n_out * a,
            weight_bytes=weight,
            tile_bytes=tile_bytes,
            merge_bytes=merge_bytes,
            onchip=onchip,
        )

    def router(self, op: Op) -> _Space:
        """`router`: rows of router logits, the experts of a row in one tile (top-k reads the
        whole row): softmax, selection and renormalisation, 8 flops per point."""
        x = self.shape(op.inputs[0])
        rows, cols = _numel(x) // x[-1], x[-1]
        a = self.a
        axes = (
            _AxisSpec("rows", rows, axis_sizes(rows, self.rmin, self.opt.max_tile_rows)),
            _AxisSpec("cols", cols, (round_up(cols, self.cmin),)),
        )

        def tile_bytes(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            return t[0] * t[1] * (a + 4)

        def zero(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            return 0

        # a per-expert vector [E] (Gemma 4's scales, DeepSeek-V3's correction bias), read whole
        weight = sum(_numel(self.shape(n)) * self.w for n in op.inputs[1:])
        return _Space(
            axes=axes,
            flops_per_point=8,
            rate="fp32",
            bytes=rows * cols * (a + 4) + weight,
            weight_bytes=weight,
            tile_bytes=tile_bytes,
            merge_bytes=zero,
            onchip=zero,
        )

    def ssm(self, op: Op) -> _Space:
        """Mamba-2's ops and Kimi-Linear's `kda`. `ssm_conv`: axes (batch rows, conv
        channels); `ssm_scan`, `kda`: (batch rows, heads). A tile holds every token of its
        rows: the recurrence runs through them in order, reading and rewriting the rows'
        state (conv window / heads' SSM or KDA state) once per step; tiles never share state
        words. `ssm_norm`: (token rows, norm groups). All stream (the state is read from and
        written to memory)."""
        a, k = self.a, op.kind
        weight = 0
        if k is OpKind.ssm_conv:
            b, t, ch = self.shape(op.outputs[0])
            kern = int(op.attrs["kernel"])
            rows, cols = b, ch
            fpp = t * (2 * kern + 5)  # taps, bias, silu
            per_point = 2 * t * a + 2 * (kern - 1) * 4
            weight = ch * (kern + (len(op.inputs) == 5)) * self.w  # taps (+ bias)
        elif k is OpKind.ssm_scan:
            b, t, _ = self.shape(op.inputs[0])
            h, p, n = (int(op.attrs[x]) for x in ("heads", "head_dim", "state_size"))
            rows, cols = b, h
            fpp = t * (6 * p * n + 4 * p + 8)  # decay, B x, state update, C readout, D, dt
            per_point = t * (2 * p + 2 * n + 1) * a + 2 * p * n * 4
            weight = 3 * h * self.w
        elif k is OpKind.kda:  # Kimi-Linear: (batch rows, heads), the same rules as the scan
            b, t, _ = self.shape(op.inputs[0])
            h, d = int(op.attrs["heads"]), int(op.attrs["head_dim"])
            rows, cols = b, h
            # l2 norms, decay, S^T k, rank-1 update, S^T q, gated norm per token
            fpp = t * (8 * d * d + 20 * d + 10)
            per_point = t * (6 * d + 1) * a + 2 * d * d * 4  # q k v f gate out, beta; S
            weight = (h * d + h + d) * self.w  # dt_bias, A_log, o_norm
        else:
            x = self.shape(op.inputs[0])
            gs = int(op.attrs["group"])
            rows, cols = _numel(x) // x[-1], x[-1] // gs
            fpp, per_point = 6 * gs, 3 * gs * a
            weight = x[-1] * self.w
        axes = (
            _AxisSpec("rows", rows, axis_sizes(rows, self.rmin, self.opt.max_tile_rows)),
            _AxisSpec("cols", cols, axis_sizes(cols, self.cmin, self.opt.max_tile_elementwise)),
        )
        per_col = weight // cols

        def tile_bytes(tl: tuple[int, ...], s: tuple[int, ...]) -> int:
            return tl[0] * tl[1] * per_point + tl[1] * per_col

        def zero(tl: tuple[int, ...], s: tuple[int, ...]) -> int:
            return 0

        return _Space(
            axes=axes,
            flops_per_point=fpp,
            rate="fp32",
            bytes=rows * cols * per_point + weight,
            weight_bytes=weight,
            tile_bytes=tile_bytes,
            merge_bytes=zero,
            onchip=zero,
        )

    def attention(self, op: Op) -> _Space:
        q, kc = op.inputs[0], op.inputs[3]
        b, t = self.shape(q)[0], self.shape(q)[1]
        heads, kvh, d = op.attrs["heads"], op.attrs["kv_heads"], op.attrs["head_dim"]
        ctx = self.shape(kc)[2]
        window = op.attrs.get("window")
        s_ext = ctx if window is None else min(ctx, window + t - 1)
        rows = b * t * heads
        block = t * (heads // kvh)  # rows sharing one key-value head (rows grouped by it)
        a, c = self.a, self.c
        axes = (
            # whole key-value groups are candidates too: their rows share one read of the keys
            _AxisSpec(
                "rows",
                rows,
                axis_sizes(
                    rows, self.rmin, self.opt.max_tile_rows,
                    tuple(block << i for i in range(8) if block << i < rows),
                ),
            ),  # fmt: skip
            # even splits too: a split's steps share the live keys evenly at run time
            # (tiles.h), so S steps of ceil(extent / S) keys are what a split costs
            _AxisSpec(
                "s",
                s_ext,
                axis_sizes(
                    s_ext, self.cmin, self.opt.max_tile_kv,
                    tuple(round_up(cdiv(s_ext, n), self.cmin) for n in (2, 3, 4, 8)),
                ),
            ),  # fmt: skip
            _AxisSpec("d", d, (round_up(d, self.cmin),)),
        )

        def kv_heads_touched(rt: int) -> int:
            return min(cdiv(rt, block), b * kvh)

        def tile_bytes(tl: tuple[int, ...], s: tuple[int, ...]) -> int:
            rt, st, dt = tl
            out = rt * dt * a if s[1] == 1 else rt * (dt * 4 + 8)  # partials + (max, sum)
            return kv_heads_touched(rt) * st * dt * 2 * c + rt * dt * a + out

        def merge_bytes(tl: tuple[int, ...], s: tuple[int, ...]) -> int:
            if s[1] == 1:
                return 0
            rp = tl[0] * s[0]
            return s[1] * rp * (tl[2] * 4 + 8) + rp * tl[2] * a

        def onchip(tl: tuple[int, ...], s: tuple[int, ...]) -> int:
            rt, st, dt = tl
            return (
                rt * dt * a
                + rt * min(st, 256) * 4
                + 2 * min(st, 64) * dt * c * kv_heads_touched(rt)
            )

        compulsory = (
            rows * d * a  # queries
            + 2 * b * t * kvh * d * (a + c)  # new keys/values read, written into the cache
            + 2 * b * kvh * s_ext * d * c  # cache read
            + rows * d * a  # output
        )
        return _Space(
            axes=axes,
            flops_per_point=4,
            rate=self.attn_rate,
            bytes=compulsory,
            weight_bytes=0,
            tile_bytes=tile_bytes,
            merge_bytes=merge_bytes,
            onchip=onchip,
        )

    def rowwise(self, op: Op) -> _Space:
        a, w, k = self.a, self.w, op.kind
        per_row = 0  # extra bytes per row (ids, positions, sampled index)
        weight = 0
        gather: str | None = None  # embedding: the table whose rows it reads, as stored
        if k is OpKind.embedding:
            rows, cols = _numel(self.shape(op.inputs[0])), self.shape(op.inputs[1])[1]
            fpp, per_point, per_row, gather = 1, a, 4, op.inputs[1]
            if len(op.inputs) == 3:  # R18: the rows and their norm (whole rows per tile)
                fpp, per_point, weight = 5, 2 * a, cols * w
        elif k is OpKind.rmsnorm:
            x = self.shape(op.inputs[0])
            cols = int(op.attrs.get("group", x[-1]))
            rows = _numel(x) // cols
            fpp, per_point, weight = 4, 2 * a, cols * w
        elif k is OpKind.rope:
            x = self.shape(op.inputs[0])
            rows, cols = _numel(x) // x[-1], x[-1]
            fpp, per_point, per_row = 3, 2 * a, 4
        elif k is OpKind.gated_mlp:
            x = self.shape(op.inputs[0])
            rows, cols = _numel(x) // x[-1], x[-1]
            fpp = 5 if op.attrs.get("activation", "silu") == "silu" else 9
            per_point = 3 * a
        elif k is OpKind.residual_add:
            x = self.shape(op.inputs[0])
            rows, cols = _numel(x) // x[-1], x[-1]
            fpp, per_point = 1, 3 * a
        elif k is OpKind.allreduce:  # reads every device's partial, writes the sum
            x = self.shape(op.inputs[0])
            rows, cols = _numel(x) // x[-1], x[-1]
            fpp, per_point = len(op.inputs) - 1, (len(op.inputs) + 1) * a
        elif k is OpKind.add_rmsnorm:  # R1: reads a, b; writes the sum and its norm
            x = self.shape(op.inputs[0])
            rows, cols = _numel(x) // x[-1], x[-1]
            fpp, per_point, weight = 5, 4 * a, cols * w
        else:  # sample: one logits row per batch row (the sampled position)
            logits = self.shape(op.inputs[0])
            rows, cols = logits[0], logits[-1]
            fpp, per_point, per_row = 1, a, 8
        one_wave = round_up(cdiv(cols, self.target.workers), self.cmin)
        col_sizes = axis_sizes(cols, self.cmin, self.opt.max_tile_elementwise, (one_wave,))
        if k is OpKind.embedding and len(op.inputs) == 3:  # R18: a tile normalises whole rows
            col_sizes = (round_up(max(cols, 1), self.cmin),)
        if k is OpKind.sample and any(
            o.kind is OpKind.lm_head and op.inputs[0] in o.outputs for o in self.graph.ops
        ):  # greedy fused into lm_head (plow/bundle/argmax.py): lm_head reduces the columns
            col_sizes = (round_up(max(cols, 1), self.cmin),)  # one tile: no sample partials
        axes = (
            _AxisSpec("rows", rows, axis_sizes(rows, self.rmin, self.opt.max_tile_rows)),
            _AxisSpec("cols", cols, col_sizes),
        )
        # rmsnorm (sum of squares) and sample (argmax) reduce over the row: a split row
        # writes per-step partials that a merge pass reads; a split norm reads x twice.
        reduces = k in (OpKind.rmsnorm, OpKind.sample, OpKind.add_rmsnorm)
        reread = a if k in (OpKind.rmsnorm, OpKind.add_rmsnorm) else 0

        def tile_bytes(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            pp = per_point + (reread if s[1] > 1 else 0)
            table = self.wbox(gather, t[0] * t[1]) if gather else 0
            return t[0] * t[1] * pp + t[0] * per_row + (t[1] * w if weight else 0) + table

        def merge_bytes(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            return 2 * s[1] * t[0] * s[0] * 8 if reduces and s[1] > 1 else 0

        def zero(t: tuple[int, ...], s: tuple[int, ...]) -> int:
            return 0

        gathered = self.wbox(gather, rows * cols) if gather else 0
        return _Space(
            axes=axes,
            flops_per_point=fpp,
            rate="fp32",
            bytes=rows * cols * per_point + rows * per_row + weight + gathered,
            weight_bytes=weight,
            tile_bytes=tile_bytes,
            merge_bytes=merge_bytes,
            onchip=zero,
        )

    # -- candidates ----------------------------------------------------------------------
    def candidates(self, sp: _Space, cm: CostModel) -> list[Candidate]:
        out = []
        W = self.target.workers
        onchip_cap = self.target.onchip_bytes_per_worker
        for tile in itertools.product(*(ax.sizes for ax in sp.axes)):
            steps = tuple(cdiv(ax.extent, t) for ax, t in zip(sp.axes, tile, strict=True))
            ntiles = math.prod(steps)
            tile_flops = sp.flops_per_point * math.prod(tile)
            tile_bytes = sp.tile_bytes(tile, steps)
            fe = cm.tile_fe(tile_bytes, tile_flops)
            merge = sp.merge_bytes(tile, steps)
            tile_ns = cm.fe_to_worker_ns(fe)
            waves = cdiv(ntiles, W)
            time_ns = waves * tile_ns
            charged = ntiles * fe
            if merge:
                time_ns += cm.device_ns(merge) + self.target.tile_overhead_ns
                charged += cm.bytes_fe(merge) + cm.overhead_fe
            need = sp.onchip(tile, steps)
            feasible = need <= onchip_cap
            note = (
                "" if feasible else f"needs {need} on-chip bytes per tile, worker has {onchip_cap}"
            )
            out.append(
                Candidate(
                    tile=tile,
                    steps=steps,
                    tiles=ntiles,
                    tile_bytes=tile_bytes,
                    tile_flops=tile_flops,
                    tile_ns=tile_ns,
                    waves=waves,
                    time_ns=time_ns,
                    charged_cost=charged,
                    padded_work=ntiles * tile_flops,
                    feasible=feasible,
                    note=note,
                )
            )
        return out

    def tile_op(self, op: Op) -> TiledOp:
        sp = self.space(op)
        cands = self.candidates(sp, self.cost_model(sp))
        feasible = [i for i, c in enumerate(cands) if c.feasible]
        if not feasible:
            from plow.errors import PlanRejected

            smallest = min(cands, key=lambda c: c.tile)
            raise PlanRejected(
                f"op {op.name!r}",
                f"no tiling fits on-chip memory of target {self.target.name}: {smallest.note}",
            )
        axis = REDUCTION_AXIS.get(op.kind)
        if self.opt.rung_invariant and axis is not None:
            steps = self.reference_steps(op, axis)
            same = [i for i in feasible if cands[i].steps[axis] == steps]
            # none: the bucket's extent differs from the one-row reference's (a sliding
            # window's keys grow with the tokens of a prefill row) and offers no such split
            if same and len(same) < len(feasible):
                note = f"rung invariance: {steps} {sp.axes[axis].name} steps (the one-row choice)"
                for i in set(feasible) - set(same):
                    cands[i] = dataclasses.replace(cands[i], feasible=False, note=note)
                feasible = same
        best = min(feasible, key=lambda i: (cands[i].time_ns, cands[i].charged_cost, i))
        choice = cands[best]
        axes = tuple(
            Axis(ax.name, ax.extent, t, s)
            for ax, t, s in zip(sp.axes, choice.tile, choice.steps, strict=True)
        )
        busy, expected = 1.0, None
        if op.kind is OpKind.expert_linear:
            busy, expected = self.expected_load(op, axes, choice)
        return TiledOp(
            name=op.name,
            kind=op.kind.value,
            layer=op.layer,
            rate=sp.rate,
            axes=axes,
            flops_per_point=sp.flops_per_point,
            flops=sp.flops_per_point * math.prod(ax.extent for ax in sp.axes),
            bytes=sp.bytes,
            weight_bytes=sp.weight_bytes,
            candidates=tuple(cands),
            chosen=best,
            tiles=enumerate_tiles(op.name, axes),
            inputs=op.inputs,
            outputs=op.outputs,
            expected_busy=busy,
            expected_ns=expected,
        )

    def expected_load(
        self, op: Op, axes: tuple[Axis, ...], choice: Candidate
    ) -> tuple[float, float]:
        """(expected share of busy tiles, expected time in ns) of an `expert_linear` op when
        each row picks `top_k` of the `E` experts uniformly at random: a tile of `r` rows is
        busy with probability `1 - (1 - k/E)^r`; an idle tile costs its overhead only. The
        worst case (every tile busy) is what the tiling is charged and must fit."""
        route = self.shape(op.inputs[1])
        n_exp = route[-1]
        k = 0
        for other in self.graph.ops:
            if other.outputs and other.outputs[0] == op.inputs[1]:
                k = int(other.attrs.get("top_k", n_exp))
        m = axes[0]
        rows = [b - a for a, b in m.ranges()]
        busy = sum(busy_probability(r, k, n_exp) for r in rows) / max(1, len(rows))
        over = float(self.target.tile_overhead_ns)
        return busy, choice.waves * (busy * choice.tile_ns + (1.0 - busy) * over)


def enumerate_tiles(op: str, axes: tuple[Axis, ...]) -> tuple[Tile, ...]:
    """Every tile of a tiling, row-major over the axes (last axis fastest)."""
    ranges = [ax.ranges() for ax in axes]
    masks = [[j * ax.tile + ax.tile > ax.extent for j in range(ax.steps)] for ax in axes]
    return tuple(
        Tile(op, i, rs, True in ms)
        for i, (rs, ms) in enumerate(
            zip(itertools.product(*ranges), itertools.product(*masks), strict=True)
        )
    )


def tile_graph(graph: OpGraph, target: Target, options: TilingOptions | None = None) -> TileGraph:
    """The tiled plan of one bucket's graph on `target` (pure and deterministic)."""
    t = _Tiler(graph, target, options or TilingOptions())
    ops = tuple(t.tile_op(op) for op in graph.ops)
    rates = {o.rate for o in ops} or {t.mm_rate}
    # tensor parallel: `gpus` devices, each with the target's bandwidth and peak, so a step
    # takes at least the plan's bytes over the group's bandwidth (flops: its peak)
    n = target.gpus
    devices = tuple(int(op.attrs.get("device", 0)) for op in graph.ops) if n > 1 else ()
    return TileGraph(
        bucket=graph.bucket_name,
        target=target.name,
        workers=target.workers,
        ops=ops,
        edges=tuple(graph.edges()),
        weight_dtype=t.weight_dtype,
        activation_dtype=t.act_dtype,
        cache_dtype=t.cache_dtype,
        peak_flops_per_s=n * max(target.peak_flops_per_s[r] for r in rates),  # type: ignore[index]
        bandwidth_bytes_per_s=n * target.bandwidth_bytes_per_s,
        devices=devices,
    )
