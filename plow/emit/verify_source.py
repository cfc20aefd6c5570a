"""`plow verify BUNDLE --source CKPT`: the bundle's weights and config are the checkpoint's.

Plain `plow verify` certifies the bundle against itself: the hashes in its manifest, and the
op table against the graph its own `config.json` lowers to (checkpoint A). Both are
bundle-supplied, so an edit made consistently to `config.json`, the op table and the hashes
passes; and A checks the *names* of a re-laid-out weight's sources, never its bytes. This
check closes both against the checkpoint the bundle was compiled from:

- `config.json`: equal to the source's, key for key (recursively), except the keys that do not
  reach the graph (`IGNORED_CONFIG_KEYS`: provenance, training-only settings); the first
  differing key is named;
- every tensor of `weights.safetensors` (read from the bundle's bytes: its own header) is the
  checkpoint's tensor(s) under the layout `rewrites.json` records for it, byte for byte:
  a plain weight its source tensor; `interleave(Wg, Wu)` row 2i = row i of Wg and row 2i + 1 =
  row i of Wu; `cat3(Wq, Wk, Wv)` the three stacked by rows. Same dtype, the layout's shape.
  A mismatch names the weight, its first differing element and the source element it should
  equal. Both files are memory-mapped and compared in chunks (nothing is read whole).

The source side reads the checkpoint as `plow compile` does (`WeightStore`: shards, stacked
experts, derived weights); the expected byte runs are built here from the source tensors'
entries and the recorded layout, not by the bundle writer's code (`plow.emit.bundle`).
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plow.errors import PlowError

# config.json keys that do not reach the graph or the weights (compared everywhere else)
IGNORED_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "use_cache",
        "initializer_range",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
    }
)
CHUNK = 1 << 24  # bytes compared at a time

ProgressCallback = Callable[[int, int], None]  # (bytes done so far, total bytes)


@dataclass(frozen=True, slots=True)
class SourceReport:
    bundle: Path
    source: Path
    weights: int  # tensors compared
    bytes: int
    problem: str | None  # the first mismatch, one line; None: the bundle is the source's

    @property
    def accepted(self) -> bool:
        return self.problem is None


def config_difference(bundle_cfg: Any, source_cfg: Any, where: str = "") -> str | None:
    """The first key (dotted path) whose value differs between the two configs, ignoring
    `IGNORED_CONFIG_KEYS` at every level; None when they agree."""
    if isinstance(bundle_cfg, dict) and isinstance(source_cfg, dict):
        for k in sorted(set(bundle_cfg) | set(source_cfg)):
            if k in IGNORED_CONFIG_KEYS:
                continue
            path = f"{where}.{k}" if where else k
            if k not in bundle_cfg:
                return f"{path} (absent from the bundle's)"
            if k not in source_cfg:
                return f"{path} (absent from the source's)"
            d = config_difference(bundle_cfg[k], source_cfg[k], path)
            if d is not None:
                return d
        return None
    if isinstance(bundle_cfg, list) and isinstance(source_cfg, list):
        if len(bundle_cfg) != len(source_cfg):
            return f"{where or 'config'} (length {len(bundle_cfg)} vs {len(source_cfg)})"
        for i, (a, b) in enumerate(zip(bundle_cfg, source_cfg, strict=True)):
            d = config_difference(a, b, f"{where}[{i}]")
            if d is not None:
                return d
        return None

    # numbers compare by value (1 == 1.0; a bool is no number here), everything else exactly
    def numeric(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    same_type = type(bundle_cfg) is type(source_cfg) or (
        numeric(bundle_cfg) and numeric(source_cfg)
    )
    if bundle_cfg == source_cfg and same_type:
        return None
    mine, theirs = json.dumps(bundle_cfg), json.dumps(source_cfg)
    return f"{where or 'config'} ({mine} in the bundle, {theirs} in the source)"


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise PlowError(path, f"{what} not found") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlowError(path, f"{what} is not valid JSON: {e}") from e


@dataclass(frozen=True, slots=True)
class _Run:
    """A byte run the bundle tensor must hold: `nbytes` of `file` from `offset`, which are the
    bytes from `src_byte` on of source tensor `src` (for locating a mismatch)."""

    file: Path
    offset: int
    nbytes: int
    src: str
    src_byte: int


def _plain_runs(store: Any, name: str) -> tuple[Any, list[_Run]]:
    e = store.entry(name)
    runs, at = [], 0
    for p in e.pieces:
        runs.append(_Run(p.file, p.offset, p.nbytes, name, at))
        at += p.nbytes
    return e, runs


@dataclass(frozen=True, slots=True)
class _SliceEntry:
    """A tensor-parallel slice as a source of a fused op's layout (its dtype and shape)."""

    dtype: Any
    shape: tuple[int, ...]
    nbytes: int
    quant: None = None

    @property
    def logical_shape(self) -> tuple[int, ...]:
        return self.shape


