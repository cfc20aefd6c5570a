"""Extraction: choose one e-node per needed e-class by the target's cost model.

Each op e-node costs the time one op takes on the target under the roofline of
`plow/tiles/cost.py` — `max(bytes / bandwidth, flops / peak)` for the bytes the op moves
(inputs read, outputs written; an intermediate a fused op keeps on chip is not moved) and
the flops it performs — plus the fixed cost of one op in the persistent kernel: a tile's
overhead and one device-scope counter round trip (`tile_overhead_ns`,
`atomic_latency_ns.device`). Layouts (`cat3`, `interleave`) are weights re-laid-out at
bundle time and views (`part`, `fst`, `snd`) select an output: both cost nothing and are
not ops.

The extractor is the greedy DAG extractor of extraction-gym: an e-class's cost is the sum
over the *set* of op e-nodes its best choice needs, so an op read twice (the residual
stream, a multi-output fused op behind two views) is paid once. It relaxes every e-node
until no e-class improves. `allowed` restricts the choice to the constructors the emitter
implements; with every constructor allowed the result is what the search would pick.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from plow.egraph.rules import RULES
from plow.errors import PlowError
from plow.graph.ops import OpGraph
from plow.target import Target
from plow.target.model import dtype_bytes

VIEWS = frozenset({"part", "fst", "snd"})
LAYOUTS = frozenset({"cat3", "interleave"})
FREE = VIEWS | LAYOUTS | {"T.leaf", "nobias", "Vec"}
# constructors the emitter has an opcode for (plow's OpKind ops); `attention` and `glu` are
# R8's and R13's fused forms of the lowering's primitives
EMITTER = frozenset(
    {
        "embedding",
        "rmsnorm",
        "linear",
        "rope",
        "attention",
        "glu",
        "add",
        "lm_head",
        "sample",
        "opaque",
    }
)
# the argument position of the weight of each matmul-shaped op
MATMUL_WEIGHT = {
    "linear": 1,
    "linear_glu": 1,
    "linear_rope": 1,
    "linear_residual": 1,
    "linear_act": 1,
    "rmsnorm_linear": 3,
    "lm_head": 1,
    "lm_head_argmax": 1,
    "rmsnorm_lm_head": 3,
}
_ATTN_CACHE = {"attend": 1, "attention": 3, "attention_rope": 3}
_PAIRS = {"add_rmsnorm", "lm_head_argmax", "embedding_rmsnorm"}
# fused kinds whose plow tiles hold whole rows (plow/tiles/tiler.py: columns never split);
# none today (add_rmsnorm splits its columns, as rmsnorm)
WHOLE_ROWS: frozenset[str] = frozenset()
_ALWAYS = frozenset({"T.leaf", "nobias", "Vec"})
ACT_BYTES = 4  # activations are float32 in plow's graph


Shape = tuple[int, ...]
# (shape, bytes per element) of a tensor class; a pair class has two
Info = tuple[tuple[Shape, int], ...]


@dataclass(frozen=True, slots=True)
class Node:
    op: str
    children: tuple[int, ...]  # e-class indices
    cls: int


@dataclass(frozen=True)
class EGraphView:
    nodes: tuple[Node, ...]
    class_ids: tuple[str, ...]
    literal: Mapping[int, Any]  # primitive e-class -> its value

    @classmethod
    def parse(cls, ser: Mapping[str, Any]) -> EGraphView:
        ids: dict[str, int] = {}
        raw = ser["nodes"]
        for v in raw.values():
            ids.setdefault(v["eclass"], len(ids))
        nodes, lit = [], {}
        for k, v in raw.items():
            c = ids[v["eclass"]]
            if k.startswith("primitive-") and v["op"] != "Vec":
                lit[c] = json.loads(v["op"]) if v["op"][:1] in '"-0123456789' else v["op"]
                continue
            kids = tuple(ids[raw[ch]["eclass"]] for ch in v["children"])
            nodes.append(Node(v["op"], kids, c))
        return cls(tuple(nodes), tuple(ids), lit)


@dataclass(frozen=True)
class Extraction:
    choice: Mapping[int, int]  # e-class -> node index, for every class the roots need
    cost_ns: float
    op_nodes: tuple[int, ...]  # the chosen op nodes, children before parents


def weight_dtype(graph: OpGraph) -> str:
    """The storage dtype of `graph`'s weights (the first weight's; float32 when it has none)."""
    for t in graph.tensors.values():
        if t.role.value == "weight":
            dtype_bytes(t.dtype)  # an unknown dtype is an error here, not a wrong cost
            return t.dtype
    return "float32"


@dataclass(frozen=True)
class Prepared:
    """A saturated e-graph ready to extract from: its view, the canonical op of each op's
    e-class (by class index), every tensor class's shape and element size, the roots."""

    view: EGraphView
    canonical: dict[int, str]
    info: dict[int, Info]
    roots: list[int]


