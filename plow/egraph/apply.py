"""The extraction decides: the fused ops the emitter implements, applied to the `OpGraph`.

`fuse_graph(graph, target)` saturates the canonical graph (`plow.egraph.saturate`), extracts
over the emitter's constructors plus the fused ones it implements (`EMITTED_FUSED`), and
rewrites the canonical `OpGraph` so that every instance the extraction chose becomes one op
of the fused kind; everything the extraction left canonical stays as it was. The applied
instances are returned as blocks (rule, canonical op indices, fused op index) and written
into the bundle as `rewrites.json` (`rewrites_json`), which checkpoint A reads.

Implemented today: R1 (`add_rmsnorm`: a residual add and the full-width rmsnorm of its sum
in one op writing both) and R2+R3+R13 (`linear_glu`: the gate and up linears of one input as
one linear over `interleave(Wg, Wu)` — row 2i gate row i, row 2i+1 up row i, re-laid-out in
the bundle — whose epilogue is the gated MLP's act(g) * u) and R4 (`linear_qkv`: the q, k, v
projections of one input as one linear over `cat3(Wq, Wk, Wv)`, writing the three outputs)
R18 (the first norm beside the embedding gather: an `embedding` with the norm's weight as a
third input, writing the rows and their norm; attributes the embedding's, the norm's under
"norm") and R19 (the final full-width rmsnorm in the prologue of the lm_head that alone reads it: an
`lm_head` op with inputs x, W and the norm's weight, attributes the norm's; no softcap).
docs/egraph.md, "Status".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plow.egraph.extract import EMITTER, extract, prepare, weight_dtype
from plow.egraph.fused import build_fused
from plow.egraph.saturate import Limits, saturate
from plow.graph.ops import Op, OpGraph, OpKind, Tensor, TensorRole
from plow.target import Target

# fused constructors the emitter implements, per rule (and the views a multi-output op needs)
EMITTED_FUSED: dict[str, frozenset[str]] = {
    "R1": frozenset({"add_rmsnorm", "fst", "snd"}),
    "R2+R3+R13": frozenset({"linear_glu", "interleave"}),
    "R4": frozenset({"cat3", "part"}),
    # R19: the final norm in the lm_head's prologue, emitted as an `lm_head` with the norm's
    # weight as its third input (the fused argmax stays the lm_head's)
    "R19": frozenset({"rmsnorm_lm_head"}),
    # R18: the first norm beside the embedding gather, emitted as an `embedding` with the
    # norm's weight as its third input, writing the rows and their norm
    "R18": frozenset({"embedding_rmsnorm", "fst", "snd"}),
}
RULES = tuple(EMITTED_FUSED)
REWRITES_FILE = "rewrites.json"


@dataclass(frozen=True, slots=True)
class Block:
    """One applied rule instance: the canonical ops it covers (indices into the canonical
    graph's op list) and the fused op (index into the fused graph's)."""

    rule: str
    canonical: tuple[int, ...]
    fused: int


@dataclass(frozen=True, slots=True)
class Layout:
    """A weight the bundle stores re-laid-out from `sources` (`interleave` or `cat3`)."""

    weight: str
    layout: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class Applied:
    graph: OpGraph
    blocks: tuple[Block, ...]
    layouts: tuple[Layout, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "blocks": [
                {"rule": b.rule, "canonical": list(b.canonical), "fused": b.fused}
                for b in self.blocks
            ],
            "layouts": [
                {"weight": x.weight, "layout": x.layout, "sources": list(x.sources)}
                for x in self.layouts
            ],
        }


def rewrites_json(applied: list[Applied]) -> str:
    """`rewrites.json` of a bundle: the blocks of its rungs (every rung of a ladder has the
    same op structure, so the same blocks; a ladder whose rungs disagree is refused)."""
    docs = [a.to_json() for a in applied]
    if any(d != docs[0] for d in docs[1:]):
        raise ValueError("the rungs of the ladder were fused differently")
    return json.dumps(docs[0] if docs else {"blocks": [], "layouts": []}, indent=1)


def extracted_instances(
    graph: OpGraph, target: Target, rules: tuple[str, ...], limits: Limits | None = None
) -> dict[str, set[tuple[str, ...]]]:
    """Per fused kind, the output-name tuples of its ops in the extraction over the emitter's
    constructors plus the fused ones of `rules` (the canonical tensors each one produces)."""
    low, sat = saturate(graph, limits or Limits())
    pr = prepare(graph, sat.classes, sat.serialized, low.outputs)
    allowed = EMITTER.union(*(EMITTED_FUSED[r] for r in rules))
    ext = extract(pr.view, pr.info, pr.roots, target, weight_dtype(graph), allowed)
    fg = build_fused(pr.view, ext, pr.canonical)
    fused_kinds = frozenset().union(*(EMITTED_FUSED[r] for r in rules))
    out: dict[str, set[tuple[str, ...]]] = {}
    for op in fg.ops:
        if op.rule is not None and op.kind in fused_kinds:
            out.setdefault(op.kind, set()).add(tuple(op.outputs))
        # R4: a linear over cat3(...) read through its three parts
        if op.kind == "linear" and len(op.outputs) == 3 and "R4" in rules:
            out.setdefault("linear_qkv", set()).add(tuple(op.outputs))
    return out


def _full_width(graph: OpGraph, norm: Op) -> bool:
    x = graph.tensor(norm.inputs[0]).shape
    return len(norm.inputs) == 2 and int(norm.attrs.get("group", x[-1])) == x[-1]


def fuse_graph(
    graph: OpGraph,
    target: Target,
    rules: tuple[str, ...] = RULES,
    limits: Limits | None = None,
    chosen: dict[str, set[tuple[str, ...]]] | None = None,
    relayable: Callable[[str, tuple[str, ...]], bool] | None = None,
) -> Applied:
    """`graph` with the extraction's instances of `rules` fused (see the module doc).
    `chosen`: the instances to fuse (`extracted_instances` of another bucket of the ladder:
    every rung of a bundle is fused alike, as every rung reduces a row alike); None: this
    graph's own extraction. `relayable(layout, sources)`: whether the bundle can store those
    weights re-laid-out (`interleave` / `cat3`; fp8 weights and sources of mixed block
    formats cannot); an instance whose weights cannot be is left canonical. None: all can."""
    if chosen is None:
        chosen = extracted_instances(graph, target, rules, limits)
    norms = {name for outs in chosen.get("add_rmsnorm", ()) for name in outs}
    prod = graph.producers()
    readers: dict[str, int] = {}
    for op in graph.ops:
        for t in op.inputs:
            readers[t] = readers.get(t, 0) + 1
    # R19: an lm_head (no softcap) over a full-width rmsnorm with a weight that only it reads;
    # the fused op takes the lm_head's place (the norm is the op just before it, as the
    # canonical order has it: checkpoint A's blocks are consecutive)
    heads = {outs[0] for outs in chosen.get("rmsnorm_lm_head", ())}
    prologue: dict[str, Op] = {}  # lm_head's name -> its norm
    pos = {op.name: i for i, op in enumerate(graph.ops)}
    for op in graph.ops:
        if op.kind is not OpKind.lm_head or op.outputs[0] not in heads or len(op.inputs) != 2:
            continue
        n = prod.get(op.inputs[0])
        if n is None or n.kind is not OpKind.rmsnorm or not _full_width(graph, n):
            continue
        if op.attrs.get("softcap") or readers[n.outputs[0]] != 1 or pos[n.name] + 1 != pos[op.name]:
            continue
        prologue[op.name] = n
    in_prologue = {n.name for n in prologue.values()}
    # R18: a full-width rmsnorm with a weight over the embedding's rows, the op just after it
    gathered = {name for outs in chosen.get("embedding_rmsnorm", ()) for name in outs}
    beside: dict[str, Op] = {}  # embedding's name -> its norm
    for op in graph.ops:
        if op.kind is not OpKind.rmsnorm or op.outputs[0] not in gathered:
            continue
        e = prod.get(op.inputs[0])
        if e is None or e.kind is not OpKind.embedding or len(e.inputs) != 2:
            continue
        if not _full_width(graph, op) or pos[e.name] + 1 != pos[op.name] or e.name in beside:
            continue
        if "device" in op.attrs or "device" in e.attrs:  # tensor parallel: not yet
            continue
        beside[e.name] = op
    in_prologue |= {n.name for n in beside.values()}
    # R1: residual_add R (two operands) read by a full-width rmsnorm N that the extraction
    # fused; the fused op takes R's place and writes R's sum and N's output
    pair: dict[str, Op] = {}  # R's name -> N
    for op in graph.ops:
        if op.kind is not OpKind.rmsnorm or op.name not in norms or not _full_width(graph, op):
            continue
        if op.name in in_prologue:  # one norm, two fusions: R19's lm_head keeps it
            continue
        r = prod.get(op.inputs[0])
        if r is None or r.kind is not OpKind.residual_add or len(r.inputs) != 2:
            continue
        if r.name in pair:  # one sum, two norms: the extraction fuses at most one
            continue
        pair[r.name] = op
    fused_away = {n.name for n in pair.values()} | in_prologue
    # R2+R3+R13: gated_mlp G over two bias-free linears of one input, each read by G alone
    glus = {outs[0] for outs in chosen.get("linear_glu", ())}
    glu: dict[str, tuple[Op, Op]] = {}  # G's name -> (gate linear, up linear)
    for op in graph.ops:
        if op.kind is not OpKind.gated_mlp or op.name not in glus:
            continue
        lg, lu = prod.get(op.inputs[0]), prod.get(op.inputs[1])
        if lg is None or lu is None or lg is lu:
            continue
        if any(
            x.kind is not OpKind.linear or len(x.inputs) != 2 or readers[x.outputs[0]] != 1
            for x in (lg, lu)
        ):
            continue
        wg, wu = graph.tensor(lg.inputs[1]), graph.tensor(lu.inputs[1])
        if lg.inputs[0] != lu.inputs[0] or wg.shape != wu.shape or wg.dtype != wu.dtype:
            continue
        if relayable is not None and not relayable("interleave", (wg.name, wu.name)):
            continue
        glu[op.name] = (lg, lu)
        fused_away |= {lg.name, lu.name}
    # R4: the q, k, v projections (bias-free linears of one input) the extraction concatenated
    qkv: dict[str, tuple[Op, Op, Op]] = {}  # q's linear -> (q, k, v)
    for outs in chosen.get("linear_qkv", ()):
        lin = [prod.get(t) for t in outs]
        if any(x is None or x.kind is not OpKind.linear or len(x.inputs) != 2 for x in lin):
            continue
        lq, lk, lv = (x for x in lin if x is not None)
        ws = [graph.tensor(x.inputs[1]) for x in (lq, lk, lv)]
        if len({x.inputs[0] for x in (lq, lk, lv)}) != 1 or len({w.dtype for w in ws}) != 1:
            continue
        if len({w.shape[1] for w in ws}) != 1 or len({lq.name, lk.name, lv.name}) != 3:
            continue
        if relayable is not None and not relayable("cat3", tuple(w.name for w in ws)):
            continue
        qkv[lq.name] = (lq, lk, lv)
        fused_away |= {lk.name, lv.name}
    index = {op.name: i for i, op in enumerate(graph.ops)}
    tensors = dict(graph.tensors)
    ops: list[Op] = []
    blocks: list[Block] = []
    layouts: list[Layout] = []
    for op in graph.ops:
        if op.name in fused_away:
            continue
        if op.name in glu:
            lg, lu = glu[op.name]
            wg, wu = graph.tensor(lg.inputs[1]), graph.tensor(lu.inputs[1])
            wi = f"interleave({wg.name}, {wu.name})"
            tensors[wi] = Tensor(wi, (2 * wg.shape[0], wg.shape[1]), TensorRole.weight, wg.dtype)
            layouts.append(Layout(wi, "interleave", (wg.name, wu.name)))
            blocks.append(
                Block(
                    "R2+R3+R13",
                    tuple(sorted((index[lg.name], index[lu.name], index[op.name]))),
                    len(ops),
                )
            )
            ops.append(
                Op(
                    f"{lg.name}+{lu.name}+{op.name}",
                    OpKind.linear_glu,
                    (lg.inputs[0], wi),
                    op.outputs,
                    dict(op.attrs),
                    op.layer,
                )
            )
            continue
        if op.name in qkv:
            three = qkv[op.name]
            ws = [graph.tensor(x.inputs[1]) for x in three]
            wc = f"cat3({', '.join(w.name for w in ws)})"
            rows = sum(w.shape[0] for w in ws)
            tensors[wc] = Tensor(wc, (rows, ws[0].shape[1]), TensorRole.weight, ws[0].dtype)
            layouts.append(Layout(wc, "cat3", tuple(w.name for w in ws)))
            blocks.append(Block("R4", tuple(sorted(index[x.name] for x in three)), len(ops)))
            ops.append(
                Op(
                    "+".join(x.name for x in three),
                    OpKind.linear_qkv,
                    (op.inputs[0], wc),
                    tuple(x.outputs[0] for x in three),
                    {},
                    op.layer,
                )
            )
            continue
        if op.name in beside:
            n = beside[op.name]
            blocks.append(Block("R18", (index[op.name], index[n.name]), len(ops)))
            ops.append(
                Op(
                    f"{op.name}+{n.name}",
                    OpKind.embedding,
                    (op.inputs[0], op.inputs[1], n.inputs[1]),
                    (op.outputs[0], n.outputs[0]),
                    {**op.attrs, "norm": dict(n.attrs)},
                    op.layer,
                )
            )
            continue
        if op.name in prologue:
            n = prologue[op.name]
            blocks.append(Block("R19", (index[n.name], index[op.name]), len(ops)))
            ops.append(
                Op(
                    f"{n.name}+{op.name}",
                    OpKind.lm_head,
                    (n.inputs[0], op.inputs[1], n.inputs[1]),
                    op.outputs,
                    dict(n.attrs),
                    op.layer,
                )
            )
            continue
        n = pair.get(op.name)
        if n is None:
            ops.append(op)
            continue
        blocks.append(Block("R1", (index[op.name], index[n.name]), len(ops)))
        ops.append(
            Op(
                f"{op.name}+{n.name}",
                OpKind.add_rmsnorm,
                (op.inputs[0], op.inputs[1], n.inputs[1]),
                (op.outputs[0], n.outputs[0]),
                dict(n.attrs),
                op.layer,
            )
        )
    # the sources of a re-laid-out weight are read by no op any more, the intermediates a
    # fused op keeps on chip (R2's gate and up) written by none: neither is a tensor of it
    used = {t for op in ops for t in op.inputs}
    written = {t for op in ops for t in op.outputs}
    for lay in layouts:
        for src in lay.sources:
            if src not in used:
                tensors.pop(src, None)
    for op in graph.ops:
        for t in op.outputs:
            if t not in written:
                tensors.pop(t, None)
    fused = OpGraph(tuple(ops), tensors, graph.bucket_name)
    fused.validate()
    return Applied(fused, tuple(blocks), tuple(layouts))
