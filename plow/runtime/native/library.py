"""The native kernel's shared library (`kernels/`, built by `make native`) and its C ABI
(`kernels/plow_abi.h`) as ctypes structures.

The library is looked up as `$PLOW_NATIVE_LIB`, else `_build/native/libplow_native.so` under
the repository root (the ThreadSanitizer build: `libplow_native_tsan.so`, `make tsan`).
ctypes releases the GIL for the whole of every foreign call, so a step runs with Python
out of the way.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

from plow.errors import PlowError

ABI_VERSION = 3  # 3: op kind allreduce (kernels/collective.h)
ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "_build" / "native"
LIBRARIES = {"release": "libplow_native.so", "tsan": "libplow_native_tsan.so"}

# Op kinds (kernels/plow_abi.h `PlowKind`)
KINDS = {
    "embedding": 1,
    "rmsnorm": 2,
    "rope": 3,
    "linear": 4,
    "lm_head": 5,
    "attention": 6,
    "gated_mlp": 7,
    "residual_add": 8,
    "sample": 9,
}
DTYPE_NONE, DTYPE_F32, DTYPE_BF16 = 0, 1, 2

_I64_3 = ctypes.c_int64 * 3
_I64_8 = ctypes.c_int64 * 8
_F32_8 = ctypes.c_float * 8


class NativeUnavailable(PlowError):
    """The native library is missing or does not match this plow."""

    exit_code = 2


class PlowOp(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("opcode", ctypes.c_int32),
        ("red_axis", ctypes.c_int32),
        ("naxes", ctypes.c_int32),
        ("ext", _I64_3),
        ("tile", _I64_3),
        ("steps", _I64_3),
        ("t", _I64_8),
        ("d", _I64_8),
        ("f", _F32_8),
        ("w0", ctypes.c_void_p),
        ("w1", ctypes.c_void_p),
        ("w0_dtype", ctypes.c_int32),
        ("w1_dtype", ctypes.c_int32),
        ("table", ctypes.c_void_p),
        ("merge", ctypes.c_void_p),
        ("n_merge", ctypes.c_int64),
    ]


class PlowPlan(ctypes.Structure):
    _fields_ = [
        ("abi", ctypes.c_int32),
        ("n_workers", ctypes.c_int32),
        ("n_records", ctypes.c_int64),
        ("records", ctypes.c_void_p),
        ("n_ops", ctypes.c_int64),
        ("ops", ctypes.c_void_p),
        ("n_counters", ctypes.c_int64),
        ("kv_off", ctypes.c_int64),
        ("kv_layers", ctypes.c_int64),
        ("kv_blocks", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("kv_block", ctypes.c_int64),
        ("kv_dim", ctypes.c_int64),
        ("page_table", ctypes.c_int64),
        ("page_cols", ctypes.c_int64),
        ("fused_lm", ctypes.c_int32),
        ("fused_sample", ctypes.c_int32),
        ("n_chunks", ctypes.c_int64),
        ("bounds", ctypes.c_void_p),
        ("fused_values", ctypes.c_int64),
        ("fused_index", ctypes.c_int64),
        ("kv_dtype", ctypes.c_int32),
        ("kv_halves", ctypes.c_int32),
    ]


class PlowRow(ctypes.Structure):
    _fields_ = [
        ("active", ctypes.c_int32),
        ("greedy", ctypes.c_int32),
        ("temperature", ctypes.c_float),
        ("top_p", ctypes.c_float),
        ("min_p", ctypes.c_float),
        ("top_k", ctypes.c_int32),
        ("n_stop", ctypes.c_int32),
        ("stop", ctypes.c_void_p),
        ("uniforms", ctypes.c_void_p),
    ]


class PlowQuantum(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "out", "positions", "sample_index", "ring", "remaining", "logits",
            "batch", "tokens", "vocab", "context",
        )
    ]  # fmt: skip


def library_path(build: str = "release") -> Path:
    env = os.environ.get("PLOW_NATIVE_LIB") if build == "release" else None
    return Path(env) if env else BUILD / LIBRARIES[build]


@cache
def load(build: str = "release") -> ctypes.CDLL:
    """The loaded library (`NativeUnavailable` naming the path and the fix when it is not
    built or is from another ABI)."""
    path = library_path(build)
    if not path.is_file():
        target = "make tsan" if build == "tsan" else "make native"
        raise NativeUnavailable(path, f"the native library is not built (run `{target}`)")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(path, f"cannot load the native library: {e}") from e
    lib.plow_build_info.restype = ctypes.c_char_p
    info = lib.plow_build_info().decode()
    if f"abi {ABI_VERSION}" not in info:
        raise NativeUnavailable(path, f"built for another ABI ({info}); rebuild: make native")
    lib.plow_plan_new.restype = ctypes.c_void_p
    lib.plow_plan_new.argtypes = [ctypes.POINTER(PlowPlan), ctypes.c_char_p, ctypes.c_int64]
    lib.plow_plan_free.restype = None
    lib.plow_plan_free.argtypes = [ctypes.c_void_p]
    lib.plow_plan_dispatch.restype = ctypes.c_int32
    lib.plow_plan_dispatch.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int64,
    ]
    lib.plow_plan_quantum.restype = ctypes.c_int32
    lib.plow_plan_quantum.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.POINTER(PlowQuantum),
        ctypes.POINTER(PlowRow),
        ctypes.c_char_p,
        ctypes.c_int64,
    ]
    lib.plow_plan_last_counts.restype = None
    lib.plow_plan_last_counts.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
    lib.plow_plan_work.restype = None
    lib.plow_plan_work.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.plow_plan_profile.restype = None
    lib.plow_plan_profile.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
    return lib


def available(build: str = "release") -> bool:
    try:
        load(build)
    except NativeUnavailable:
        return False
    return True


def build_info(build: str = "release") -> str:
    return str(load(build).plow_build_info().decode())
