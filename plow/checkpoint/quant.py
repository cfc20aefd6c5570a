"""Block-quantized weights kept as blocks: GGML's Q4_0, Q4_1 and Q8_0 layouts.

A quantized `[N, K]` weight is stored as its raw blocks, a `uint8` array `[N, K/32 * B]`
(B bytes per block of 32 consecutive elements of a row), byte for byte as llama.cpp stores
it; a safetensors file marks it in its `__metadata__` under `plow.quant`
(`{name: {"format": "q4_1", "shape": [N, K]}}`). The executors decode blocks inside the
tile; `np.asarray(t, dtype=np.float32)` gives the exact de-quantization (the same float
operations as gguf-py's, which transformers uses to load GGUF files), so the `cpu` executor
and the correctness reference see the same weights the native kernel decodes.

Block layouts (d, m: float16 scale and minimum; q: the quantized values):
  q4_0  d, 16 bytes of nibbles (element j low nibble, j+16 high)   w = d * (q - 8)
  q4_1  d, m, 16 bytes of nibbles                                  w = d * q + m
  q8_0  d, 32 int8                                                 w = d * q
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plow.errors import CheckpointError

BLOCK = 32  # elements per block, every format

METADATA_KEY = "plow.quant"


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str
    block_bytes: int
    code: int  # the native ABI's weight dtype code (kernels/plow_abi.h)


FORMATS: dict[str, BlockFormat] = {
    "q4_0": BlockFormat("q4_0", 18, 3),
    "q4_1": BlockFormat("q4_1", 20, 4),
    "q8_0": BlockFormat("q8_0", 34, 5),
}


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """float16 at byte `at` of every block, widened to float32: `[rows, blocks, 1]`."""
    return raw[..., at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 packed bytes per block → 32 values: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)


def dequantize(fmt: str, blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The exact float32 weights of `blocks` (`[.., N, K/32 * B]` uint8; stacked experts have
    a leading expert dimension)."""
    f = FORMATS[fmt]
    k = shape[-1]
    n = int(np.prod(shape[:-1], dtype=np.int64))
    raw = np.asarray(blocks, dtype=np.uint8).reshape(n, k // BLOCK, f.block_bytes)
    d = _halves(raw, 0)
    if fmt == "q4_0":
        w = d * (_nibbles(raw[..., 2:]) - np.float32(8))
    elif fmt == "q4_1":
        w = d * _nibbles(raw[..., 4:]) + _halves(raw, 2)
    else:
        w = d * raw[..., 2:].copy().view(np.int8).astype(np.float32)
    return np.ascontiguousarray(w.reshape(shape), dtype=np.float32)


def check_shape(name: str, fmt: str, shape: tuple[int, ...], raw_shape: tuple[int, ...]) -> None:
    """A quantized tensor is 2-D (or 3-D: stacked experts [E, N, K]) with whole blocks per row,
    and its bytes fit its shape."""
    f = FORMATS.get(fmt)
    if f is None:
        raise CheckpointError(
            name, f"unknown block format {fmt!r} (plow keeps {', '.join(FORMATS)} as blocks)"
        )
    if len(shape) not in (2, 3) or shape[-1] % BLOCK:
        raise CheckpointError(
            name,
            f"{fmt} needs a 2-D or 3-D shape with a multiple of {BLOCK} columns, got {list(shape)}",
        )
    want = (*shape[:-1], shape[-1] // BLOCK * f.block_bytes)
    if tuple(raw_shape) != want:
        raise CheckpointError(
            name,
            f"{fmt} {list(shape)} needs uint8 blocks {list(want)}, the file has {list(raw_shape)}",
        )


class QuantTensor:
    """A block-quantized weight: `shape` is the logical `[N, K]` (stacked experts: `[E, N, K]`,
    the experts' blocks one after another); `blocks` the raw bytes; `np.asarray(t, np.float32)`
    the exact de-quantization (computed on each call)."""

    __slots__ = ("format", "shape", "blocks")

    def __init__(self, fmt: str, shape: tuple[int, ...], blocks: np.ndarray) -> None:
        self.format = fmt
        self.shape = shape
        self.blocks = blocks

    @property
    def dtype(self) -> str:
        return self.format

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        w = dequantize(self.format, self.blocks, self.shape)
        return w if dtype is None else w.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"QuantTensor({self.format}, {list(self.shape)})"


def read_metadata(
    meta: dict[str, Any] | None, where: str | Path
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The `plow.quant` entry of a safetensors `__metadata__` (a JSON string, as safetensors
    metadata values are strings): name → (format, logical shape, 2-D or 3-D)."""
    if not meta or METADATA_KEY not in meta:
        return {}
    try:
        table = json.loads(meta[METADATA_KEY])
        return {
            str(n): (str(v["format"]), tuple(int(d) for d in v["shape"])) for n, v in table.items()
        }
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(where, f"malformed {METADATA_KEY} metadata: {e}") from e


def write_metadata(table: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    return json.dumps(
        {n: {"format": f, "shape": list(s)} for n, (f, s) in sorted(table.items())},
        separators=(",", ":"),
    )
