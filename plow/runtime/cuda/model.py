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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plow.bundle.files import ScheduleFile
from plow.checkpoint.quant import QuantTensor
from plow.errors import PlowError
from plow.runtime.cpu.bundle import Bundle
from plow.runtime.cpu.engine import generate_request
from plow.runtime.cpu.generate import GenerationStats
from plow.runtime.cpu.machine import DispatchStats
from plow.runtime.cpu.model import CpuModel, RowDevice, RowInput
from plow.runtime.cpu.plan import PAGE_TABLE, REMAINING, RING, STATE_SLOT, Plan
from plow.runtime.cuda import abi
from plow.runtime.cuda.driver import CudaUnavailable, Device, device
from plow.runtime.cuda.image import DeviceImage, PageTable, assign_pages, build_image, op_modes
from plow.runtime.native import library
from plow.runtime.native.lower import KIND_NAMES, Lowered, lower, stored
from plow.runtime.native.model import NativeStepError, quantum_words
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
    max_ctas: int  # CTAs of plow_step resident at once on the whole GPU (no dynamic smem)
    max_smem: int = 0  # dynamic shared memory one CTA may ask for (opt-in maximum)
    smem_set: int = 0  # what cuFuncSetAttribute last allowed


_KERNELS: dict[tuple[str, int, str], Kernel] = {}


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


@dataclass(frozen=True)
class Backend:
    """Where the kernel runs: the device of an ordinal (`Device`'s methods) and the compiled
    images to try, in order (the first that loads on the device is used)."""

    name: str
    device: Callable[[int], Any]
    images: Callable[[], list[tuple[Path, bytes]]]
    rebuild: str  # the command that builds the images


CUDA = Backend("cuda", lambda ordinal: device(ordinal), lambda: [read_cubin()], "make cuda")


def load_kernel(ordinal: int = 0, backend: Backend = CUDA) -> Kernel:
    """The module loaded once per GPU and image path; `CudaUnavailable` when it is missing, not
    loadable on this GPU, or built from sources whose ABI is not this loader's."""
    images = backend.images()
    for path, _ in images:
        got = _KERNELS.get((backend.name, ordinal, str(path)))
        if got is not None:
            return got
    dev = backend.device(ordinal)
    dev.current()
    failed: CudaUnavailable | None = None
    for path, image in images:
        try:
            module = dev.load_module(image, str(path))
        except CudaUnavailable as e:  # another architecture's code object: try the next
            failed = e
            continue
        break
    else:
        assert failed is not None
        raise failed
    config = read_config(dev, module)
    bad = abi.config_mismatch(config)
    if bad:
        raise CudaUnavailable(path, f"built from other sources ({bad}); rebuild: {backend.rebuild}")
    func = dev.function(module, abi.KERNEL)
    per_sm = dev.occupancy(func, abi.BLOCK_THREADS)
    k = Kernel(dev, module, func, path, per_sm * dev.sms, dev.max_dynamic_smem(func))
    _KERNELS[(backend.name, ordinal, str(path))] = k
    return k


@dataclass
class RungState:
    plan: Plan
    low: Lowered
    image: DeviceImage
    counters: int  # device address: n_counters uint64
    op_work: int
    status: int
    op_mode: int = 0  # device address: u8 per op, or 0
    pages: int = 0  # device address: int32 {offset, bytes} per record, or 0
    smem_bytes: int = 0  # dynamic shared memory per CTA (the plan's page budget)
    page_table: PageTable | None = None
    tensor_core_ops: int = 0
    quantum: int = 0  # device address of a DeviceQuantum (allocated with the first quantum)
    quantum_bytes: int = 0
    step: int = 0


