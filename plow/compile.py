"""The compiler driver (shaped like CompCert's `Compiler.v`): the pipeline is listed once, in
`PIPELINE`, and composed once, in `transf_program` — import → [fuse: the extraction, once] →
per bucket: graph → [shard] → [fuse] → tile → bounds → [checkpoint B] → schedule →
[checkpoint D] → pages → arena → emit; then, in `plow.emit.bundle`, write → [verify] (the
bundle and its certificates A-F). Every stage runs through one `Timer` (seconds per stage and
the `on_stage` progress callback), which refuses a name `PIPELINE` does not list. Callers:
`compile_plan` (the plan half, through checkpoint D), `plow.emit.bundle.compile_bundle` (all of
it, atomically on disk), and through it `plow.runtime.cpu.bundle.compile_cached`.

`compile_plan` is pure apart from the oracle process; `write_plan` puts the result on disk:
`OUT/tiles.json`, and with verification `OUT/certificates/B.json` plus the exact payloads
`OUT/payloads/B/<bucket>.json` (re-checkable with `run_checkpoint`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from plow.bundle.manifest import CheckpointCertificates
from plow.checkpoint import ModelSpec, load_spec
from plow.errors import PlanRejected, PlowError
from plow.graph import Bucket, OpGraph, build_graph
from plow.graph.shard import place_fused, shard_graph, slice_layouts
from plow.oracle import Certificate
from plow.oracle.payloads.tiles import TilePayload
from plow.profile import CompileProfile
from plow.schedule import Schedule, build_schedule, certify_schedule, protocol_errors
from plow.target import Target
from plow.tiles import (
    PlanBounds,
    TileGraph,
    TilingOptions,
    certify_tiles,
    check_bounds,
    plan_bounds,
    tile_graph,
)
from plow.tiles.summary import TilesFile, bucket_summary

if TYPE_CHECKING:
    from plow.emit.emit import EmittedBucket

_T = TypeVar("_T")


class Pass(NamedTuple):
    """One stage of the pipeline: its name (the timing and progress key), whether it runs
    once per compile or once per bucket, and when it runs: "" always, "tp" when the target
    has gpus > 1, "fuse" when the profile fuses, "verify" with `compile_plan(verify=True)`,
    "bundle" when a bundle is written, "bundle verify" when it is also certified."""

    name: str
    scope: str  # "once" | "bucket"
    when: str


# The pipeline, listed once, in the order it runs (DESIGN.md §2; docs/layout.md).
PIPELINE: tuple[Pass, ...] = (
    Pass("import", "once", ""),  # config (and weights index) -> ModelSpec
    Pass("fuse", "once", "fuse"),  # the extraction decides once, on the one-row decode rung
    Pass("graph", "bucket", ""),  # -> OpGraph
    Pass("shard", "bucket", "tp"),  # tensor parallel (plow/graph/shard.py)
    Pass("fuse", "bucket", "fuse"),  # the e-graph's rewrites applied (plow/egraph/apply.py)
    Pass("tile", "bucket", ""),  # -> TileGraph
    Pass("bounds", "bucket", ""),  # -> PlanBounds, refused over budget
    Pass("checkpoint B", "bucket", "verify"),
    Pass("schedule", "bucket", ""),  # -> Schedule
    Pass("checkpoint D", "bucket", "verify"),
    Pass("pages", "bucket", "bundle"),  # memory: KV pages
    Pass("arena", "bucket", "bundle"),  # memory: the activation arena
    Pass("emit", "bucket", "bundle"),  # -> EmittedBucket (packets, op table, schedule file)
    Pass("write", "once", "bundle"),  # the bundle's files and manifest (plow/emit/bundle.py)
    Pass("verify", "once", "bundle verify"),  # certify: checkpoints A-F over the written bundle
)
PASS_NAMES = frozenset(p.name for p in PIPELINE)
# The plan half's per-bucket stages, in order (compile_plan stops after checkpoint D).
STAGES = tuple(
    p.name for p in PIPELINE if p.scope == "bucket" and p.when in ("", "verify", "tp", "fuse")
)


def progress_stages(*, verify: bool) -> tuple[list[str], list[str]]:
    """The stages `plow compile` shows a progress bar for: per bucket (the always-run ones),
    then once per bundle (write, and verify when asked)."""
    per_bucket = [p.name for p in PIPELINE if p.scope == "bucket" and p.when in ("", "bundle")]
    final = [
        p.name
        for p in PIPELINE
        if p.scope == "once" and p.when.startswith("bundle") and (verify or "verify" not in p.when)
    ]
    return per_bucket, final


# on_stage(stage, bucket name or "", "start" | "done") drives a progress display.
StageCallback = Callable[[str, str, str], None]


class Timer:
    """The one timing and progress helper: `timer(name, bucket, fn, *args)` runs `fn(*args)`,
    adds its wall time to `seconds[name]` and reports start/done to `on_stage`."""

    def __init__(self, on_stage: StageCallback | None = None) -> None:
        self.on_stage = on_stage
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, bucket: str, fn: Callable[..., _T], *args: Any) -> _T:
        if name not in PASS_NAMES:
            raise RuntimeError(f"stage {name!r} is not in plow.compile.PIPELINE")
        if self.on_stage:
            self.on_stage(name, bucket, "start")
        t0 = time.perf_counter()
        out = fn(*args)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        if self.on_stage:
            self.on_stage(name, bucket, "done")
        return out


@dataclass(frozen=True, slots=True)
class BucketPlan:
    bucket: Bucket
    budget_ns: int
    graph: OpGraph
    tiles: TileGraph
    bounds: PlanBounds
    payload: TilePayload | None = None
    certificate: Certificate | None = None
    schedule: Schedule | None = None
    schedule_certificate: Certificate | None = None
    rewrites: Any = None  # plow.egraph.apply.Applied when the profile fuses


@dataclass(frozen=True, slots=True)
class CompileResult:
    source: Path
    spec: ModelSpec
    target: Target
    profile: CompileProfile
    buckets: tuple[BucketPlan, ...]
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def certified(self) -> bool:
        return all(b.certificate is not None and b.certificate.accepted for b in self.buckets)


def compile_plan(
    source: Path,
    target: Target,
    profile: CompileProfile,
    *,
    verify: bool = False,
    on_stage: StageCallback | None = None,
) -> CompileResult:
    """Plan `source` (a checkpoint directory or a config.json) for `target` under `profile`.

    Raises `PlanRejected` (exit 1) when a bucket's lower bound exceeds its budget or the
    oracle rejects its payload; other bad input raises the matching `PlowError` (exit 2).
    """
    return transf_program(source, target, profile, verify=verify, timer=Timer(on_stage))[0]


# a budget no plan reaches: the bounds are computed, never refused (bucket_estimates_ns)
NO_BUDGET_NS = 10**18


def bucket_estimates_ns(
    source: Path,
    target: Target,
    profile: CompileProfile,
    *,
    on_stage: StageCallback | None = None,
) -> dict[Bucket, float]:
    """The cost model's sequential estimate (`PlanBounds.estimated_ns`) of every bucket of
    `profile`, from the pipeline through `bounds` (import, fuse, graph, shard, tile, bounds;
    the profile's budgets not in effect): what a caller without a latency target sizes its
    budgets from (harness/compile_step.py: twice the largest)."""
    free = profile.model_copy(
        update={"decode_budget_ns": NO_BUDGET_NS, "prefill_budget_ns_per_token": NO_BUDGET_NS}
    )
    result, _ = transf_program(source, target, free, until="bounds", timer=Timer(on_stage))
    return {bp.bucket: float(bp.bounds.estimated_ns) for bp in result.buckets}


def transf_program(
    source: Path,
    target: Target,
    profile: CompileProfile,
    *,
    verify: bool = False,
    emit: bool = False,
    until: str | None = None,
    timer: Timer,
) -> tuple[CompileResult, list[EmittedBucket]]:
    """The pipeline of `PIPELINE` through checkpoint D (with `verify`) and, with `emit`, its
    memory and emit passes: the plan and the emitted buckets (empty without `emit`).
    `until="bounds"` stops every bucket after its bounds (no schedule; `bucket_estimates_ns`)."""
    if until not in (None, "bounds") or (until and (emit or verify)):
        raise ValueError(f'until={until!r}: only "bounds", without emit or verify')
    stage = timer

    def bounds_stage(tg: TileGraph, budget: int) -> PlanBounds:
        b = plan_bounds(tg, budget, target.launch_overhead_ns)
        check_bounds(b)
        return b

    spec = stage("import", "", load_spec, Path(source))
    options = TilingOptions(activation_dtype=profile.activation_dtype, cache_dtype=profile.kv_dtype)
    plans = []
    chosen = None
    relayable = None
    # the extraction decides once, on the one-row decode rung (plow/egraph)
    if profile.fuse:  # tensor parallel: of the sharded graph (plow/graph/shard.py)
        from plow.egraph.apply import RULES, extracted_instances

        ladder = profile.buckets(spec.max_position)
        ref = min(ladder, key=lambda b: (b.phase.value != "decode", b.batch * b.seq))
        ref_graph = shard_graph(build_graph(spec, ref), target.gpus)
        chosen = stage("fuse", "", extracted_instances, ref_graph, target, RULES)
        relayable = _relayable(Path(source), slice_layouts(ref_graph))
    for bucket in profile.buckets(spec.max_position):
        name = bucket.name
        budget = profile.budget_ns(bucket)
        graph = stage("graph", name, build_graph, spec, bucket)
        applied = None
        if target.gpus > 1:  # tensor parallel: the sharded graph (plow/graph/shard.py)
            graph = stage("shard", name, shard_graph, graph, target.gpus)
        if profile.fuse:  # the extraction decides (plow/egraph/apply.py)
            from plow.egraph.apply import RULES, fuse_graph

            applied = stage("fuse", name, fuse_graph, graph, target, RULES, None, chosen, relayable)
            applied = place_fused(graph, applied)  # a fused op's device and slices
            graph = applied.graph
        # weights priced at the bytes the bundle stores them in (plow/tiles/storage.py)
        stored = _stored_bytes(Path(source), graph, applied)
        opts = options if stored is None else replace(options, weight_bytes=stored)
        tg = stage("tile", name, tile_graph, graph, target, opts)
        bounds = stage("bounds", name, bounds_stage, tg, budget)
        if until == "bounds":  # the cost model's numbers only
            plans.append(BucketPlan(bucket, budget, graph, tg, bounds, rewrites=applied))
            continue
        payload: TilePayload | None = None
        cert: Certificate | None = None
        if verify:
            payload, cert = stage("checkpoint B", name, certify_tiles, tg, target, budget)
            if not cert.accepted:
                raise PlanRejected(f"checkpoint B, bucket {name}", cert.reason or "rejected")
        sched = stage("schedule", name, build_schedule, tg, graph, target)
        dcert: Certificate | None = None
        if verify:
            errs = protocol_errors(sched)
            if errs:
                raise PlanRejected(f"checkpoint D, bucket {name}", errs[0])
            _, dcert = stage("checkpoint D", name, certify_schedule, sched)
            if not dcert.accepted:
                raise PlanRejected(f"checkpoint D, bucket {name}", dcert.reason or "rejected")
        plans.append(
            BucketPlan(bucket, budget, graph, tg, bounds, payload, cert, sched, dcert, applied)
        )
    result = CompileResult(Path(source), spec, target, profile, tuple(plans), dict(timer.seconds))
    emitted = [transf_emit(bp, target, timer) for bp in result.buckets] if emit else []
    return result, emitted


def transf_emit(bp: BucketPlan, target: Target, timer: Timer) -> EmittedBucket:
    """One bucket's memory (pages, arena) and emit passes."""
    from plow.emit.emit import emit_bucket
    from plow.memory import plan_arena, plan_pages
    from plow.memory.ordering import unordered_op_edges

    name = bp.bucket.name
    sched = bp.schedule
    assert sched is not None  # transf_program always schedules
    pages = timer("pages", name, plan_pages, sched, bp.tiles, target, bp.graph)
    unordered = unordered_op_edges(sched.decisions)
    arena = timer(
        "arena",
        name,
        lambda: plan_arena(bp.graph, bp.tiles, unordered=unordered, schedule=sched),
    )
    return timer(
        "emit",
        name,
        emit_bucket,
        bp.bucket,
        bp.graph,
        bp.tiles,
        sched,
        pages,
        arena,
        target,
        bp.budget_ns,
    )


def _stored_bytes(source: Path, graph: OpGraph, applied: Any) -> dict[str, int] | None:
    """The bytes the bundle will store per weight of `graph` (block-quantized weights as
    blocks, fp8 with its scales; fused and tensor-parallel re-layouts resolved as the bundle
    writer does), None without weights to ask (a config.json)."""
    from plow.tiles.storage import stored_weight_bytes

    layouts = dict(slice_layouts(graph))
    if applied is not None:
        layouts.update({x.weight: (x.layout, x.sources) for x in applied.layouts})
    names = [n for n, t in graph.tensors.items() if t.role.value == "weight"]
    return stored_weight_bytes(source, names, layouts)


def _relayable(
    source: Path, slices: dict[str, tuple[str, tuple[str, ...]]]
) -> Callable[[str, tuple[str, ...]], bool] | None:
    """Whether the bundle writer can store a checkpoint's weights re-laid-out (fp8 weights,
    stacked parts and sources of mixed block formats it refuses: those fusions stay
    canonical); None when `source` has no weights to ask (a config.json). `slices`: the
    tensor-parallel slices a source may be (`slice_layouts`)."""
    from plow.checkpoint.loader import weight_files
    from plow.checkpoint.weights import WeightStore
    from plow.emit.bundle import Resolved, relaid_entry

    if not source.is_dir():
        return None
    try:
        store = WeightStore.open(weight_files(source), where=source)
    except PlowError:
        return None

    def ok(layout: str, sources: tuple[str, ...]) -> bool:
        try:
            relaid_entry(Resolved(store, slices), "", layout, sources)
        except PlowError:  # MissingTensor included
            return False
        return True

    return ok


def write_plan(result: CompileResult, out: Path) -> list[Path]:
    """Write the plan directory; returns the files written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlowError(out, f"cannot create output directory: {e.strerror or e}") from e
    written = []
    tiles = TilesFile(
        model=str(result.source),
        family=result.spec.family,
        target=result.target.name,
        profile=result.profile.name,
        buckets=[bucket_summary(b.tiles, b.bounds) for b in result.buckets],
    )
    p = out / "tiles.json"
    p.write_text(tiles.model_dump_json())
    written.append(p)
    (out / "target.json").write_text(result.target.model_dump_json(indent=2))
    (out / "profile.json").write_text(result.profile.model_dump_json(indent=2))
    written += [out / "target.json", out / "profile.json"]
    certs = {b.bucket.name: b.certificate for b in result.buckets if b.certificate is not None}
    if certs:
        (out / "certificates").mkdir(exist_ok=True)
        (out / "payloads" / "B").mkdir(parents=True, exist_ok=True)
        c = CheckpointCertificates(
            checkpoint="B", accepted=all(x.accepted for x in certs.values()), buckets=certs
        )
        p = out / "certificates" / "B.json"
        p.write_text(c.model_dump_json(indent=2))
        written.append(p)
        for b in result.buckets:
            if b.payload is not None:
                p = out / "payloads" / "B" / f"{b.bucket.name}.json"
                p.write_text(json.dumps(b.payload.model_dump(mode="json")))
                written.append(p)
    dcerts = {
        b.bucket.name: b.schedule_certificate
        for b in result.buckets
        if b.schedule_certificate is not None
    }
    if dcerts:
        (out / "certificates").mkdir(exist_ok=True)
        c = CheckpointCertificates(
            checkpoint="D", accepted=all(x.accepted for x in dcerts.values()), buckets=dcerts
        )
        p = out / "certificates" / "D.json"
        p.write_text(c.model_dump_json(indent=2))
        written.append(p)
    return written