def _source_runs(
    store: Any, s: str, layouts: dict[str, tuple[str, list[str]]]
) -> tuple[Any, list[_Run], dict[str, Any]] | str:
    """A layout source's entry, runs and source entries: a checkpoint tensor, or a
    tensor-parallel slice of one (a fused op of a `--tp` plan re-lays out its device's
    slices)."""
    lay = layouts.get(s)
    if lay is None or not lay[0].startswith(("rows ", "cols ")):
        e, runs = _plain_runs(store, s)
        return e, runs, {s: e}
    exp = _expected(store, s, lay, {})
    if isinstance(exp, str):
        return f"its source {s!r}: {exp}"
    dtype, shape, runs, entries = exp
    e0 = next(iter(entries.values()))
    return _SliceEntry(e0.dtype, shape, sum(r.nbytes for r in runs)), runs, entries


def _expected(
    store: Any,
    name: str,
    layout: tuple[str, list[str]] | None,
    layouts: dict[str, tuple[str, list[str]]],
) -> tuple[str, tuple[int, ...], list[_Run], dict[str, Any]] | str:
    """(dtype name, shape, runs, source entries) the bundle tensor `name` must equal, or a
    one-line problem. `layouts`: every recorded layout (a source may be a slice)."""
    from plow.checkpoint.weights import MissingTensor

    try:
        if layout is None:
            e, runs = _plain_runs(store, name)
            return e.dtype.name, tuple(e.shape), runs, {name: e}
        kind, sources = layout
        if kind.startswith(("rows ", "cols ")):
            layouts = {}  # a slice is of a checkpoint tensor
        found = [_source_runs(store, s, layouts) for s in sources]
    except MissingTensor:
        missing = name if layout is None else ", ".join(layout[1])
        return f"{missing}: not a tensor of the source checkpoint"
    trips = [g for g in found if not isinstance(g, str)]
    if len(trips) < len(found):
        return next(g for g in found if isinstance(g, str))
    got = [(e, runs) for e, runs, _ in trips]
    entries = {k: v for _, _, ents in trips for k, v in ents.items()}
    es = [e for e, _ in got]
    if kind.startswith(("rows ", "cols ")) and len(sources) == 1:  # tensor parallel
        return _sliced(kind, es[0], got[0][1], entries)
    if len({(e.dtype.name, tuple(e.shape[1:]), e.quant is None) for e in es}) != 1:
        return f"its sources {', '.join(sources)} differ in dtype or row shape"
    dtype, rest = es[0].dtype.name, tuple(es[0].shape[1:])
    if kind == "cat3":
        if len(sources) != 3:
            return f"cat3 of {len(sources)} sources"
        runs = [r for _, rs in got for r in rs]
        return dtype, (sum(e.shape[0] for e in es), *rest), runs, entries
    if kind == "interleave":
        if len(sources) != 2 or es[0].shape != es[1].shape:
            return "interleave needs two sources of one shape"
        rows = es[0].logical_shape[0]
        if any(e.nbytes % rows for e in es):
            return f"its sources' bytes do not divide into {rows} rows"
        rb = es[0].nbytes // rows
        runs = []
        for i in range(rows):
            for s in sources:
                runs += list(_slice(got[sources.index(s)][1], i * rb, rb))
        return dtype, (2 * es[0].shape[0], *rest), runs, entries
    return f"unknown layout {kind!r}"


