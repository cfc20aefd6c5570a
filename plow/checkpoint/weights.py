"""Memory-mapped safetensors weights, dtype preserved (bf16/fp8 through ml_dtypes).

The `safetensors` package's numpy loader copies tensors and has no bfloat16, so the (tiny,
documented) file format is read here: an 8-byte little-endian header length, a JSON header of
`{name: {dtype, shape, data_offsets}}`, then the data. Each tensor is an `np.memmap` view;
nothing is read until used.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from plow.errors import CheckpointError

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, validated against the file's size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(path, "not a safetensors file (shorter than 8 bytes)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > size - 8:
                raise CheckpointError(path, f"header length {hlen} exceeds the file size {size}")
            header = json.loads(f.read(hlen))
    except FileNotFoundError as e:
        raise CheckpointError(path, "file not found") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(path, f"malformed safetensors header: {e}") from e
    base = 8 + hlen
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype", "?"))
        if dtype is None:
            raise CheckpointError(
                path, f"tensor {name!r} has unsupported dtype {info.get('dtype')!r}"
            )
        shape = tuple(int(d) for d in info["shape"])
        start, end = (int(x) for x in info["data_offsets"])
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - start != n * dtype.itemsize or base + end > size:
            raise CheckpointError(
                path, f"tensor {name!r}: data offsets {start}..{end} do not match shape {shape}"
            )
        entries[name] = TensorEntry(path, dtype, shape, base + start, end - start)
    return entries


class MissingTensor(CheckpointError, KeyError):
    """A tensor the model needs is in none of the checkpoint's safetensors files: a one-line
    `PlowError` naming the checkpoint and the tensor, and a `KeyError` for `Mapping` users."""

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


class WeightStore(Mapping[str, np.ndarray]):
    """Name → read-only memory-mapped array, over one or many safetensors files; `where` (the
    checkpoint directory, or the file) is what errors about a missing tensor name."""

    def __init__(self, entries: dict[str, TensorEntry], where: Path | str = "weights") -> None:
        self._entries = entries
        self.where = Path(where)

    @classmethod
    def open(cls, files: list[Path], where: Path | str | None = None) -> WeightStore:
        entries: dict[str, TensorEntry] = {}
        for f in files:
            for name, e in read_header(f).items():
                if name in entries:
                    raise CheckpointError(
                        f, f"tensor {name!r} also appears in {entries[name].file.name}"
                    )
                entries[name] = e
        if where is None:
            parents = {f.parent for f in files}
            where = files[0] if len(files) == 1 else parents.pop() if len(parents) == 1 else "."
        return cls(entries, where)

    def _missing(self, name: str) -> MissingTensor:
        files = sorted({e.file.name for e in self._entries.values()})
        return MissingTensor(
            self.where,
            f"tensor {name!r} is missing from the safetensors files ({', '.join(files) or 'none'})",
        )

    def entry(self, name: str) -> TensorEntry:
        e = self._entries.get(name)
        if e is None:
            raise self._missing(name)
        return e

    def __getitem__(self, name: str) -> np.ndarray:
        e = self.entry(name)
        return np.memmap(e.file, dtype=e.dtype, mode="r", offset=e.offset, shape=e.shape)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every expected tensor is present with its shape (extra tensors are allowed)."""
        for name, shape in expected.items():
            e = self._entries.get(name)
            if e is None:
                raise self._missing(name)
            if e.shape != shape:
                raise CheckpointError(
                    e.file, f"tensor {name!r} has shape {list(e.shape)}, expected {list(shape)}"
                )
