"""`shard_graph(graph, tp)`: a one-device graph as a tensor-parallel graph whose ops carry a
device (docs/parallel.md).

Megatron-style, per decoder layer:

- attention: the q/k/v projections are column-parallel: device `d` computes a consecutive
  range of whole key-value groups (`head_split(KV, tp)`: as even as it goes, larger parts
  first, so 3 key-value heads over 2 devices are 2 + 1) and those groups' query heads (9
  heads: 6 + 3) — the rows of Wq, Wk, Wv for those heads; the per-head q/k/v norms, the
  ropes and the attention run on the device's heads (its own key-value cache: `cache_layer =
  layer * tp + d` in the paged pool, whose layers hold `pool_kv_heads` heads, the largest
  part); o_proj is row-parallel (the columns of Wo for the device's heads) and writes a
  partial sum of the full width;
- MLP: gate/up column-parallel (device `d`'s part of `head_split(I, tp)`: rows of Wg, Wu),
  the activation on the device's columns, down row-parallel (the same columns of Wd), a
  partial sum;
- where partial sums meet: one `allreduce` op per device, reading every device's partial and
  writing that device's sum (`p_0 + p_1 + ... + p_{tp-1}` in device order on every device, so
  every replica of the residual stream is the same bits);
- the op order: between two allreduces, device 0's ops (in the one-device graph's order),
  then device 1's, ...;
- replicated (every device runs its own copy over the same weights): the embedding, every
  norm of the residual stream and the residual adds;
- device 0 alone: the final norm, lm_head and sample (the host reads one copy of the
  logits and ids; a vocab-split lm_head is future work). Replicas nobody reads (the last
  layer's residual on devices 1..) are dropped.

A sliced weight is its own tensor, `<name>@tp<d>of<tp>`, and the op that reads it records the
slice in its attributes: `slices = [[tensor, source, axis, start, stop], ...]` (rows: axis 0,
columns: axis 1), so a checker can recompute it from the bundle's bytes. Refused with one line:
fewer key-value heads than devices (a group's query heads stay with its key-value head), a
row-parallel linear with a bias, and op kinds this pass does not shard (experts, latent
attention, SSMs, fused ops: shard before fusing).

Fusion runs after this pass, on the sharded graph (plow/compile.py): R4 concatenates a
device's own q/k/v slices (`linear_qkv` over `cat3(Wq@tp<d>, Wk@tp<d>, Wv@tp<d>)`: the rows
of the device's heads), R2+R3+R13 interleaves its gate/up slices (`linear_glu` over
`interleave(Wg@tp<d>, Wu@tp<d>)`: a contiguous range of intermediate units, both their gate
and up rows), R1 fuses each replica's residual add and norm. `place_fused` gives every fused
op the device of the canonical ops it covers and their slices, so the bundle writer, checkpoint
A and `plow verify --source` see where each source row comes from.
"""

from __future__ import annotations

from typing import Any

from plow.errors import GraphError
from plow.graph.ops import Op, OpGraph, OpKind, Tensor, TensorRole, infer_shapes

SHARDABLE = {
    OpKind.embedding,
    OpKind.rmsnorm,
    OpKind.linear,
    OpKind.rope,
    OpKind.attention,
    OpKind.gated_mlp,
    OpKind.residual_add,
    OpKind.lm_head,
    OpKind.sample,
}
TAIL = (OpKind.lm_head, OpKind.sample)


def sliced_name(weight: str, d: int, tp: int) -> str:
    return f"{weight}@tp{d}of{tp}"


def device_of(op: Op) -> int:
    """The device of an op of a sharded graph (0 for a graph that is not sharded)."""
    return int(op.attrs.get("device", 0))


def graph_tp(graph: OpGraph) -> int:
    """The tensor-parallel degree a graph was sharded for (1: not sharded)."""
    return max((int(op.attrs.get("tp", 1)) for op in graph.ops), default=1)


