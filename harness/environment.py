"""What a run records about itself: software versions, git commit, machine, calibration."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
from pydantic import BaseModel

_REPO = Path(__file__).resolve().parents[1]
_PACKAGES = ("numpy", "torch", "transformers", "pydantic", "pandas", "matplotlib", "plow")


class GitInfo(BaseModel):
    commit: str | None
    short: str
    dirty: bool | None


class Calibration(BaseModel):
    """Measured on this run (best of `repeats`): numpy copy bandwidth (read + write counted)
    and an fp32 GEMM rate. `source` names the measuring functions."""

    bandwidth_bytes_per_s: int
    matmul_flops_per_s: int
    copy_bytes: int
    gemm_n: int
    repeats: int
    seconds: float
    source: str


class Environment(BaseModel):
    python: str
    platform: str
    packages: dict[str, str | None]
    git: GitInfo
    cpu_model: str
    cpu_count: int
    gpu_model: str | None
    blas_threads: str | None
    calibration: Calibration | None = None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_info(repo: Path = _REPO) -> GitInfo:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(repo), *args],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return GitInfo(
        commit=commit,
        short=commit[:7] if commit else "nogit",
        dirty=None if status is None else bool(status),
    )


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_model() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [x.strip() for x in out.stdout.splitlines() if x.strip()]
    return ", ".join(names) if out.returncode == 0 and names else None


def cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def environment() -> Environment:
    return Environment(
        python=platform.python_version(),
        platform=platform.platform(),
        packages={p: _version(p) for p in _PACKAGES},
        git=git_info(),
        cpu_model=cpu_model(),
        cpu_count=cpu_count(),
        gpu_model=gpu_model(),
        blas_threads=os.environ.get("OMP_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS"),
    )


def _openblas() -> tuple[Any, Any, str] | None:
    """numpy's bundled OpenBLAS: (set_num_threads, get_num_threads, library name), or None."""
    import ctypes
    import glob

    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for lib in sorted(glob.glob(str(libs / "*openblas*"))):
        try:
            h = ctypes.CDLL(lib)  # already loaded by numpy: the same handle
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", ""), ("openblas", "64_")):
            set_ = getattr(h, f"{prefix}_set_num_threads{suffix}", None)
            get_ = getattr(h, f"{prefix}_get_num_threads{suffix}", None)
            if set_ is not None and get_ is not None:
                set_.argtypes = [ctypes.c_int]
                get_.restype = ctypes.c_int
                return set_, get_, Path(lib).name
    return None


@contextlib.contextmanager
def blas_threads(n: int | None) -> Iterator[str | None]:
    """Run the block with numpy's BLAS limited to `n` threads (None: leave it); yields what
    was set, for the record (None when nothing was changed or no OpenBLAS was found); the
    previous count is restored afterwards."""
    found = _openblas() if n is not None else None
    if found is None:
        yield None
        return
    set_, get_, name = found
    before = int(get_())
    set_(n)
    try:
        yield f"{n} (set by the workload; {name}, was {before})"
    finally:
        set_(before)


Measure = Callable[[int, int], int]


def _local_bandwidth(size_bytes: int, repeats: int) -> int:
    src = np.ones(size_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return int(2 * src.nbytes / best)


def _local_matmul(n: int, repeats: int) -> int:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    _ = a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _ = a @ b
        best = min(best, time.perf_counter() - t0)
    return int(2 * n**3 / best)


def _measurers() -> tuple[Measure, Measure, str]:
    """`plow calibrate target cpu`'s measuring functions when present, else local copies."""
    try:
        mod: Any = importlib.import_module("plow.target.calibrate")
        bw = cast(Measure, mod.measure_bandwidth)
        mm = cast(Measure, mod.measure_matmul)
        return bw, mm, "plow.target.calibrate.measure_bandwidth / measure_matmul"
    except (ImportError, AttributeError):
        return _local_bandwidth, _local_matmul, "harness.environment (local copy / GEMM)"


def calibrate(copy_bytes: int = 64 << 20, gemm_n: int = 512, repeats: int = 3) -> Calibration:
    """A short calibration of this run's machine (a few seconds)."""
    bw_fn, mm_fn, source = _measurers()
    t0 = time.perf_counter()
    bw = bw_fn(copy_bytes, repeats)
    flops = mm_fn(gemm_n, repeats)
    return Calibration(
        bandwidth_bytes_per_s=bw,
        matmul_flops_per_s=flops,
        copy_bytes=copy_bytes,
        gemm_n=gemm_n,
        repeats=repeats,
        seconds=round(time.perf_counter() - t0, 3),
        source=source,
    )
