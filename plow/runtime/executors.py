"""The one registry of executors: `reference`, `cpu`, `native`, `cuda` behind one interface.

`plow serve`, the harness and `plow generate` (`ExecutorKind.generate`: one request through a
bundle) look executors up here; nothing else should keep a list of them.

An `ExecutorKind` says what it runs and how it is opened:

- a *bundle* executor (`cpu`, `native`, `cuda`) runs a certified bundle's packet streams. All
  three share the host side (`plow.runtime.cpu.model.CpuModel`: ladder, arena, paged key-value
  pool, prefix cache) and differ only in the machine that runs a step, so `open_model` is the
  one place that differs and `open_engine` wraps any of them in the same
  `plow.runtime.cpu.engine.CpuEngine`;
- the `reference` executor runs a checkpoint's per-op numpy forward (`ReferenceEngine`),
  independent of any plan.

`plans_in_memory` says whether the executor can also run a bucket its bundle lacks by planning
it in memory (the `cpu` emulator can; the native and CUDA kernels run certified plans only).
`unavailable_reason()` is None when this machine can run the executor, else one line saying why
not (no native library built, no GPU); `get_executor` turns that into `ExecutorUnavailable`
(exit 2).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from plow.errors import PlowError

if TYPE_CHECKING:
    from plow.checkpoint import Checkpoint
    from plow.runtime.cpu.bundle import Bundle
    from plow.runtime.cpu.generate import GenerationStats
    from plow.runtime.cpu.model import CpuModel
    from plow.runtime.engine import Engine
    from plow.runtime.sampler import SamplingParams


class ExecutorUnavailable(PlowError):
    """An executor this machine or this version cannot run, or an unknown name (exit 2)."""


def gpu_present() -> bool:
    """An NVIDIA GPU is visible (`PLOW_ASSUME_NO_GPU` set says no, for tests)."""
    if os.environ.get("PLOW_ASSUME_NO_GPU"):
        return False
    from plow.runtime.cuda.driver import gpu_present as visible

    return visible()


def _always() -> str | None:
    return None


def _native_reason() -> str | None:
    from plow.runtime.native import library

    try:
        library.load()
    except PlowError as e:
        return str(e)
    return None


def _cuda_reason() -> str | None:
    if not gpu_present():
        return "no GPU on this machine (this workload needs an NVIDIA GPU)"
    from plow.runtime.cuda.model import read_cubin

    try:
        read_cubin()
    except PlowError as e:
        return str(e)
    return None


def _hip_reason() -> str | None:
    from plow.runtime.hip.driver import amd_gpu_present
    from plow.runtime.hip.model import code_objects

    if not amd_gpu_present():
        return "no AMD GPU on this machine (no /dev/kfd): the hip executor needs one"
    try:
        code_objects()
    except PlowError as e:
        return str(e)
    return None


def _open_cpu(b: Bundle, **kw: Any) -> CpuModel:
    from plow.runtime.cpu.model import CpuModel

    return CpuModel.from_bundle(b, **kw)


def _open_native(b: Bundle, **kw: Any) -> CpuModel:
    from plow.runtime.native import open_native

    return open_native(b, **kw)


def _open_cuda(b: Bundle, **kw: Any) -> CpuModel:
    from plow.runtime.cuda import open_cuda

    return open_cuda(b, **kw)


def _open_hip(b: Bundle, **kw: Any) -> CpuModel:
    from plow.runtime.hip import open_hip

    return open_hip(b, **kw)


@dataclass(frozen=True, slots=True)
class ExecutorKind:
    """One registered executor (module docstring)."""

    name: str
    description: str
    runs: Literal["bundle", "checkpoint"]
    plans_in_memory: bool
    _reason: Callable[[], str | None]
    _open: Callable[..., CpuModel] | None = None
    multi_step: int = 1  # decode steps per host round trip in `generate`

    def unavailable_reason(self) -> str | None:
        return self._reason()

    def check(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise ExecutorUnavailable(f"executor {self.name}", reason)

    def open_model(
        self,
        bundle: Bundle | Path | str,
        *,
        max_batch: int | None = None,
        max_context: int | None = None,
        verify: bool = True,
        **machine: Any,
    ) -> CpuModel:
        """The bundle's model on this executor's machine (a bundle executor only); `machine`:
        the machine's own options (`threads=` for native)."""
        from plow.runtime.cpu.bundle import Bundle

        if self._open is None:
            raise PlowError(f"executor {self.name}", "runs checkpoints, not bundles")
        self.check()
        b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle, verify=verify)
        return self._open(b, max_batch=max_batch, max_context=max_context, verify=verify, **machine)

    def generate(
        self,
        bundle: Bundle | Path | str,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        params: SamplingParams | None = None,
        stop_ids: tuple[int, ...] = (),
        multi_step: int | None = None,
        verify: bool = True,
        **machine: Any,
    ) -> tuple[list[int], GenerationStats]:
        """One request through a bundle on this executor (what `plow generate` runs):
        `multi_step` decode steps per host round trip (default: the executor's)."""
        from plow.runtime.cpu.engine import generate_request

        if not prompt_ids:
            raise PlowError("prompt", "empty prompt")
        model = self.open_model(bundle, max_batch=1, verify=verify, **machine)
        steps = self.multi_step if multi_step is None else multi_step
        return generate_request(model, prompt_ids, max_new_tokens, params, stop_ids, steps)

    def engine_of(self, model: CpuModel, *, prefix_cache: bool = True) -> Engine:
        """The slot-table engine over a bundle executor's model."""
        from plow.runtime.cpu.engine import CpuEngine

        return CpuEngine(model, prefix_cache=prefix_cache)

    def open_engine(
        self,
        source: Bundle | Checkpoint,
        *,
        max_batch: int,
        max_context: int | None = None,
    ) -> Engine:
        """The engine of `source` on this executor: a bundle for a bundle executor, a
        checkpoint for the reference one; the wrong kind is a one-line error."""
        from plow.checkpoint import Checkpoint
        from plow.runtime.engine import ReferenceEngine

        if self.runs == "checkpoint":
            if not isinstance(source, Checkpoint):
                raise PlowError(
                    getattr(source, "path", "bundle"),
                    "a bundle runs on --executor native, cpu or cuda",
                )
            return ReferenceEngine.from_checkpoint(
                source, max_batch=max_batch, max_context=max_context
            )
        if isinstance(source, Checkpoint):
            raise PlowError(f"executor {self.name}", "runs bundles: compile the checkpoint first")
        return self.engine_of(self.open_model(source, max_batch=max_batch, max_context=max_context))


