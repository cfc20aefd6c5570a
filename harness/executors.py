"""The executors a study can run on, behind one small interface.

An `Executor` is looked up by name (`get_executor("reference")`); `open` gives a `Runner` for
one checkpoint with room for `max_batch` rows of `max_context` positions. The harness drives
a runner in two calls and times them itself:

    logits = runner.prefill(rows)    # start a batch: one prompt per row; [B, V] last-token logits
    logits = runner.decode(tokens)   # one step for every row: append tokens[i] to row i; [B, V]

`prefill` drops whatever the runner held before. `last_step_ns()` may return the executor's
own measurement of the last call (a device timer); None means the harness's host timer
(`time.perf_counter_ns` around the call) is the step time.

`serving_engine` gives the `plow.serve` engine of the same executor (the serving surface runs
the dispatcher over it), or None.

`compiled` (both calls) is step (a)'s `CompiledStudy`: an executor that runs compiled plans
runs those certified plans, loaded from the certified bundle files on disk, for the buckets
they cover (and records every launch in `compiled.usage`: certified or not, loaded from which
bundle); the reference executor ignores it.

To plug in an executor (CUDA), implement `Executor` and `Runner` and register it in
`EXECUTORS`; nothing else in the harness changes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from plow.checkpoint import Checkpoint
from plow.errors import PlowError
from plow.runtime.cpu.machine import DispatchStats
from plow.runtime.cpu.model import CpuModel
from plow.runtime.cpu.plan import Plan
from plow.runtime.native.model import NativeModel, check_host_target
from plow.runtime.reference import ReferenceSession

if TYPE_CHECKING:
    from harness.compile_step import CompiledStudy


class ExecutorUnavailable(PlowError):
    """The workload names an executor this machine or this version cannot run (exit 2)."""


@runtime_checkable
class Runner(Protocol):
    @property
    def executor(self) -> str: ...

    @property
    def max_batch(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def prefill(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Start a batch (one prompt per row); logits [len(rows), V] of each last token."""
        ...

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        """One decode step for every row of the batch; logits [len(tokens), V]."""
        ...

    def last_step_ns(self) -> int | None:
        """The executor's own time for the last prefill/decode call, if it measures one."""
        ...


