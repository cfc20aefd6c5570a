"""The fusion stage: the operator graph as e-graph terms, the rules R1–R19 as one egglog
ruleset, saturation within limits, extraction by the target's cost model, and a report.

`rewrite(graph, target)` returns the extracted graphs and the report. Two extractions are
made from one saturated e-graph: over every rule (what the search would choose) and over the
constructors the emitter implements (what reaches the packets today). The rules are proved
equalities of tensor functions in `Plow/Rewritesproof.v`; see docs/egraph.md.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from plow.egraph.extract import (
    EMITTER,
    MATMUL_WEIGHT,
    EGraphView,
    Extraction,
    extract,
    prepare,
    rule_of,
    weight_dtype,
)
from plow.egraph.fused import FusedGraph, build_fused, transitive_reduction_count
from plow.egraph.report import GraphCounts, LimitsRow, RelayoutRow, RewriteReport, RuleRow
from plow.egraph.rules import RULES
from plow.egraph.saturate import Limits, saturate
from plow.graph.ops import OpGraph
from plow.target import Target

__all__ = ["Limits", "Rewritten", "RewriteReport", "FusedGraph", "rewrite"]

LAYOUT_RULE = {"cat3": "R4", "interleave": "R2"}  # layout -> the rule that introduces it


@dataclass(frozen=True)
class Rewritten:
    searched: FusedGraph
    emitted: FusedGraph
    report: RewriteReport


def _counts(names: list[str], edges: list[tuple[str, str]], cost: float) -> GraphCounts:
    distinct = set(edges)
    return GraphCounts(
        ops=len(names),
        edges=len(edges),
        op_edges=len(distinct),
        op_edges_after_reduction=transitive_reduction_count(names, distinct),
        cost_ns=round(cost, 3),
    )


def _instances(view: EGraphView, ext: Extraction) -> Counter[str]:
    """Instances of each rule in an extraction: its fused e-nodes, and for the layout rules
    (R2, R4) the matmuls whose weight is an interleaved or concatenated one."""
    c: Counter[str] = Counter()
    for i in ext.op_nodes:
        n = view.nodes[i]
        r = rule_of(n.op)
        if r:
            c[r] += 1
        if n.op in MATMUL_WEIGHT:
            k = ext.choice.get(n.children[MATMUL_WEIGHT[n.op]])
            op = view.nodes[k].op if k is not None else ""
            if op in LAYOUT_RULE:
                c[LAYOUT_RULE[op]] += 1
    return c


def rewrite(
    graph: OpGraph, target: Target, limits: Limits | None = None, fuse: bool = False
) -> Rewritten:
    """Saturate `graph` under R1–R19 within `limits`, extract twice (every rule; the
    emitter's ops) by `target`'s cost model, and report. `fuse`: the emitter's ops include
    the fused kinds it implements (a `CompileProfile.fuse` compile, plow/egraph/apply.py)."""
    from plow.egraph.apply import EMITTED_FUSED

    implemented = frozenset().union(*EMITTED_FUSED.values())
    limits = limits or Limits()
    t0 = time.perf_counter()
    low, sat = saturate(graph, limits)
    lower_s = time.perf_counter() - t0 - sat.seconds
    t1 = time.perf_counter()
    pr = prepare(graph, sat.classes, sat.serialized, low.outputs)
    view, canonical = pr.view, pr.canonical
    dtype = weight_dtype(graph)
    ext_s = extract(view, pr.info, pr.roots, target, dtype)
    ext_e = extract(
        view, pr.info, pr.roots, target, dtype, EMITTER | implemented if fuse else EMITTER
    )
    if ext_e.cost_ns < ext_s.cost_ns:  # the heuristic lost to a choice it could have made
        ext_s = ext_e
    fs, fe = build_fused(view, ext_s, canonical), build_fused(view, ext_e, canonical)
    extract_s = time.perf_counter() - t1
    inst_s, inst_e = _instances(view, ext_s), _instances(view, ext_e)
    canon_names = [op.name for op in graph.ops]
    # the emitter's ops are plow's OpKinds, so the emitted extraction is the canonical graph
    # when no emitted rule beyond R8/R13 fires; its cost is the canonical graph's
    canon_cost = ext_e.cost_ns
    rows = [
        RuleRow(
            id=r.id,
            name=r.name,
            statement=r.statement,
            side_condition=r.side_condition,
            lemma=r.lemma,
            matches=sat.matches.get(r.id, 0),
            searched=inst_s[r.id],
            emitted=inst_e[r.id],
            emitter=r.emitter,
        )
        for r in RULES
    ]
    report = RewriteReport(
        bucket=graph.bucket_name,
        target=target.name,
        limits=LimitsRow(iterations=limits.iterations, nodes=limits.nodes, seconds=limits.seconds),
        iterations=sat.iterations,
        stop=sat.stop,
        lower_seconds=round(lower_s, 3),
        saturate_seconds=round(sat.seconds, 3),
        extract_seconds=round(extract_s, 3),
        enodes=sat.enodes,
        eclasses=len(sat.serialized["class_data"]),
        rules=rows,
        canonical=_counts(canon_names, graph.edges(), canon_cost),
        searched=_counts([o.name for o in fs.ops], fs.edges(), ext_s.cost_ns),
        emitted=_counts([o.name for o in fe.ops], fe.edges(), ext_e.cost_ns),
        relayouts=[
            RelayoutRow(name=r.name, layout=r.layout, sources=list(r.sources), rows=r.rows)
            for r in fs.relayouts
        ],
        unimplemented=sorted(
            {o.kind for o in fs.ops if o.kind not in EMITTER and o.kind not in implemented}
        ),
    )
    return Rewritten(fs, fe, report)
