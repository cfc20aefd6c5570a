"""Tiling: every op of a bucket cut into tiles chosen by the target's cost model
(DESIGN.md §3, docs/tiling.md), makespan bounds, and checkpoint B certification."""

from plow.tiles.bounds import PlanBounds, check_bounds, fmt_ns, plan_bounds
from plow.tiles.cost import CostModel
from plow.tiles.ir import Axis, Candidate, Tile, TiledOp, TileGraph
from plow.tiles.payload import certify_tiles, tile_payload
from plow.tiles.tiler import TilingOptions, axis_sizes, enumerate_tiles, tile_graph

__all__ = [
    "Axis",
    "Candidate",
    "CostModel",
    "PlanBounds",
    "Tile",
    "TileGraph",
    "TiledOp",
    "TilingOptions",
    "axis_sizes",
    "certify_tiles",
    "check_bounds",
    "enumerate_tiles",
    "fmt_ns",
    "plan_bounds",
    "tile_graph",
    "tile_payload",
]