@runtime_checkable
class Executor(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str:
        """One line for reports: what actually computes the steps."""
        ...

    def unavailable_reason(self) -> str | None:
        """None when this machine can run the executor; else why not (one line)."""
        ...

    def open(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Runner: ...

    def serving_engine(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Any:
        """A `plow.serve.engine.Engine` for the serving surface (the dispatcher drives it),
        or None when the executor has none yet (the harness's own loop is measured then)."""
        ...


@dataclass
class ReferenceRunner:
    """Rows are independent `ReferenceSession`s run one after another (the reference has no
    batched kernel). A prefill whose rows repeat a prompt computes it once and copies the
    key-value cache to the other rows (as a prefix-cache hit would); every decode step
    computes every row."""

    ckpt: Checkpoint
    batch: int
    context: int
    sessions: list[ReferenceSession] = field(default_factory=list)

    @property
    def executor(self) -> str:
        return "reference"

    @property
    def max_batch(self) -> int:
        return self.batch

    @property
    def max_context(self) -> int:
        return self.context

    def prefill(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        if not 1 <= len(rows) <= self.batch:
            raise ValueError(f"batch of {len(rows)} rows outside 1..{self.batch}")
        self.sessions = []
        done: dict[tuple[int, ...], tuple[ReferenceSession, np.ndarray]] = {}
        out = []
        for row in rows:
            key = tuple(int(t) for t in row)
            if not key:
                raise ValueError("empty prompt row")
            if key in done:
                src, last = done[key]
                s = ReferenceSession(
                    src.spec,
                    src.weights,
                    self.context,
                    caches={n: a.copy() for n, a in src.caches.items()},
                    length=src.length,
                    _graphs=src._graphs,
                )
            else:
                shared = self.sessions[0]._graphs if self.sessions else {}
                s = ReferenceSession(
                    self.ckpt.spec, self.ckpt.weights, self.context, _graphs=shared
                )
                last = s.step(list(key))[-1]
                done[key] = (s, last)
            self.sessions.append(s)
            out.append(last)
        return np.stack(out)

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        if len(tokens) != len(self.sessions):
            raise ValueError(f"{len(tokens)} tokens for a batch of {len(self.sessions)} rows")
        return np.stack([s.step([int(t)])[-1] for s, t in zip(self.sessions, tokens, strict=True)])

    def last_step_ns(self) -> int | None:
        return None


class ReferenceExecutor:
    name = "reference"
    description = (
        "the plain per-op numpy forward (fp32, contiguous key-value cache, rows run "
        "one after another); independent of the compiled plan"
    )

    def unavailable_reason(self) -> str | None:
        return None

    def open(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Runner:
        return ReferenceRunner(ckpt, max_batch, max_context)

    def serving_engine(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Any:
        from plow.serve.engine import ReferenceEngine

        return ReferenceEngine.from_checkpoint(ckpt, max_batch=max_batch, max_context=max_context)


class _CpuModel(CpuModel):
    """A `CpuModel` that reports every launch to the study (which plan ran, loaded from which
    bundle, certified or not)."""

    study: CompiledStudy | None = None

    def dispatch(self, plan: Plan, **kw: object) -> DispatchStats:
        st = super().dispatch(plan, **kw)
        if self.study is not None:
            self.study.record(plan.bucket, plan.source)
        return st


class _NativeModel(NativeModel):
    """A `NativeModel` that reports every launch to the study, as `_CpuModel` does."""

    study: CompiledStudy | None = None

    def dispatch(self, plan: Plan, **kw: object) -> DispatchStats:
        st = super().dispatch(plan, **kw)
        if self.study is not None:
            self.study.record(plan.bucket, plan.source)
        return st


def cpu_model(
    ckpt: Checkpoint, *, max_batch: int, max_context: int, compiled: CompiledStudy | None
) -> CpuModel:
    """The CPU executor's model for one runner. With `compiled`: planned for its (calibrated)
    target, and the certified decode plans of this context loaded from the study's bundle
    files on disk (`plow.runtime.cpu.bundle`: hashes and certificates checked, the packet
    stream and arena offsets of the plan file; weights from `ckpt`, checked against the op
    tables, since the study's bundles are plan-only) and installed as they are, so those
    buckets run exactly what the oracle certified and are never re-planned; buckets outside
    the study's compile (prefill) are planned in memory on first use, as without it."""
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    if not 1 <= max_context <= ckpt.spec.max_position:
        raise ValueError(f"max_context must be in 1..{ckpt.spec.max_position}, got {max_context}")
    model = _CpuModel(
        ckpt.spec,
        ckpt.weights,
        target=compiled.target if compiled is not None else "cpu",
        max_batch=max_batch,
        max_context=max_context,
    )
    model.study = compiled
    if compiled is not None:
        for bp in compiled.plans_for(model.context):
            if bp.bucket.batch not in model.decode_batches:
                continue
            bundle = compiled.bundle(bp.bucket, ckpt.weights)
            if bundle is None:
                raise PlowError(
                    "compile", f"no certified bundle on record for bucket {bp.bucket.name}"
                )
            model.add_plan(bundle.plan(bp.bucket, kv=model.arena.kv_shape, ring=model.ring))
    return model


class CpuExecutor:
    """The compiled CPU executor (persistent-kernel emulation, issue 6): the plan's packets
    on virtual workers, counters as the only synchronisation (`plow.runtime.cpu`)."""

    name = "cpu"
    description = (
        "the compiled plan's packet stream on the CPU persistent-kernel emulation "
        "(plow.runtime.cpu: virtual workers, counters, numpy tile kernels)"
    )

    def unavailable_reason(self) -> str | None:
        return None

    def open(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Runner:
        from plow.runtime.cpu.engine import CpuEngine, CpuRunner

        model = cpu_model(ckpt, max_batch=max_batch, max_context=max_context, compiled=compiled)
        return CpuRunner(CpuEngine(model))

    def serving_engine(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Any:
        from plow.runtime.cpu.engine import CpuEngine

        return CpuEngine(
            cpu_model(ckpt, max_batch=max_batch, max_context=max_context, compiled=compiled)
        )


class NativeExecutor:
    """The native persistent kernel (issue 12): the study's certified bundles run by the C++
    interpreter of `kernels/` on CPU threads (`plow.runtime.native`)."""

    name = "native"
    description = (
        "the certified bundle's packet stream on the native persistent kernel "
        "(kernels/, C++: one thread per plan worker, monotonic atomic counters)"
    )

    def unavailable_reason(self) -> str | None:
        from plow.runtime.native import library

        try:
            library.load()
        except PlowError as e:
            return str(e)
        return None

    def _model(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None,
    ) -> Any:
        if compiled is None:
            raise PlowError("executor native", "runs the study's certified bundles (step a)")
        plans = [
            bp for bp in compiled.plans_for(max_context) if bp.bucket.batch >= max_batch
        ] or compiled.plans_for(max_context)
        if not plans:
            raise PlowError("compile", f"no certified plan for context {max_context}")
        bundle = compiled.bundle(plans[0].bucket, ckpt.weights)
        if bundle is None:
            raise PlowError("compile", f"no certified bundle for bucket {plans[0].bucket.name}")
        check_host_target(bundle)
        model = _NativeModel.from_bundle(bundle, max_batch=max_batch, max_context=max_context)
        assert isinstance(model, _NativeModel)
        model.study = compiled
        return model

    def open(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Runner:
        from plow.runtime.cpu.engine import CpuEngine, CpuRunner

        model = self._model(ckpt, max_batch=max_batch, max_context=max_context, compiled=compiled)
        return CpuRunner(CpuEngine(model))

    def serving_engine(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Any:
        from plow.runtime.cpu.engine import CpuEngine

        return CpuEngine(
            self._model(ckpt, max_batch=max_batch, max_context=max_context, compiled=compiled)
        )


def gpu_present() -> bool:
    """An NVIDIA GPU is visible: a device node, or `nvidia-smi` on PATH."""
    if os.environ.get("PLOW_ASSUME_NO_GPU"):
        return False
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


class CudaExecutor:
    name = "cuda"
    description = "one persistent kernel per step on an NVIDIA GPU"

    def unavailable_reason(self) -> str | None:
        if not gpu_present():
            return "no GPU on this machine (this workload needs an NVIDIA GPU)"
        return "the CUDA executor is not built yet in this version"

    def open(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Runner:
        raise ExecutorUnavailable("executor cuda", self.unavailable_reason() or "")

    def serving_engine(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Any:
        raise ExecutorUnavailable("executor cuda", self.unavailable_reason() or "")


EXECUTORS: dict[str, Executor] = {
    e.name: e for e in (ReferenceExecutor(), NativeExecutor(), CpuExecutor(), CudaExecutor())
}


def get_executor(name: str) -> Executor:
    """The registered executor, or `ExecutorUnavailable` (one line, exit 2) saying why not."""
    ex = EXECUTORS.get(name)
    if ex is None:
        raise ExecutorUnavailable(
            f"executor {name}", f"unknown executor (have {', '.join(EXECUTORS)})"
        )
    reason = ex.unavailable_reason()
    if reason is not None:
        raise ExecutorUnavailable(f"executor {name}", reason)
    return ex