def prepare(
    graph: OpGraph, classes: Mapping[str, Any], serialized: Any, outputs: Iterable[str]
) -> Prepared:
    """The `Prepared` of `graph`'s saturated e-graph (`classes`: op name -> e-class id;
    `serialized`: egglog's serialization; `outputs`: the program outputs' op names)."""
    view = EGraphView.parse(serialized)
    index = {cid: i for i, cid in enumerate(view.class_ids)}
    canonical = {index[c]: op for op, c in classes.items()}
    seed = {index[c]: ((graph.tensor(op).shape, 4),) for op, c in classes.items()}
    return Prepared(
        view, canonical, infer_info(view, seed, graph), [index[classes[o]] for o in outputs]
    )


def infer_info(view: EGraphView, seed: Mapping[int, Info], graph: OpGraph) -> dict[int, Info]:
    """Shape and element size of every tensor e-class: seeded from the canonical ops'
    tensors and the leaves, then propagated through the new e-classes the rules made
    (concatenated and interleaved weights, their linears, the pairs)."""
    info: dict[int, Info] = dict(seed)
    for n in view.nodes:
        if n.op == "T.leaf":
            t = graph.tensor(view.literal[n.children[0]])
            info[n.cls] = ((t.shape, dtype_bytes(t.dtype)),)
        elif n.op == "nobias":
            info[n.cls] = (((), 0),)
    changed = True
    while changed:
        changed = False
        for n in view.nodes:
            if n.cls in info:
                continue
            r = _infer(n, info)
            if r is not None:
                info[n.cls] = r
                changed = True
    return info


