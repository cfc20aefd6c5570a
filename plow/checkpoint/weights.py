"""Memory-mapped safetensors weights, dtype preserved (bf16/fp8 through ml_dtypes).

The `safetensors` package's numpy loader copies tensors and has no bfloat16, so the (tiny,
documented) file format is read here: an 8-byte little-endian header length, a JSON header of
`{name: {dtype, shape, data_offsets}}`, then the data. Each tensor is an `np.memmap` view;
nothing is read until used.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import struct
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from plow.checkpoint.fp8 import FP8, SCALE_SUFFIXES, Fp8Tensor, block_of
from plow.checkpoint.quant import QuantTensor
from plow.checkpoint.quant import check_shape as check_quant_shape
from plow.checkpoint.quant import read_metadata as read_quant_metadata
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
    """One tensor's bytes in a file; a stacked tensor (`parts` non-empty) is the
    concatenation of its parts' bytes in order (`file`/`offset` are the first part's)."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    parts: tuple[TensorEntry, ...] = ()
    quant: tuple[str, tuple[int, ...]] | None = None  # block format, logical [N, K] / [E, N, K]

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The weight's shape (a block-quantized tensor's `shape` is its raw bytes')."""
        return self.quant[1] if self.quant else self.shape

    @property
    def pieces(self) -> tuple[TensorEntry, ...]:
        """The contiguous byte runs of the tensor, in order."""
        return self.parts or (self,)


