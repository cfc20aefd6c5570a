"""`tiles.json`: the on-disk summary of the tiling stage (what `plow inspect` lists per op:
the chosen tile, every candidate considered and the cost of each, and the bucket's bounds)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from plow.tiles.bounds import PlanBounds
from plow.tiles.ir import Candidate, TiledOp, TileGraph


class AxisSummary(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    extent: int
    tile: int
    steps: int


class CandidateSummary(BaseModel):
    model_config = ConfigDict(frozen=True)
    tile: list[int]
    steps: list[int]
    tiles: int
    tile_bytes: int
    tile_flops: int
    tile_ns: float
    waves: int
    time_ns: float
    charged_cost: int
    feasible: bool
    note: str = ""


class OpSummary(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    kind: str
    layer: int | None
    rate: str
    axes: list[AxisSummary]
    tiles: int
    masked_tiles: int
    flops_per_point: int
    flops: int
    bytes: int
    weight_bytes: int
    charged_cost: int
    time_ns: float
    chosen: int  # index into candidates
    candidates: list[CandidateSummary]
    # routed experts: expected share of busy tiles and expected time (time_ns: worst case)
    expected_busy: float = 1.0
    expected_ns: float | None = None


class BoundsSummary(BaseModel):
    model_config = ConfigDict(frozen=True)
    budget_ns: int
    bytes: int
    flops: int
    weight_bytes: int
    bandwidth_bytes_per_s: int
    peak_flops_per_s: int
    bandwidth_bound_ns: float
    compute_bound_ns: float
    lower_bound_ns: float
    estimated_ns: float
    largest_bytes_op: str
    largest_flops_op: str


class BucketTiles(BaseModel):
    model_config = ConfigDict(frozen=True)
    bucket: str
    target: str
    workers: int
    weight_dtype: str
    activation_dtype: str
    cache_dtype: str
    num_ops: int
    num_tiles: int
    num_edges: int
    bounds: BoundsSummary
    ops: list[OpSummary]


class TilesFile(BaseModel):
    """`OUT/tiles.json`."""

    model_config = ConfigDict(frozen=True)
    version: int = 1
    model: str
    family: str
    target: str
    profile: str
    buckets: list[BucketTiles]


def _cand(c: Candidate) -> CandidateSummary:
    return CandidateSummary(
        tile=list(c.tile),
        steps=list(c.steps),
        tiles=c.tiles,
        tile_bytes=c.tile_bytes,
        tile_flops=c.tile_flops,
        tile_ns=round(c.tile_ns, 3),
        waves=c.waves,
        time_ns=round(c.time_ns, 3),
        charged_cost=c.charged_cost,
        feasible=c.feasible,
        note=c.note,
    )


def op_summary(o: TiledOp) -> OpSummary:
    return OpSummary(
        name=o.name,
        kind=o.kind,
        layer=o.layer,
        rate=o.rate,
        axes=[
            AxisSummary(name=a.name, extent=a.extent, tile=a.tile, steps=a.steps) for a in o.axes
        ],
        tiles=len(o.tiles),
        masked_tiles=sum(1 for t in o.tiles if t.masked),
        flops_per_point=o.flops_per_point,
        flops=o.flops,
        bytes=o.bytes,
        weight_bytes=o.weight_bytes,
        charged_cost=o.charged_cost,
        time_ns=round(o.time_ns, 3),
        chosen=o.chosen,
        candidates=[_cand(c) for c in o.candidates],
        expected_busy=round(o.expected_busy, 6),
        expected_ns=None if o.expected_ns is None else round(o.expected_ns, 3),
    )


def bucket_summary(tg: TileGraph, b: PlanBounds) -> BucketTiles:
    return BucketTiles(
        bucket=tg.bucket,
        target=tg.target,
        workers=tg.workers,
        weight_dtype=tg.weight_dtype,
        activation_dtype=tg.activation_dtype,
        cache_dtype=tg.cache_dtype,
        num_ops=len(tg.ops),
        num_tiles=tg.num_tiles,
        num_edges=len(tg.edges),
        bounds=BoundsSummary(
            budget_ns=b.budget_ns,
            bytes=b.bytes,
            flops=b.flops,
            weight_bytes=b.weight_bytes,
            bandwidth_bytes_per_s=b.bandwidth_bytes_per_s,
            peak_flops_per_s=b.peak_flops_per_s,
            bandwidth_bound_ns=round(b.bandwidth_bound_ns, 3),
            compute_bound_ns=round(b.compute_bound_ns, 3),
            lower_bound_ns=round(b.lower_bound_ns, 3),
            estimated_ns=round(b.estimated_ns, 3),
            largest_bytes_op=b.largest_bytes_op,
            largest_flops_op=b.largest_flops_op,
        ),
        ops=[op_summary(o) for o in tg.ops],
    )
