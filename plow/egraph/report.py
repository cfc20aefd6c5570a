"""The rewrite report: what the search found, what each extraction chose, what the emitter
lacks. Crosses the CLI boundary as JSON (`plow inspect --rewrites --json`), so pydantic."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RuleRow(_M):
    id: str
    name: str
    statement: str
    side_condition: str
    lemma: str
    matches: int  # summed over the saturation's iterations
    searched: int  # instances in the extraction over every rule
    emitted: int  # instances in the extraction over what the emitter implements
    emitter: bool


class GraphCounts(_M):
    ops: int
    edges: int  # one per input an op reads from another op
    op_edges: int  # distinct producer -> consumer pairs
    op_edges_after_reduction: int
    cost_ns: float  # the cost model's sum over the ops


class RelayoutRow(_M):
    name: str
    layout: str
    sources: list[str]
    rows: str


class LimitsRow(_M):
    iterations: int
    nodes: int
    seconds: float


class RewriteReport(_M):
    bucket: str
    target: str
    limits: LimitsRow
    iterations: int
    stop: str
    lower_seconds: float
    saturate_seconds: float
    extract_seconds: float
    enodes: int
    eclasses: int
    rules: list[RuleRow]
    canonical: GraphCounts
    searched: GraphCounts  # extraction over every rule: what the search would pick
    emitted: GraphCounts  # extraction over the emitter's ops: what reaches the packets
    relayouts: list[RelayoutRow]  # weights the searched extraction re-lays out
    unimplemented: list[str]  # fused kinds the searched extraction uses, no emitter yet


def render(report: RewriteReport) -> list[Any]:
    """Rich tables of one report: the search, the rules, the counts before and after."""
    from rich.table import Table

    head = Table(title=f"rewrites: {report.bucket} on {report.target}")
    for c in ("iterations", "stop", "e-nodes", "e-classes", "lower s", "saturate s", "extract s"):
        head.add_column(c)
    head.add_row(
        str(report.iterations),
        report.stop,
        str(report.enodes),
        str(report.eclasses),
        f"{report.lower_seconds:.2f}",
        f"{report.saturate_seconds:.2f}",
        f"{report.extract_seconds:.2f}",
    )
    rules = Table(title="rules (matches over the saturation; instances in each extraction)")
    for c in ("rule", "name", "matches", "searched", "emitted", "emitter", "lemma"):
        rules.add_column(c)
    for r in report.rules:
        rules.add_row(
            r.id,
            r.name,
            str(r.matches),
            str(r.searched),
            str(r.emitted),
            "yes" if r.emitter else "no",
            r.lemma,
        )
    counts = Table(title="graph before and after extraction")
    for c in ("graph", "ops", "edges", "distinct op edges", "after reduction", "cost ms"):
        counts.add_column(c)
    for name, g in (
        ("canonical", report.canonical),
        ("searched", report.searched),
        ("emitted", report.emitted),
    ):
        counts.add_row(
            name,
            str(g.ops),
            str(g.edges),
            str(g.op_edges),
            str(g.op_edges_after_reduction),
            f"{g.cost_ns / 1e6:.3f}",
        )
    tail = Table(show_header=False, box=None)
    tail.add_row("no emitter yet", ", ".join(report.unimplemented) or "-")
    tail.add_row("re-laid-out weights (searched)", str(len(report.relayouts)))
    return [head, rules, counts, tail]