def shard_graph(graph: OpGraph, tp: int) -> OpGraph:
    """The tensor-parallel graph of `graph` over `tp` devices (module docstring)."""
    if tp == 1:
        return graph
    where = graph.bucket_name or "graph"
    if tp < 1:
        raise GraphError(where, f"tp must be at least 1, got {tp}")
    for op in graph.ops:
        if op.kind not in SHARDABLE:
            raise GraphError(
                op.name,
                f"--tp {tp}: op kind {op.kind.value!r} is not sharded (tensor parallel covers "
                "dense attention and gated MLPs; compile these with --tp 1, or --no-fuse)",
            )
    prod = graph.producers()
    kind_of = {t: o.kind for t, o in prod.items()}
    # column-parallel chains: from an attention's q/k/v (through ropes and per-head norms) or
    # a gated MLP's gate/up back to the linear that starts them
    col: dict[str, list[tuple[int, int]]] = {}  # column linear -> each device's rows
    cols: dict[str, list[tuple[int, int]]] = {}  # attention / gated_mlp -> each device's cols
    split: dict[str, Op] = {}  # ops run on the device's heads / columns
    row: dict[str, list[tuple[int, int]]] = {}  # row linear -> each device's input columns
    for op in graph.ops:
        if op.kind is OpKind.attention:
            h, kvh, hd = (int(op.attrs[a]) for a in ("heads", "kv_heads", "head_dim"))
            if kvh < tp or h % kvh:
                ok = ", ".join(map(str, range(2, kvh + 1)))
                raise GraphError(
                    op.name,
                    f"--tp {tp}: {h} attention heads and {kvh} key-value heads do not split "
                    f"over {tp} devices (each device takes whole key-value groups, at least "
                    f"one; {f'tp {ok} would' if kvh > 1 else 'only tp 1 fits'})",
                )
            kv = head_split(kvh, tp)  # key-value heads per device; its groups' query heads
            grp = h // kvh
            spans = {"q": _spans([n * grp * hd for n in kv]), "kv": _spans([n * hd for n in kv])}
            for t, key in zip(op.inputs[:3], ("q", "kv", "kv"), strict=True):
                _chain(prod, t, spans[key], hd, col, split, tp)
            split[op.name] = op
            cols[op.name] = spans["q"]
        elif op.kind is OpKind.gated_mlp:
            width = graph.tensor(op.outputs[0]).shape[-1]
            if width < tp:
                raise GraphError(op.name, f"--tp {tp}: MLP width {width} is below {tp}")
            for t in op.inputs:
                _chain(prod, t, _spans(head_split(width, tp)), width, col, split, tp)
            split[op.name] = op
            cols[op.name] = _spans(head_split(width, tp))
    for op in graph.ops:
        if op.kind is OpKind.linear and kind_of.get(op.inputs[0]) in (
            OpKind.attention,
            OpKind.gated_mlp,
        ):
            if len(op.inputs) > 2:
                raise GraphError(
                    op.name, f"--tp {tp}: a row-parallel linear with a bias is not sharded"
                )
            row[op.name] = cols[prod[op.inputs[0]].name]
    tail_start = next((i for i, o in enumerate(graph.ops) if o.kind in TAIL), len(graph.ops))
    # the final norm feeding lm_head runs on device 0 with it
    tail = {o.name for o in graph.ops[tail_start:]}
    for o in graph.ops[tail_start:]:
        if o.kind is OpKind.lm_head and kind_of.get(o.inputs[0]) is OpKind.rmsnorm:
            tail.add(prod[o.inputs[0]].name)

    tensors: dict[str, Tensor] = dict(
        (n, t) for n, t in graph.tensors.items() if t.role in (TensorRole.input,)
    )
    ops: list[Op] = []
    # per device: a tensor of the one-device graph -> the device's tensor
    rename: list[dict[str, str]] = [{} for _ in range(tp)]

    def weight(name: str) -> str:
        if name not in tensors:
            tensors[name] = graph.tensor(name)
        return name

    def sliced(name: str, d: int, axis: int, span: tuple[int, int]) -> tuple[str, list[Any]]:
        t = graph.tensor(name)
        shape = list(t.shape)
        lo, hi = span
        shape[axis] = hi - lo
        new = sliced_name(name, d, tp)
        tensors[new] = Tensor(new, tuple(shape), TensorRole.weight, t.dtype)
        return new, [new, name, axis, lo, hi]

    def emit(op: Op, d: int, name: str, ins: list[str], attrs: dict[str, Any]) -> str:
        shapes = infer_shapes(op.kind, name, [tensors[t].shape for t in ins], attrs)
        t0 = graph.tensor(op.outputs[0])
        role = t0.role
        tensors[name] = Tensor(name, shapes[0], role, t0.dtype)
        ops.append(Op(name, op.kind, tuple(ins), (name,), attrs, op.layer))
        return name

    def inputs_on(op: Op, d: int) -> list[str]:
        out = []
        for t in op.inputs:
            tt = graph.tensor(t)
            if t in rename[d]:
                out.append(rename[d][t])
            elif tt.role is TensorRole.weight:
                out.append(weight(t))
            elif tt.role in (TensorRole.input, TensorRole.cache):
                out.append(t)  # a cache: replaced by the device's below
            else:
                raise GraphError(op.name, f"--tp {tp}: reads {t!r}, which is not sharded")
        return out

    for op in graph.ops:
        base = {**op.attrs, "tp": tp}
        if op.name in tail:
            ins = inputs_on(op, 0)
            out = emit(op, 0, op.outputs[0], ins, {**base, "device": 0})
            rename[0][op.outputs[0]] = out
            continue
        for d in range(tp):
            ins = inputs_on(op, d)
            attrs: dict[str, Any] = {**base, "device": d}
            slices: list[Any] = []
            if op.name in col:  # rows of the weight (and bias) for the device's heads/columns
                span = col[op.name][d]
                ins[1], s = sliced(op.inputs[1], d, 0, span)
                slices.append(s)
                if len(ins) > 2:
                    ins[2], s = sliced(op.inputs[2], d, 0, span)
                    slices.append(s)
            elif op.name in row:  # columns of the weight for the device's part of the input
                ins[1], s = sliced(op.inputs[1], d, 1, row[op.name][d])
                slices.append(s)
            elif op.kind is OpKind.attention:
                hd = int(op.attrs["head_dim"])
                q0, q1 = cols[op.name][d]
                kvh = int(op.attrs["kv_heads"])
                attrs["heads"] = (q1 - q0) // hd
                attrs["kv_heads"] = kvd = head_split(kvh, tp)[d]
                attrs["cache_layer"] = int(op.layer or 0) * tp + d
                for j in (3, 4):  # the device's key-value cache
                    c = graph.tensor(op.inputs[j])
                    b, _, ctx, hd = c.shape
                    name = f"{op.inputs[j]}@d{d}"
                    tensors[name] = Tensor(name, (b, kvd, ctx, hd), c.role, c.dtype)
                    ins[j] = name
            elif op.kind is OpKind.rope and op.name in split:
                hd = int(op.attrs["head_dim"])
                attrs["heads"] = tensors[ins[0]].shape[-1] // hd
            if slices:
                attrs["slices"] = slices
            rename[d][op.outputs[0]] = emit(op, d, f"{op.name}@d{d}", ins, attrs)
        if op.name in row:  # the partial sums meet: every device's sum of all partials
            parts = [rename[d][op.outputs[0]] for d in range(tp)]
            ar = Op(op.name + ".allreduce", OpKind.allreduce, (), op.outputs, {}, op.layer)
            for d in range(tp):
                name = f"{op.name}.allreduce@d{d}"
                rename[d][op.outputs[0]] = emit(ar, d, name, parts, {"tp": tp, "device": d})
    ops = _drop_unread(_device_major(ops), tensors)
    sharded = OpGraph(tuple(ops), tensors, graph.bucket_name)
    sharded.validate()
    return sharded


