"""Step (a) of a study: compile the workload's decode and prefill buckets into bundles and
certify them.

This is plow's own pipeline, the one `plow compile SOURCE -o OUT --verify` runs: per key-value
context the study needs, `plow.emit.bundle.compile_bundle` (import -> graph -> tile -> bounds
-> schedule -> pages -> arena -> emit -> write; `plow.compile.compile_plan` underneath) writes a
plan-only bundle holding one decode bucket per batch size and the prefill rungs the study's
prefills need (`prefill_rungs`: rows per launch x a chunk of at most `PREFILL_CHUNK` tokens;
a longer prompt is prefilled in chunks at the longest rung), then `plow.emit.verify.verify_bundle`
re-derives checkpoints A-F from the bundle's own files and runs the oracle on each
(docs/bundle.md "Verify"), and the certificates are written into the bundle. A bound over the
step budget or any rejected checkpoint stops the study: `compile.json` and `report.md` are
published, exit 1.

Every checkpoint row is the oracle's verdict, with its theorems (none is checked in Python).

The bundles go to `$PLOW_CACHE/bundles/<study>-<key>/kv<N>/` (not under `results/`: plan files
are megabytes); `compile.json` records each bundle's path and manifest digest. The executor
loads the certified plans from those bundle files (`CompiledStudy.bundle`: opened once per
study, certificates checked, with the checkpoint's weights since the bundles are plan-only),
so it runs exactly what the oracle certified — decode and prefill, on every executor; nothing
is planned in memory. `CompiledStudy.plans` keeps the compile's
per-bucket results (bounds, which buckets were certified).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel

from harness.environment import Calibration
from harness.workload import Workload
from plow.compile import BucketPlan
from plow.errors import PlanRejected, PlowError
from plow.graph import Bucket, Phase
from plow.target import Target

if TYPE_CHECKING:
    from plow.runtime.cpu.bundle import Bundle

CHECKPOINTS = ("A", "B", "C", "D", "E", "F")
PREFILL_CHUNK = 64  # tokens per row of the longest prefill rung a study compiles


class CheckRow(BaseModel):
    """One certificate-table row: a checkpoint's verdict on one bucket."""

    checkpoint: str
    verdict: str  # accept / reject
    theorems: list[str]
    reason: str = ""
    payload_sha256: str | None = None


class BucketReport(BaseModel):
    bucket: str
    phase: str = "decode"  # decode / prefill
    batch: int
    seq: int = 1  # tokens per row of one launch (prefill: the chunk length)
    context: int | None  # the study context this bucket measures (None: gate/serving only)
    kv_positions: int  # key-value positions the bucket holds (context + measured steps)
    bundle: str
    budget_ms: float
    estimated_ms: float
    bandwidth_bound_ms: float
    compute_bound_ms: float
    makespan_ms: float | None = None
    tiles: int
    tasks: int | None = None
    packets: int | None = None
    checks: list[CheckRow] = []
    rejected: str | None = None

    def check(self, checkpoint: str) -> CheckRow | None:
        return next((c for c in self.checks if c.checkpoint == checkpoint), None)


class BundleReport(BaseModel):
    path: str
    kv_positions: int
    buckets: list[str]
    plan_only: bool
    manifest_sha256: str | None
    check: str  # the bundle-level row: hashes and cross-references
    accepted: bool
    seconds: float


class CompileReport(BaseModel):
    pipeline: str
    target: str
    target_bandwidth_bytes_per_s: int
    target_peak_flops_per_s: int
    target_calibrated: bool
    budget_rule: str
    bundles: list[BundleReport] = []
    buckets: list[BucketReport]
    launches: dict[str, PlanUse] = {}  # bucket -> launches the executor made (cpu executor)
    seconds: float
    accepted: bool
    reason: str | None = None

    @property
    def theorems(self) -> list[str]:
        seen: dict[str, None] = {}
        for b in self.buckets:
            for c in b.checks:
                for t in c.theorems:
                    seen.setdefault(t, None)
        return list(seen)

    def theorems_by_checkpoint(self) -> dict[str, list[str]]:
        out: dict[str, dict[str, None]] = {}
        for b in self.buckets:
            for c in b.checks:
                d = out.setdefault(c.checkpoint, {})
                for t in c.theorems:
                    d.setdefault(t, None)
        return {k: list(v) for k, v in out.items()}

    def bound_ms(self, batch: int, context: int) -> float | None:
        for b in self.buckets:
            if b.phase == "decode" and b.batch == batch and b.context == context:
                return max(b.bandwidth_bound_ms, b.compute_bound_ms)
        return None


