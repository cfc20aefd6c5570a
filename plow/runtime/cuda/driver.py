"""The CUDA driver API through cuda-python's bindings (`cuda.bindings.driver`), imported lazily:
plow does not depend on cuda-python, and nothing here runs until the CUDA executor is asked
for. No runtime API, no vendor libraries: context, module, memory, stream, launch.

Every driver call goes through `check`, so a failing call is a `CudaError` naming the call and
the driver's error name (one line). No GPU, no driver or no cuda-python is `CudaUnavailable`
(exit 2) with the fix.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
import subprocess
from functools import cache
from typing import Any

from plow.errors import PlowError


class CudaUnavailable(PlowError):
    """cuda-python, the NVIDIA driver, a GPU or the compiled module is missing."""

    exit_code = 2


class CudaError(PlowError):
    """A driver call failed."""

    exit_code = 2


def gpu_present() -> bool:
    """An NVIDIA GPU is visible to this process (its device node, or `nvidia-smi -L`), without
    touching the driver API: what the `gpu` tests skip on."""
    if os.path.exists("/dev/nvidia0"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and "GPU" in r.stdout


@cache
def bindings() -> Any:
    """`cuda.bindings.driver` (cuda-python >= 12.6; `cuda.cuda` before), or `CudaUnavailable`."""
    for name in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise CudaUnavailable(
        "cuda-python", "not installed; the cuda executor needs it: pip install cuda-python"
    )


def check(result: Any, what: str) -> Any:
    """The values of a driver call's `(CUresult, *values)` tuple; `CudaError` unless
    CUDA_SUCCESS. One value comes back bare, none as None."""
    d = bindings()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != d.CUresult.CUDA_SUCCESS:
        try:
            name = d.cuGetErrorName(err)[1].decode()
        except Exception:  # pragma: no cover - the name lookup itself failing
            name = str(err)
        raise CudaError(what, f"the driver returned {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


class Device:
    """One GPU: its primary context made current, a non-blocking stream, its attributes."""

    def __init__(self, ordinal: int = 0) -> None:
        d = bindings()
        self.d = d
        try:
            err = d.cuInit(0)
        except Exception as e:  # the driver library itself is missing (no NVIDIA driver)
            raise CudaUnavailable(
                "GPU", f"no NVIDIA driver ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
            ) from e
        err0 = err[0] if isinstance(err, tuple) else err
        if err0 != d.CUresult.CUDA_SUCCESS:
            name = check(d.cuGetErrorName(err0), "cuGetErrorName").decode()
            raise CudaUnavailable("GPU", f"cuInit failed ({name}): no usable NVIDIA GPU")
        count = int(check(d.cuDeviceGetCount(), "cuDeviceGetCount"))
        if count == 0:
            raise CudaUnavailable("GPU", "no NVIDIA GPU visible (cuDeviceGetCount = 0)")
        if not 0 <= ordinal < count:
            raise CudaUnavailable("GPU", f"device {ordinal} does not exist ({count} GPUs)")
        self.ordinal = ordinal
        self.dev = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ctx = check(d.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        check(d.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        a = d.CUdevice_attribute
        self.sms = self.attr(a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.cc = (
            self.attr(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self.attr(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        )
        self.cooperative = bool(self.attr(a.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH))
        raw = check(d.cuDeviceGetName(256, self.dev), "cuDeviceGetName")
        self.name = bytes(raw).split(b"\0")[0].decode(errors="replace")
        flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.stream = check(d.cuStreamCreate(int(flags)), "cuStreamCreate")

    def attr(self, a: Any) -> int:
        return int(check(self.d.cuDeviceGetAttribute(a, self.dev), f"cuDeviceGetAttribute {a}"))

    def current(self) -> None:
        check(self.d.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    # -- memory ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        return int(check(self.d.cuMemAlloc(max(1, int(nbytes))), f"cuMemAlloc({nbytes})"))

    def free(self, dptr: int) -> None:
        check(self.d.cuMemFree(dptr), "cuMemFree")

    def htod(self, dptr: int, host: int, nbytes: int) -> None:
        """Host address → device, ordered on the stream (the host buffer is pageable: the copy
        is staged before the call returns)."""
        if nbytes:
            check(self.d.cuMemcpyHtoDAsync(dptr, host, nbytes, self.stream), "cuMemcpyHtoDAsync")

    def dtoh(self, host: int, dptr: int, nbytes: int) -> None:
        if nbytes:
            check(self.d.cuMemcpyDtoHAsync(host, dptr, nbytes, self.stream), "cuMemcpyDtoHAsync")

    def dtod(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            check(self.d.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def memset(self, dptr: int, nbytes: int) -> None:
        if nbytes:
            check(self.d.cuMemsetD8Async(dptr, 0, nbytes, self.stream), "cuMemsetD8Async")

    def sync(self) -> None:
        check(self.d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    # -- modules and launches ---------------------------------------------------------------
    def load_module(self, image: bytes, where: str) -> Any:
        """`cuModuleLoadData` of a cubin / fatbin / PTX image."""
        d = self.d
        buf = ctypes.create_string_buffer(image, len(image) + 1)  # NUL-terminated for PTX
        res = d.cuModuleLoadData(ctypes.addressof(buf))
        err = res[0]
        if err != d.CUresult.CUDA_SUCCESS:
            name = check(d.cuGetErrorName(err), "cuGetErrorName").decode()
            hint = ""
            if "NO_BINARY_FOR_GPU" in name:
                hint = (
                    f": it has no code for this GPU ({self.name}, compute capability "
                    f"{self.cc[0]}.{self.cc[1]}); rebuild with make cuda "
                    f"CUDA_ARCH=sm_{self.cc[0]}{self.cc[1]}a"
                )
            raise CudaUnavailable(where, f"cuModuleLoadData failed ({name}){hint}")
        return res[1]

    def function(self, module: Any, name: str) -> Any:
        return check(self.d.cuModuleGetFunction(module, name.encode()), f"function {name}")

    def occupancy(self, func: Any, threads: int, smem: int = 0) -> int:
        """CTAs of `func` that fit on one SM at once (with `smem` bytes of dynamic shared
        memory each)."""
        return int(
            check(
                self.d.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, threads, smem),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )
        )

    def max_dynamic_smem(self, func: Any) -> int:
        """Dynamic shared memory one CTA of `func` may ask for: the device's opt-in maximum
        per block less the kernel's static shared memory."""
        d = self.d
        optin = self.attr(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        )
        static = int(
            check(
                d.cuFuncGetAttribute(
                    d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func
                ),
                "cuFuncGetAttribute(SHARED_SIZE_BYTES)",
            )
        )
        return max(0, optin - static)

    def set_dynamic_smem(self, func: Any, nbytes: int) -> None:
        """Allow launches of `func` with `nbytes` of dynamic shared memory (over 48 KiB needs
        the opt-in)."""
        d = self.d
        attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(d.cuFuncSetAttribute(func, attr, int(nbytes)), f"cuFuncSetAttribute({nbytes})")

    def launch(
        self,
        func: Any,
        grid: int,
        block: int,
        params_address: int,
        *,
        persistent: bool = True,
        shmem: int = 0,
    ) -> None:
        """One launch of `grid` CTAs of `block` threads; `params_address` is a `void*[]` (see
        `abi.pack_params`). A persistent kernel's launch (CTAs waiting on each other's
        counters) is cooperative where the device supports it: the driver then refuses a grid
        whose CTAs cannot all be resident at once."""
        d = self.d
        if persistent and self.cooperative:
            check(
                d.cuLaunchCooperativeKernel(
                    func, grid, 1, 1, block, 1, 1, shmem, self.stream, params_address
                ),
                "cuLaunchCooperativeKernel",
            )
        else:
            check(
                d.cuLaunchKernel(
                    func, grid, 1, 1, block, 1, 1, shmem, self.stream, params_address, 0
                ),
                "cuLaunchKernel",
            )

    # -- timing -----------------------------------------------------------------------------
    def event(self) -> Any:
        return check(self.d.cuEventCreate(0), "cuEventCreate")

    def record(self, ev: Any) -> None:
        check(self.d.cuEventRecord(ev, self.stream), "cuEventRecord")

    def elapsed_ms(self, start: Any, end: Any) -> float:
        check(self.d.cuEventSynchronize(end), "cuEventSynchronize")
        return float(check(self.d.cuEventElapsedTime(start, end), "cuEventElapsedTime"))


@cache
def device(ordinal: int = 0) -> Device:
    """The process's `Device` for `ordinal` (one context and stream per GPU, made once)."""
    return Device(ordinal)