def place_fused(graph: OpGraph, applied: Any) -> Any:
    """`applied` (plow.egraph.apply.Applied, fused from the sharded `graph`) with each fused
    op carrying the placement of the canonical ops its block covers: their `tp` and `device`
    (one device: a fusion never joins two devices' ops; refused otherwise) and the
    concatenation of their `slices` in canonical order (R4: q's, k's, v's; R2+R3+R13: gate's,
    up's), the slices its re-laid-out weight is built from."""
    if graph_tp(graph) == 1:
        return applied
    ops = list(applied.graph.ops)
    for b in applied.blocks:
        covered = [graph.ops[i] for i in b.canonical]
        devices = {device_of(o) for o in covered}
        fused = ops[b.fused]
        if len(devices) != 1:
            raise GraphError(fused.name, f"fuses ops of devices {sorted(devices)} (one each)")
        attrs = {**fused.attrs, "tp": graph_tp(graph), "device": devices.pop()}
        slices = [s for o in covered for s in o.attrs.get("slices", [])]
        if slices:
            attrs["slices"] = slices
        ops[b.fused] = Op(fused.name, fused.kind, fused.inputs, fused.outputs, attrs, fused.layer)
    placed = OpGraph(tuple(ops), applied.graph.tensors, applied.graph.bucket_name)
    placed.validate()
    return type(applied)(placed, applied.blocks, applied.layouts)