class PlanUse(BaseModel):
    """Launches of one bucket's plan by the executor, and whether step (a) certified it:
    `certified` when the plan that ran was loaded from the study's certified bundle for that
    bucket; `from_bundle` counts the launches of a plan loaded from a bundle file, `bundle`
    names it (None: planned in memory)."""

    launches: int = 0
    certified: bool = False
    from_bundle: int = 0
    bundle: str | None = None


@dataclass
class CompiledStudy:
    """What the executor needs from step (a): the (calibrated) target and the certified plans
    by bucket; `usage` (the report's `launches`) counts the launches of every plan the
    executor ran, certified or not (the executor fills it)."""

    report: CompileReport
    target: Target
    plans: dict[Bucket, BucketPlan]
    _opened: dict[str, Bundle] = field(default_factory=dict)

    @property
    def usage(self) -> dict[str, PlanUse]:
        return self.report.launches

    def plans_for(self, kv_positions: int, phase: Phase = Phase.decode) -> list[BucketPlan]:
        return [p for b, p in self.plans.items() if b.context == kv_positions and b.phase is phase]

    def bundle_path(self, bucket: Bucket) -> Path | None:
        """The certified bundle holding `bucket` (from the report's bundle rows), or None."""
        for b in self.report.bundles:
            if b.accepted and bucket.name in b.buckets:
                return Path(b.path)
        return None

    def bundle(self, bucket: Bucket, weights: Mapping[str, np.ndarray]) -> Bundle | None:
        """The certified bundle holding `bucket`, opened from disk (hashes and certificates
        checked; `weights` are the checkpoint's, checked against the op tables since the
        study's bundles are plan-only); opened once per study."""
        from plow.runtime.cpu.bundle import Bundle

        path = self.bundle_path(bucket)
        if path is None:
            return None
        key = str(path)
        if key not in self._opened:
            self._opened[key] = Bundle.open(path, verify=True, weights=weights)
        return self._opened[key]

    def record(self, bucket: Bucket, source: str = "") -> None:
        """One launch of `bucket`'s plan; `source` is the bundle it was loaded from ("" when
        planned in memory)."""
        home = self.bundle_path(bucket)
        certified = bucket in self.plans and home is not None and source == str(home)
        u = self.usage.setdefault(bucket.name, PlanUse(certified=certified, bundle=source or None))
        u.certified = u.certified and certified  # every launch of the bucket, certified
        u.launches += 1
        if source:
            u.from_bundle += 1

    def uncertified_runs(self) -> dict[str, int]:
        return {k: u.launches for k, u in self.usage.items() if not u.certified}


def measured_positions(wl: Workload) -> int:
    """Key-value positions a measured decode step can reach beyond the context it starts at."""
    return wl.measure.warmup_steps + wl.measure.decode_steps + 1


def study_target(wl: Workload, calibration: Calibration | None) -> tuple[Target, bool]:
    """The workload's target; `cpu` takes this run's measured bandwidth and matmul rate."""
    from plow.target import load_target

    target = load_target(wl.target)
    if calibration is None or target.name != "cpu":
        return target, False
    rate = calibration.matmul_flops_per_s
    return (
        target.model_copy(
            update={
                "bandwidth_bytes_per_s": calibration.bandwidth_bytes_per_s,
                "peak_flops_per_s": dict.fromkeys(target.peak_flops_per_s, rate),
            }
        ),
        True,
    )


def bundle_root(wl: Workload, model_dir: Path) -> Path:
    """Where this study's bundles go: one folder per (study, model, workload), reused by
    re-runs (each bundle is replaced atomically)."""
    from plow.default_model import cache_dir

    key = hashlib.sha256(
        json.dumps([str(model_dir), wl.model_dump(mode="json")], sort_keys=True).encode()
    ).hexdigest()[:12]
    return cache_dir() / "bundles" / f"{wl.study}-{key}"


