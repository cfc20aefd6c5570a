"""Checkpoint B: the payload of a tiled bucket, and its certification by the oracle."""

from __future__ import annotations

from plow.oracle import Certificate, run_checkpoint
from plow.oracle.payloads.tiles import TileAxis, TileOp, TilePayload, TileTarget
from plow.target.model import Target
from plow.tiles.ir import TileGraph


def tile_payload(tg: TileGraph, target: Target, budget_ns: int) -> TilePayload:
    """The checkpoint B payload of one tiled bucket under a step budget (integers only).

    Per op: its axes and chosen tiling, `flops` on the true extents, the charged cost of the
    chosen candidate, and its compulsory bytes; the plan claims `weight_bytes` (T6). The
    peak is the highest rate the plan's ops compute at; the minimum tile is the target's
    smallest (`min(rows, cols)`), which every axis of every op honours.
    """
    ops = [
        TileOp(
            name=o.name,
            kind=o.kind,
            axes=[
                TileAxis(name=a.name, extent=a.extent, tile=a.tile, steps=a.steps) for a in o.axes
            ],
            flops_per_point=o.flops_per_point,
            flops=o.flops,
            charged_cost=o.charged_cost,
            bytes=o.bytes,
        )
        for o in tg.ops
    ]
    return TilePayload(
        ops=ops,
        target=TileTarget(
            name=target.name,
            bandwidth_bytes_per_s=tg.bandwidth_bytes_per_s,
            peak_flops_per_s=tg.peak_flops_per_s,
            min_tile=target.min_tile_any_axis,
        ),
        budget_ns=budget_ns,
        weight_bytes=tg.weight_bytes,
    )


def certify_tiles(tg: TileGraph, target: Target, budget_ns: int) -> tuple[TilePayload, Certificate]:
    """Run checkpoint B on the bucket; returns the payload and the oracle's certificate."""
    payload = tile_payload(tg, target, budget_ns)
    return payload, run_checkpoint("B", payload)
