"""Step (a) of a study: compile the workload's buckets and certify them.

Today the compile pipeline is tiling + checkpoint B (plow.tiles, the extracted oracle): every
decode bucket the study measures is built into an operator graph, tiled against the target,
its makespan lower bounds checked against the step budget, and its payload certified by the
oracle. A bound over budget or a rejected certificate stops the study (exit 1). When the full
pipeline (schedule, emit, bundle, checkpoints A-F) lands, this is the one place to call it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from pydantic import BaseModel

from harness.environment import Calibration
from harness.workload import Workload
from plow.checkpoint import ModelSpec
from plow.errors import PlanRejected, PlowError
from plow.graph import Bucket, build_graph
from plow.oracle import Certificate


class BucketReport(BaseModel):
    bucket: str
    batch: int
    context: int
    budget_ms: float
    estimated_ms: float
    bandwidth_bound_ms: float
    compute_bound_ms: float
    tiles: int
    certificate: Certificate | None
    rejected: str | None = None


class CompileReport(BaseModel):
    pipeline: str
    target: str
    target_bandwidth_bytes_per_s: int
    target_peak_flops_per_s: int
    target_calibrated: bool
    budget_rule: str
    buckets: list[BucketReport]
    seconds: float
    accepted: bool
    reason: str | None = None

    @property
    def theorems(self) -> list[str]:
        seen: dict[str, None] = {}
        for b in self.buckets:
            if b.certificate is not None:
                for t in b.certificate.theorems:
                    seen.setdefault(t, None)
        return list(seen)

    def bound_ms(self, batch: int, context: int) -> float | None:
        for b in self.buckets:
            if b.batch == batch and b.context == context:
                return max(b.bandwidth_bound_ms, b.compute_bound_ms)
        return None


def measured_positions(wl: Workload) -> int:
    """Key-value positions a measured decode step can reach beyond the context it starts at."""
    return wl.measure.warmup_steps + wl.measure.decode_steps + 1


def compile_study(
    spec: ModelSpec,
    wl: Workload,
    calibration: Calibration | None,
    on_bucket: Callable[[str], None] | None = None,
) -> CompileReport:
    """Tile and certify every (batch, context) decode bucket of the study; raises
    `PlanRejected` (with the report attached as `.report`) when any bucket is rejected."""
    try:
        from plow.target import load_target
        from plow.tiles import certify_tiles, check_bounds, plan_bounds, tile_graph
    except ImportError as e:  # pragma: no cover - the pipeline ships with plow
        raise PlowError("compile", f"the compile pipeline is not importable: {e}") from e

    t0 = time.perf_counter()
    target = load_target(wl.target)
    calibrated = False
    if calibration is not None and target.name == "cpu":
        rate = calibration.matmul_flops_per_s
        target = target.model_copy(
            update={
                "bandwidth_bytes_per_s": calibration.bandwidth_bytes_per_s,
                "peak_flops_per_s": dict.fromkeys(target.peak_flops_per_s, rate),
            }
        )
        calibrated = True
    budget_ms = wl.compile.step_budget_ms
    rule = (
        f"{budget_ms:g} ms per step (workload)"
        if budget_ms is not None
        else "twice the cost model's sequential estimate (the workload sets no latency target)"
    )
    extra = measured_positions(wl)
    reports: list[BucketReport] = []
    reason: str | None = None
    for batch in wl.batch_sizes:
        for context in wl.context_lengths:
            bucket = Bucket.decode(batch, context + extra)
            if on_bucket:
                on_bucket(bucket.name)
            tg = tile_graph(build_graph(spec, bucket), target)
            estimate = plan_bounds(tg, 1, target.launch_overhead_ns).estimated_ns
            budget_ns = (
                math.ceil(budget_ms * 1e6) if budget_ms is not None else math.ceil(2 * estimate)
            )
            bounds = plan_bounds(tg, budget_ns, target.launch_overhead_ns)
            rejected: str | None = None
            cert: Certificate | None = None
            try:
                check_bounds(bounds)
                _, cert = certify_tiles(tg, target, budget_ns)
                if not cert.accepted:
                    rejected = f"checkpoint B rejected bucket {bucket.name}: {cert.reason}"
            except PlanRejected as e:
                rejected = str(e)
            reports.append(
                BucketReport(
                    bucket=bucket.name,
                    batch=batch,
                    context=context,
                    budget_ms=budget_ns / 1e6,
                    estimated_ms=bounds.estimated_ns / 1e6,
                    bandwidth_bound_ms=bounds.bandwidth_bound_ns / 1e6,
                    compute_bound_ms=bounds.compute_bound_ns / 1e6,
                    tiles=tg.num_tiles,
                    certificate=cert,
                    rejected=rejected,
                )
            )
            if rejected is not None:
                reason = rejected
                break
        if reason is not None:
            break
    report = CompileReport(
        pipeline=(
            "build_graph -> tile_graph -> plan bounds -> oracle checkpoint B (per decode bucket)"
        ),
        target=target.name,
        target_bandwidth_bytes_per_s=target.bandwidth_bytes_per_s,
        target_peak_flops_per_s=max(target.peak_flops_per_s.values()),
        target_calibrated=calibrated,
        budget_rule=rule,
        buckets=reports,
        seconds=round(time.perf_counter() - t0, 3),
        accepted=reason is None,
        reason=reason,
    )
    if reason is not None:
        err = CompileRejected("compile", reason)
        err.report = report
        raise err
    return report


class CompileRejected(PlanRejected):
    """A bucket was rejected; `report` holds what was compiled up to it (exit 1)."""

    report: CompileReport | None = None
