"""`lower(graph)`: every op of an `OpGraph` as a canonical e-graph term.

The lowering is the identity on structure: one term per op, its inputs the terms of the ops
that write them (or a `leaf` for inputs, weights and caches), its attributes the op's attrs
as one canonical JSON string. Two ops are written in primitive form so that plow's already
fused ops are rule instances like the others (R8, R13): `attention` becomes
`attend(q, kv_write(kc, k, pos), kv_write(vc, v, pos), pos)` and `gated_mlp` becomes
`mul(act(gate), up)`. An op kind this module does not know (a family added after it) is
written `opaque(kind, attrs, inputs)`: no rule matches it, and extraction keeps it as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from egglog import StringLike, Vec, function

from plow.egraph import terms as t
from plow.egraph.terms import T
from plow.errors import GraphError
from plow.graph.ops import Op, OpGraph, OpKind


@function
def opaque(kind: StringLike, attrs: StringLike, args: Vec[T]) -> T: ...  # type: ignore[empty-body]


def attrs_key(attrs: Mapping[str, Any]) -> str:
    """The canonical string of an op's attributes (sorted keys, JSON)."""
    return json.dumps(dict(attrs), sort_keys=True, default=str)


@dataclass(frozen=True)
class Lowered:
    graph: OpGraph
    terms: Mapping[str, T]  # op name -> its term
    outputs: tuple[str, ...]  # the ops whose tensors the host reads (role output)


def _term(op: Op, ins: list[T], graph: OpGraph) -> T:
    k, a = op.kind, dict(op.attrs)
    if k is OpKind.embedding:
        return t.embedding(ins[0], ins[1], attrs_key(a))
    if k is OpKind.rmsnorm:
        x = graph.tensor(op.inputs[0])
        group = int(a.pop("group", x.shape[-1]))
        return t.rmsnorm(ins[0], ins[1], attrs_key(a), 0 if group == x.shape[-1] else group)
    if k is OpKind.linear:
        return t.linear(ins[0], ins[1], ins[2] if len(ins) == 3 else t.nobias())
    if k is OpKind.rope:
        return t.rope(ins[0], ins[1], attrs_key(a), int(a["head_dim"]))
    if k is OpKind.attention:
        q, kk, v, kc, vc, pos = ins
        return t.attend(q, t.kv_write(kc, kk, pos), t.kv_write(vc, v, pos), pos, attrs_key(a))
    if k is OpKind.gated_mlp:
        return t.mul(t.act(ins[0], str(a["activation"])), ins[1])
    if k is OpKind.residual_add:
        return t.add(ins[0], ins[1])
    if k is OpKind.lm_head:
        return t.lm_head(ins[0], ins[1], attrs_key(a))
    if k is OpKind.sample:
        return t.sample(ins[0], ins[1], attrs_key(a))
    return opaque(str(k.value), attrs_key(a), Vec[T](*ins))


def lower(graph: OpGraph, bind: Callable[[str, T], T] | None = None) -> Lowered:
    """The canonical term of every op of `graph` (ops with one output each).

    `bind(name, term)` returns what later terms use to refer to the op (the saturation binds
    each op to a let variable, so a term holds its inputs by name and the e-graph receives
    a DAG, not the tree it unfolds to — the residual stream is read twice per layer)."""
    terms: dict[str, T] = {}
    by_tensor: dict[str, T] = {}
    for op in graph.ops:
        if len(op.outputs) != 1:
            raise GraphError(op.name, f"the e-graph stage lowers one-output ops; has {op.outputs}")
        ins = [by_tensor[n] if n in by_tensor else t.T.leaf(n) for n in op.inputs]
        term = _term(op, ins, graph)
        terms[op.name] = term
        by_tensor[op.outputs[0]] = bind(op.name, term) if bind else term
    outputs = tuple(
        op.name for op in graph.ops if graph.tensor(op.outputs[0]).role.value == "output"
    )
    return Lowered(graph, terms, outputs)
