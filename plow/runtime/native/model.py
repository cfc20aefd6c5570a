"""The native executor: the certified bundle's packet streams run by the persistent kernel in
C++ (`kernels/`) on CPU threads.

`NativeModel` is the CPU executor's host side (`CpuModel`: ladder, arena with the paged
key-value pool, prefix cache, inputs, multi-step epilogue) with the machine swapped: a step is
one call into the library, which runs every worker queue of the rung to its end with the GIL
released, and weights stay in their stored precision (fp32, bf16) instead of being widened.
It runs bundles only (a checkpoint goes through `compile_cached` first), with the same
refusal rules as the `cpu` executor (`plow.runtime.cpu.bundle.Bundle.open`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plow.checkpoint.quant import QuantTensor
from plow.errors import PlowError
from plow.runtime.cpu.bundle import Bundle
from plow.runtime.cpu.engine import generate_request
from plow.runtime.cpu.generate import GenerationStats
from plow.runtime.cpu.machine import DispatchStats
from plow.runtime.cpu.model import CpuModel, RowDevice, RowInput
from plow.runtime.cpu.plan import REMAINING, RING, Plan
from plow.runtime.kv_cache import KVDtype
from plow.runtime.native import library
from plow.runtime.native.lower import Lowered, lower, stored
from plow.runtime.sampler import SamplingParams


class NativeStepError(PlowError):
    """A step did not finish (a plan whose counters never open: not a certified plan)."""

    exit_code = 1


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class NativeMachine:
    """One lowered plan per rung, dispatched by the library. `threads`: host threads per step
    (default: the plan's workers, at most the usable cores); the bytes do not depend on it."""

    def __init__(
        self,
        model: CpuModel,
        *,
        threads: int | None = None,
        build: str = "release",
        timeout_ms: int = 20_000,
    ) -> None:
        self.model = model
        self.lib = library.load(build)
        self.threads = threads
        self.timeout_ms = timeout_ms
        self._plans: dict[int, tuple[Plan, Lowered, int]] = {}
        self.last = DispatchStats(0, ())

    def _handle(self, plan: Plan) -> tuple[Lowered, int]:
        got = self._plans.get(id(plan))
        if got is not None:
            return got[1], got[2]
        b = self.model.bundle
        if b is None or not plan.source:
            raise PlowError(plan.bucket.name, "the native executor runs plans loaded from bundles")
        low = lower(
            plan, self.model.arena, self.model.weights, Path(plan.source), b.rung(plan.bucket)
        )
        err = ctypes.create_string_buffer(512)
        h = self.lib.plow_plan_new(ctypes.byref(low.plan), err, len(err))
        if not h:
            raise PlowError(Path(plan.source) / b.rung(plan.bucket).plan, err.value.decode())
        self._plans[id(plan)] = (plan, low, h)
        return low, h

    def threads_for(self, plan: Plan) -> int:
        if self.threads is not None:
            return max(1, self.threads)
        return max(1, min(len(plan.stream.queues), usable_cores()))

    def dispatch(self, plan: Plan, **_: Any) -> DispatchStats:
        """One step of `plan` (no epilogue: the host's `CpuModel` paths call this)."""
        return self._run(plan, lambda lib, h, buf, th, err: lib.plow_plan_dispatch(
            h, buf.ctypes.data, buf.shape[0], th, self.timeout_ms, err, len(err)
        ))  # fmt: skip

    def quantum(
        self, plan: Plan, steps: int, q: library.PlowQuantum, rows: ctypes.Array[library.PlowRow]
    ) -> DispatchStats:
        """`steps` dispatches of `plan`, each followed by the step epilogue, in one call."""
        return self._run(plan, lambda lib, h, buf, th, err: lib.plow_plan_quantum(
            h, buf.ctypes.data, buf.shape[0], th, self.timeout_ms, steps,
            ctypes.byref(q), rows, err, len(err),
        ))  # fmt: skip

    def _run(self, plan: Plan, call: Any) -> DispatchStats:
        h = self._handle(plan)[1]
        arena = self.model.arena
        if arena.layout is not plan.layout:
            raise PlowError(plan.bucket.name, "the arena holds another bucket's layout")
        err = ctypes.create_string_buffer(512)
        if call(self.lib, h, arena.buf, self.threads_for(plan), err) != 0:
            raise NativeStepError(plan.bucket.name, err.value.decode())
        counts = (ctypes.c_int64 * 3)()
        self.lib.plow_plan_last_counts(h, counts)
        self.last = DispatchStats(int(counts[0]), (), int(counts[0] + counts[1]), int(counts[1]))
        return self.last

    def profile(self, plan: Plan, enable: bool = True) -> dict[str, int]:
        """Nanoseconds per op kind spent in task packets since the last call (summed over
        threads), then per-op timing on (`enable`) or off for the following steps."""
        _, h = self._handle(plan)
        ns = np.zeros(max(1, len(plan.ops)), dtype=np.int64)
        self.lib.plow_plan_profile(h, int(enable), ns.ctypes.data)
        out: dict[str, int] = {}
        for op, t in zip(plan.ops, ns.tolist(), strict=False):
            out[op.kind] = out.get(op.kind, 0) + int(t)
        return out

    def work(self, plan: Plan) -> dict[str, int]:
        """Counted work per op of the last dispatch of `plan` (attention: query-key pairs
        scored — it follows the rows' live lengths, not the rung's context)."""
        _, h = self._handle(plan)
        out = np.zeros(max(1, len(plan.ops)), dtype=np.int64)
        self.lib.plow_plan_work(h, out.ctypes.data)
        return {op.name: int(w) for op, w in zip(plan.ops, out.tolist(), strict=False) if w}

    def close(self) -> None:
        for _, _, h in self._plans.values():
            self.lib.plow_plan_free(h)
        self._plans.clear()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order
        with contextlib.suppress(Exception):
            self.close()


def quantum_words(model: CpuModel, plan: Plan) -> library.PlowQuantum:
    """Where a quantum's epilogue reads and writes in `model`'s arena (absolute words), and
    the bucket's shape: the same for every executor that runs kernels/sampler.h."""
    base = model.arena.kv_words

    def word(name: str) -> int:
        return base + plan.layout.slot(name).offset

    return library.PlowQuantum(
        word("sample"), word("positions"), word("sample_index"), word(RING),
        word(REMAINING), word("lm_head"), plan.batch, plan.tokens,
        model.spec.vocab_size, model.context,
    )  # fmt: skip


class NativeModel(CpuModel):
    """`CpuModel` on the native machine (module docstring). Build with `from_bundle`."""

    executor_name = "native"

    def __init__(
        self,
        *args: Any,
        threads: int | None = None,
        build: str = "release",
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.machine: NativeMachine = NativeMachine(self, threads=threads, build=build)  # type: ignore[assignment]

    def run_quantum(
        self,
        plan: Plan,
        rows: Sequence[RowInput | None],
        dev: Sequence[RowDevice | None],
        steps: int,
        **kw: object,
    ) -> np.ndarray:
        """`CpuModel.run_quantum` with the epilogue in the kernel (kernels/sampler.h): the
        host writes the inputs once, draws each stochastic row's uniforms from its generator
        (one per token it may produce: what the `cpu` executor's epilogue draws), and the
        library runs `steps` steps and epilogues in one call; then the host reads the ring."""
        if not 1 <= steps <= plan.ring:
            raise PlowError("multi-step", f"quantum {steps} outside 1..{plan.ring}")
        if plan.tokens > 1 and steps != 1:
            raise PlowError("multi-step", "a prefill launch is one step")
        self.write_inputs(plan, rows)
        rem = self.arena.view(REMAINING)
        rem[:] = 0
        crows = (library.PlowRow * plan.batch)()
        keep: list[np.ndarray] = []
        for b, d in enumerate(dev):
            if d is None or b >= plan.batch:
                continue
            rem[b] = d.remaining
            r = crows[b]
            r.active, r.greedy = 1, int(d.params.is_greedy)
            r.temperature, r.top_k = d.params.temperature, d.params.top_k
            r.top_p, r.min_p = d.params.top_p, d.params.min_p
            stop = np.asarray(d.stop_ids, dtype=np.int32)
            u = np.zeros(steps, dtype=np.float64)
            if not d.params.is_greedy:
                if d.rng is None:
                    raise PlowError("rng", "a stochastic row (temperature > 0) needs a generator")
                n = min(steps, d.remaining)
                u[:n] = [d.rng.random() for _ in range(n)]
            keep += [stop, u]
            r.n_stop, r.stop, r.uniforms = len(stop), stop.ctypes.data, u.ctypes.data
        st = self.machine.quantum(plan, steps, quantum_words(self, plan), crows)
        self.last_plan = plan
        self.steps += steps
        self.tasks_run += st.tasks * steps
        return np.array(self.arena.view(RING)[:steps, : plan.batch])

    def _weight(self, name: str) -> None:
        if name not in self.weights:
            raw: object = self._raw[name]  # GGML blocks stay blocks (the dict holds both)
            w = stored(raw if isinstance(raw, QuantTensor) else np.asarray(raw))
            self.weights[name] = w  # type: ignore[assignment]

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights a step reads, in their stored dtype (each tensor once)."""
        return sum(int(self._raw[n].nbytes) for n in self._names)


GPU_VENDORS = ("nvidia", "amd")


def check_host_target(b: Bundle) -> None:
    """The native executor runs plans made for a CPU target: a GPU target's plan places its
    tiles on SMs / CUs, with on-chip pages and scopes of that machine."""
    t = b.manifest.target
    name, vendor = str(t.get("name", "?")), str(t.get("vendor", "")).lower()
    if vendor in GPU_VENDORS:
        raise PlowError(
            b.path,
            f"compiled for target {name!r} ({vendor}): the native executor runs plans for a "
            "CPU target (recompile with --target cpu)",
        )


def open_native(
    bundle: Bundle | Path | str,
    *,
    verify: bool = True,
    threads: int | None = None,
    build: str = "release",
    **kw: Any,
) -> NativeModel:
    """A `NativeModel` of a bundle (refused like the `cpu` executor refuses it)."""
    library.load(build)  # a missing library is an error before any bundle work
    b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle, verify=verify)
    check_host_target(b)
    m = NativeModel.from_bundle(b, verify=verify, threads=threads, build=build, **kw)
    assert isinstance(m, NativeModel)
    return m


def generate_native(
    bundle: Bundle | Path | str,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    params: SamplingParams | None = None,
    stop_ids: tuple[int, ...] = (),
    multi_step: int = 4,
    verify: bool = True,
    threads: int | None = None,
    kv_dtype: KVDtype = "float32",
) -> tuple[list[int], GenerationStats]:
    """One request through a bundle on the native executor (`plow generate --executor
    native`); `multi_step` decode steps per host round trip; `kv_dtype` bfloat16 keeps the
    key-value cache in bf16 (opt-in, lossy: half the cache bytes)."""
    if not prompt_ids:
        raise PlowError("prompt", "empty prompt")
    model = open_native(bundle, verify=verify, threads=threads, max_batch=1, kv_dtype=kv_dtype)
    return generate_request(model, prompt_ids, max_new_tokens, params, stop_ids, multi_step)
