"""Equality saturation of a lowered graph under the fusion ruleset, within limits.

The ruleset runs one iteration at a time; after each the stage checks the limits (iterations,
e-nodes, seconds) and stops at the first one reached, or when an iteration changes nothing
(saturated). The match count of every rule is summed over the iterations from egglog's run
reports. The e-graph is then serialised (egglog's JSON: e-nodes with their e-class and the
e-nodes of their children) for the extractor.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from egglog import EGraph

from plow.egraph.lower import Lowered, egg_names, let_name, lower
from plow.egraph.rules import RULES, fusion, rule_id
from plow.graph.ops import OpGraph


@dataclass(frozen=True, slots=True)
class Limits:
    iterations: int = 12
    nodes: int = 200_000
    seconds: float = 5.0


@dataclass(frozen=True)
class Saturated:
    classes: dict[str, str]  # let name (op name) -> e-class id
    serialized: dict[str, Any]  # egglog's JSON
    matches: dict[str, int]  # rule id -> matches summed over iterations
    iterations: int
    stop: str  # saturated | iteration limit | node limit | time limit
    seconds: float
    enodes: int
    per_iteration: list[dict[str, int]] = field(default_factory=list)


def saturate(graph: OpGraph, limits: Limits | None = None) -> tuple[Lowered, Saturated]:
    """Lower `graph` into a fresh e-graph (one let per op) and run the fusion ruleset."""
    limits = limits or Limits()
    eg = EGraph()
    low = lower(graph, egg_names(eg))
    # egglog's own e-graph runs the lets as text, one at a time (its parser is superlinear in
    # a program's length: the 12B graph's 916 lets parse in 0.3-2 s as one, 0.05 s one by one)
    prog = eg._egraph
    for line in low.program.splitlines():
        prog.run_program(*prog.parse_program(line))
    matches = {r.id: 0 for r in RULES}
    per_it: list[dict[str, int]] = []
    t0 = time.perf_counter()
    stop, it, size = "iteration limit", 0, 0
    while it < limits.iterations:
        rep = eg.run(fusion)
        it += 1
        row: dict[str, int] = {}
        for decl, c in rep.num_matches_per_rule.items():
            name = getattr(decl, "name", None) or ""
            rid = rule_id(name)
            if rid in matches:
                matches[rid] += c
                row[rid] = row.get(rid, 0) + c
        per_it.append(row)
        size = sum(n for _, n in eg.all_function_sizes())
        if not rep.updated:
            stop = "saturated"
            break
        if size > limits.nodes:
            stop = "node limit"
            break
        if time.perf_counter() - t0 > limits.seconds:
            stop = "time limit"
            break
    seconds = time.perf_counter() - t0
    ser = json.loads(eg._serialize().to_json())
    lets = {v["let"][1:]: k for k, v in ser["class_data"].items() if "let" in v}
    classes = {op.name: lets[let_name(i)] for i, op in enumerate(graph.ops)}
    return low, Saturated(classes, ser, matches, it, stop, seconds, size, per_it)
