"""The extracted graph as ops with named inputs and outputs, and its counts.

An op of the fused graph is one chosen op e-node. Its outputs are named after the canonical
ops whose values it produces (`L3.q_proj+L3.k_proj+L3.v_proj` for the concatenated
projection read through three views); its inputs are the leaves (weights, inputs, caches),
the re-laid-out weights (`cat3(...)`, `interleave(...)`) and the outputs of other ops.
Edges are counted as `OpGraph.edges` counts them: one per input an op reads from another op.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from plow.egraph.extract import LAYOUTS, VIEWS, EGraphView, Extraction, rule_of


@dataclass(frozen=True, slots=True)
class FusedOp:
    name: str
    kind: str  # the e-node constructor: a canonical kind or a fused one
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    rule: str | None  # the rule whose fused op this is (None: canonical)
    # the e-node's literal arguments in order: attribute objects (decoded JSON), integers
    params: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Relayout:
    """A weight the bundle stores re-laid-out, and how its rows come from the sources."""

    name: str
    layout: str  # "concat" | "interleave"
    sources: tuple[str, ...]
    rows: str  # the permutation, in words


@dataclass(frozen=True)
class FusedGraph:
    ops: tuple[FusedOp, ...]
    relayouts: tuple[Relayout, ...]

    def edges(self) -> list[tuple[str, str]]:
        prod = {t: op.name for op in self.ops for t in op.outputs}
        return [(prod[t], op.name) for op in self.ops for t in op.inputs if t in prod]


def transitive_reduction_count(names: list[str], edges: set[tuple[str, str]]) -> int:
    """Edges of the op DAG (ops listed children first) not implied by a longer path."""
    idx = {n: i for i, n in enumerate(names)}
    succ: list[list[int]] = [[] for _ in names]
    for src, dst in edges:
        succ[idx[src]].append(idx[dst])
    reach = [0] * len(names)
    for u in range(len(names) - 1, -1, -1):
        r = 0
        for v in succ[u]:
            r |= (1 << v) | reach[v]
        reach[u] = r
    return sum(
        1
        for u in range(len(names))
        for v in succ[u]
        if not any(w != v and (reach[w] >> v) & 1 for w in succ[u])
    )


def build_fused(view: EGraphView, ext: Extraction, canonical: Mapping[int, str]) -> FusedGraph:
    """`canonical`: e-class -> the canonical op (tensor) name it holds."""
    nodes, choice = view.nodes, ext.choice
    # classes read through a view, per viewed class: the view classes
    viewers: dict[int, list[tuple[int, int]]] = {}
    for c, i in choice.items():
        n = nodes[i]
        if n.op in VIEWS:
            k = int(view.literal[n.children[1]]) if n.op == "part" else (n.op == "snd") * 1
            viewers.setdefault(n.children[0], []).append((k, c))

    names: dict[int, str] = {}  # tensor class -> the name ops read it by

    def tensor_name(c: int) -> str:
        if c in names:
            return names[c]
        n = nodes[choice[c]]
        if c in canonical:
            s = canonical[c]
        elif n.op == "T.leaf":
            s = str(view.literal[n.children[0]])
        elif n.op == "nobias":
            s = "nobias"
        elif n.op in LAYOUTS:
            s = f"{n.op}({', '.join(tensor_name(ch) for ch in n.children)})"
        else:
            parts = sorted(viewers.get(c, []))
            s = "+".join(tensor_name(v) for _, v in parts) or f"t{c}"
        names[c] = s
        return s

    ops: list[FusedOp] = []
    relayouts: dict[str, Relayout] = {}
    for i in ext.op_nodes:
        n = nodes[i]
        ins: list[str] = []
        for ch in n.children:
            if ch in view.literal:
                continue
            cn = nodes[choice[ch]]
            if cn.op == "nobias" or (
                cn.op in LAYOUTS
                and tensor_name(ch).startswith(("cat3(nobias", "interleave(nobias"))
            ):
                continue
            if cn.op == "Vec":  # an opaque op's inputs
                ins.extend(tensor_name(x) for x in cn.children)
                continue
            if cn.op in VIEWS:  # read the viewed op's output
                ins.append(tensor_name(ch))
                continue
            if cn.op in LAYOUTS:
                src = tuple(tensor_name(x) for x in cn.children)
                rows = (
                    "rows of the three sources stacked in order"
                    if cn.op == "cat3"
                    else "row 2i is gate row i, row 2i+1 is up row i"
                )
                nm = tensor_name(ch)
                relayouts[nm] = Relayout(
                    nm, "concat" if cn.op == "cat3" else "interleave", src, rows
                )
            ins.append(tensor_name(ch))
        if n.cls in viewers:
            outs = tuple(tensor_name(v) for _, v in sorted(viewers[n.cls]))
        else:
            outs = (tensor_name(n.cls),)
        params = tuple(_param(view.literal[ch]) for ch in n.children if ch in view.literal)
        ops.append(FusedOp("+".join(outs), n.op, tuple(ins), outs, rule_of(n.op), params))
    return FusedGraph(tuple(ops), tuple(relayouts.values()))


def _param(v: Any) -> Any:
    if isinstance(v, str) and v.startswith("{"):
        return json.loads(v)
    return v