def _sliced(
    kind: str, e: Any, runs: list[_Run], entries: dict[str, Any]
) -> tuple[str, tuple[int, ...], list[_Run], dict[str, Any]] | str:
    """A tensor-parallel slice (plow/graph/shard.py, the op table's `slices`): `rows A:B` of a
    1-D or 2-D source, or `cols A:B` of a 2-D one (one run per row)."""
    axis, span = kind.split(" ")
    try:
        lo, hi = (int(v) for v in span.split(":"))
    except ValueError:
        return f"slice {kind!r} is not `rows|cols A:B`"
    shape = tuple(e.shape)
    if e.quant is not None or len(shape) not in (1, 2) or (axis == "cols" and len(shape) != 2):
        return f"slice {kind!r} of a {len(shape)}-d or block-quantized source"
    dim = shape[0] if axis == "rows" else shape[1]
    if not 0 <= lo < hi <= dim:
        return f"slice {kind!r} outside the source's {dim} {axis}"
    item = e.dtype.itemsize
    if axis == "rows":
        rb = item * (shape[1] if len(shape) == 2 else 1)
        return (
            e.dtype.name,
            (hi - lo, *shape[1:]),
            list(_slice(runs, lo * rb, (hi - lo) * rb)),
            entries,
        )
    rb = shape[1] * item
    out = [r for i in range(shape[0]) for r in _slice(runs, i * rb + lo * item, (hi - lo) * item)]
    return e.dtype.name, (shape[0], hi - lo), out, entries


def _slice(runs: list[_Run], start: int, n: int) -> Iterator[_Run]:
    """The sub-runs covering bytes [start, start + n) of the concatenation of `runs`."""
    at = 0
    for r in runs:
        lo, hi = max(start, at), min(start + n, at + r.nbytes)
        if lo < hi:
            yield _Run(r.file, r.offset + lo - at, hi - lo, r.src, r.src_byte + lo - at)
        at += r.nbytes


