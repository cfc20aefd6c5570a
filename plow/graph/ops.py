"""Ops, tensors and shape inference.

Each op kind has one shape rule (`infer_shapes`); the builder declares every tensor through
it, and `OpGraph.validate` re-runs it, so a graph with an inconsistent dim cannot exist.
Semantics of each kind (what the reference executor computes) are in docs/graph.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from plow.errors import GraphError

Shape = tuple[int, ...]


class OpKind(str, Enum):
    embedding = "embedding"
    rmsnorm = "rmsnorm"
    linear = "linear"
    rope = "rope"
    attention = "attention"  # also writes the new keys/values into the cache
    gated_mlp = "gated_mlp"  # act(gate) * up, between the gate/up and down linears
    residual_add = "residual_add"
    lm_head = "lm_head"
    sample = "sample"
    router = "router"  # router logits -> dense combine weights (top-k kept, the rest 0)
    expert_linear = "expert_linear"  # stacked experts, gated by the router's weights
    # Mamba-2 (docs/families.md): each reads and updates its row's recurrent state in place
    ssm_conv = "ssm_conv"  # causal depthwise conv over the xBC columns of in_proj, then SiLU
    ssm_scan = "ssm_scan"  # the selective-scan recurrence per head (dt, A, B, C, D skip)
    ssm_norm = "ssm_norm"  # gated RMSNorm: y * silu(z), normalised per group
    # Kimi-Linear (plow/graph/kda.py): the delta-rule recurrence per head and its gated norm,
    # reading and updating its row's recurrent state in place
    kda = "kda"
    # fused (plow/egraph, opt-in `CompileProfile.fuse`): R1, a + b and rmsnorm(a + b) in one op
    add_rmsnorm = "add_rmsnorm"
    # R2+R3+R13: one linear over interleave(Wg, Wu) (row 2i gate i, 2i+1 up i), act(g) * u after
    linear_glu = "linear_glu"
    # R4: one linear over cat3(Wq, Wk, Wv) writing q, k and v (its rows split by the widths of
    # its three outputs, so it has no attributes: `OpGraph.validate` checks the outputs)
    linear_qkv = "linear_qkv"
    # R18 likewise: an `embedding` with a third input, the first norm's weight (attrs the
    # embedding's, the norm's under "norm"), writes the rows and their full-width norm
    # R19 is no kind of its own: an `lm_head` with a third input, the final norm's weight
    # (inputs x, W, norm weight; attrs the norm's), normalises x in its prologue
    # tensor parallel (plow/graph/shard.py): the sum of every device's partial [.., N] in
    # device order, written on one device (one op per device: each reads all the partials)
    allreduce = "allreduce"


class TensorRole(str, Enum):
    input = "input"  # written by the host before a step (token ids, positions)
    weight = "weight"
    activation = "activation"
    cache = "cache"  # key-value cache, persists across steps
    state = "state"  # recurrent state, one fixed-size block per sequence, persists across steps
    output = "output"  # read by the host after a step


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    shape: Shape
    role: TensorRole
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Op:
    name: str
    kind: OpKind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    layer: int | None = None


def _need(op: str, cond: bool, msg: str) -> None:
    if not cond:
        raise GraphError(op, msg)


def infer_shapes(
    kind: OpKind, name: str, ins: list[Shape], attrs: Mapping[str, Any]
) -> list[Shape]:
    """Output shapes of an op from its input shapes; raises `GraphError` on a mismatch."""
    if kind is OpKind.embedding:
        ids, table = ins[0], ins[1]
        _need(
            name,
            len(ids) == 2 and len(table) == 2,
            f"embedding wants ids[B,T], table[V,H]; got {ids}, {table}",
        )
        if len(ins) == 3:  # R18 (plow/egraph): the first norm's weight; outputs rows, their norm
            _need(name, ins[2] == (table[1],), f"embedding norm weight {ins[2]} != [{table[1]}]")
            return [(*ids, table[1]), (*ids, table[1])]
        return [(*ids, table[1])]
    if kind is OpKind.rmsnorm:
        # no weight input (Gemma 4's v_norm): the scale is `offset` alone
        x, w = ins[0], (ins[1] if len(ins) > 1 else (attrs.get("group", ins[0][-1]),))
        group = attrs.get("group", x[-1])
        _need(
            name,
            x[-1] % group == 0 and w == (group,),
            f"rmsnorm weight {w} does not match group {group} of {x}",
        )
        return [x]
    if kind is OpKind.linear:
        x, w = ins[0], ins[1]
        _need(name, len(w) == 2 and x[-1] == w[1], f"linear input {x} does not match weight {w}")
        if len(ins) == 3:
            _need(name, ins[2] == (w[0],), f"bias {ins[2]} does not match weight {w}")
        return [(*x[:-1], w[0])]
    if kind is OpKind.rope:
        x, pos = ins
        heads, hd = attrs["heads"], attrs["head_dim"]
        _need(
            name,
            x[-1] == heads * hd and pos == x[:-1],
            f"rope input {x} / positions {pos} mismatch",
        )
        _need(name, hd % 2 == 0, f"head_dim {hd} must be even for rope")
        return [x]
    if kind is OpKind.attention:
        q, k, v, kc, vc, pos = ins
        h, kvh, hd = attrs["heads"], attrs["kv_heads"], attrs["head_dim"]
        b, t = q[0], q[1]
        _need(name, q == (b, t, h * hd), f"query {q} is not [B,T,{h}*{hd}]")
        _need(name, k == v == (b, t, kvh * hd), f"keys {k} / values {v} are not [B,T,{kvh}*{hd}]")
        _need(
            name, kc == vc and kc[0] == b and kc[1] == kvh and kc[3] == hd, f"cache {kc} mismatch"
        )
        _need(name, kc[2] >= t, f"cache length {kc[2]} is below the {t} tokens a step writes")
        _need(name, pos == (b, t), f"positions {pos} are not [B,T]")
        _need(name, h % kvh == 0, f"{h} heads are not a multiple of {kvh} key-value heads")
        return [q]
    if kind is OpKind.gated_mlp:
        g, u = ins
        _need(name, g == u, f"gate {g} and up {u} differ")
        return [g]
    if kind is OpKind.residual_add:
        a, b_ = ins[0], ins[1]
        _need(name, a == b_, f"residual operands {a} and {b_} differ")
        # a third input [1] scales the sum (Gemma 4's layer_scalar)
        _need(name, len(ins) == 2 or ins[2] == (1,), f"residual scale {ins[2:]} is not [1]")
        return [a]
    if kind is OpKind.allreduce:  # the partials of every device, one shape
        _need(name, len(ins) >= 2, f"allreduce wants at least two partials, got {len(ins)}")
        _need(name, all(s == ins[0] for s in ins), f"allreduce partials {ins} differ in shape")
        return [ins[0]]
    if kind is OpKind.add_rmsnorm:  # inputs a, b, norm weight; outputs a + b, rmsnorm(a + b)
        a, b_, w = ins
        _need(name, a == b_, f"residual operands {a} and {b_} differ")
        _need(name, w == (a[-1],), f"rmsnorm weight {w} does not match {a} (full-width norm)")
        return [a, a]
    if kind is OpKind.linear_glu:  # x [.., K], w [2N, K] (interleaved) -> [.., N]
        x, w = ins
        _need(
            name,
            len(w) == 2 and x[-1] == w[1] and w[0] % 2 == 0,
            f"linear_glu input {x} does not match interleaved weight {w}",
        )
        return [(*x[:-1], w[0] // 2)]
    if kind is OpKind.linear_qkv:
        raise GraphError(name, "linear_qkv's output widths are its outputs' (OpGraph.validate)")
    if kind is OpKind.lm_head:
        x, w = ins[0], ins[1]
        _need(name, len(w) == 2 and x[-1] == w[1], f"lm_head input {x} does not match weight {w}")
        # R19 (plow/egraph): a third input is the final norm's weight, the norm (its attrs
        # eps, offset) in the lm_head's prologue: full width, no softcap
        _need(
            name,
            len(ins) == 2 or (ins[2] == (x[-1],) and not attrs.get("softcap")),
            f"lm_head norm weight {ins[2:]} does not match input {x} (full-width, no softcap)",
        )
        return [(*x[:-1], w[0])]
    if kind is OpKind.sample:
        logits, idx = ins
        _need(
            name,
            len(logits) == 3 and idx == (logits[0],),
            f"sample wants logits[B,T,V], index[B]; got {logits}, {idx}",
        )
        return [(logits[0],)]
    if kind is OpKind.router:
        # optional second input: per-expert scales [E] of the kept weights (Gemma 4); attr
        # `logit_scale` multiplies the logits before the softmax
        logits = ins[0]
        top, n_exp = int(attrs["top_k"]), logits[-1]
        _need(name, 1 <= top <= n_exp, f"router top_k {top} outside 1..{n_exp} experts")
        _need(name, len(ins) == 1 or ins[1] == (n_exp,), f"expert scales {ins[1:]} are not [E]")
        return [logits]
    if kind is OpKind.expert_linear:
        # gate_up: x[.., K] (shared), w[E, 2N, K] -> act(x w_gate^T) * (x w_up^T) per expert,
        #   out[.., E*N] (expert e's columns e*N .. e*N+N);
        # down: x[.., E*K] (expert e's columns e*K ..), w[E, N, K] -> out[.., N], the
        #   router-weighted sum over experts. Input 1 is the router's weights [.., E].
        x, r, w = ins
        _need(name, len(w) == 3, f"expert weight {w} is not [E, N, K]")
        n_exp, wn, kin = w
        _need(name, r[-1] == n_exp and r[:-1] == x[:-1], f"router weights {r} do not fit {x}, {w}")
        if attrs["mode"] == "gate_up":
            _need(name, x[-1] == kin and wn % 2 == 0, f"input {x} does not match weight {w}")
            return [(*x[:-1], n_exp * (wn // 2))]
        _need(name, attrs["mode"] == "down", f"unknown expert_linear mode {attrs['mode']!r}")
        _need(name, x[-1] == n_exp * kin, f"input {x} is not {n_exp} experts x {kin} columns")
        return [(*x[:-1], wn)]
    if kind in (OpKind.ssm_conv, OpKind.ssm_scan, OpKind.ssm_norm):
        return _ssm_shapes(kind, name, ins, attrs)
    if kind is OpKind.kda:
        # conv out [B,T,3C] (q|k|v), f [B,T,C], beta [B,T,H], gate [B,T,C], dt_bias [C],
        # A_log [1,1,H,1], o_norm [D], state [B,H,D,D], positions [B,T]
        x, f, beta, gate, dtb, alog, nw, st, pos = ins
        h, d = int(attrs["heads"]), int(attrs["head_dim"])
        c = h * d
        b, t = x[0], x[1]
        _need(name, x == (b, t, 3 * c), f"conv output {x} is not [B,T,3*{h}*{d}]")
        _need(name, f == gate == (b, t, c), f"forget gate {f} / gate {gate} are not [B,T,{c}]")
        _need(name, beta == (b, t, h), f"beta {beta} is not [B,T,{h}]")
        _need(name, dtb == (c,) and alog == (1, 1, h, 1), f"dt_bias {dtb} / A_log {alog}")
        _need(name, nw == (d,), f"norm weight {nw} is not [{d}]")
        _need(name, st == (b, h, d, d), f"kda state {st} is not [{b}, {h}, {d}, {d}]")
        _need(name, pos == (b, t), f"positions {pos} are not [B,T]")
        return [(b, t, c)]
    raise GraphError(name, f"unknown op kind {kind}")


def _ssm_shapes(kind: OpKind, name: str, ins: list[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    """Mamba-2's ops; `proj` is in_proj's output [B, T, inner + conv_dim + heads] (z, xBC, dt
    columns), the state's first dim is the batch row (the runtime maps rows to slots)."""
    if kind is OpKind.ssm_conv:
        # proj, conv weight [C, 1, K], (conv bias [C]), conv state [B, C, K-1], positions
        proj, w, st, pos = ins[0], ins[1], ins[-2], ins[-1]
        c, k, off = int(attrs["channels"]), int(attrs["kernel"]), int(attrs["offset"])
        b, t = proj[0], proj[1]
        _need(name, len(proj) == 3 and proj[2] >= off + c, f"proj {proj} lacks columns {off}+{c}")
        _need(name, w == (c, 1, k), f"conv weight {w} is not [{c}, 1, {k}]")
        _need(name, len(ins) == 4 or ins[2] == (c,), f"conv bias {ins[2]} is not [{c}]")
        _need(name, st == (b, c, k - 1), f"conv state {st} is not [{b}, {c}, {k - 1}]")
        _need(name, pos == (b, t), f"positions {pos} are not [B,T]")
        return [(b, t, c)]
    if kind is OpKind.ssm_scan:
        # xBC [B,T,C], proj (dt columns), dt_bias [H], A_log [H], D [H], ssm state, positions
        xbc, proj, dtb, alog, dsk, st, pos = ins
        h, p, n, g = (int(attrs[a]) for a in ("heads", "head_dim", "state_size", "groups"))
        b, t = xbc[0], xbc[1]
        _need(name, xbc == (b, t, h * p + 2 * g * n), f"xBC {xbc} is not [B,T,{h}*{p}+2*{g}*{n}]")
        _need(name, proj[:2] == (b, t) and proj[2] >= int(attrs["dt_offset"]) + h, f"proj {proj}")
        _need(name, dtb == alog == dsk == (h,), f"dt_bias / A_log / D {dtb} are not [{h}]")
        _need(name, st == (b, h, p, n), f"ssm state {st} is not [{b}, {h}, {p}, {n}]")
        _need(name, h % g == 0, f"{h} heads are not a multiple of {g} groups")
        _need(name, pos == (b, t), f"positions {pos} are not [B,T]")
        return [(b, t, h * p)]
    y, proj, w = ins
    group = int(attrs["group"])
    _need(name, len(y) == 3 and proj[:2] == y[:2] and proj[2] >= y[2], f"gate {proj} vs {y}")
    _need(name, y[-1] % group == 0 and w == (y[-1],), f"norm weight {w} / group {group} vs {y}")
    return [y]


