"""What a HIP code object says of its kernels (for tests and diagnosis; nothing here loads
HIP): `hipcc --genco` writes a clang offload bundle holding one AMDGPU ELF per architecture;
each ELF's `NT_AMDGPU_METADATA` note (msgpack) lists every kernel's arguments with the offset
and size the runtime copies `kernelParams` to — what `hipModuleLaunchKernel` relies on, as the
cubin's `.nv.info` table is for CUDA (plow.runtime.cuda.abi.cubin_params)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plow.runtime.cuda.abi import _elf_sections

BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"
NT_AMDGPU_METADATA = 32


def unbundle(data: bytes) -> dict[str, bytes]:
    """Entries of a clang offload bundle by target triple (a bare ELF: one entry, key "")."""
    if data[:4] == b"\x7fELF":
        return {"": data}
    if not data.startswith(BUNDLE_MAGIC):
        raise ValueError("neither an offload bundle nor an ELF code object")
    pos = len(BUNDLE_MAGIC)
    n = int.from_bytes(data[pos : pos + 8], "little")
    pos += 8
    out = {}
    for _ in range(n):
        off, size, tlen = (
            int.from_bytes(data[pos + 8 * i : pos + 8 * i + 8], "little") for i in range(3)
        )
        pos += 24
        triple = data[pos : pos + tlen].decode()
        pos += tlen
        out[triple] = data[off : off + size]
    return out


def amdgpu_metadata(elf: bytes) -> dict[str, Any]:
    """The code object's metadata note, decoded (msgpack; the `msgpack` package)."""
    import msgpack  # only for this reading; the loader itself never needs it

    for name, typ, off, size in _elf_sections(elf):
        if typ != 7:  # SHT_NOTE
            continue
        pos, end = off, off + size
        while pos + 12 <= end:
            namesz, descsz, ntype = (
                int.from_bytes(elf[pos + 4 * i : pos + 4 * i + 4], "little") for i in range(3)
            )
            pos += 12
            nm = elf[pos : pos + namesz].rstrip(b"\0")
            pos += -(-namesz // 4) * 4
            desc = elf[pos : pos + descsz]
            pos += -(-descsz // 4) * 4
            if nm == b"AMDGPU" and ntype == NT_AMDGPU_METADATA:
                meta: dict[str, Any] = msgpack.unpackb(desc, raw=False)
                return meta
        del name
    raise ValueError("no AMDGPU metadata note in the code object")


@dataclass(frozen=True)
class KernelArg:
    offset: int
    size: int
    kind: str


def kernel_args(elf: bytes, kernel: str) -> tuple[list[KernelArg], dict[str, Any]]:
    """The explicit arguments of `kernel` (hidden ones dropped) in order, and its whole
    metadata entry."""
    for k in amdgpu_metadata(elf).get("amdhsa.kernels", []):
        if k.get(".name") == kernel:
            args = [
                KernelArg(int(a[".offset"]), int(a[".size"]), str(a[".value_kind"]))
                for a in k.get(".args", [])
                if not str(a.get(".value_kind", "")).startswith("hidden")
            ]
            return args, k
    raise ValueError(f"no kernel {kernel} in the code object")
