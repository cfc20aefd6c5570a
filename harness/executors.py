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

The executors are the runtime's registry (`plow.runtime.executors`): the reference one, and
one `BundleExecutor` for each bundle executor (cpu, native, cuda: one runner and one serving
engine for all three, the machine chosen by the registry). An executor registered there is
a study's executor here with nothing else to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from plow.checkpoint import Checkpoint
from plow.errors import PlowError
from plow.runtime.cpu.engine import CpuEngine, CpuRunner
from plow.runtime.cpu.machine import DispatchStats
from plow.runtime.cpu.model import CpuModel
from plow.runtime.cpu.plan import Plan
from plow.runtime.executors import EXECUTORS as RUNTIME_EXECUTORS
from plow.runtime.executors import ExecutorKind, ExecutorUnavailable, gpu_present
from plow.runtime.reference import ReferenceSession

if TYPE_CHECKING:
    from harness.compile_step import CompiledStudy


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
    description = RUNTIME_EXECUTORS["reference"].description

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
        return RUNTIME_EXECUTORS["reference"].open_engine(
            ckpt, max_batch=max_batch, max_context=max_context
        )


def _recording(model: CpuModel, study: CompiledStudy | None) -> CpuModel:
    """`model`, reporting every launch to the study (which plan ran, loaded from which
    bundle, certified or not); the same for every bundle executor."""
    if study is None:
        return model
    inner = model.dispatch

    def dispatch(plan: Plan, **kw: Any) -> DispatchStats:
        st = inner(plan, **kw)
        study.record(plan.bucket, plan.source)
        return st

    model.dispatch = dispatch  # type: ignore[method-assign]
    return model


def _check_shape(ckpt: Checkpoint, max_batch: int, max_context: int) -> None:
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    if not 1 <= max_context <= ckpt.spec.max_position:
        raise ValueError(f"max_context must be in 1..{ckpt.spec.max_position}, got {max_context}")


def cpu_model(
    ckpt: Checkpoint, *, max_batch: int, max_context: int, compiled: CompiledStudy | None
) -> CpuModel:
    """The model of the cpu emulator: the study's certified bundle of this context on the
    emulator (`bundle_model`), decode and prefill rungs alike; nothing is planned in memory
    (without `compiled`, refused as on every bundle executor)."""
    return bundle_model(
        RUNTIME_EXECUTORS["cpu"],
        ckpt,
        max_batch=max_batch,
        max_context=max_context,
        compiled=compiled,
    )


def bundle_model(
    kind: ExecutorKind,
    ckpt: Checkpoint,
    *,
    max_batch: int,
    max_context: int,
    compiled: CompiledStudy | None,
) -> CpuModel:
    """The model of a bundle executor for one runner: the study's certified bundle of this
    context (the first one whose decode rung holds `max_batch` rows), opened from its files
    on disk (`CompiledStudy.bundle`: hashes and certificates checked; weights from `ckpt`,
    checked against the op tables, since the study's bundles are plan-only) on the
    executor's machine (`ExecutorKind.open_model`). Every launch runs one of the bundle's
    certified rungs: decode, and prefill on its prefill rungs (the smallest that covers the
    launch's rows and tokens; longer prompts in chunks at the longest), so the steps run
    exactly what the oracle certified. Without `compiled` every executor refuses: the harness
    plans nothing in memory."""
    _check_shape(ckpt, max_batch, max_context)
    if compiled is None:
        raise PlowError(f"executor {kind.name}", "runs the study's certified bundles (step a)")
    plans = [
        bp for bp in compiled.plans_for(max_context) if bp.bucket.batch >= max_batch
    ] or compiled.plans_for(max_context)
    if not plans:
        raise PlowError("compile", f"no certified plan for context {max_context}")
    bundle = compiled.bundle(plans[0].bucket, ckpt.weights)
    if bundle is None:
        raise PlowError("compile", f"no certified bundle for bucket {plans[0].bucket.name}")
    model = kind.open_model(bundle, max_batch=max_batch, max_context=max_context)
    return _recording(model, compiled)


@dataclass(frozen=True)
class BundleExecutor:
    """A bundle executor of the runtime registry (`cpu`, `native`, `cuda`) as a study runs it:
    the same runner and serving engine (`CpuEngine` over `bundle_model`) for all three."""

    kind: ExecutorKind

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def description(self) -> str:
        return self.kind.description

    def unavailable_reason(self) -> str | None:
        return self.kind.unavailable_reason()

    def _engine(
        self, ckpt: Checkpoint, max_batch: int, max_context: int, compiled: CompiledStudy | None
    ) -> CpuEngine:
        self.kind.check()
        model = bundle_model(
            self.kind, ckpt, max_batch=max_batch, max_context=max_context, compiled=compiled
        )
        return CpuEngine(model)

    def open(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Runner:
        return CpuRunner(self._engine(ckpt, max_batch, max_context, compiled))

    def serving_engine(
        self,
        ckpt: Checkpoint,
        *,
        max_batch: int,
        max_context: int,
        compiled: CompiledStudy | None = None,
    ) -> Any:
        return self._engine(ckpt, max_batch, max_context, compiled)


EXECUTORS: dict[str, Executor] = {
    name: ReferenceExecutor() if kind.runs == "checkpoint" else BundleExecutor(kind)
    for name, kind in RUNTIME_EXECUTORS.items()
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


__all__ = [
    "EXECUTORS",
    "BundleExecutor",
    "Executor",
    "ExecutorUnavailable",
    "ReferenceExecutor",
    "Runner",
    "bundle_model",
    "cpu_model",
    "get_executor",
    "gpu_present",
]