@dataclass(frozen=True)
class OpGraph:
    """Ops in a topological order (the order the builder emitted them) and their tensors."""

    ops: tuple[Op, ...]
    tensors: Mapping[str, Tensor]
    bucket_name: str = ""

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def tensor(self, name: str) -> Tensor:
        return self.tensors[name]

    def producers(self) -> dict[str, Op]:
        return {t: op for op in self.ops for t in op.outputs}

    def edges(self) -> list[tuple[str, str]]:
        """(producer op, consumer op) for every activation an op reads from another op."""
        prod = self.producers()
        out = []
        for op in self.ops:
            for t in op.inputs:
                if t in prod:
                    out.append((prod[t].name, op.name))
        return out

    def validate(self) -> None:
        """Re-run shape inference and check every input is defined before it is read."""
        defined = {
            n
            for n, t in self.tensors.items()
            if t.role in (TensorRole.input, TensorRole.weight, TensorRole.cache, TensorRole.state)
        }
        for op in self.ops:
            for t in op.inputs:
                _need(op.name, t in defined, f"reads {t!r} before any op writes it")
            if op.kind is OpKind.linear_qkv:  # R4: x [.., K], w [nq + nk + nv, K]
                x, w = (self.tensors[t].shape for t in op.inputs)
                outs = [self.tensors[t].shape for t in op.outputs]
                _need(
                    op.name,
                    len(outs) == 3
                    and len(w) == 2
                    and x[-1] == w[1]
                    and all(o[:-1] == x[:-1] for o in outs)
                    and sum(o[-1] for o in outs) == w[0],
                    f"linear_qkv weight {w} does not split into outputs {outs} of input {x}",
                )
                defined.update(op.outputs)
                continue
            shapes = infer_shapes(
                op.kind, op.name, [self.tensors[t].shape for t in op.inputs], op.attrs
            )
            for t, s in zip(op.outputs, shapes, strict=True):
                _need(
                    op.name,
                    self.tensors[t].shape == s,
                    f"output {t} declared {self.tensors[t].shape}, inferred {s}",
                )
                defined.add(t)
