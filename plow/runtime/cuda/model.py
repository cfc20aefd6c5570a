"""The CUDA executor: a certified bundle's packet streams run by the persistent kernel of
`kernels/device.cu` on an NVIDIA GPU, one launch per decode step.

`CudaModel` is the CPU executor's host side (`CpuModel`: ladder, arena layout, paged key-value
pool bookkeeping, prefix cache, inputs, multi-step epilogue, `generate`) with the machine
swapped, as `NativeModel` does it. The machine keeps on the GPU, allocated once:

- the weights, in their stored dtype (fp32, bf16), uploaded once and shared by every rung;
- the arena (the key-value pool, then one bucket's activations), as big as the host arena;
- per rung, its plan descriptors with device pointers, its queues and counter tables
  (`plow.runtime.cuda.image`), and its 64-bit counters, monotonic across steps.

A step writes the words the host changed since the last one (ids, positions, sample index,
page table: a few hundred bytes), launches `plow_step` with one CTA per plan worker, and reads
back the status word and the sampled ids; the logits come back only when something asks
(`logits`, a stochastic row's epilogue). The key-value pool never leaves the GPU.

Refusals, each one line (exit 2): no cuda-python, no GPU or driver, a module that is not built
or is from other sources, a bundle compiled for a target that is not NVIDIA's, a plan with more
workers than the GPU runs CTAs at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plow.checkpoint.quant import QuantTensor
from plow.errors import PlowError
from plow.runtime.cpu.bundle import Bundle
from plow.runtime.cpu.engine import generate_request
from plow.runtime.cpu.generate import GenerationStats
from plow.runtime.cpu.machine import DispatchStats
from plow.runtime.cpu.model import CpuModel, RowDevice
from plow.runtime.cpu.plan import PAGE_TABLE, STATE_SLOT, Plan
from plow.runtime.cuda import abi
from plow.runtime.cuda.driver import CudaUnavailable, Device, device
from plow.runtime.cuda.image import DeviceImage, build_image
from plow.runtime.native import library
from plow.runtime.native.lower import Lowered, lower, stored
from plow.runtime.native.model import NativeStepError
from plow.runtime.sampler import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
CUBIN = ROOT / "_build" / "native" / "plow_device.cubin"
# Slots the host writes before a step (CpuModel.write_inputs and the epilogue) and the one it
# reads after every step; "lm_head" (the logits) is read on demand.
HOST_WRITES = ("ids", "positions", "sample_index", PAGE_TABLE)
HOST_READS = ("sample",)


class CudaStepError(NativeStepError):
    """A step did not finish (a wait timed out: not a certified plan)."""


def cubin_path() -> Path:
    env = os.environ.get("PLOW_CUDA_CUBIN")
    return Path(env) if env else CUBIN


def read_cubin() -> tuple[Path, bytes]:
    path = cubin_path()
    if not path.is_file():
        raise CudaUnavailable(path, "the CUDA module is not built (run `make cuda`)")
    return path, path.read_bytes()


def check_gpu_target(b: Bundle) -> None:
    """The CUDA executor runs plans made for an NVIDIA target: a CPU target's plan places its
    tiles on a few host workers and a GPU's on its SMs, with that machine's scopes."""
    t = b.manifest.target
    name, vendor = str(t.get("name", "?")), str(t.get("vendor", "")).lower()
    if vendor != "nvidia" or name not in abi.NVIDIA_TARGETS:
        raise PlowError(
            b.path,
            f"compiled for target {name!r} ({vendor or 'no vendor'}): the cuda executor runs "
            f"plans for an NVIDIA target ({', '.join(abi.NVIDIA_TARGETS)}; recompile with "
            "--target h200)",
        )


@dataclass
class Kernel:
    """The loaded module on one GPU: `plow_step` and what the loader checked of it."""

    dev: Device
    module: Any
    func: Any
    path: Path
    max_ctas: int  # CTAs of plow_step resident at once on the whole GPU


_KERNELS: dict[tuple[int, str], Kernel] = {}


def read_config(dev: Device, module: Any) -> list[int]:
    """The module's `plow_device_config`, written by its `plow_config` kernel into a scratch
    buffer (one CTA of 8 threads)."""
    n = len(abi.expected_config())
    buf = dev.alloc(8 * n)
    try:
        dev.memset(buf, 8 * n)
        args = abi.pack_values([(ctypes.c_uint64, buf)])
        dev.launch(dev.function(module, abi.CONFIG_KERNEL), 1, 32, args.address, persistent=False)
        out = np.zeros(n, dtype=np.int64)
        dev.dtoh(int(out.ctypes.data), buf, 8 * n)
        dev.sync()
    finally:
        dev.free(buf)
    return [int(v) for v in out]


def load_kernel(ordinal: int = 0) -> Kernel:
    """The module loaded once per GPU and cubin path; `CudaUnavailable` when it is missing, not
    loadable on this GPU, or built from sources whose ABI is not this loader's."""
    path, image = read_cubin()
    got = _KERNELS.get((ordinal, str(path)))
    if got is not None:
        return got
    dev = device(ordinal)
    dev.current()
    module = dev.load_module(image, str(path))
    config = read_config(dev, module)
    bad = abi.config_mismatch(config)
    if bad:
        raise CudaUnavailable(path, f"built from other sources ({bad}); rebuild: make cuda")
    func = dev.function(module, abi.KERNEL)
    per_sm = dev.occupancy(func, abi.BLOCK_THREADS)
    k = Kernel(dev, module, func, path, per_sm * dev.sms)
    _KERNELS[(ordinal, str(path))] = k
    return k