# transformers-4 checkpoints (and transformers-5's `save_pretrained`, which converts back)
# store one tensor per expert; the graph reads them stacked, as transformers-5 holds them.
# Kimi-Linear's checkpoints name them `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2`
# (down), stacked the same way (so its int4 experts stay q4_0 blocks, not de-quantized copies).
_EXPERT = re.compile(
    r"^(.*\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_W_KIND = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def stack_experts(entries: dict[str, TensorEntry], where: Path | str) -> dict[str, TensorEntry]:
    """`entries` plus, for every layer with per-expert tensors `<p>.{e}.gate_proj.weight`,
    `up_proj`, `down_proj` (e = 0..E-1, all present, equal shapes and dtypes), the stacked
    `<p>.gate_up_proj` `[E, 2I, H]` (gate rows then up rows per expert) and `<p>.down_proj`
    `[E, H, I]`, as entries whose parts are the per-expert tensors (nothing is copied).
    Block-quantized experts (GGML blocks, or int4 repacked by `plow.checkpoint.int4`) stack
    as blocks: the entry's `quant` is the format and the logical `[E, 2I, H]` / `[E, H, I]`."""
    found: dict[str, dict[int, dict[str, TensorEntry]]] = {}
    label: dict[str, dict[str, str]] = {}  # prefix -> kind -> the checkpoint's own name for it
    for name, entry in entries.items():
        m = _EXPERT.match(name)
        if m:
            kind = _W_KIND.get(m.group(3), m.group(3))
            found.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[kind] = entry
            named = label.setdefault(m.group(1), {})
            if m.group(3) in _W_KIND:
                named.update({v: k for k, v in _W_KIND.items()})
    out = dict(entries)
    for prefix, per in found.items():
        n = len(per)
        own = label.get(prefix, {})
        if sorted(per) != list(range(n)):
            missing = min(set(range(max(per) + 1)) - set(per))
            gate = own.get("gate_proj", "gate_proj")
            raise CheckpointError(where, f"tensor '{prefix}.{missing}.{gate}.weight' is missing")
        for e in range(n):
            for kind in ("gate_proj", "up_proj", "down_proj"):
                if kind not in per[e]:
                    raise CheckpointError(
                        where, f"tensor '{prefix}.{e}.{own.get(kind, kind)}.weight' is missing"
                    )
        for kind in ("gate_proj", "up_proj", "down_proj"):
            ref = per[0][kind]
            for e in range(n):
                x = per[e][kind]
                if x.shape != ref.shape or x.dtype != ref.dtype or x.quant != ref.quant:
                    raise CheckpointError(
                        x.file,
                        f"tensor '{prefix}.{e}.{own.get(kind, kind)}.weight' is {x.dtype} "
                        f"{list(x.shape)}, expert 0's is {ref.dtype} {list(ref.shape)}",
                    )
        g = per[0]["gate_proj"]
        if per[0]["up_proj"].shape != g.shape or per[0]["up_proj"].quant != g.quant:
            raise CheckpointError(where, f"{prefix}: gate_proj and up_proj shapes differ")
        gu = tuple(x for e in range(n) for x in (per[e]["gate_proj"], per[e]["up_proj"]))
        dn = tuple(per[e]["down_proj"] for e in range(n))
        d = per[0]["down_proj"]
        for stacked, parts, shape, quant in (
            ("gate_up_proj", gu, (n, 2 * g.shape[0], g.shape[1]), _stacked_quant(g, n, 2)),
            ("down_proj", dn, (n, *d.shape), _stacked_quant(d, n, 1)),
        ):
            full = f"{prefix}.{stacked}"
            if full in out:
                raise CheckpointError(
                    where, f"tensor {full!r} is stored both stacked and per expert"
                )
            out[full] = TensorEntry(
                parts[0].file,
                parts[0].dtype,
                shape,
                parts[0].offset,
                sum(p.nbytes for p in parts),
                parts,
                quant,
            )
            _stack_fp8_scales(entries, out, full, parts, where)
    return out


def _stacked_quant(e: TensorEntry, n: int, per: int) -> tuple[str, tuple[int, ...]] | None:
    """The block format and logical shape of `n` experts' `per` stacked blocked tensors."""
    if e.quant is None:
        return None
    rows, cols = e.quant[1]
    return (e.quant[0], (n, per * rows, cols))


def _stack_fp8_scales(
    entries: dict[str, TensorEntry],
    out: dict[str, TensorEntry],
    full: str,
    parts: tuple[TensorEntry, ...],
    where: Path | str,
) -> None:
    """fp8 experts: the per-expert scale tensors stacked beside the stacked weight, in the
    same part order (gate and up scales concatenated per expert: their blocks must not
    straddle the gate / up boundary)."""
    names = {id(e): n for n, e in entries.items()}
    for suffix in SCALE_SUFFIXES:
        scales = [entries.get(names[id(p)] + suffix) for p in parts]
        if all(sc is None for sc in scales):
            continue
        if any(sc is None for sc in scales):
            raise CheckpointError(where, f"{full}: some experts' tensors have no {suffix} tensor")
        sc = [x for x in scales if x is not None]
        first = sc[0]
        if any(x.shape != first.shape or x.dtype != first.dtype for x in sc):
            raise CheckpointError(where, f"{full}: the experts' {suffix} tensors differ in shape")
        if full.endswith("gate_up_proj") and len(first.shape) == 2:
            rows = parts[0].shape[0]
            if rows % block_of(rows, first.shape[0]) and first.shape[0] > 1:
                raise CheckpointError(
                    where,
                    f"{full}: fp8 blocks of {block_of(rows, first.shape[0])} rows straddle "
                    f"the gate / up boundary at {rows} rows",
                )
        n_exp = out[full].shape[0]
        lead = len(sc) // n_exp  # 2 for gate_up (gate, up), 1 for down
        shape = (n_exp, lead * first.shape[0], *first.shape[1:])
        out[full + suffix] = TensorEntry(
            first.file, first.dtype, shape, first.offset, sum(x.nbytes for x in sc), tuple(sc)
        )


# int4 repack files of this process (plow.checkpoint.int4), by source files
_INT4: dict[tuple[tuple[str, int, int], ...], tuple[Path, frozenset[str]]] = {}


def _repack_int4(entries: dict[str, TensorEntry], files: list[Path], where: Path | str) -> None:
    """compressed-tensors pack-quantized weights (`X.weight_packed`, `_scale`, `_shape`)
    replaced in `entries` by `X.weight` as q4_0 blocks, repacked once per process into a
    temporary file (`plow.checkpoint.int4`)."""
    from plow.checkpoint.int4 import packed_names, repack_file

    if not packed_names(set(entries)):
        return
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    cached = _INT4.get(key)
    if cached is None or not cached[0].is_file():

        def read(name: str) -> np.ndarray:
            e = entries[name]
            return np.array(
                np.memmap(e.file, dtype=e.dtype, mode="r", offset=e.offset, shape=e.shape)
            )

        made = repack_file(list(entries), read, set(entries), where)
        assert made is not None
        cached = _INT4[key] = (made[0], frozenset(made[1]))
    for name in cached[1]:
        entries.pop(name, None)
    entries.update(read_header(cached[0]))


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
    quant = read_quant_metadata(header.get("__metadata__"), path)
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
        q = quant.get(name)
        if q is not None:
            check_quant_shape(f"{path}: tensor {name!r}", q[0], q[1], shape)
        entries[name] = TensorEntry(path, dtype, shape, base + start, end - start, quant=q)
    return entries


# derived-weight files of this process (WeightStore._derive), by config bytes and source files
_DERIVED: dict[tuple[bytes, tuple[tuple[str, int, int], ...]], Path] = {}


class MissingTensor(CheckpointError, KeyError):
    """A tensor the model needs is in none of the checkpoint's safetensors files: a one-line
    `PlowError` naming the checkpoint and the tensor, and a `KeyError` for `Mapping` users."""

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


class WeightStore(Mapping[str, np.ndarray]):
    """Name → read-only memory-mapped array, over one or many safetensors files; `where` (the
    checkpoint directory, or the file) is what errors about a missing tensor name."""

    def __init__(self, entries: dict[str, TensorEntry], where: Path | str = "weights") -> None:
        self._entries = stack_experts(entries, where)
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
        _repack_int4(entries, files, where)
        store = cls(entries, where)
        store._derive()
        return store

    def _derive(self) -> None:
        """A checkpoint directory of a family that derives weights (DeepSeek-V3's latent
        attention, `plow.checkpoint.families.derived_weights_hook`): the derived tensors the
        model reads and the files lack, computed once into a temporary safetensors file
        (removed at exit; the checkpoint directory is never written) and added as entries."""
        config = self.where / "config.json"
        if not config.is_file():
            return
        try:
            data = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return  # the loader reports a malformed config itself
        from plow.checkpoint.families import derived_weights_hook

        hook = derived_weights_hook(str(data.get("model_type"))) if isinstance(data, dict) else None
        if hook is None:
            return
        from plow.checkpoint.loader import spec_from_config

        spec = spec_from_config(data, config)
        missing = {n for n in spec.weight_shapes() if n not in self._entries}
        if not missing:
            return
        # the same files (and config) opened again in this process reuse the derived file
        files = sorted({p.file for e in self._entries.values() for p in e.pieces})
        key = (
            config.read_bytes(),
            tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files),
        )
        cached = _DERIVED.get(key)
        if cached is not None and cached.is_file():
            self._entries.update(read_header(cached))
            return
        derived = hook(spec, self.__getitem__, missing)
        if not derived:
            return
        fd, tmp = tempfile.mkstemp(prefix="plow-derived-", suffix=".safetensors")
        os.close(fd)
        path = Path(tmp)
        atexit.register(path.unlink, missing_ok=True)
        rev = {v: k for k, v in _DTYPES.items()}
        write_safetensors(
            path, {n: (rev[a.dtype], a) for n, a in derived.items()}, {"writer": "plow-derived"}
        )
        _DERIVED[key] = path
        self._entries.update(read_header(path))

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
        if e.parts:  # stacked experts: one copy of the parts, read-only
            runs = [
                np.memmap(p.file, dtype=p.dtype, mode="r", offset=p.offset, shape=p.shape)
                for p in e.parts
            ]
            flat = np.concatenate([r.ravel() for r in runs]).reshape(e.shape)
            flat.flags.writeable = False
            if e.quant is not None:  # stacked blocks stay blocks (logical [E, N, K])
                return QuantTensor(e.quant[0], e.quant[1], flat)  # type: ignore[return-value]
            stacked_scale = self.fp8_scale(name)
            if stacked_scale is not None:  # fp8 experts with their stacked scales
                return Fp8Tensor(flat, self[stacked_scale], f"{self.where}: tensor {name!r}")  # type: ignore[return-value]
            return flat
        mm = np.memmap(e.file, dtype=e.dtype, mode="r", offset=e.offset, shape=e.shape)
        if e.quant is not None:  # blocks kept as blocks; np.asarray de-quantizes exactly
            return QuantTensor(e.quant[0], e.quant[1], mm)  # type: ignore[return-value]
        scale = self.fp8_scale(name)
        if scale is not None:  # fp8 with its scales; np.asarray de-quantizes (plow.checkpoint.fp8)
            return Fp8Tensor(mm, self[scale], f"{e.file}: tensor {name!r}")  # type: ignore[return-value]
        return mm

    def fp8_scale(self, name: str) -> str | None:
        """The scale tensor of an fp8 weight `name` (`<name>_scale_inv` or `<name>_scale`),
        None when `name` is not an fp8 weight with scales."""
        e = self._entries.get(name)
        if e is None or e.dtype != FP8 or len(e.shape) < 2:
            return None
        for suffix in SCALE_SUFFIXES:
            if name + suffix in self._entries:
                return name + suffix
        return None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if not e.parts)

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every expected tensor is present with its shape (extra tensors are allowed)."""
        for name, shape in expected.items():
            e = self._entries.get(name)
            if e is None:
                raise self._missing(name)
            if e.logical_shape != shape:
                raise CheckpointError(
                    e.file,
                    f"tensor {name!r} has shape {list(e.logical_shape)}, expected {list(shape)}",
                )


def safetensors_header(
    tensors: Sequence[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str]
) -> bytes:
    """The length-prefixed, 8-byte-padded header of a safetensors file holding `tensors`
    (name, safetensors dtype, shape, byte count) back to back in that order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    pos = 0
    for name, st, shape, nbytes in tensors:
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(
    path: Path, tensors: Mapping[str, tuple[str, np.ndarray]], metadata: Mapping[str, str]
) -> None:
    """A safetensors file of in-memory arrays (name → (safetensors dtype, array))."""
    arrays = {n: (st, np.ascontiguousarray(a)) for n, (st, a) in tensors.items()}
    with path.open("wb") as f:
        f.write(
            safetensors_header(
                [(n, st, a.shape, a.nbytes) for n, (st, a) in arrays.items()], metadata
            )
        )
        for _, a in arrays.values():
            f.write(a.tobytes())