def prefill_rungs(wl: Workload, study_ctx: int | None, kv: int) -> tuple[tuple[int, ...], int]:
    """The prefill rungs of one bundle, (batches, chunk length): a study context's bundle
    prefills its filler prompt of `study_ctx` tokens at every batch size (and one row: the
    cold-start and e2e prompts), the gate's bundle one prompt at a time; the chunk is the
    prompt's length, at most `PREFILL_CHUNK` tokens (longer prompts run in chunks)."""
    if study_ctx is None:
        return (1,), min(PREFILL_CHUNK, kv)
    return tuple(sorted({1, *wl.batch_sizes})), min(PREFILL_CHUNK, study_ctx)


def compile_study(
    model_dir: Path,
    wl: Workload,
    calibration: Calibration | None,
    *,
    kv_contexts: list[int] | None = None,
    out_root: Path | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> CompiledStudy:
    """Compile and certify every decode bucket of the study and the prefill rungs its prefills
    run on (a bundle per key-value context: each `context + measured steps`, plus
    `kv_contexts` — the gate's runner — when larger; prefill rungs: `prefill_rungs`).
    Raises `CompileRejected` (report attached) when a bound or a checkpoint rejects a bucket."""
    try:
        from plow.bundle.manifest import sha256_file
        from plow.compile import bucket_estimates_ns
        from plow.emit.bundle import compile_bundle
        from plow.emit.verify import verify_bundle, write_certificates
        from plow.profile import CompileProfile
    except ImportError as e:  # pragma: no cover - the pipeline ships with plow
        raise PlowError("compile", f"the compile pipeline is not importable: {e}") from e

    t0 = time.perf_counter()
    target, calibrated = study_target(wl, calibration)
    extra = measured_positions(wl)
    by_kv: dict[int, int | None] = {c + extra: c for c in wl.context_lengths}
    for kv in kv_contexts or []:
        by_kv.setdefault(kv, None)
    root = out_root or bundle_root(wl, model_dir)
    budget_ms = wl.compile.step_budget_ms
    rule = (
        f"{budget_ms:g} ms per step (workload)"
        if budget_ms is not None
        else "twice the cost model's sequential estimate of the bundle's largest bucket "
        "(the workload sets no latency target)"
    )
    report = CompileReport(
        pipeline=(
            "plow compile --plan-only --verify per key-value context: import -> graph -> tile "
            "-> bounds -> schedule -> pages -> arena -> emit -> write bundle, then verify: "
            "checkpoints A-F re-derived from the bundle's files and checked by the oracle"
        ),
        target=target.name,
        target_bandwidth_bytes_per_s=target.bandwidth_bytes_per_s,
        target_peak_flops_per_s=max(target.peak_flops_per_s.values()),
        target_calibrated=calibrated,
        budget_rule=rule,
        buckets=[],
        seconds=0.0,
        accepted=True,
    )
    plans: dict[Bucket, BucketPlan] = {}

    def reject(reason: str) -> CompileRejected:
        report.accepted = False
        report.reason = reason
        report.seconds = round(time.perf_counter() - t0, 3)
        err = CompileRejected("compile", reason)
        err.report = report
        return err

    for kv in sorted(by_kv):
        study_ctx = by_kv[kv]
        pre_batches, chunk = prefill_rungs(wl, study_ctx, kv)
        shape = CompileProfile(
            name=f"{wl.study}-kv{kv}",
            decode_batches=tuple(wl.batch_sizes),
            prefill_seqs=(chunk,),
            prefill_batches=pre_batches,
            context=kv,
        )
        # the budgets from the compiler's own cost model (the driver through its bounds
        # stage, the graph it compiles: fused, sharded, weights at their stored bytes)
        est = bucket_estimates_ns(model_dir, target, shape)
        if budget_ms is not None:
            budget_ns = math.ceil(budget_ms * 1e6)
        else:
            budget_ns = math.ceil(2 * max(v for b, v in est.items() if b.phase is Phase.decode))
        # prefill: twice the cost model's sequential estimate per token of its widest rung
        # (no workload sets a prefill latency target)
        widest = max((b for b in est if b.phase is Phase.prefill), key=lambda b: (b.batch, b.seq))
        per_token = est[widest] / (widest.batch * widest.seq)
        profile = shape.model_copy(
            update={
                "decode_budget_ns": budget_ns,
                "prefill_budget_ns_per_token": max(1, math.ceil(2 * per_token)),
            }
        )
        out = root / f"kv{kv}"
        tb = time.perf_counter()

        def stage(name: str, bucket: str, phase: str, kv: int = kv) -> None:
            if on_stage and phase == "start":
                on_stage(f"kv {kv}: {name} {bucket}".strip())

        try:
            res = compile_bundle(
                model_dir, out, target, profile, verify=False, plan_only=True, on_stage=stage
            )
        except PlanRejected as e:  # a bound over the budget: nothing written
            raise reject(str(e)) from e
        if on_stage:
            on_stage(f"kv {kv}: verify (oracle A-F)")
        ver = verify_bundle(out)
        by_bucket = {r.name: r for r in res.manifest.ladder}
        for bp in res.plan.buckets:
            name = bp.bucket.name
            rung = by_bucket.get(name)
            checks = [
                CheckRow(
                    checkpoint=r.checkpoint,
                    verdict=r.verdict,
                    theorems=list(r.theorems),
                    reason=r.reason,
                    payload_sha256=r.certificate.payload_sha256 if r.certificate else None,
                )
                for r in ver.rows
                if r.bucket == name
            ]
            bad = next((c for c in checks if c.verdict == "reject"), None)
            report.buckets.append(
                BucketReport(
                    bucket=name,
                    phase=bp.bucket.phase.value,
                    batch=bp.bucket.batch,
                    seq=bp.bucket.seq if bp.bucket.phase is Phase.prefill else 1,
                    context=study_ctx,
                    kv_positions=kv,
                    bundle=out.name,
                    budget_ms=bp.budget_ns / 1e6,
                    estimated_ms=bp.bounds.estimated_ns / 1e6,
                    bandwidth_bound_ms=bp.bounds.bandwidth_bound_ns / 1e6,
                    compute_bound_ms=bp.bounds.compute_bound_ns / 1e6,
                    makespan_ms=rung.cost.makespan_ns / 1e6 if rung else None,
                    tiles=bp.tiles.num_tiles,
                    tasks=rung.tasks if rung else None,
                    packets=rung.packets if rung else None,
                    checks=checks,
                    rejected=(
                        f"checkpoint {bad.checkpoint} rejected bucket {name}: {bad.reason}"
                        if bad
                        else None
                    ),
                )
            )
            plans[bp.bucket] = bp
        bundle_row = next((r for r in ver.rows if r.checkpoint == "bundle"), None)
        report.bundles.append(
            BundleReport(
                path=str(out),
                kv_positions=kv,
                buckets=[b.bucket.name for b in res.plan.buckets],
                plan_only=True,
                manifest_sha256=sha256_file(out / "manifest.json"),
                check=f"{bundle_row.verdict}: {bundle_row.reason}" if bundle_row else "",
                accepted=ver.accepted,
                seconds=round(time.perf_counter() - tb, 3),
            )
        )
        first = ver.first_rejection()
        if first is not None:
            shutil.rmtree(out, ignore_errors=True)  # never leave a rejected plan to be run
            where = f"checkpoint {first.checkpoint}" + (
                f", bucket {first.bucket}" if first.bucket else " (bundle)"
            )
            raise reject(f"{where}: {first.reason or 'rejected'}")
        write_certificates(ver)
        missing = [
            f"{b}: {ck}"
            for b in by_bucket
            for ck in CHECKPOINTS
            if not any(r.checkpoint == ck and r.bucket == b for r in ver.rows)
        ]
        if missing:
            raise reject(f"no verdict for {', '.join(missing)}")
    report.seconds = round(time.perf_counter() - t0, 3)
    return CompiledStudy(report, target, plans)


class CompileRejected(PlanRejected):
    """A bucket was rejected; `report` holds what was compiled up to it (exit 1)."""

    report: CompileReport | None = None