class CudaMachine:
    """One device image per rung, one `plow_step` launch per dispatch (module docstring).
    `timeout_ms`: a wait that does not open for this long stops the step (`CudaStepError`);
    `jitter_ns`: tests only — thread 0 of every CTA sleeps up to this long before each task,
    which widens any window an uncertified plan leaves open; `timing`: time each launch with
    CUDA events (`last_kernel_us`); `tensor_cores`: the linears whose weights are bf16 (the
    plan's precision) on tensor cores — None: PLOW_CUDA_TENSOR_CORES=0 / 1, else on where the
    GPU has them (compute capability 8.0 or later);
    `smem_pages`: the plan's on-chip pages in dynamic shared memory (where the budget fits the
    GPU); `device_quantum`: a multi-step quantum in one launch (stochastic rows sampled
    by the kernel)."""

    def __init__(
        self,
        model: CpuModel,
        *,
        ordinal: int = 0,
        timeout_ms: int = 20_000,
        jitter_ns: int = 0,
        timing: bool = False,
        tensor_cores: bool | None = None,
        smem_pages: bool = True,
        device_quantum: bool = True,
        backend: Backend = CUDA,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kernel = load_kernel(ordinal, backend)
        self.dev = self.kernel.dev
        self.timeout_ms = timeout_ms
        self.jitter_ns = jitter_ns
        self.timing = timing
        if tensor_cores is None:  # PLOW_CUDA_TENSOR_CORES=0 / 1 overrides the default
            env = os.environ.get("PLOW_CUDA_TENSOR_CORES", "")
            tensor_cores = env == "1" if env in ("0", "1") else self.dev.cc >= (8, 0)
        self.tensor_cores = tensor_cores
        self.smem_pages = smem_pages
        self.device_quantum = device_quantum
        self.launches = 0
        self._qkeep: np.ndarray | None = None
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
        modes = op_modes(img.ops_host, img.n_ops, self.tensor_cores)
        st.tensor_core_ops = int(np.count_nonzero(modes))
        if st.tensor_core_ops:
            st.op_mode = self._upload(modes, False)
        if self.smem_pages:
            self._install_pages(st, Path(plan.source) / rung.schedule)
        self.dev.sync()
        self._rungs[id(plan)] = st
        return st

    def _install_pages(self, st: RungState, schedule: Path) -> None:
        """The rung's page table (`image.assign_pages` of its schedule file's timeline), when
        the page budget fits this GPU's dynamic shared memory; else the arena path."""
        pg = ScheduleFile.model_validate_json(schedule.read_bytes()).pages
        table = assign_pages(
            st.image.records_host, pg.budget_pages, pg.page_bytes, pg.start, pg.finish, pg.load,
            pg.weight_pages, pg.act_pages,
        )  # fmt: skip
        if table.smem_bytes == 0 or table.smem_bytes > self.kernel.max_smem:
            return
        if table.smem_bytes > self.kernel.smem_set:
            self.dev.set_dynamic_smem(self.kernel.func, table.smem_bytes)
            self.kernel.smem_set = table.smem_bytes
        per_sm = self.dev.occupancy(self.kernel.func, abi.BLOCK_THREADS, table.smem_bytes)
        if per_sm * self.dev.sms < st.image.n_workers:
            return  # the pages would leave too few CTAs resident: the arena path
        st.page_table, st.smem_bytes = table, table.smem_bytes
        st.pages = self._upload(table.device_table(), False)

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
            "op_mode": st.op_mode,
            "pages": st.pages,
            "quantum": 0,
            "n_steps": 1,
        }

    # -- a step ---------------------------------------------------------------------------
    def dispatch(self, plan: Plan, **_: Any) -> DispatchStats:
        return self._launch(plan, 1, None)

    def dispatch_quantum(
        self,
        plan: Plan,
        steps: int,
        q: library.PlowQuantum,
        stops: Sequence[Sequence[int] | None],
        draws: Sequence[tuple[SamplingParams, np.ndarray] | None] = (),
    ) -> DispatchStats:
        """`steps` decode steps and their epilogues in one launch: `stops[b]` is row b's stop
        ids, None for a padding row; `draws[b]`, for a stochastic row, its sampling parameters
        and its `steps` uniforms (the kernel samples it: kernels/device_sampler.h). The host
        wrote the inputs and `remaining`; the ring, positions, budgets and the last sampled ids
        come back. One device buffer holds the quantum, its rows, stop ids, uniforms and the
        sampler's scratch (only the first four are copied per launch)."""
        st = self._rung(plan)
        n = len(stops)
        draw = [draws[b] if b < len(draws) else None for b in range(n)]
        flat = np.array([t for s in stops if s for t in s] or [0], dtype=np.int32)
        unis = [u for d in draw if d is not None for u in d[1]] or [0.0]
        uniforms = np.asarray(unis, dtype=np.float64)
        head = ctypes.sizeof(abi.DeviceQuantum)
        rows_bytes = n * ctypes.sizeof(abi.DeviceRow)
        at_uni = -(-(head + rows_bytes + int(flat.nbytes)) // 8) * 8
        at_scratch = at_uni + int(uniforms.nbytes)
        scratch = abi.sampler_scratch_bytes(int(q.vocab)) if any(draw) else 0
        need = at_scratch + scratch
        if need > st.quantum_bytes:
            st.quantum, st.quantum_bytes = self._alloc(need), need
        base = st.quantum
        rows = (abi.DeviceRow * max(1, n))()
        at, ua = 0, 0
        for b, s in enumerate(stops):
            rows[b].active, rows[b].greedy = int(s is not None), 1
            if s:
                rows[b].n_stop, rows[b].stop = len(s), base + head + rows_bytes + 4 * at
                at += len(s)
            drawn = draw[b]
            if s is not None and drawn is not None:
                params, u = drawn
                r = rows[b]
                r.greedy, r.temperature, r.top_k = 0, params.temperature, params.top_k
                r.top_p, r.min_p = params.top_p, params.min_p
                r.uniforms = base + at_uni + 8 * ua
                ua += len(u)
        dq = abi.DeviceQuantum(q, base + head, 0, 0, base + at_scratch if scratch else 0)
        blob = bytes(dq) + bytes(rows)[:rows_bytes] + flat.tobytes()
        blob += bytes(at_uni - len(blob)) + uniforms.tobytes()
        buf = np.frombuffer(blob, dtype=np.uint8).copy()
        self.dev.htod(base, int(buf.ctypes.data), int(buf.nbytes))
        self._qkeep = buf  # pageable host memory: kept until the launch has read it
        return self._launch(plan, steps, base)

    def _launch(self, plan: Plan, steps: int, quantum: int | None) -> DispatchStats:
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
        writes = HOST_WRITES + state + ((REMAINING,) if quantum else ())
        for name in writes:
            off, n = self._slot(plan, name)
            dev.htod(base + off, host + off, n)
        dev.memset(st.op_work, max(1, st.image.n_ops) * 8)
        dev.memset(st.status, ctypes.sizeof(abi.DeviceStatus))
        first = st.step + 1
        st.step += steps
        p = self.params(st)
        p["step"], p["quantum"], p["n_steps"] = first, quantum or 0, steps
        args = abi.pack_params(p)
        if self.timing:
            if self._events is None:
                self._events = (dev.event(), dev.event())
            dev.record(self._events[0])
        dev.launch(
            self.kernel.func, st.image.n_workers, abi.BLOCK_THREADS, args.address,
            shmem=st.smem_bytes,
        )  # fmt: skip
        self.launches += 1
        if self.timing and self._events is not None:
            dev.record(self._events[1])
        status = abi.DeviceStatus()
        dev.dtoh(ctypes.addressof(status), st.status, ctypes.sizeof(status))
        reads = HOST_READS + (("positions", RING, REMAINING) if quantum else ())
        for name in reads:
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
            if status.abort == abi.ABORT_NO_TILE:
                kind = KIND_NAMES.get(status.counter, "?")
                raise CudaStepError(
                    plan.bucket.name,
                    f"packet {status.packet} (worker {status.worker}): op kind {kind!r} "
                    f"({status.counter}) has no tile in this device build; rebuild it "
                    "(make cuda) from this plow's kernels/",
                )
            if status.counter == abi.BARRIER_COUNTER:
                raise CudaStepError(
                    plan.bucket.name,
                    f"step stuck: worker {status.worker} at the quantum's step barrier: "
                    f"{status.value} arrivals or steps, waits for {status.want}",
                )
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
        tensor_cores: bool | None = None,
        smem_pages: bool = True,
        device_quantum: bool = True,
        backend: Backend = CUDA,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.machine = CudaMachine(  # type: ignore[assignment]
            self, ordinal=ordinal, timeout_ms=timeout_ms, jitter_ns=jitter_ns, timing=timing,
            tensor_cores=tensor_cores, smem_pages=smem_pages, device_quantum=device_quantum,
            backend=backend,
        )  # fmt: skip

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

    def run_quantum(
        self,
        plan: Plan,
        rows: Sequence[RowInput | None],
        dev: Sequence[RowDevice | None],
        steps: int,
        **kw: object,
    ) -> np.ndarray:
        """A decode quantum is one launch of `steps` steps (the kernel's step barrier and
        epilogue, stochastic rows sampled by the kernel: kernels/device.cu); a prefill or a
        one-step quantum is `CpuModel`'s, with the host's epilogue. A stochastic row's
        uniforms are drawn here from its generator, one per token it may produce (what the
        native executor draws), so its tokens are the native executor's."""
        if not (self.cuda.device_quantum and plan.tokens == 1 and 1 < steps <= plan.ring):
            return super().run_quantum(plan, rows, dev, steps, **kw)
        self.write_inputs(plan, rows)
        rem = self.arena.view(REMAINING)
        rem[:] = 0
        stops: list[Sequence[int] | None] = [None] * plan.batch
        draws: list[tuple[SamplingParams, np.ndarray] | None] = [None] * plan.batch
        for b, d in enumerate(dev[: plan.batch]):
            if d is None:
                continue
            rem[b] = d.remaining
            stops[b] = tuple(int(t) for t in d.stop_ids)
            if not d.params.is_greedy:
                if d.rng is None:
                    raise PlowError("rng", "a stochastic row (temperature > 0) needs a generator")
                u = np.zeros(steps, dtype=np.float64)
                k = min(steps, d.remaining)
                u[:k] = [d.rng.random() for _ in range(k)]
                draws[b] = (d.params, u)
        st = self.cuda.dispatch_quantum(plan, steps, quantum_words(self, plan), stops, draws)
        self.last_plan = plan
        self.steps += steps
        self.tasks_run += st.tasks
        return np.array(self.arena.view(RING)[:steps, : plan.batch])

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