def _element(shape: tuple[int, ...], itemsize: int, byte: int) -> str:
    if not shape:
        return "[]"
    idx = np.unravel_index(byte // itemsize, shape)
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def _tp_slices(bundle: Path) -> dict[str, tuple[str, list[str]]]:
    """The slices a tensor-parallel bundle's op tables record (`slices`: [tensor, source,
    axis, start, stop]; checkpoint A compares them with the shard pass's), as layouts."""
    out: dict[str, tuple[str, list[str]]] = {}
    manifest = _read_json(bundle / "manifest.json", "the bundle's manifest.json")
    for rung in manifest.get("ladder", []):
        ops = _read_json(bundle / rung["ops"], "an op table")
        for op in ops.get("ops", []):
            for new, src, axis, lo, hi in op.get("attrs", {}).get("slices", []):
                out[new] = (f"{('rows', 'cols')[int(axis)]} {int(lo)}:{int(hi)}", [src])
    return out


def verify_source(
    bundle: Path, source: Path, *, on_progress: ProgressCallback | None = None
) -> SourceReport:
    """Check `bundle` against checkpoint directory `source` (see the module doc). Raises
    `PlowError` (one line) when either cannot be read; a mismatch is the report's `problem`."""
    from plow.bundle.manifest import WEIGHTS, MalformedBundle
    from plow.checkpoint.loader import weight_files
    from plow.checkpoint.weights import WeightStore, read_header
    from plow.oracle.payloads.rewrites import read_rewrites

    bundle, source = Path(bundle), Path(source)
    if not source.is_dir():
        raise PlowError(source, "--source must be the checkpoint directory the bundle came from")
    if not bundle.is_dir():
        raise MalformedBundle(bundle, "not a bundle directory")
    diff = config_difference(
        _read_json(bundle / "config.json", "the bundle's config.json"),
        _read_json(source / "config.json", "the source's config.json"),
    )
    if diff is not None:
        return SourceReport(bundle, source, 0, 0, f"config.json differs at key {diff}")
    wpath = bundle / WEIGHTS
    if not wpath.is_file():
        raise MalformedBundle(wpath, "missing (a --plan-only bundle has no weights to compare)")
    mine = read_header(wpath)
    rw = read_rewrites(bundle)
    if isinstance(rw, str):
        raise MalformedBundle(bundle / "rewrites.json", rw)
    layouts: dict[str, tuple[str, list[str]]] = {
        x.weight: (x.layout, list(x.sources)) for x in rw.layouts
    }
    layouts.update(_tp_slices(bundle))
    store = WeightStore.open(weight_files(source), where=source)
    plans: list[tuple[str, Any, list[_Run], dict[str, Any]]] = []
    for name in sorted(mine, key=lambda n: mine[n].offset):
        b = mine[name]
        exp = _expected(store, name, layouts.get(name), layouts)
        if isinstance(exp, str):
            return SourceReport(bundle, source, 0, 0, f"weight {name!r}: {exp}")
        dtype, shape, runs, entries = exp
        if b.dtype.name != dtype or tuple(b.shape) != shape:
            return SourceReport(
                bundle,
                source,
                0,
                0,
                f"weight {name!r}: {b.dtype.name} {list(b.shape)} in the bundle, "
                f"the source's layout gives {dtype} {list(shape)}",
            )
        if sum(r.nbytes for r in runs) != b.nbytes:
            return SourceReport(
                bundle, source, 0, 0, f"weight {name!r}: {b.nbytes} bytes, the source's differ"
            )
        plans.append((name, b, runs, entries))
    total = sum(b.nbytes for _, b, _, _ in plans)
    done = 0
    maps: dict[Path, mmap.mmap] = {}

    def mapped(p: Path) -> mmap.mmap:
        m = maps.get(p)
        if m is None:
            with p.open("rb") as f:
                m = maps[p] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return m

    try:
        bmap = mapped(wpath)
        for name, b, runs, entries in plans:
            at = b.offset
            for r in runs:
                smap = mapped(r.file)
                for lo in range(0, r.nbytes, CHUNK):
                    n = min(CHUNK, r.nbytes - lo)
                    if r.offset + lo + n > len(smap):
                        raise PlowError(r.file, "safetensors file ended early")
                    got = bmap[at + lo : at + lo + n]
                    want = smap[r.offset + lo : r.offset + lo + n]
                    if got != want:
                        a, w = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
                        k = int(np.flatnonzero(a != w)[0])
                        item = b.dtype.itemsize
                        mine_byte = at + lo + k - b.offset
                        src_byte = r.src_byte + lo + k
                        se = entries[r.src]
                        where = (
                            f"byte {mine_byte}"
                            if b.quant is not None
                            else f"element {_element(tuple(b.shape), item, mine_byte)}"
                        )
                        swhere = (
                            f" byte {src_byte}"
                            if se.quant is not None
                            else _element(tuple(se.shape), item, src_byte)
                        )
                        lay = layouts.get(name)
                        under = f" under {lay[0]}" if lay else ""
                        return SourceReport(
                            bundle,
                            source,
                            len(plans),
                            total,
                            f"weight {name!r}: {where} differs from the source's "
                            f"{r.src}{swhere}{under}",
                        )
                    done += n
                    if on_progress:
                        on_progress(done, total)
                at += r.nbytes
    finally:
        for m in maps.values():
            m.close()
    return SourceReport(bundle, source, len(plans), total, None)
