"""`lower(graph)`: every op of an `OpGraph` as a canonical e-graph term.

The lowering is the identity on structure: one term per op, its inputs the terms of the ops
that write them (or a `leaf` for inputs, weights and caches), its attributes the op's attrs
as one canonical JSON string. Two ops are written in primitive form so that plow's already
fused ops are rule instances like the others (R8, R13): `attention` becomes
`attend(q, kv_write(kc, k, pos), kv_write(vc, v, pos), pos)` and `gated_mlp` becomes
`mul(act(gate), up)`. An op kind this module does not know (a family added after it) is
written `opaque(kind, attrs, inputs)`: no rule matches it, and extraction keeps it as it is.

The terms are written as egglog program text (`(let $op0 (rmsnorm ...))`, one let per op, so
a term holds its inputs by name and the e-graph receives a DAG, not the tree it unfolds to)
and parsed and run by egglog in one call. The constructors are the ones `plow.egraph.terms`
declares through egglog's Python API (their egglog names are asked of the e-graph, which
registers them): building one Python expression object per op through that API cost about
5 ms an op, 4-5 s for the 12B graph's 916 ops; the text costs a few milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from egglog import EGraph, StringLike, Vec, function

from plow.egraph import terms as t
from plow.egraph.terms import T
from plow.errors import GraphError
from plow.graph.ops import Op, OpGraph, OpKind


@function
def opaque(kind: StringLike, attrs: StringLike, args: Vec[T]) -> T: ...  # type: ignore[empty-body]


# the constructors the lowering writes, by the name this module calls them
CONSTRUCTORS: dict[str, Callable[..., Any]] = {
    "leaf": T.leaf,
    "nobias": t.nobias,
    "embedding": t.embedding,
    "rmsnorm": t.rmsnorm,
    "linear": t.linear,
    "rope": t.rope,
    "kv_write": t.kv_write,
    "attend": t.attend,
    "act": t.act,
    "mul": t.mul,
    "add": t.add,
    "lm_head": t.lm_head,
    "sample": t.sample,
    "opaque": opaque,
}


def attrs_key(attrs: Mapping[str, Any]) -> str:
    """The canonical string of an op's attributes (sorted keys, JSON)."""
    return json.dumps(dict(attrs), sort_keys=True, default=str)


def let_name(i: int) -> str:
    return f"op{i}"


@dataclass(frozen=True)
class Lowered:
    graph: OpGraph
    terms: Mapping[str, str]  # op name -> its term (egglog text; inputs by let name)
    outputs: tuple[str, ...]  # the ops whose tensors the host reads (role output)
    program: str = ""  # the lets, one per op, in op order (let_name(i) is op i)


def _s(x: str) -> str:
    """An egglog string literal."""
    return '"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _term(op: Op, ins: list[str], graph: OpGraph, f: Mapping[str, str]) -> str:
    k, a = op.kind, dict(op.attrs)

    def call(name: str, *args: str | int) -> str:
        parts = [x if isinstance(x, str) else str(int(x)) for x in args]
        return f"({f[name]} {' '.join(parts)})" if parts else f"({f[name]})"

    if k is OpKind.embedding:
        return call("embedding", ins[0], ins[1], _s(attrs_key(a)))
    if k is OpKind.rmsnorm and len(ins) == 2:  # (a weightless norm, Gemma 4's v norm: opaque)
        x = graph.tensor(op.inputs[0])
        group = int(a.pop("group", x.shape[-1]))
        return call(
            "rmsnorm", ins[0], ins[1], _s(attrs_key(a)), 0 if group == x.shape[-1] else group
        )
    if k is OpKind.linear:
        return call("linear", ins[0], ins[1], ins[2] if len(ins) == 3 else call("nobias"))
    if k is OpKind.rope:
        return call("rope", ins[0], ins[1], _s(attrs_key(a)), int(a["head_dim"]))
    if k is OpKind.attention:
        q, kk, v, kc, vc, pos = ins
        return call(
            "attend", q, call("kv_write", kc, kk, pos), call("kv_write", vc, v, pos), pos,
            _s(attrs_key(a)),
        )  # fmt: skip
    if k is OpKind.gated_mlp:
        return call("mul", call("act", ins[0], _s(str(a["activation"]))), ins[1])
    if k is OpKind.residual_add:
        return call("add", ins[0], ins[1])
    if k is OpKind.lm_head:
        return call("lm_head", ins[0], ins[1], _s(attrs_key(a)))
    if k is OpKind.sample:
        return call("sample", ins[0], ins[1], _s(attrs_key(a)))
    vec = f"(vec-of {' '.join(ins)})" if ins else "(vec-empty)"
    return call("opaque", _s(str(k.value)), _s(attrs_key(a)), vec)


def egg_names(eg: EGraph) -> dict[str, str]:
    """The egglog name of every constructor in `CONSTRUCTORS`, declared in `eg`."""
    return {k: eg._callable_to_egg(fn)[1] for k, fn in CONSTRUCTORS.items()}


def lower(graph: OpGraph, names: Mapping[str, str] | None = None) -> Lowered:
    """The canonical term of every op of `graph` (ops with one output each), as egglog text
    over the constructor names `names` (`egg_names` of the e-graph that will run it; None:
    the names this module calls them, for reading)."""
    f = names or {k: k for k in CONSTRUCTORS}
    terms: dict[str, str] = {}
    by_tensor: dict[str, str] = {}
    lines = []
    for i, op in enumerate(graph.ops):
        if len(op.outputs) != 1:
            raise GraphError(op.name, f"the e-graph stage lowers one-output ops; has {op.outputs}")
        ins = [by_tensor.get(n) or f"({f['leaf']} {_s(n)})" for n in op.inputs]
        term = _term(op, ins, graph, f)
        terms[op.name] = term
        var = f"${let_name(i)}"
        lines.append(f"(let {var} {term})")
        by_tensor[op.outputs[0]] = var
    outputs = tuple(
        op.name for op in graph.ops if graph.tensor(op.outputs[0]).role.value == "output"
    )
    return Lowered(graph, terms, outputs, "\n".join(lines))
