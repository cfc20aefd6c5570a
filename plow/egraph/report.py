"""The rewrite report: what the search found, what each extraction chose, what the emitter
lacks. Crosses the CLI boundary as JSON (`plow inspect --rewrites --json`), so pydantic."""

from __future__ import annotations

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