def slice_layouts(graph: OpGraph) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The sliced weights the ops of a sharded graph record, as the bundle writer's layouts
    (`name -> ("rows A:B" | "cols A:B", (source,))`)."""
    return {
        new: (f"{('rows', 'cols')[int(axis)]} {int(lo)}:{int(hi)}", (src,))
        for op in graph.ops
        for new, src, axis, lo, hi in op.attrs.get("slices", ())
    }


def _chain(
    prod: dict[str, Op],
    t: str,
    rows: list[tuple[int, int]],
    group: int,
    col: dict[str, list[tuple[int, int]]],
    split: dict[str, Op],
    tp: int,
) -> None:
    """Mark the ops from tensor `t` back to its column-parallel linear (rope, per-head norms)."""
    op = prod.get(t)
    while op is not None and op.kind in (OpKind.rope, OpKind.rmsnorm):
        if op.kind is OpKind.rmsnorm and int(op.attrs.get("group", -1)) != group:
            raise GraphError(op.name, f"--tp {tp}: a norm across heads is not sharded")
        split[op.name] = op
        op = prod.get(op.inputs[0])
    if op is None or op.kind is not OpKind.linear:
        raise GraphError(t, f"--tp {tp}: not the output of a linear (cannot shard its columns)")
    col[op.name] = rows
    split[op.name] = op


def head_split(n: int, tp: int) -> list[int]:
    """`n` units (key-value heads, MLP columns) over `tp` devices: as even as it goes, the
    larger parts first (9 heads / 3 key-value heads over 2 devices: key-value heads 2 + 1,
    so query heads 6 + 3; 1536 MLP columns: 768 + 768)."""
    q, r = divmod(n, tp)
    return [q + (d < r) for d in range(tp)]


def pool_kv_heads(kv_heads: int, tp: int) -> int:
    """Key-value heads of one layer of the paged pool of a `tp`-device plan: device `d`'s
    heads of layer `n` are pool layer `n * tp + d`, its `head_split(kv_heads, tp)[d]` heads
    (the largest part sizes the pool; a device with fewer uses its first heads)."""
    return head_split(kv_heads, tp)[0]


def _spans(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive [start, stop) ranges of the given sizes, from 0."""
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


def _device_major(ops: list[Op]) -> list[Op]:
    """`ops` (each canonical op's device copies in turn) ordered device by device between the
    collectives: the stretch of ops from one allreduce to the next is device 0's copies in
    canonical order, then device 1's, ...; the allreduces keep their place. Topological,
    since a device's copies in a stretch read only that device's tensors or earlier ones; it
    keeps a device's consecutive canonical ops consecutive, as the fusion rules' blocks need
    (checkpoint A: the canonical table is the blocks' concatenation)."""
    out: list[Op] = []
    stretch: list[Op] = []
    for op in ops:
        if op.kind is OpKind.allreduce:
            out += sorted(stretch, key=device_of)  # stable: canonical order per device
            stretch = []
            out.append(op)
        else:
            stretch.append(op)
    return out + sorted(stretch, key=device_of)


def _drop_unread(ops: list[Op], tensors: dict[str, Tensor]) -> list[Op]:
    """Drop replicas whose outputs nobody reads (outputs of the step stay)."""
    while True:
        read = {t for o in ops for t in o.inputs}
        keep = [
            any(t in read or tensors[t].role is TensorRole.output for t in o.outputs) for o in ops
        ]
        if all(keep):
            return ops
        for o, k in zip(ops, keep, strict=True):
            if not k:
                for t in o.outputs:
                    tensors.pop(t, None)
        ops = [o for o, k in zip(ops, keep, strict=True) if k]
