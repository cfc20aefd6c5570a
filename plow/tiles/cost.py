"""The cost model: what one tile costs on a target, and what a tiling is charged.

A tile that moves `b` bytes and performs `f` flops (both on padded dims) occupies one worker
for `max(b / (bandwidth/W), f / (peak/W)) + tile_overhead` — a worker gets a 1/W share of
memory bandwidth and of the peak. In flop-equivalents of worker time (the unit of
`charged_cost`, exact integers):

    fe(tile) = max(ceil(b * peak / bandwidth), f) + ceil(tile_overhead_ns * peak / (W * 1e9))

so `fe(tile) >= f` and a tiling's charge `tiles * fe(tile) (+ merge)` is at least its padded
work, hence at least its arithmetic (checkpoint B, T3). The op's time is `waves * tile_ns`
with `waves = ceil(tiles / W)` (tiles run W at a time), plus the merge of a split reduction.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def round_up(x: int, m: int) -> int:
    return cdiv(x, m) * m


@dataclass(frozen=True, slots=True)
class CostModel:
    workers: int
    bandwidth: int  # bytes/s, whole device
    peak: int  # flop/s, whole device, at the op's rate class
    tile_overhead_ns: int

    @property
    def overhead_fe(self) -> int:
        return cdiv(self.tile_overhead_ns * self.peak, self.workers * 10**9)

    def tile_fe(self, tile_bytes: int, tile_flops: int) -> int:
        """Flop-equivalents of worker time one tile is charged (>= `tile_flops`)."""
        return max(cdiv(tile_bytes * self.peak, self.bandwidth), tile_flops) + self.overhead_fe

    def fe_to_worker_ns(self, fe: int) -> float:
        """Worker-time in ns of `fe` flop-equivalents (one worker runs at peak/W)."""
        return fe * self.workers * 1e9 / self.peak

    def device_ns(self, nbytes: int) -> float:
        """Time in ns to move `nbytes` at the whole device's bandwidth."""
        return nbytes * 1e9 / self.bandwidth

    def bytes_fe(self, nbytes: int) -> int:
        """Flop-equivalents of whole-device time to move `nbytes` (merge passes)."""
        return cdiv(nbytes * self.peak, self.bandwidth)


def busy_probability(rows: int, top_k: int, experts: int) -> float:
    """Routed experts: the probability that a tile of `rows` rows of one expert does work
    when each row picks `top_k` of `experts` uniformly at random (independent rows):
    `1 - (1 - k/E)^rows`. An idle tile costs only its overhead (it still signals); the
    worst case (every tile busy) is what a tiling is charged and must fit."""
    p = min(1.0, top_k / max(1, experts))
    return 1.0 - (1.0 - p) ** rows
