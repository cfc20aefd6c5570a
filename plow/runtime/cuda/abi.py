"""The device ABI of `kernels/device.cu` beyond `kernels/plow_abi.h`: the kernel's parameter
list (what the loader packs for `cuLaunchKernel`, in order), the status word the kernel writes,
and the constants the module exports in `plow_device_config`.

Nothing here needs a GPU or cuda-python: the parameter list is checked against the compiled
module (the PTX `.entry` signature and the cubin's `.nv.info` parameter table) by
tests/runtime/test_cuda.py, and against `plow_device_config` by the loader when it loads the
module.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plow.runtime.native.library import ABI_VERSION, PlowOp, PlowPlan, PlowQuantum, PlowRow

KERNEL = "plow_step"
CONFIG_SYMBOL = "plow_device_config"
CONFIG_KERNEL = "plow_config"  # writes CONFIG_SYMBOL's 8 words to its one pointer argument
DEVICE_ABI = 3  # 3: the page table has 8 words per record (weight windows)
BLOCK_THREADS = 256
ATTN_THREADS = 32
LANES = 32
NO_COUNTER = 0xFFFFFFFF
BARRIER_COUNTER = 0xFFFFFFFE  # status.counter of a timed-out step barrier (a quantum launch)
ABORT_NO_TILE = 2  # status.abort: a record's op kind has no tile in the device build
MODE_TC = 1  # op_mode bit: a bf16 linear / lm_head on tensor cores (mma.sync m16n8k16)
# The NVIDIA targets whose plans the CUDA executor runs (plow/target/specs).
NVIDIA_TARGETS = ("h100", "h200", "b200")

# plow_step's parameters in order: (name, ctypes type). Pointers are device addresses.
PARAMS: tuple[tuple[str, Any], ...] = (
    ("plan", ctypes.c_uint64),
    ("arena", ctypes.c_uint64),
    ("counters", ctypes.c_uint64),
    ("per_step", ctypes.c_uint64),
    ("counter_scope", ctypes.c_uint64),
    ("queue", ctypes.c_uint64),
    ("queue_start", ctypes.c_uint64),
    ("scratch", ctypes.c_uint64),
    ("scratch_floats", ctypes.c_int64),
    ("op_work", ctypes.c_uint64),
    ("status", ctypes.c_uint64),
    ("step", ctypes.c_uint64),
    ("timeout_ns", ctypes.c_uint64),
    ("jitter_ns", ctypes.c_uint32),
    ("op_mode", ctypes.c_uint64),  # u8 per op (MODE_TC), or 0
    ("pages", ctypes.c_uint64),  # int32 [8] per record (image.PageTable.device_table), or 0
    ("quantum", ctypes.c_uint64),  # DeviceQuantum, or 0 (one step)
    ("n_steps", ctypes.c_uint32),
)


class DeviceStatus(ctypes.Structure):
    """`PlowDeviceStatus` (kernels/device.cu)."""

    _fields_ = [
        ("abort", ctypes.c_uint32),
        ("worker", ctypes.c_uint32),
        ("packet", ctypes.c_int64),
        ("counter", ctypes.c_uint32),
        ("scope", ctypes.c_uint32),
        ("value", ctypes.c_uint64),
        ("want", ctypes.c_uint64),
        ("tasks", ctypes.c_uint64),
        ("nops", ctypes.c_uint64),
    ]


class DeviceQuantum(ctypes.Structure):
    """`PlowDeviceQuantum` (kernels/device.cu): a multi-step quantum in one launch — the
    epilogue's arena words and shape, the rows (device pointers), the step barrier's counters
    (zeroed before each launch), the stochastic rows' sampler scratch (device pointer)."""

    _fields_ = [
        ("q", PlowQuantum),
        ("rows", ctypes.c_uint64),
        ("arrive", ctypes.c_uint64),
        ("go", ctypes.c_uint64),
        ("sampler", ctypes.c_uint64),
    ]


DeviceRow = PlowRow  # `stop` and `uniforms` device pointers


def sampler_scratch_bytes(vocab: int, threads: int = 0) -> int:
    """Bytes of the device sampler's scratch for one row (kernels/device_sampler.h's
    sampler_scratch_bytes: z, p, the sort's keys and ids over the next power of two, the
    threads' partials and crossings, the survivors)."""
    t = threads or BLOCK_THREADS
    n2 = 1 << max(0, int(vocab) - 1).bit_length()
    keep = (vocab + 7) // 8 * 8
    return 8 * vocab + 8 * vocab + 8 * n2 + 4 * n2 + 8 * (t + 1) + 8 * (2 * t) + keep