EXECUTORS: dict[str, ExecutorKind] = {
    e.name: e
    for e in (
        ExecutorKind(
            "reference",
            "the plain per-op numpy forward (fp32, contiguous key-value cache, rows run one "
            "after another); independent of the compiled plan",
            "checkpoint",
            False,
            _always,
        ),
        ExecutorKind(
            "native",
            "the certified bundle's packet stream on the native persistent kernel (kernels/, "
            "C++: one thread per plan worker, monotonic atomic counters)",
            "bundle",
            False,
            _native_reason,
            _open_native,
            4,
        ),
        ExecutorKind(
            "cpu",
            "the compiled plan's packet stream on the CPU persistent-kernel emulation "
            "(plow.runtime.cpu: virtual workers, counters, numpy tile kernels)",
            "bundle",
            True,
            _always,
            _open_cpu,
        ),
        ExecutorKind(
            "cuda",
            "the certified bundle's packet stream on the persistent kernel of "
            "kernels/device.cu, one launch per step on an NVIDIA GPU",
            "bundle",
            False,
            _cuda_reason,
            _open_cuda,
            4,
        ),
        ExecutorKind(
            "hip",
            "the same persistent kernel built by hipcc, on an AMD GPU (HIP module API; not "
            "yet run on one)",
            "bundle",
            False,
            _hip_reason,
            _open_hip,
            4,
        ),
    )
}


def get_executor(name: str) -> ExecutorKind:
    """The registered executor, or `ExecutorUnavailable` (one line, exit 2) saying why not."""
    ex = EXECUTORS.get(name)
    if ex is None:
        raise ExecutorUnavailable(
            f"executor {name}", f"unknown executor (have {', '.join(EXECUTORS)})"
        )
    ex.check()
    return ex


def gpu_target_of(device_name: str) -> str:
    """The shipped NVIDIA target for a GPU's name (`cuDeviceGetName`), e.g. 'NVIDIA H200' → h200;
    an unknown NVIDIA GPU is a one-line error naming it."""
    from plow.runtime.cuda.abi import NVIDIA_TARGETS

    low = device_name.lower()
    for t in sorted(NVIDIA_TARGETS, key=len, reverse=True):
        if t in low:
            return t
    raise PlowError(
        device_name,
        f"no shipped target for this GPU (have {', '.join(NVIDIA_TARGETS)}); "
        "compile a bundle with --target FILE.json",
    )


def checkpoint_target(executor: str) -> str:
    """The target a checkpoint is compiled for (`compile_cached`) to run on `executor`: the
    cpu target (this machine's calibration) for cpu / native, the present GPU's for cuda."""
    if executor == "hip":
        return "mi350x"
    if executor != "cuda":
        return "cpu"
    from plow.runtime.cuda.driver import Device

    return gpu_target_of(Device(0).name)
