"""The tile graph: every op of one bucket with its chosen tiling, the candidates the tiler
weighed (with their cost), and the tiles themselves (half-open index ranges per axis).

Frozen dataclasses (internal IR). `tiles.json` in a plan directory is the on-disk summary
(`plow.tiles.summary`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Axis:
    """One axis of an op's index space: true `extent`, `tile` size, `steps` of the tile.

    Step `j` covers `j*tile .. min((j+1)*tile, extent)`; lanes past the extent are masked
    (an 8-wide axis under a 16-wide minimum tile is one masked step).
    """

    name: str
    extent: int
    tile: int
    steps: int

    @property
    def padded(self) -> int:
        """`steps * tile`: what the steps cover, masked lanes included."""
        return self.steps * self.tile

    def ranges(self) -> list[tuple[int, int]]:
        """The half-open index range of each step, clipped at the extent."""
        return [(j * self.tile, min((j + 1) * self.tile, self.extent)) for j in range(self.steps)]


@dataclass(frozen=True, slots=True)
class Tile:
    """One tile of an op: its position in the op's tile list and its index ranges."""

    op: str
    index: int  # row-major over the axes (last axis fastest)
    ranges: tuple[tuple[int, int], ...]  # half-open [start, stop) per axis, clipped at extent
    masked: bool  # the nominal tile box reaches past an extent (masked lanes)

    @property
    def points(self) -> int:
        """Index-space points the tile really computes (masked lanes excluded)."""
        n = 1
        for a, b in self.ranges:
            n *= b - a
        return n


@dataclass(frozen=True, slots=True)
class Candidate:
    """One tiling the tiler weighed for an op, with what the cost model charged it.

    `tile`/`steps` are per axis (in the op's axis order). Costs: `tile_bytes`/`tile_flops`
    are per tile on padded dims; `charged_cost` is in flop-equivalents of worker time over
    all tiles (>= `padded_work` >= the op's arithmetic); `time_ns` is the estimated op time
    (`waves * tile_ns` plus any split-reduction merge). Infeasible candidates (e.g. an
    accumulator larger than on-chip memory) are kept with the reason in `note`.
    """

    tile: tuple[int, ...]
    steps: tuple[int, ...]
    tiles: int
    tile_bytes: int
    tile_flops: int
    tile_ns: float
    waves: int
    time_ns: float
    charged_cost: int
    padded_work: int
    feasible: bool = True
    note: str = ""


@dataclass(frozen=True, slots=True)
class TiledOp:
    """An op of the graph with its chosen tiling.

    `flops` is the arithmetic on the true extents (`flops_per_point * Π extent`); `bytes` the
    compulsory device-memory traffic (each weight, input and output byte once: what the
    makespan lower bound may assume); `weight_bytes` the weight bytes the op reads in full.
    `chosen` indexes `candidates`; `axes` and `tiles` are the chosen candidate's.
    """

    name: str
    kind: str
    layer: int | None
    rate: str  # peak-rate class the op computes at: "bf16", "fp8" or "fp32"
    axes: tuple[Axis, ...]
    flops_per_point: int
    flops: int
    bytes: int
    weight_bytes: int
    candidates: tuple[Candidate, ...]
    chosen: int
    tiles: tuple[Tile, ...]
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    # Routed experts: the expected share of the op's tiles that do work (a tile is busy when
    # some row of it chose its expert) and the op's expected time; 1.0 / `time_ns` otherwise.
    expected_busy: float = 1.0
    expected_ns: float | None = None

    @property
    def choice(self) -> Candidate:
        return self.candidates[self.chosen]

    @property
    def tile_shape(self) -> tuple[int, ...]:
        return tuple(a.tile for a in self.axes)

    @property
    def charged_cost(self) -> int:
        return self.choice.charged_cost

    @property
    def time_ns(self) -> float:
        return self.choice.time_ns

    @property
    def padded_work(self) -> int:
        return self.choice.padded_work


@dataclass(frozen=True, slots=True)
class TileGraph:
    """The tiled plan of one bucket: ops in the graph's topological order, and its edges
    `(producer op, consumer op)`. `peak_flops_per_s` is the highest rate any op uses (the
    compute lower bound divides by it); `activation_dtype`/`cache_dtype` are the storage
    dtypes the traffic was counted in."""

    bucket: str
    target: str
    workers: int
    ops: tuple[TiledOp, ...]
    edges: tuple[tuple[str, str], ...]
    weight_dtype: str
    activation_dtype: str
    cache_dtype: str
    peak_flops_per_s: int
    bandwidth_bytes_per_s: int
    devices: tuple[int, ...] = ()  # tensor parallel: each op's device (empty: one device)

    def __iter__(self) -> Iterator[TiledOp]:
        return iter(self.ops)

    def op(self, name: str) -> TiledOp:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(name)

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in self.ops)

    @property
    def flops(self) -> int:
        return sum(o.flops for o in self.ops)

    @property
    def device_bytes(self) -> tuple[int, ...]:
        """Tensor parallel: the compulsory bytes of each device's ops (empty: one device)."""
        if not self.devices:
            return ()
        out = [0] * (max(self.devices) + 1)
        for o, d in zip(self.ops, self.devices, strict=True):
            out[d] += o.bytes
        return tuple(out)

    @property
    def weight_bytes(self) -> int:
        return sum(o.weight_bytes for o in self.ops)

    @property
    def num_tiles(self) -> int:
        return sum(len(o.tiles) for o in self.ops)

    @property
    def estimated_ns(self) -> float:
        """Sum of the ops' estimated times (ops run one after another; no overlap assumed)."""
        return sum(o.time_ns for o in self.ops)