@dataclass
class RungState:
    plan: Plan
    low: Lowered
    image: DeviceImage
    counters: int  # device address: n_counters uint64
    op_work: int
    status: int
    step: int = 0


class CudaMachine:
    """One device image per rung, one `plow_step` launch per dispatch (module docstring).
    `timeout_ms`: a wait that does not open for this long stops the step (`CudaStepError`);
    `jitter_ns`: tests only — thread 0 of every CTA sleeps up to this long before each task,
    which widens any window an uncertified plan leaves open; `timing`: time each launch with
    CUDA events (`last_kernel_us`)."""

    def __init__(
        self,
        model: CpuModel,
        *,
        ordinal: int = 0,
        timeout_ms: int = 20_000,
        jitter_ns: int = 0,
        timing: bool = False,
    ) -> None:
        self.model = model
        self.kernel = load_kernel(ordinal)
        self.dev = self.kernel.dev
        self.timeout_ms = timeout_ms
        self.jitter_ns = jitter_ns
        self.timing = timing
        self.native = library.load()  # the host build validates each plan as it loads it
        self._rungs: dict[int, RungState] = {}
        self._uploaded: dict[tuple[int, int], int] = {}  # (host address, bytes) -> device
        self._allocs: list[int] = []
        self._arena = 0
        self._arena_bytes = 0
        self._scratch = 0
        self._scratch_bytes = 0
        self._events: tuple[Any, Any] | None = None
        self.last = DispatchStats(0, ())
        self.last_kernel_us = 0.0

    # -- memory ---------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        p = self.dev.alloc(nbytes)
        self._allocs.append(p)
        return p

    def _upload(self, arr: np.ndarray, cache: bool) -> int:
        key = (int(arr.ctypes.data), int(arr.nbytes))
        if cache and key in self._uploaded:
            return self._uploaded[key]
        p = self._alloc(arr.nbytes)
        self.dev.htod(p, int(arr.ctypes.data), int(arr.nbytes))
        if cache:
            self._uploaded[key] = p
        return p

    def _ensure_arena(self) -> int:
        """The device arena, as big as the host arena (allocated once; regrown, keeping its
        contents, only when a larger bucket's layout is installed)."""
        buf = self.model.arena.buf
        if self._arena and self._arena_bytes >= buf.nbytes:
            return self._arena
        new = self.dev.alloc(buf.nbytes)
        self.dev.htod(new, int(buf.ctypes.data), int(buf.nbytes))
        if self._arena:
            self.dev.dtod(new, self._arena, self._arena_bytes)
            self.dev.sync()
            self.dev.free(self._arena)
        self._arena, self._arena_bytes = new, int(buf.nbytes)
        return new

    def _ensure_scratch(self, img: DeviceImage) -> int:
        need = img.n_workers * abi.ATTN_THREADS * img.scratch_floats * 4
        if need > self._scratch_bytes:
            if self._scratch:
                self.dev.sync()
                self.dev.free(self._scratch)
            self._scratch, self._scratch_bytes = self.dev.alloc(need), need
        return self._scratch

    # -- plans ----------------------------------------------------------------------------
    def _validate(self, low: Lowered, where: Path) -> None:
        """The host build's load-time refusals (opcode, worker, counter, op index, unit range,
        opcode against the op table), with its messages: one rule set for both builds."""
        err = ctypes.create_string_buffer(512)
        h = self.native.plow_plan_new(ctypes.byref(low.plan), err, len(err))
        if not h:
            raise PlowError(where, err.value.decode())
        self.native.plow_plan_free(h)

    def _rung(self, plan: Plan) -> RungState:
        got = self._rungs.get(id(plan))
        if got is not None:
            return got
        b = self.model.bundle
        if b is None or not plan.source:
            raise PlowError(plan.bucket.name, "the cuda executor runs plans loaded from bundles")
        rung = b.rung(plan.bucket)
        low = lower(plan, self.model.arena, self.model.weights, Path(plan.source), rung)
        self._validate(low, Path(plan.source) / rung.plan)
        if low.plan.n_workers > self.kernel.max_ctas:
            raise PlowError(
                Path(plan.source) / rung.plan,
                f"{low.plan.n_workers} workers, but {self.dev.name} runs at most "
                f"{self.kernel.max_ctas} CTAs of plow_step at once ({self.dev.sms} SMs): "
                "recompile for this GPU's target",
            )
        self.dev.current()
        img = build_image(low, self._upload)
        counters = self._alloc(max(1, img.n_counters) * 8)
        self.dev.memset(counters, max(1, img.n_counters) * 8)
        st = RungState(
            plan,
            low,
            img,
            counters,
            self._alloc(max(1, img.n_ops) * 8),
            self._alloc(ctypes.sizeof(abi.DeviceStatus)),
        )
        self.dev.sync()
        self._rungs[id(plan)] = st
        return st

    def _slot(self, plan: Plan, name: str) -> tuple[int, int]:
        """(byte offset in the arena, bytes) of a tensor of `plan`'s layout."""
        s = plan.layout.slot(name)
        return (self.model.arena.kv_words + s.offset) * 4, s.words * 4

    def fetch(self, plan: Plan, name: str) -> None:
        """Copy one tensor's words of the device arena into the host arena."""
        off, n = self._slot(plan, name)
        buf = self.model.arena.buf
        self.dev.dtoh(int(buf.ctypes.data) + off, self._arena + off, n)
        self.dev.sync()

    def snapshot(self) -> np.ndarray:
        """The whole device arena, copied (tests: bitwise comparisons)."""
        out = np.empty(self._arena_bytes // 4, dtype=np.float32)
        self.dev.dtoh(int(out.ctypes.data), self._arena, self._arena_bytes)
        self.dev.sync()
        return out

    def params(self, st: RungState) -> dict[str, int]:
        img = st.image
        return {
            "plan": img.plan,
            "arena": self._arena,
            "counters": st.counters,
            "per_step": img.per_step,
            "counter_scope": img.counter_scope,
            "queue": img.queue,
            "queue_start": img.queue_start,
            "scratch": self._scratch,
            "scratch_floats": img.scratch_floats,
            "op_work": st.op_work,
            "status": st.status,
            "step": st.step,
            "timeout_ns": max(1, self.timeout_ms) * 1_000_000,
            "jitter_ns": self.jitter_ns,
        }

    # -- a step ---------------------------------------------------------------------------
    def dispatch(self, plan: Plan, **_: Any) -> DispatchStats:
        arena = self.model.arena
        if arena.layout is not plan.layout:
            raise PlowError(plan.bucket.name, "the arena holds another bucket's layout")
        st = self._rung(plan)
        dev = self.dev
        dev.current()
        base = self._ensure_arena()
        self._ensure_scratch(st.image)
        host = int(arena.buf.ctypes.data)
        state = (STATE_SLOT,) if STATE_SLOT in plan.layout.slots else ()  # Mamba-2's rows
        for name in HOST_WRITES + state:
            off, n = self._slot(plan, name)
            dev.htod(base + off, host + off, n)
        dev.memset(st.op_work, max(1, st.image.n_ops) * 8)
        dev.memset(st.status, ctypes.sizeof(abi.DeviceStatus))
        st.step += 1
        args = abi.pack_params(self.params(st))
        if self.timing:
            if self._events is None:
                self._events = (dev.event(), dev.event())
            dev.record(self._events[0])
        dev.launch(self.kernel.func, st.image.n_workers, abi.BLOCK_THREADS, args.address)
        if self.timing and self._events is not None:
            dev.record(self._events[1])
        status = abi.DeviceStatus()
        dev.dtoh(ctypes.addressof(status), st.status, ctypes.sizeof(status))
        for name in HOST_READS:
            off, n = self._slot(plan, name)
            dev.dtoh(host + off, base + off, n)
        dev.sync()
        if self.timing and self._events is not None:
            self.last_kernel_us = 1000.0 * dev.elapsed_ms(*self._events)
        if status.abort:
            # counters are left mid-step: bring each to its end-of-step value (host.cpp does
            # the same), so the next step's targets stay right; this step's bytes are not used
            fixed = (st.image.per_step_host * np.uint64(st.step)).astype(np.uint64)
            dev.htod(st.counters, int(fixed.ctypes.data), int(fixed.nbytes))
            dev.sync()
            raise CudaStepError(
                plan.bucket.name,
                f"step stuck: worker {status.worker} blocked at packet {status.packet}: counter "
                f"{status.counter} is at {status.value}, waits for {status.want}",
            )
        tasks, nops = int(status.tasks), int(status.nops)
        self.last = DispatchStats(tasks, (), tasks + nops, nops)
        return self.last

    def work(self, plan: Plan) -> dict[str, int]:
        """Counted work per op of the last dispatch of `plan` (attention: query-key pairs)."""
        st = self._rung(plan)
        out = np.zeros(max(1, st.image.n_ops), dtype=np.uint64)
        self.dev.dtoh(int(out.ctypes.data), st.op_work, int(out.nbytes))
        self.dev.sync()
        return {op.name: int(w) for op, w in zip(plan.ops, out.tolist(), strict=False) if w}

    def profile(self, plan: Plan, enable: bool = True) -> dict[str, int]:
        """Per-op times are not measured on the GPU (one launch runs every op): an empty map,
        the interface of `NativeMachine.profile`. `timing=True` times whole launches."""
        return {}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.dev.sync()
        for p in [*self._allocs, self._arena, self._scratch]:
            if p:
                with contextlib.suppress(Exception):
                    self.dev.free(p)
        self._allocs.clear()
        self._uploaded.clear()
        self._rungs.clear()
        self._arena = self._scratch = 0
        self._arena_bytes = self._scratch_bytes = 0

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order
        with contextlib.suppress(Exception):
            self.close()


class CudaModel(CpuModel):
    """`CpuModel` on the CUDA machine (module docstring). Build with `open_cuda`."""

    executor_name = "cuda"

    def __init__(
        self,
        *args: Any,
        ordinal: int = 0,
        timeout_ms: int = 20_000,
        jitter_ns: int = 0,
        timing: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.machine = CudaMachine(  # type: ignore[assignment]
            self, ordinal=ordinal, timeout_ms=timeout_ms, jitter_ns=jitter_ns, timing=timing
        )

    @property
    def cuda(self) -> CudaMachine:
        m = self.machine
        assert isinstance(m, CudaMachine)
        return m

    def _weight(self, name: str) -> None:
        if name not in self.weights:
            raw: object = self._raw[name]  # GGML blocks stay blocks (uploaded as bytes)
            w = stored(raw if isinstance(raw, QuantTensor) else np.asarray(raw))
            self.weights[name] = w  # type: ignore[assignment]

    def logits(self, plan: Plan) -> np.ndarray:
        self.cuda.fetch(plan, "lm_head")
        return super().logits(plan)

    def _epilogue(self, plan: Plan, i: int, dev: Sequence[RowDevice | None]) -> None:
        if any(d is not None and not d.params.is_greedy for d in dev):
            self.cuda.fetch(plan, "lm_head")  # a stochastic row samples from the logits
        super()._epilogue(plan, i, dev)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights a step reads, in their stored dtype (each tensor once)."""
        return sum(int(np.asarray(self._raw[n]).nbytes) for n in self._names)


def open_cuda(
    bundle: Bundle | Path | str,
    *,
    verify: bool = True,
    ordinal: int = 0,
    **kw: Any,
) -> CudaModel:
    """A `CudaModel` of a bundle. Checked in this order, each a one-line error: the module is
    built, the bundle opens (and verifies) and is for an NVIDIA target, cuda-python and a GPU
    are there and the module loads on it."""
    read_cubin()
    b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle, verify=verify)
    check_gpu_target(b)
    library.load()
    load_kernel(ordinal)
    m = CudaModel.from_bundle(b, verify=verify, ordinal=ordinal, **kw)
    assert isinstance(m, CudaModel)
    return m


def generate_cuda(
    bundle: Bundle | Path | str,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    params: SamplingParams | None = None,
    stop_ids: tuple[int, ...] = (),
    multi_step: int = 4,
    verify: bool = True,
) -> tuple[list[int], GenerationStats]:
    """One request through a bundle on the CUDA executor (`plow generate --executor cuda`,
    once the CLI offers it); `multi_step` decode steps per host round trip."""
    if not prompt_ids:
        raise PlowError("prompt", "empty prompt")
    model = open_cuda(bundle, verify=verify, max_batch=1)
    return generate_request(model, prompt_ids, max_new_tokens, params, stop_ids, multi_step)
