"""Makespan lower bounds of a tiled bucket, and rejection of plans that cannot fit a budget.

No schedule of the plan on the target finishes before

    bandwidth bound = Σ op bytes / bandwidth      (each op's compulsory traffic)
    compute bound   = Σ op flops / peak           (arithmetic on the true extents)

(docs/theorems.md T4/T5; the oracle re-checks both exactly in checkpoint B). A bucket whose
bound exceeds its budget is rejected here with the resource, the excess, and the op that
contributes most to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from plow.errors import PlanRejected
from plow.tiles.ir import TileGraph


def fmt_ns(ns: float) -> str:
    """A duration for reading: 812 ns, 3.58 us, 1.61 ms, 2.5 s."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


@dataclass(frozen=True, slots=True)
class PlanBounds:
    bucket: str
    target: str
    budget_ns: int
    bytes: int
    flops: int
    weight_bytes: int
    bandwidth_bytes_per_s: int
    peak_flops_per_s: int
    bandwidth_bound_ns: float
    compute_bound_ns: float
    estimated_ns: float  # Σ op estimates + one launch (ops in sequence; not a bound)
    largest_bytes_op: str
    largest_flops_op: str
    largest_bytes: int
    largest_flops: int
    # tensor parallel: the busiest device's bytes and the devices (each with 1/gpus of the
    # bandwidth above, the group's); 0 / 1 for one device
    device_bytes: int = 0
    gpus: int = 1
    busiest_device: int = 0

    @property
    def charged_bytes(self) -> int:
        """The bytes the bandwidth bound charges at the group's bandwidth: the plan's, or the
        busiest device's times the devices when that is more (each device moves its own
        ops' bytes through its own memory, the replicated ops' included)."""
        return max(self.bytes, self.device_bytes * self.gpus)

    @property
    def lower_bound_ns(self) -> float:
        return max(self.bandwidth_bound_ns, self.compute_bound_ns)

    @property
    def bandwidth_exceeds(self) -> bool:
        """Exact: `bytes * 1e9 > budget * bandwidth` (the oracle's test, negated; for a --tp
        plan the compiler's is the busiest device's, at least as strict as B's group sum)."""
        return self.charged_bytes * 10**9 > self.budget_ns * self.bandwidth_bytes_per_s

    @property
    def compute_exceeds(self) -> bool:
        return self.flops * 10**9 > self.budget_ns * self.peak_flops_per_s

    @property
    def fits(self) -> bool:
        return not (self.bandwidth_exceeds or self.compute_exceeds)


def plan_bounds(tg: TileGraph, budget_ns: int, launch_overhead_ns: int = 0) -> PlanBounds:
    """The lower bounds (and the sequential estimate) of one tiled bucket against a budget."""
    by_bytes = max(tg.ops, key=lambda o: o.bytes, default=None)
    by_flops = max(tg.ops, key=lambda o: o.flops, default=None)
    nbytes, flops = tg.bytes, tg.flops
    per = tg.device_bytes
    busiest = max(range(len(per)), key=lambda d: per[d]) if per else 0
    charged = max(nbytes, per[busiest] * len(per)) if per else nbytes
    return PlanBounds(
        bucket=tg.bucket,
        target=tg.target,
        budget_ns=budget_ns,
        bytes=nbytes,
        flops=flops,
        weight_bytes=tg.weight_bytes,
        bandwidth_bytes_per_s=tg.bandwidth_bytes_per_s,
        peak_flops_per_s=tg.peak_flops_per_s,
        bandwidth_bound_ns=charged * 1e9 / tg.bandwidth_bytes_per_s,
        compute_bound_ns=flops * 1e9 / tg.peak_flops_per_s,
        estimated_ns=tg.estimated_ns + launch_overhead_ns,
        largest_bytes_op=by_bytes.name if by_bytes else "",
        largest_flops_op=by_flops.name if by_flops else "",
        largest_bytes=by_bytes.bytes if by_bytes else 0,
        largest_flops=by_flops.flops if by_flops else 0,
        device_bytes=per[busiest] if per else 0,
        gpus=max(1, len(per)),
        busiest_device=busiest,
    )


def check_bounds(b: PlanBounds) -> None:
    """Raise `PlanRejected` if a lower bound exceeds the budget (bandwidth checked first)."""
    budget = fmt_ns(b.budget_ns)
    if b.bandwidth_exceeds:
        over = b.bandwidth_bound_ns - b.budget_ns
        share = b.largest_bytes / b.bytes if b.bytes else 0.0
        raise PlanRejected(
            f"bucket {b.bucket}",
            f"memory bandwidth: lower bound {fmt_ns(b.bandwidth_bound_ns)} exceeds the budget "
            f"{budget} by {fmt_ns(over)} ({b.bandwidth_bound_ns / max(b.budget_ns, 1):.3g}x): "
            f"{b.bytes:.3g} bytes at {b.bandwidth_bytes_per_s:.3g} B/s on {b.target}"
            + (
                f" (device {b.busiest_device} of {b.gpus} moves {b.device_bytes:.3g} at "
                f"{b.bandwidth_bytes_per_s // b.gpus:.3g} B/s)"
                if b.gpus > 1
                else ""
            )
            + "; "
            f'op "{b.largest_bytes_op}" moves the most ({b.largest_bytes:.3g} bytes, '
            f"{share:.0%} of the step)",
        )
    if b.compute_exceeds:
        over = b.compute_bound_ns - b.budget_ns
        share = b.largest_flops / b.flops if b.flops else 0.0
        raise PlanRejected(
            f"bucket {b.bucket}",
            f"compute: lower bound {fmt_ns(b.compute_bound_ns)} exceeds the budget {budget} by "
            f"{fmt_ns(over)} ({b.compute_bound_ns / max(b.budget_ns, 1):.3g}x): "
            f"{b.flops:.3g} flops at {b.peak_flops_per_s:.3g} flop/s on {b.target}; "
            f'op "{b.largest_flops_op}" performs the most ({b.largest_flops:.3g} flops, '
            f"{share:.0%} of the step)",
        )
