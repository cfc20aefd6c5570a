"""4-bit weights as compressed-tensors' "pack-quantized" format ships them (Kimi K2/K3's
routed experts), repacked at load time into GGML q4_0 blocks (`plow.checkpoint.quant`).

A quantized linear `X` is stored as three tensors:
  `X.weight_packed` int32 [N, K/8]  element j of a row at bits 4*(j%8) of int32 j//8, as the
                                    unsigned nibble q + 8 (compressed-tensors' `pack_to_int32`)
  `X.weight_scale`  bf16/fp16/fp32 [N, K/32]  one scale per group of 32 consecutive elements
  `X.weight_shape`  int32 [2]        the logical [N, K]
and the weight is `scale[n, k // 32] * q[n, k]` (`quantization_config`: symmetric int, 4 bits,
strategy group, group_size 32 — `plow.checkpoint.families.common` refuses anything else).

That is q4_0 (`w = d * (nibble - 8)`, fp16 `d`) up to the nibble order and the scale's type:
each group becomes one q4_0 block, its scale `d` as float16 — a scale float16 cannot hold
exactly is refused naming the tensor, so the de-quantization is bit-for-bit the checkpoint's.
The repacked blocks are written once to a temporary safetensors file (removed at exit, the
checkpoint never written) as `X.weight` with `plow.quant` metadata, so every later stage
(stacked experts, the bundle writer, the native kernel's `dot_w`) sees ordinary q4_0 blocks.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from plow.checkpoint.quant import BLOCK, METADATA_KEY, write_metadata
from plow.errors import CheckpointError

GROUP = 32
SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")


def quantize_int4_pack(
    w: np.ndarray, group: int = GROUP
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`w` [N, K] as compressed-tensors' symmetric int4 group quantization: (weight_packed
    int32 [N, K/8], weight_scale bf16 [N, K/group], weight_shape int32 [2]). Scales are
    `amax / 7` rounded to bf16 values float16 also holds (tests build fixtures with it)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % group or k % 8:
        raise ValueError(f"int4 packing needs columns a multiple of {group}, got {k}")
    g = w.reshape(n, k // group, group)
    s = (np.abs(g).max(axis=-1) / 7.0).astype(np.float32)
    s = np.where(s == 0, 1.0, s).astype(ml_dtypes.bfloat16)  # in fp16's range: exact in fp16
    sf = s.astype(np.float32)[..., None]
    q = np.clip(np.rint(g / sf), -8, 7).astype(np.int64).reshape(n, k)
    u = (q + 8).astype(np.uint32)
    packed = np.zeros((n, k // 8), dtype=np.uint32)
    for i in range(8):
        packed |= u[:, i::8] << np.uint32(4 * i)
    return packed.view(np.int32), np.ascontiguousarray(s), np.array([n, k], dtype=np.int32)


def unpack_int4(packed: np.ndarray, k: int) -> np.ndarray:
    """The signed int4 values [N, K] of `weight_packed` (as `unpack_from_int32` gives them)."""
    p = np.asarray(packed).view(np.uint32)
    out = np.empty((p.shape[0], p.shape[1] * 8), dtype=np.int8)
    for i in range(8):
        out[:, i::8] = ((p >> np.uint32(4 * i)) & np.uint32(0xF)).astype(np.int8) - 8
    return out[:, :k]


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """The exact float32 weight of the three tensors (the reference for tests)."""
    n, k = (int(x) for x in np.asarray(shape).reshape(-1))
    q = unpack_int4(packed, k).astype(np.float32)
    s = np.repeat(np.asarray(scale, dtype=np.float32), GROUP, axis=1)[:, :k]
    return (q * s).astype(np.float32)


def to_q4_0(packed: np.ndarray, scale: np.ndarray, shape: np.ndarray, name: str) -> np.ndarray:
    """The q4_0 blocks `[N, K/32 * 18]` of one pack-quantized weight `name` (checked)."""
    shp = np.asarray(shape).reshape(-1)
    if shp.size != 2:
        raise CheckpointError(name, f"weight_shape has {shp.size} values, expected 2")
    n, k = (int(x) for x in shp)
    p = np.asarray(packed)
    if p.dtype != np.int32 or p.shape != (n, -(-k // 8)):
        raise CheckpointError(
            name,
            f"weight_packed is {p.dtype} {list(p.shape)}, expected int32 {[n, -(-k // 8)]} "
            f"for weight_shape {[n, k]}",
        )
    if k % BLOCK:
        raise CheckpointError(name, f"{k} columns are not whole groups of {BLOCK}")
    s = np.asarray(scale)
    if s.shape != (n, k // GROUP):
        raise CheckpointError(
            name,
            f"weight_scale has shape {list(s.shape)}, expected {[n, k // GROUP]} "
            f"(group_size {GROUP})",
        )
    s32 = s.astype(np.float32)
    d = s32.astype(np.float16)
    bad = np.flatnonzero(d.astype(np.float32) != s32)
    if bad.size:
        r, c = divmod(int(bad[0]), s.shape[1])
        raise CheckpointError(
            name,
            f"weight_scale[{r}, {c}] = {float(s32.flat[bad[0]])!r} is not exactly representable "
            "in float16 (q4_0 blocks keep fp16 scales)",
        )
    u = np.empty((n, k), dtype=np.uint8)  # the unsigned nibbles q + 8
    pu = p.view(np.uint32)
    for i in range(8):
        u[:, i::8] = ((pu >> np.uint32(4 * i)) & np.uint32(0xF)).astype(np.uint8)
    g = u.reshape(n, k // BLOCK, BLOCK)
    out = np.empty((n, k // BLOCK, 18), dtype=np.uint8)
    out[..., :2] = d.reshape(n, k // BLOCK, 1).view(np.uint8)
    out[..., 2:] = g[..., :16] | (g[..., 16:] << 4)  # q4_0: j low nibble, j + 16 high
    return out.reshape(n, k // BLOCK * 18)


def packed_names(names: list[str] | set[str]) -> list[str]:
    """The weights `X.weight` stored pack-quantized (`X.weight_packed` present)."""
    return sorted(n[: -len("_packed")] for n in names if n.endswith(".weight_packed"))


def repack_file(
    names: list[str], read: Callable[[str], np.ndarray], have: set[str], where: Path | str
) -> tuple[Path, set[str]] | None:
    """The q4_0 file of the pack-quantized weights among `names` (`read` gives a tensor), and
    the compressed-tensors names it replaces; None when there are none."""
    from plow.checkpoint.weights import write_safetensors

    todo = packed_names(names)
    if not todo:
        return None
    out: dict[str, tuple[str, np.ndarray]] = {}
    quant: dict[str, tuple[str, tuple[int, ...]]] = {}
    gone: set[str] = set()
    for w in todo:
        label = f"{where}: tensor {w + '_packed'!r}"
        for suffix in SUFFIXES[1:]:
            if w + suffix[len(".weight") :] not in have:
                raise CheckpointError(label, f"has no {w + suffix[len('.weight') :]!r} beside it")
        if w in have:
            raise CheckpointError(label, f"{w!r} is stored both packed and unpacked")
        blocks = to_q4_0(read(w + "_packed"), read(w + "_scale"), read(w + "_shape"), label)
        out[w] = ("U8", blocks)
        quant[w] = ("q4_0", (blocks.shape[0], blocks.shape[1] // 18 * BLOCK))
        gone.update(w + s[len(".weight") :] for s in SUFFIXES)
    fd, tmp = tempfile.mkstemp(prefix="plow-int4-", suffix=".safetensors")
    os.close(fd)
    path = Path(tmp)
    atexit.register(path.unlink, missing_ok=True)
    write_safetensors(path, out, {"writer": "plow-int4", METADATA_KEY: write_metadata(quant)})
    return path, gone
