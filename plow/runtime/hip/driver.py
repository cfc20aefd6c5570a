"""The HIP runtime's module API through ctypes (`libamdhip64.so`; no hip-python, no vendor
BLAS): the AMD counterpart of `plow.runtime.cuda.driver.Device`, with the same methods, so the
CUDA executor's machine (`plow.runtime.cuda.model.CudaMachine`) runs `kernels/device.cu`'s
HIP build (`make hip`: one code object per architecture) unchanged.

Calls: hipInit, hipGetDeviceCount, hipSetDevice, hipDeviceGetAttribute, hipDeviceGetName,
hipStreamCreateWithFlags, hipMalloc / hipFree, hipMemcpy{HtoD,DtoH,DtoD}Async,
hipMemsetD8Async, hipStreamSynchronize, hipModuleLoadData, hipModuleGetFunction,
hipFuncGetAttribute, hipModuleOccupancyMaxActiveBlocksPerMultiprocessor,
hipModuleLaunchKernel, hipEvent*; hipModuleLaunchCooperativeKernel where the runtime exports
it (ROCm 6; Debian's 5.2 does not). Every call goes through `check` (a `HipError` naming the
call and `hipGetErrorName`); no library, no driver or no GPU is `HipUnavailable` (exit 2).

The attribute numbers are hip_runtime_api.h's (checked against the installed header by
tests/runtime/test_hip.py). Not run on an AMD GPU yet: nothing here has seen one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache
from typing import Any

from plow.runtime.cuda.driver import CudaError, CudaUnavailable

# hipDeviceAttribute_t (hip_runtime_api.h, ROCm 5.2)
ATTR_MULTIPROCESSOR_COUNT = 63
ATTR_COOPERATIVE_LAUNCH = 10
ATTR_MAX_SHARED_MEMORY_PER_BLOCK = 74
ATTR_WARP_SIZE = 87
FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1  # hipFunction_attribute
STREAM_NON_BLOCKING = 1
HIP_SUCCESS = 0
ERROR_NO_BINARY_FOR_GPU = 209  # hipErrorNoBinaryForGpu

# name -> (restype, argtypes): every entry point the loader calls
_P = ctypes.c_void_p
_SIG: dict[str, list[Any]] = {
    "hipInit": [ctypes.c_uint],
    "hipGetDeviceCount": [ctypes.POINTER(ctypes.c_int)],
    "hipSetDevice": [ctypes.c_int],
    "hipDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "hipDeviceGetName": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
    "hipStreamCreateWithFlags": [ctypes.POINTER(_P), ctypes.c_uint],
    "hipStreamSynchronize": [_P],
    "hipMalloc": [ctypes.POINTER(_P), ctypes.c_size_t],
    "hipFree": [_P],
    "hipMemcpyHtoDAsync": [_P, _P, ctypes.c_size_t, _P],
    "hipMemcpyDtoHAsync": [_P, _P, ctypes.c_size_t, _P],
    "hipMemcpyDtoDAsync": [_P, _P, ctypes.c_size_t, _P],
    "hipMemsetD8Async": [_P, ctypes.c_ubyte, ctypes.c_size_t, _P],
    "hipModuleLoadData": [ctypes.POINTER(_P), _P],
    "hipModuleGetFunction": [ctypes.POINTER(_P), _P, ctypes.c_char_p],
    "hipFuncGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, _P],
    "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor": [
        ctypes.POINTER(ctypes.c_int), _P, ctypes.c_int, ctypes.c_size_t,
    ],
    "hipModuleLaunchKernel": [
        _P, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
        ctypes.c_uint, ctypes.c_uint, _P, _P, _P,
    ],
    "hipEventCreate": [ctypes.POINTER(_P)],
    "hipEventRecord": [_P, _P],
    "hipEventSynchronize": [_P],
    "hipEventElapsedTime": [ctypes.POINTER(ctypes.c_float), _P, _P],
}  # fmt: skip

# bound when the runtime exports them (a persistent launch is cooperative only where it can be)
_OPTIONAL_SIG = {
    "hipModuleLaunchCooperativeKernel": [
        _P, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
        ctypes.c_uint, ctypes.c_uint, _P, _P,
    ],
}  # fmt: skip


class HipUnavailable(CudaUnavailable):
    """The HIP runtime library, an AMD GPU or the compiled code object is missing."""


class HipError(CudaError):
    """A HIP call failed."""


def library_names() -> list[str]:
    env = os.environ.get("PLOW_HIP_LIBRARY")
    found = ctypes.util.find_library("amdhip64")
    return [n for n in (env, found, "libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5") if n]


@cache
def library() -> ctypes.CDLL:
    """`libamdhip64` with the loader's signatures, or `HipUnavailable`."""
    errors = []
    for name in library_names():
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as e:
            errors.append(str(e).splitlines()[0][:120])
    else:
        raise HipUnavailable(
            "libamdhip64", "the HIP runtime is not installed (ROCm; Debian: libamdhip64-5)"
        )
    missing = [n for n in _SIG if not hasattr(lib, n)]
    if missing:
        raise HipUnavailable("libamdhip64", f"lacks {', '.join(missing)}")
    for n, args in _SIG.items():
        f = getattr(lib, n)
        f.restype, f.argtypes = ctypes.c_int, args
    for n, args in _OPTIONAL_SIG.items():
        if hasattr(lib, n):
            f = getattr(lib, n)
            f.restype, f.argtypes = ctypes.c_int, args
    lib.hipGetErrorName.restype, lib.hipGetErrorName.argtypes = ctypes.c_char_p, [ctypes.c_int]
    return lib