def expected_config() -> tuple[int, ...]:
    """`plow_device_config` as this loader expects it (device.cu's order)."""
    return (
        DEVICE_ABI,
        ABI_VERSION,
        BLOCK_THREADS,
        ATTN_THREADS,
        ctypes.sizeof(PlowPlan),
        ctypes.sizeof(PlowOp),
        ctypes.sizeof(DeviceStatus),
        LANES,
    )


CONFIG_NAMES = (
    "device ABI",
    "plan ABI",
    "block threads",
    "attention threads",
    "sizeof(PlowPlan)",
    "sizeof(PlowOp)",
    "sizeof(PlowDeviceStatus)",
    "lanes",
)


def config_mismatch(got: Sequence[int]) -> str | None:
    """None when the module's `plow_device_config` is this loader's, else what differs."""
    want = expected_config()
    bad = [
        f"{n} {g} (loader: {w})"
        for n, g, w in zip(CONFIG_NAMES, got, want, strict=False)
        if int(g) != w
    ]
    if len(got) != len(want):
        bad.append(f"{len(got)} config words (loader: {len(want)})")
    return "; ".join(bad) or None


@dataclass
class KernelArgs:
    """The `void*[]` array `cuLaunchKernel` takes: one pointer per parameter, each to a ctypes
    scalar holding the value (kept alive here with the array)."""

    values: list[Any] = field(default_factory=list)
    array: Any = None

    @property
    def address(self) -> int:
        return int(ctypes.addressof(self.array))

    def read_back(self) -> dict[str, int]:
        """The value each slot points at (tests: what the driver will copy)."""
        out = {}
        for i, (name, ct) in enumerate(PARAMS):
            out[name] = int(ct.from_address(int(self.array[i])).value)
        return out


def pack_values(typed: Sequence[tuple[Any, int]]) -> KernelArgs:
    """A `void*[]` of (ctypes type, value) in order (any kernel's parameters)."""
    args = KernelArgs()
    for ct, v in typed:
        args.values.append(ct(int(v)))
    args.array = (ctypes.c_void_p * max(1, len(typed)))(*[ctypes.addressof(v) for v in args.values])
    return args


def pack_params(values: Mapping[str, int]) -> KernelArgs:
    """Pack `values` (every name of `PARAMS`, no other) in `PARAMS` order."""
    names = [n for n, _ in PARAMS]
    if set(values) != set(names):
        missing = sorted(set(names) - set(values))
        extra = sorted(set(values) - set(names))
        raise ValueError(f"kernel parameters: missing {missing}, unknown {extra}")
    return pack_values([(ct, values[name]) for name, ct in PARAMS])


# -- the compiled module's own account of the kernel (for tests and diagnosis) ---------------
_PTX_TYPES = {
    "u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "u32": 4, "s32": 4, "b32": 4,
    "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8,
}  # fmt: skip


