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
the dispatcher over it), or None. To plug in an executor (the compiled CPU executor of issue 6,
CUDA), implement `Executor` and `Runner` and register it in `EXECUTORS`; nothing else in the
harness changes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from plow.checkpoint import Checkpoint
from plow.errors import PlowError
from plow.runtime.reference import ReferenceSession


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

    def open(self, ckpt: Checkpoint, *, max_batch: int, max_context: int) -> Runner: ...

    def serving_engine(self, ckpt: Checkpoint, *, max_batch: int, max_context: int) -> Any:
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

    def open(self, ckpt: Checkpoint, *, max_batch: int, max_context: int) -> Runner:
        return ReferenceRunner(ckpt, max_batch, max_context)

    def serving_engine(self, ckpt: Checkpoint, *, max_batch: int, max_context: int) -> Any:
        from plow.serve.engine import ReferenceEngine

        return ReferenceEngine.from_checkpoint(ckpt, max_batch=max_batch, max_context=max_context)


class CpuExecutor:
    """The compiled CPU executor (persistent-kernel emulation, issue 6): the plan's packets
    on virtual workers, counters as the only synchronisation (`plow.runtime.cpu`)."""

    name = "cpu"
    description = "the compiled plan's packet stream on the CPU persistent-kernel emulation"

    def unavailable_reason(self) -> str | None:
        return None

    def open(self, ckpt: Checkpoint, *, max_batch: int, max_context: int) -> Runner:
        from plow.runtime.cpu.engine import CpuRunner

        return CpuRunner.open(ckpt, max_batch=max_batch, max_context=max_context)

    def serving_engine(self, ckpt: Checkpoint, *, max_batch: int, max_context: int) -> Any:
        from plow.runtime.cpu.engine import CpuEngine

        return CpuEngine.from_checkpoint(ckpt, max_batch=max_batch, max_context=max_context)


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

    def open(self, ckpt: Checkpoint, *, max_batch: int, max_context: int) -> Runner:
        raise ExecutorUnavailable("executor cuda", self.unavailable_reason() or "")

    def serving_engine(self, ckpt: Checkpoint, *, max_batch: int, max_context: int) -> Any:
        raise ExecutorUnavailable("executor cuda", self.unavailable_reason() or "")


EXECUTORS: dict[str, Executor] = {
    e.name: e for e in (ReferenceExecutor(), CpuExecutor(), CudaExecutor())
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