def check(err: int, what: str) -> None:
    if err != HIP_SUCCESS:
        name = library().hipGetErrorName(err) or b"?"
        raise HipError(what, f"HIP returned {name.decode()} ({err})")


class HipDevice:
    """One AMD GPU: current device, a non-blocking stream, its attributes (the methods of
    `plow.runtime.cuda.driver.Device`)."""

    def __init__(self, ordinal: int = 0) -> None:
        lib = library()
        self.lib = lib
        err = lib.hipInit(0)
        if err != HIP_SUCCESS:
            name = (lib.hipGetErrorName(err) or b"?").decode()
            raise HipUnavailable("GPU", f"hipInit failed ({name}): no usable AMD GPU")
        n = ctypes.c_int(0)
        if lib.hipGetDeviceCount(ctypes.byref(n)) != HIP_SUCCESS or n.value == 0:
            raise HipUnavailable("GPU", "no AMD GPU visible (hipGetDeviceCount = 0)")
        if not 0 <= ordinal < n.value:
            raise HipUnavailable("GPU", f"device {ordinal} does not exist ({n.value} GPUs)")
        self.ordinal = ordinal
        self.current()
        self.sms = self.attr(ATTR_MULTIPROCESSOR_COUNT)  # compute units
        self.cc = (0, 0)  # no NVIDIA compute capability: no tensor-core tiles on HIP
        # a cooperative launch needs the module entry point (ROCm 6) and the device's support;
        # without it the launch is a plain one and residency is checked before it
        self.cooperative = hasattr(lib, "hipModuleLaunchCooperativeKernel") and bool(
            self.attr(ATTR_COOPERATIVE_LAUNCH)
        )
        self.warp_size = self.attr(ATTR_WARP_SIZE)
        buf = ctypes.create_string_buffer(256)
        check(lib.hipDeviceGetName(buf, 256, ordinal), "hipDeviceGetName")
        self.name = buf.value.decode(errors="replace")
        s = ctypes.c_void_p()
        check(lib.hipStreamCreateWithFlags(ctypes.byref(s), STREAM_NON_BLOCKING), "hipStreamCreate")
        self.stream = s

    def attr(self, a: int) -> int:
        v = ctypes.c_int(0)
        check(self.lib.hipDeviceGetAttribute(ctypes.byref(v), a, self.ordinal), f"attribute {a}")
        return int(v.value)

    def current(self) -> None:
        check(self.lib.hipSetDevice(self.ordinal), "hipSetDevice")

    # -- memory ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        check(self.lib.hipMalloc(ctypes.byref(p), max(1, int(nbytes))), f"hipMalloc({nbytes})")
        return int(p.value or 0)

    def free(self, dptr: int) -> None:
        check(self.lib.hipFree(dptr), "hipFree")

    def htod(self, dptr: int, host: int, nbytes: int) -> None:
        if nbytes:
            check(self.lib.hipMemcpyHtoDAsync(dptr, host, nbytes, self.stream), "hipMemcpyHtoD")

    def dtoh(self, host: int, dptr: int, nbytes: int) -> None:
        if nbytes:
            check(self.lib.hipMemcpyDtoHAsync(host, dptr, nbytes, self.stream), "hipMemcpyDtoH")

    def dtod(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            check(self.lib.hipMemcpyDtoDAsync(dst, src, nbytes, self.stream), "hipMemcpyDtoD")

    def memset(self, dptr: int, nbytes: int) -> None:
        if nbytes:
            check(self.lib.hipMemsetD8Async(dptr, 0, nbytes, self.stream), "hipMemsetD8Async")

    def sync(self) -> None:
        check(self.lib.hipStreamSynchronize(self.stream), "hipStreamSynchronize")

    # -- modules and launches ---------------------------------------------------------------
    def load_module(self, image: bytes, where: str) -> Any:
        buf = ctypes.create_string_buffer(image, len(image))
        m = ctypes.c_void_p()
        err = self.lib.hipModuleLoadData(ctypes.byref(m), buf)
        if err != HIP_SUCCESS:
            name = (self.lib.hipGetErrorName(err) or b"?").decode()
            hint = " (built for another architecture)" if err == ERROR_NO_BINARY_FOR_GPU else ""
            raise HipUnavailable(where, f"hipModuleLoadData failed ({name}){hint}")
        return m

    def function(self, module: Any, name: str) -> Any:
        f = ctypes.c_void_p()
        check(self.lib.hipModuleGetFunction(ctypes.byref(f), module, name.encode()), name)
        return f

    def occupancy(self, func: Any, threads: int, smem: int = 0) -> int:
        v = ctypes.c_int(0)
        check(
            self.lib.hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(v), func, threads, smem
            ),
            "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor",
        )
        return int(v.value)

    def max_dynamic_smem(self, func: Any) -> int:
        """LDS one workgroup may take dynamically: the per-block maximum less the static LDS
        (AMD has no opt-in step)."""
        v = ctypes.c_int(0)
        check(
            self.lib.hipFuncGetAttribute(ctypes.byref(v), FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func),
            "hipFuncGetAttribute(SHARED_SIZE_BYTES)",
        )
        return max(0, self.attr(ATTR_MAX_SHARED_MEMORY_PER_BLOCK) - int(v.value))

    def set_dynamic_smem(self, func: Any, nbytes: int) -> None:
        """Nothing to allow on AMD (any size up to `max_dynamic_smem` launches)."""

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
        """One launch; `params_address` is the `void*[]` of `abi.pack_params`. A persistent
        launch (workgroups waiting on each other's counters) is cooperative where the runtime
        and the device allow it, so the runtime refuses a grid that cannot be resident at
        once; elsewhere it is a plain launch, and the machine has already refused a plan with
        more workers than resident workgroups."""
        if persistent and self.cooperative:
            check(
                self.lib.hipModuleLaunchCooperativeKernel(
                    func, grid, 1, 1, block, 1, 1, shmem, self.stream, params_address
                ),
                "hipModuleLaunchCooperativeKernel",
            )
            return
        check(
            self.lib.hipModuleLaunchKernel(
                func, grid, 1, 1, block, 1, 1, shmem, self.stream, params_address, None
            ),
            "hipModuleLaunchKernel",
        )

    # -- timing -----------------------------------------------------------------------------
    def event(self) -> Any:
        e = ctypes.c_void_p()
        check(self.lib.hipEventCreate(ctypes.byref(e)), "hipEventCreate")
        return e

    def record(self, ev: Any) -> None:
        check(self.lib.hipEventRecord(ev, self.stream), "hipEventRecord")

    def elapsed_ms(self, start: Any, end: Any) -> float:
        check(self.lib.hipEventSynchronize(end), "hipEventSynchronize")
        ms = ctypes.c_float(0.0)
        check(self.lib.hipEventElapsedTime(ctypes.byref(ms), start, end), "hipEventElapsedTime")
        return float(ms.value)


@cache
def device(ordinal: int = 0) -> HipDevice:
    return HipDevice(ordinal)


def amd_gpu_present() -> bool:
    """An AMD GPU is visible to this process (the kernel driver's node), without loading
    HIP: what the `gpu` HIP tests skip on."""
    return os.path.exists("/dev/kfd") and os.path.isdir("/dev/dri")