def ptx_params(ptx: str, kernel: str = KERNEL) -> list[int]:
    """Byte sizes of `kernel`'s parameters in order, from its PTX `.entry` signature."""
    m = re.search(r"\.entry\s+" + re.escape(kernel) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise ValueError(f"no .entry {kernel} in the PTX")
    sizes = []
    for p in m.group(1).split(","):
        p = p.strip()
        if not p:
            continue
        arr = re.match(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\w+(?:\[(\d+)\])?", p)
        if arr is None:
            raise ValueError(f"cannot read PTX parameter {p!r}")
        size = _PTX_TYPES[arr.group(1)] * (int(arr.group(2)) if arr.group(2) else 1)
        sizes.append(size)
    return sizes


def ptx_config(ptx: str) -> list[int]:
    """`plow_device_config`'s initialiser (8-byte little-endian words) from the PTX."""
    m = re.search(r"\b" + CONFIG_SYMBOL + r"\[(\d+)\]\s*=\s*\{([^}]*)\}", ptx)
    if m is None:
        raise ValueError(f"no {CONFIG_SYMBOL} in the PTX")
    raw = [int(b) for b in m.group(2).split(",")]
    raw += [0] * (int(m.group(1)) - len(raw))
    return [int.from_bytes(bytes(raw[i : i + 8]), "little") for i in range(0, len(raw), 8)]


def source_params(source: str, kernel: str = KERNEL) -> list[str]:
    """Parameter names of `kernel` as declared in kernels/device.cu."""
    m = re.search(r"\b" + re.escape(kernel) + r"\s*\(([^)]*)\)\s*\{", source, re.S)
    if m is None:
        raise ValueError(f"no definition of {kernel} in the source")
    names = []
    for p in m.group(1).split(","):
        words = re.findall(r"[A-Za-z_]\w*", p)
        if words:
            names.append(words[-1])
    return names


def _elf_sections(data: bytes) -> list[tuple[str, int, int, int]]:
    """(name, type, offset, size) of each section of a 64-bit little-endian ELF image."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff = int.from_bytes(data[0x28:0x30], "little")
    shentsize = int.from_bytes(data[0x3A:0x3C], "little")
    shnum = int.from_bytes(data[0x3C:0x3E], "little")
    shstrndx = int.from_bytes(data[0x3E:0x40], "little")
    raw = []
    for i in range(shnum):
        h = data[shoff + i * shentsize : shoff + (i + 1) * shentsize]
        raw.append(
            (
                int.from_bytes(h[0:4], "little"),
                int.from_bytes(h[4:8], "little"),
                int.from_bytes(h[0x18:0x20], "little"),
                int.from_bytes(h[0x20:0x28], "little"),
            )
        )
    stroff = raw[shstrndx][2]

    def name(n: int) -> str:
        return data[stroff + n : data.index(b"\0", stroff + n)].decode()

    return [(name(n), t, off, size) for n, t, off, size in raw]


def cubin_symbols(path: Path | bytes) -> dict[str, tuple[str, str]]:
    """A cubin's symbol table: name -> (binding, type), e.g. ("GLOBAL", "FUNC") for a kernel.
    The driver's cuModuleGetFunction / cuModuleGetGlobal find GLOBAL names."""
    data = path if isinstance(path, bytes) else Path(path).read_bytes()
    secs = _elf_sections(data)
    symtab = next((s for s in secs if s[1] == 2), None)  # SHT_SYMTAB
    strtab = next((s for s in secs if s[0] == ".strtab"), None)
    if symtab is None or strtab is None:
        raise ValueError("no symbol table in the cubin")
    binds = {0: "LOCAL", 1: "GLOBAL", 2: "WEAK"}
    types = {0: "NOTYPE", 1: "OBJECT", 2: "FUNC", 3: "SECTION"}
    out = {}
    for at in range(symtab[2], symtab[2] + symtab[3], 24):
        ent = data[at : at + 24]
        n = int.from_bytes(ent[0:4], "little")
        if n == 0:
            continue
        name = data[strtab[2] + n : data.index(b"\0", strtab[2] + n)].decode()
        info = ent[4]
        out[name] = (binds.get(info >> 4, str(info >> 4)), types.get(info & 15, str(info & 15)))
    return out


@dataclass(frozen=True)
class CubinParam:
    ordinal: int
    offset: int
    size: int


EIATTR_KPARAM_INFO = 0x17
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4


def cubin_params(path: Path | bytes, kernel: str = KERNEL) -> list[CubinParam]:
    """The kernel's parameter table from a cubin (ELF): the `EIATTR_KPARAM_INFO` records of its
    `.nv.info.<kernel>` section — what the driver reads to copy `kernelParams` — by ordinal."""
    data = path if isinstance(path, bytes) else Path(path).read_bytes()
    want = f".nv.info.{kernel}"
    for name, _, off, size in _elf_sections(data):
        if name != want:
            continue
        out = []
        pos, end = off, off + size
        while pos < end:
            fmt, attr = data[pos], data[pos + 1]
            pos += 2
            if fmt == _EIFMT_SVAL:
                ln = int.from_bytes(data[pos : pos + 2], "little")
                val = data[pos + 2 : pos + 2 + ln]
                pos += 2 + ln
                if attr == EIATTR_KPARAM_INFO:
                    ordinal = int.from_bytes(val[4:6], "little")
                    offset = int.from_bytes(val[6:8], "little")
                    flags = int.from_bytes(val[8:12], "little")
                    out.append(CubinParam(ordinal, offset, (flags >> 18) & 0x3FFF))
            elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
                pos += 2  # a 4-byte record: the value (if any) in its last two bytes
            else:
                raise ValueError(f"unknown .nv.info attribute format {fmt}")
        return sorted(out, key=lambda p: p.ordinal)
    raise ValueError(f"no {want} section in the cubin")
