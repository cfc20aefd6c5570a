"""`plow calibrate target cpu`: measure this machine and write a `Target`.

Bandwidth: a large numpy copy (`np.copyto`, bytes read + bytes written), best of N.
Arithmetic: an fp32 GEMM (`a @ b`, 2·n³ flop), best of N. Tile overhead: the mean time of a
tiny numpy matmul (the fixed cost one CPU-executor tile pays). Cache sizes come from sysfs
where present; everything else keeps the shipped `cpu` defaults.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from plow.target.load import load_target
from plow.target.model import Target

# on_step(stage description, completed, total) is called as the measurement advances.
StepCallback = Callable[[str, int, int], None]


def _cache_bytes(level: int) -> int | None:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    if not base.is_dir():
        return None
    for idx in sorted(base.glob("index*")):
        try:
            if int((idx / "level").read_text()) != level:
                continue
            if (idx / "type").read_text().strip() == "Instruction":
                continue
            size = (idx / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        mult = {"K": 1024, "M": 1024 * 1024}.get(size[-1:], 1)
        digits = size.rstrip("KMB")
        if digits.isdigit():
            return int(digits) * mult
    return None


def _workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def measure_bandwidth(size_bytes: int, repeats: int, on_step: StepCallback | None = None) -> int:
    """Best-of-`repeats` copy bandwidth in bytes/s (read + write counted)."""
    n = size_bytes // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
        if on_step:
            on_step("memory bandwidth", r + 1, repeats)
    return int(2 * n * 8 / best)


def measure_matmul(n: int, repeats: int, on_step: StepCallback | None = None) -> int:
    """Best-of-`repeats` fp32 GEMM rate in flop/s for n x n x n."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    _ = a @ b
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        _ = a @ b
        best = min(best, time.perf_counter() - t0)
        if on_step:
            on_step("fp32 matmul", r + 1, repeats)
    return int(2 * n**3 / best)


def measure_tile_overhead(calls: int = 2000) -> int:
    """Mean ns of a tiny numpy matmul: the fixed cost of one CPU tile."""
    a = np.ones((8, 8), dtype=np.float32)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            _ = a @ a
        best = min(best, (time.perf_counter() - t0) / calls)
    return max(1, int(best * 1e9))


def calibrate_cpu(
    *,
    repeats: int = 5,
    copy_bytes: int = 256 * 1024 * 1024,
    gemm_n: int = 1024,
    on_step: StepCallback | None = None,
) -> Target:
    """Measure this machine; returns the shipped `cpu` target with measured numbers."""
    base = load_target("cpu")
    bandwidth = measure_bandwidth(copy_bytes, repeats, on_step)
    flops = measure_matmul(gemm_n, repeats, on_step)
    overhead = measure_tile_overhead()
    if on_step:
        on_step("tile overhead", 1, 1)
    l2 = _cache_bytes(2)
    l3 = _cache_bytes(3)
    onchip = l2 or base.onchip_bytes_per_worker
    return base.model_copy(
        update={
            "workers": _workers(),
            "bandwidth_bytes_per_s": max(1, bandwidth),
            "peak_flops_per_s": {
                "bf16": max(1, flops),
                "fp8": max(1, flops),
                "fp32": max(1, flops),
            },
            "l2_bytes": l3 or l2 or base.l2_bytes,
            "onchip_bytes_per_worker": onchip,
            "page_bytes": min(base.page_bytes, onchip),
            "tile_overhead_ns": overhead,
            "comment": (
                f"Calibrated on this machine ({time.strftime('%Y-%m-%d')}): copy bandwidth best of "
                f"{repeats} x {copy_bytes >> 20} MiB numpy copies (read+write), fp32 GEMM "
                f"{gemm_n}^3 best of {repeats}; bf16/fp8 at the fp32 rate (the CPU executor "
                "computes in fp32); tile overhead = mean tiny numpy matmul; caches from sysfs."
            ),
        }
    )


def _machine_fingerprint() -> str:
    """What a calibration is valid for: the CPU model, the usable cores, the memory size."""
    import hashlib
    import platform

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    key = f"{model}|{_workers()}|{mem >> 30}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def cached_cpu_target(cache: Path, on_note: Callable[[str], None] | None = None) -> Target:
    """This machine's calibrated `cpu` target: measured once (a few seconds), then read from
    `cache/targets/cpu-<machine>.json`. A damaged cache file is measured again (it is ours)."""
    path = cache / "targets" / f"cpu-{_machine_fingerprint()}.json"
    if path.is_file():
        try:
            return Target.model_validate_json(path.read_text())
        except ValueError:
            pass
    tgt = calibrate_cpu(repeats=3, copy_bytes=128 * 1024 * 1024, gemm_n=768)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(tgt.model_dump_json(indent=2) + "\n")
    tmp.replace(path)  # atomic: concurrent first uses agree on one file
    if on_note:
        on_note(
            f"calibrated the cpu target once ({tgt.workers} workers, "
            f"{tgt.bandwidth_bytes_per_s / 1e9:.1f} GB/s): {path}"
        )
    return tgt