def _infer(n: Node, info: Mapping[int, Info]) -> Info | None:
    ch = [info.get(c) for c in n.children]
    if n.op == "cat3" and all(ch):
        (a, e), (b, _), (c, _) = ch[0][0], ch[1][0], ch[2][0]  # type: ignore[index]
        return (((a[0] + b[0] + c[0], *a[1:]) if a else (), e),)
    if n.op == "interleave" and ch[0] is not None:
        a, e = ch[0][0]
        return (((2 * a[0], *a[1:]) if a else (), e),)
    if n.op in MATMUL_WEIGHT and n.op not in _PAIRS and ch[0] and ch[MATMUL_WEIGHT[n.op]]:
        x, w = ch[0][0][0], ch[MATMUL_WEIGHT[n.op]][0][0]  # type: ignore[index]
        cols = w[0] // 2 if n.op == "linear_glu" else w[0]
        return (((*x[:-1], cols), ACT_BYTES),)
    if n.op == "glu_interleaved" and ch[0]:
        y = ch[0][0][0]
        return (((*y[:-1], y[-1] // 2), ACT_BYTES),)
    if n.op == "add_rmsnorm" and ch[0]:
        return (ch[0][0], ch[0][0])
    if n.op == "embedding_rmsnorm" and ch[0] and ch[1]:
        s = ((*ch[0][0][0], ch[1][0][0][1]), ACT_BYTES)
        return (s, s)
    if n.op == "lm_head_argmax" and ch[0] and ch[1]:
        x, w = ch[0][0][0], ch[1][0][0]
        return (((*x[:-1], w[0]), ACT_BYTES), ((x[0],), 4))
    if n.op == "Vec" and all(ch):
        return tuple(x for c in ch for x in c)  # type: ignore[union-attr]
    if n.op == "kv_write" and ch[0]:
        return (ch[0][0],)
    if n.op in ("fst", "snd") and ch[0]:
        return (ch[0][0 if n.op == "fst" else 1],)
    return None


def _nbytes(i: Info) -> int:
    return sum(math.prod(s) * e for s, e in i)


def node_cost_ns(n: Node, info: Mapping[int, Info], target: Target, dtype: str) -> float:
    """Time in ns of one op e-node on `target` (0 for leaves, layouts and views)."""
    if n.op in FREE:
        return 0.0
    out = info.get(n.cls)
    tensors = [info[c] for c in n.children if c in info]
    if out is None:
        raise PlowError("egraph", f"no shape for the output of a {n.op} e-node")
    if n.op == "kv_write":  # writes the new rows only
        moved = 2 * _nbytes(info[n.children[1]]) + _nbytes(info[n.children[2]])
    else:
        moved = sum(_nbytes(i) for i in tensors) + _nbytes(out)
    if n.op in MATMUL_WEIGHT:
        x = info[n.children[0]][0][0]
        w = info[n.children[MATMUL_WEIGHT[n.op]]][0][0]
        flops = 2 * (math.prod(x) // x[-1]) * w[0] * w[1]
    elif n.op in _ATTN_CACHE:
        q = info[n.children[0]][0][0]
        flops = 4 * math.prod(q) * info[n.children[_ATTN_CACHE[n.op]]][0][0][2]
    else:
        flops = 4 * sum(math.prod(s) for s, _ in out)
    # fused kinds whose tiles hold whole rows: at most one worker per row streams them
    share = 1.0
    if n.op in WHOLE_ROWS:
        shape = out[0][0]
        share = min(1.0, (math.prod(shape) // max(1, shape[-1])) / max(1, target.workers))
    bandwidth = target.bandwidth_bytes_per_s * share
    t = max(moved / bandwidth, flops / (target.peak(dtype) * share)) * 1e9
    return t + target.tile_overhead_ns + target.atomic_latency_ns["device"]


def extract(
    view: EGraphView,
    info: Mapping[int, Info],
    roots: Iterable[int],
    target: Target,
    dtype: str,
    allowed: frozenset[str] | None = None,
) -> Extraction:
    """The greedy-DAG choice for `roots`; `allowed` (None: all) limits the op constructors."""
    nodes = view.nodes
    cost = [node_cost_ns(n, info, target, dtype) for n in nodes]
    # views and layouts need the emitter too (a sliced output, a re-laid-out weight)
    ok = [allowed is None or n.op in _ALWAYS or n.op in allowed for n in nodes]
    # e-class -> (cost, the priced nodes it needs, its node, those nodes' e-classes)
    best: dict[int, tuple[float, frozenset[int], int, frozenset[int]]] = {}
    for c in view.literal:
        best[c] = (0.0, frozenset(), -1, frozenset())
    parents: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        for c in set(n.children):
            parents.setdefault(c, []).append(i)
    empty: frozenset[int] = frozenset()
    # worklist relaxation: a node is (re)evaluated when one of its children's best improved
    queue = deque(i for i, n in enumerate(nodes) if all(c in best for c in n.children))
    queued = set(queue)
    while queue:
        i = queue.popleft()
        queued.discard(i)
        n = nodes[i]
        if not ok[i] or any(c not in best for c in n.children):
            continue
        s = empty.union(*(best[c][1] for c in n.children))
        cs = empty.union(*(best[c][3] for c in n.children))
        if n.cls in cs:
            continue  # would be a cycle through its own e-class
        if cost[i] > 0:
            s, cs = s | {i}, cs | {n.cls}
        total = sum(map(cost.__getitem__, s))
        old = best.get(n.cls)
        if old is None or total < old[0] - 1e-9 or (total <= old[0] + 1e-9 and i < old[2]):
            if old is not None and old[2] == i:
                continue
            best[n.cls] = (total, s, i, cs)
            for j in parents.get(n.cls, ()):
                if j not in queued:
                    queue.append(j)
                    queued.add(j)
    roots = list(roots)
    for r in roots:
        if r not in best:
            raise PlowError(
                "egraph", "extraction found no term for an output within the allowed ops"
            )
    choice = {c: v[2] for c, v in best.items() if v[2] >= 0}
    if _acyclic(view):
        choice = _improve(view, cost, ok, choice, roots)
    order = _post_order(view, choice, roots)
    op_nodes = tuple(i for i in order if nodes[i].op not in FREE)
    reached = {nodes[i].cls for i in order}
    return Extraction(
        {c: i for c, i in choice.items() if c in reached},
        sum(cost[i] for i in op_nodes),
        op_nodes,
    )


def _post_order(view: EGraphView, choice: Mapping[int, int], roots: list[int]) -> list[int]:
    """The chosen nodes reachable from `roots`, children before parents."""
    order: list[int] = []
    seen: set[int] = set()
    for r in roots:
        stack = [(r, False)]
        while stack:
            k, done = stack.pop()
            if done:
                order.append(choice[k])
                continue
            if k in seen or k in view.literal:
                continue
            seen.add(k)
            stack.append((k, True))
            stack.extend((ch, False) for ch in reversed(view.nodes[choice[k]].children))
    return order


def _acyclic(view: EGraphView) -> bool:
    """No e-class reaches itself through any e-node's children (then every choice is a DAG)."""
    succ: dict[int, set[int]] = {}
    for n in view.nodes:
        succ.setdefault(n.cls, set()).update(n.children)
    state: dict[int, int] = {}  # 1 on the stack, 2 done
    for start in succ:
        if start in state:
            continue
        stack = [(start, iter(succ.get(start, ())))]
        state[start] = 1
        while stack:
            k, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[k] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return False
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(succ.get(nxt, ()))))
    return True


def _improve(
    view: EGraphView,
    cost: list[float],
    ok: list[bool],
    choice: dict[int, int],
    roots: list[int],
) -> dict[int, int]:
    """Local search on the exact DAG cost, from the greedy choice.

    A move switches one e-class to another of its e-nodes; when that e-node is a view of a
    multi-output op (a `part` of the concatenated projection, `fst`/`snd` of a pair), the
    move switches every e-class holding a view of the same op at once, since the shared op
    pays off only when all its outputs are used. The DAG cost is kept exact by reference
    counts on e-classes; a move that does not lower it is undone.
    """
    nodes = view.nodes
    choice = dict(choice)
    ref: dict[int, int] = {}
    total = [0.0]

    def inc(k0: int) -> None:
        stack = [k0]
        while stack:
            k = stack.pop()
            if k in view.literal:
                continue
            ref[k] = ref.get(k, 0) + 1
            if ref[k] == 1:
                total[0] += cost[choice[k]]
                stack.extend(nodes[choice[k]].children)

    def dec(k0: int) -> None:
        stack = [k0]
        while stack:
            k = stack.pop()
            if k in view.literal:
                continue
            ref[k] -= 1
            if ref[k] == 0:
                total[0] -= cost[choice[k]]
                stack.extend(nodes[choice[k]].children)

    def switch(c: int, b: int) -> None:
        a = choice[c]
        if ref.get(c, 0) > 0:
            total[0] += cost[b] - cost[a]
            for ch in nodes[b].children:
                inc(ch)
            choice[c] = b
            for ch in nodes[a].children:
                dec(ch)
        else:
            choice[c] = b

    for r in roots:
        inc(r)
    views_of: dict[int, list[int]] = {}  # viewed class -> view nodes
    by_class: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        if ok[i] and all(ch in choice or ch in view.literal for ch in n.children):
            by_class.setdefault(n.cls, []).append(i)
            if n.op in VIEWS:
                views_of.setdefault(n.children[0], []).append(i)
    for _ in range(6):
        improved = False
        for c in sorted(k for k, v in ref.items() if v > 0):
            if ref.get(c, 0) == 0:
                continue
            for b in by_class.get(c, ()):
                if b == choice[c]:
                    continue
                if nodes[b].op in VIEWS:
                    move = [(nodes[j].cls, j) for j in views_of[nodes[b].children[0]]]
                else:
                    move = [(c, b)]
                move = [(k, j) for k, j in move if choice.get(k) != j]
                before, undo = total[0], [(k, choice[k]) for k, _ in move]
                for k, j in move:
                    switch(k, j)
                if total[0] < before - 1e-6:
                    improved = True
                else:
                    for k, j in reversed(undo):
                        switch(k, j)
        if not improved:
            break
    return choice


def rule_of(op: str) -> str | None:
    """The rule whose fused constructor `op` is (None for a canonical one)."""
    for r in RULES:
        if op in r.fused and op not in LAYOUTS and op not in VIEWS:
            return r.id
    return None
