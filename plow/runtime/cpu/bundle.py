"""Loading a bundle (docs/bundle.md) into the CPU executor: the plan of every rung is built
from the bundle's files alone, and the machine runs the plan file's packet stream.

`Bundle.open(path)` reads the manifest, the model config, the tokenizer and the weights
(`weights.safetensors`, memory-mapped), and — unless `verify=False` — refuses a bundle that
is not what was verified (`plow.bundle.open.check_bundle`: every file hash matches, the
certificates A..F are accepted and carry the bundle digest; a stale certificate is refused
and `plow verify` is run once to name what is wrong with the bundle, if anything).

A `--plan-only` bundle has no weights file: `Bundle.open(path, weights=ckpt.weights)` (and
`load_bundle_plan(..., weights=...)`) opens it with the caller's weights (the checkpoint the
bundle was compiled from) after the same checks, and refuses weights that do not match the
op tables (a weight missing, or a shape other than the op table's) in one line. Weights given
for a full bundle are checked the same way and used instead of its own file.

`Bundle.plan(bucket)` (and `load_bundle_plan`) decodes one rung:

- the packets: the plan file, memory-mapped, decoded by `plow.bundle.wire.decode_plan`; tasks
  are grouped by `plow.bundle.stream.group_tasks` (leading wait-only nops, the task packet,
  trailing signal-only nops). Every record is a queue entry of the machine (`Stream`): nops
  run as real entries that only wait or only signal, with the threshold the record carries;
- what a task packet computes: the op table's op `op_index`, the unit range `row_start,
  rows` (tiles, row-major over the op's axes; merges, flag ACCUMULATE: output blocks of the
  split reduction, numbered as `plow.schedule.regions` cuts them), partial vs full from the
  op table's `partial`. The offsets each packet carries are checked against the op table;
- the graph the kernels read shapes and attributes from: rebuilt from the op table;
- the arena: every non-weight, non-cache tensor at the bundle's offset (so tensors the
  arena planner overlaps share words here too, and the checking mode sees the reuse); the
  weights stay in the memory-mapped weights file; the key-value cache is the executor's
  paged pool (docs/runtime.md). Executor-private words (page table, token ring, the
  attention merge's running max/sum) go after the bundle's arena;
- task names, counter names, the task-level edges and `workers_per_gpu` (merge numbering)
  come from the schedule file; waits, signals, thresholds and queues only from the packets.

`compile_cached(checkpoint)` is what `--executor cpu` does with a checkpoint: compile it once
(verified) into `cache_dir()/bundles/<key>`, atomically, and return the bundle's path.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from plow.bundle.files import OpTable, ScheduleFile
from plow.bundle.manifest import WEIGHTS, LadderRung, Manifest, read_manifest
from plow.bundle.open import BundleRefused, check_bundle, is_bundle
from plow.bundle.wire import NO_COUNTER, Flag, Opcode, PacketArray, WireError, decode_plan
from plow.checkpoint import ModelSpec
from plow.checkpoint.loader import spec_from_config
from plow.checkpoint.tokenizer import Tokenizer
from plow.checkpoint.weights import WeightStore
from plow.errors import PlowError
from plow.graph import Bucket, OpGraph, Phase, TensorRole
from plow.graph.mla import kv_halves
from plow.graph.ops import Op, OpKind, Tensor
from plow.graph.shard import pool_kv_heads
from plow.profile import CompileProfile
from plow.runtime.cpu.arena import KVShape, Layout, LayoutBuilder, WordDType
from plow.runtime.cpu.plan import (
    PAGE_TABLE,
    REMAINING,
    RING,
    STATE_SLOT,
    FusedArgmax,
    OpEntry,
    Packet,
    Plan,
    Ranges,
    Stream,
    merge_units,
)
from plow.schedule.regions import REDUCTION_AXIS, partial_name
from plow.target.model import dtype_bytes
from plow.tiles.ir import Axis, Tile, TiledOp

ArenaMode = Literal["bundle", "private"]


# ----------------------------------------------------------------------------- the bundle


def diagnose(bundle: Path) -> tuple[str, str, str] | None:
    """`plow verify`'s first rejection of `bundle` (checkpoint, bucket, reason), or None: what
    the loader says about a bundle whose certificates are stale."""
    from plow.emit.verify import verify_bundle

    r = verify_bundle(bundle).first_rejection()
    return None if r is None else (r.checkpoint, r.bucket, r.reason)


def _bucket(r: LadderRung) -> Bucket:
    return Bucket(Phase(r.phase), r.batch, r.seq, r.context)


@dataclass
class Bundle:
    """An opened bundle (see the module docstring)."""

    path: Path
    manifest: Manifest
    spec: ModelSpec
    ladder: tuple[Bucket, ...]
    weights: Mapping[str, np.ndarray]
    verified: bool
    notes: list[str] = field(default_factory=list)
    _tokenizer: Tokenizer | None = None

    @classmethod
    def open(
        cls,
        path: Path | str,
        *,
        verify: bool = True,
        weights: Mapping[str, np.ndarray] | None = None,
    ) -> Bundle:
        """`weights`: the caller's weights (a plan-only bundle needs them; see the module
        docstring), checked against every rung's op table."""
        path = Path(path)
        m = read_manifest(path)
        if m.plan_only and weights is None:
            raise BundleRefused(
                path,
                "a --plan-only bundle has no weights: it cannot run without the checkpoint's "
                "weights",
            )
        notes = check_bundle(path, m, diagnose=diagnose) if verify else []
        cfg_path = path / "config.json"
        try:
            config = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise BundleRefused(cfg_path, f"unreadable: {e}") from e
        spec = spec_from_config(config, cfg_path)
        if weights is None:
            weights = WeightStore.open([path / WEIGHTS])
        else:
            weights = _with_layouts(path, weights)
            _check_weights(path, m, weights)
        ladder = tuple(_bucket(r) for r in m.ladder)
        return cls(path, m, spec, ladder, weights, verify, notes)

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.load(self.path)
        return self._tokenizer

    def rung(self, bucket: Bucket | str) -> LadderRung:
        name = bucket if isinstance(bucket, str) else bucket.name
        for r in self.manifest.ladder:
            if r.name == name:
                return r
        have = ", ".join(r.name for r in self.manifest.ladder)
        raise BundleRefused(self.path, f"no bucket {name!r} in the ladder (have {have})")

    @property
    def tp(self) -> int:
        """Devices of a tensor-parallel bundle (plow/graph/shard.py; 1: not sharded)."""
        return int(self.manifest.target.get("gpus", 1))

    def default_kv(self, block_size: int = 16, blocks: int | None = None) -> KVShape:
        ctx = max(b.context for b in self.ladder)
        rows = max(b.batch for b in self.ladder)
        s, tp = self.spec, self.tp
        n = blocks or 2 * rows * -(-ctx // block_size)
        # tensor parallel: pool layer n * tp + d holds device d's part of the kv heads
        return KVShape(
            s.num_layers * tp, n, pool_kv_heads(s.num_kv_heads, tp), block_size, s.head_dim,
            halves=kv_halves(s),
        )  # fmt: skip

    def plan(
        self,
        bucket: Bucket | str,
        *,
        kv: KVShape | None = None,
        ring: int = 8,
        arena: ArenaMode = "bundle",
    ) -> Plan:
        r = self.rung(bucket)
        return _load_plan(self.path, r, kv or self.default_kv(), ring, arena)


def load_bundle_plan(
    bundle_dir: Path | str,
    bucket: Bucket | str,
    *,
    kv: KVShape | None = None,
    ring: int = 8,
    verify: bool = True,
    arena: ArenaMode = "bundle",
    weights: Mapping[str, np.ndarray] | None = None,
) -> Plan:
    """The executor's plan of one rung, from the bundle's files (module docstring);
    `weights` opens a plan-only bundle with the caller's weights."""
    b = Bundle.open(bundle_dir, verify=verify, weights=weights)
    return b.plan(bucket, kv=kv, ring=ring, arena=arena)


class _Relaid(Mapping[str, np.ndarray]):
    """The caller's (checkpoint) weights plus the re-laid-out ones a fused bundle's op tables
    read, built on first use from their sources as `rewrites.json` records them
    (`interleave`: row 2i of the first, 2i + 1 of the second; `cat3`: stacked by rows)."""

    def __init__(self, base: Mapping[str, np.ndarray], layouts: dict[str, Any]) -> None:
        self._base, self._layouts = base, layouts
        self._built: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        lay = self._layouts.get(name)
        if lay is None:
            return self._base[name]
        if name not in self._built:
            src = [np.asarray(self._base[s]) for s in lay.sources]
            if lay.layout == "interleave":
                out = np.empty((2 * src[0].shape[0], *src[0].shape[1:]), src[0].dtype)
                out[0::2], out[1::2] = src
            else:
                out = np.concatenate(src, axis=0)
            self._built[name] = out
        return self._built[name]

    def __contains__(self, name: object) -> bool:
        if name in self._layouts:
            return all(s in self._base for s in self._layouts[name].sources)
        return name in self._base

    def __iter__(self) -> Any:
        yield from self._base
        yield from (n for n in self._layouts if n not in self._base)

    def __len__(self) -> int:
        return len(self._base) + sum(n not in self._base for n in self._layouts)


def _with_layouts(bundle: Path, weights: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """`weights` (a plan-only bundle's checkpoint weights), with the re-laid-out weights of
    a fused bundle (`rewrites.json`) derived from them; as given when it has none."""
    from plow.oracle.payloads.rewrites import read_rewrites

    rw = read_rewrites(bundle)
    if isinstance(rw, str):
        raise BundleRefused(bundle / "rewrites.json", rw)
    layouts = {x.weight: x for x in rw.layouts if x.weight not in weights}
    for x in layouts.values():
        gone = next((s for s in x.sources if s not in weights), None)
        if gone is not None:
            raise BundleRefused(
                bundle,
                f"the weights do not match the bundle: no tensor {gone!r} (a source of "
                f"{x.weight!r}, rewrites.json)",
            )
    return _Relaid(weights, layouts) if layouts else weights


def _check_weights(bundle: Path, m: Manifest, weights: Mapping[str, np.ndarray]) -> None:
    """Every weight of every rung's op table is in `weights` with the op table's shape, else
    `BundleRefused` (one line, naming the first mismatch)."""
    seen: set[str] = set()
    for r in m.ladder:
        try:
            ot = OpTable.model_validate_json((bundle / r.ops).read_bytes())
        except (OSError, ValueError) as e:
            raise BundleRefused(bundle / r.ops, f"unreadable: {str(e).splitlines()[0]}") from e
        for name, t in ot.tensors.items():
            if t.role != "weight" or name in seen:
                continue
            seen.add(name)
            if name not in weights:
                raise BundleRefused(
                    bundle, f"the weights do not match the bundle: no tensor {name!r}"
                )
            shape = tuple(weights[name].shape)
            if shape != tuple(t.shape):
                raise BundleRefused(
                    bundle,
                    f"the weights do not match the bundle: {name!r} has shape {list(shape)}, "
                    f"the op table {r.ops} says {list(t.shape)}",
                )


# ----------------------------------------------------------------------------- one plan


def _map_plan(path: Path) -> tuple[Any, PacketArray]:
    """Decode a plan file memory-mapped (the records are a view of the mapping)."""
    try:
        with path.open("rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise BundleRefused(path, f"cannot map the plan file: {e}") from e
    try:
        return decode_plan(memoryview(mm))
    except WireError as e:
        raise BundleRefused(path, str(e)) from e


def _graph(ot: OpTable) -> OpGraph:
    tensors = {
        n: Tensor(n, tuple(t.shape), TensorRole(t.role), t.dtype)
        for n, t in ot.tensors.items()
        if t.role != "scratch"
    }
    ops = tuple(
        Op(o.name, OpKind(o.kind), tuple(o.inputs), tuple(o.outputs), dict(o.attrs), o.layer)
        for o in ot.ops
    )
    return OpGraph(ops, tensors, ot.bucket)


def _tiles(axes: tuple[Axis, ...]) -> list[Ranges]:
    out = []
    for ks in itertools.product(*(range(a.steps) for a in axes)):
        out.append(
            tuple(
                (k * a.tile, min((k + 1) * a.tile, a.extent)) for k, a in zip(ks, axes, strict=True)
            )
        )
    return out


def _tiled_op(o: Any, axes: tuple[Axis, ...], ranges: list[Ranges]) -> TiledOp:
    tiles = tuple(
        Tile(
            o.name,
            j,
            r,
            any((k0 // a.tile + 1) * a.tile > a.extent for (k0, _), a in zip(r, axes, strict=True)),
        )
        for j, r in enumerate(ranges)
    )
    return TiledOp(
        name=o.name,
        kind=o.kind,
        layer=o.layer,
        rate="fp32",
        axes=axes,
        flops_per_point=o.cost.flops_per_point,
        flops=o.cost.flops,
        bytes=o.cost.bytes,
        weight_bytes=0,
        candidates=(),
        chosen=0,
        tiles=tiles,
        inputs=tuple(o.inputs),
        outputs=tuple(o.outputs),
    )


def _layout(
    ot: OpTable,
    ops: tuple[OpEntry, ...],
    kv: KVShape,
    ring: int,
    where: Path,
    arena: ArenaMode = "bundle",
    fused: FusedArgmax | None = None,
) -> Layout:
    """The bundle's arena offsets as word offsets (module docstring). With element size `e`
    the smallest of the activation dtypes, byte offset `o` maps to word `(o - base) / e`: a
    monotone map, so tensors disjoint in the bundle stay disjoint and overlapping ones
    overlap; every fp32 / int32 slot fits because a tensor of `n` elements has `>= n * e`
    bytes.

    `arena="private"` gives every tensor words of its own instead (only `sample` keeps
    sharing `ids`'s words, the executor's contract with the host): a diagnosis mode that
    takes the arena planner's reuse out of the picture and keeps the packet stream."""
    # recurrent state (Mamba-2) lives in the arena's state region, by slot (`StateShape`)
    act = {n: t for n, t in ot.tensors.items() if t.role not in ("weight", "cache", "state")}
    if not act:
        raise BundleRefused(where, "no activation tensors in the op table")
    e = min(dtype_bytes(t.dtype) for t in act.values())
    base = min(t.offset for t in act.values())

    def word(name: str) -> int:
        off = act[name].offset - base
        if off % e:
            raise BundleRefused(where, f"tensor {name!r}: offset {act[name].offset} misaligned")
        return off // e

    lb = LayoutBuilder()
    private_words: dict[str, int] = {}
    for n, t in act.items():
        dt: WordDType = "int32" if t.dtype == "int32" else "float32"
        if arena == "bundle":
            if t.role != "scratch":
                lb.place(n, word(n), tuple(t.shape), dt)
        elif n == "sample" and t.offset == act["ids"].offset and "ids" in private_words:
            lb.place(n, private_words["ids"], tuple(t.shape), dt)  # the sampled id -> ids
        else:
            private_words[n] = lb.top
            lb.reserve(lb.top + max(int(np.prod(t.shape)), -(-t.size // 4), 1))
            if t.role != "scratch":
                lb.place(n, private_words[n], tuple(t.shape), dt)
    if arena == "bundle":
        for n, t in act.items():
            lb.reserve(word(n) + -(-t.size // e))
        lb.reserve(-(-(ot.arena_bytes - base) // e))
    ids = ot.tensors["ids"].shape
    ctx = next((t.shape[2] for t in ot.tensors.values() if t.role == "cache"), 1)
    private: list[tuple[str, tuple[int, ...], WordDType]] = []
    for op in ops:
        if op.reduction_axis is None:
            continue
        s = op.steps[op.reduction_axis]
        pn = partial_name(op.name)
        if pn not in act:
            raise BundleRefused(where, f"op {op.name!r} is split but {pn!r} has no place")
        at = word(pn) if arena == "bundle" else private_words[pn]
        cap = act[pn].size // e if arena == "bundle" else int(np.prod(act[pn].shape))
        shapes: list[tuple[str, tuple[int, ...], WordDType]]
        if op.kind in ("linear", "lm_head", "expert_linear", "linear_qkv", "linear_glu"):
            cols = op.extents[1] * (2 if op.kind == "linear_glu" else 1)  # glu: gate, up pairs
            shapes = [(pn, (s, op.extents[0], cols), "float32")]
        elif op.kind == "attention":
            shapes = [(pn, (s, op.extents[0], op.extents[2]), "float32")]
            private.append((pn + ".ml", (s, op.extents[0], 2), "float32"))
        elif op.kind in ("rmsnorm", "add_rmsnorm"):
            shapes = [(pn, (s, op.extents[0]), "float32")]
        elif op.kind == "sample":  # [steps, B, 2]: the values, then the indices
            shapes = [
                (pn, (s, op.extents[0]), "float32"),
                (pn + ".index", (s, op.extents[0]), "int32"),
            ]
        else:
            raise BundleRefused(where, f"no partial layout for a split {op.kind} op")
        for pname, pshape, pdt in shapes:
            words = int(np.prod(pshape))
            if words > cap:
                raise BundleRefused(where, f"{pn!r} is too small for {pname!r} {pshape}")
            lb.place(pname, at, pshape, pdt)
            at += words
            cap -= words
    for pname, pshape, pdt in private:
        lb.add(pname, pshape, pdt)
    if fused is not None:  # the compiler's argmax buffers, at their arena-map offsets
        for pname, pdt in ((fused.values, "float32"), (fused.index, "int32")):
            if pname not in act or act[pname].shape != [fused.chunks, _lm_rows(ops, fused)]:
                raise BundleRefused(where, f"{pname!r} is not [{fused.chunks}, M] in the op table")
            at = word(pname) if arena == "bundle" else private_words[pname]
            lb.place(pname, at, (fused.chunks, _lm_rows(ops, fused)), pdt)
    lb.add(PAGE_TABLE, (ids[0], -(-max(1, ctx) // kv.block_size)), "int32")
    lb.add(RING, (ring, ids[0]), "int32")
    lb.add(REMAINING, (ids[0],), "int32")
    if any(t.role == "state" for t in ot.tensors.values()):
        lb.add(STATE_SLOT, (ids[0],), "int32")
    return lb.build()


def _load_plan(
    bundle: Path, rung: LadderRung, kv: KVShape, ring: int, arena: ArenaMode = "bundle"
) -> Plan:
    from plow.bundle.stream import Grouped, group_tasks

    ops_path, plan_path = bundle / rung.ops, bundle / rung.plan
    try:
        ot = OpTable.model_validate_json(ops_path.read_bytes())
        sf = ScheduleFile.model_validate_json((bundle / rung.schedule).read_bytes())
    except (OSError, ValueError) as e:
        raise BundleRefused(bundle / rung.ops, f"unreadable: {str(e).splitlines()[0]}") from e
    bucket = _bucket(rung)
    header, arr = _map_plan(plan_path)
    graph = _graph(ot)
    # -- the op table
    ops: list[OpEntry] = []
    tile_ranges: list[list[Ranges]] = []
    tops: list[TiledOp] = []
    for o in ot.ops:
        axes = tuple(Axis(a.name, a.extent, a.tile, a.steps) for a in o.axes)
        red = REDUCTION_AXIS.get(o.kind)
        split = red is not None and red < len(axes) and axes[red].steps > 1
        if split != (o.partial is not None):
            raise BundleRefused(ops_path, f"op {o.name!r}: partial buffer disagrees with its axes")
        if o.kind == "attention":  # its heads in its pool layer (--tp: `cache_layer`)
            layer = int(o.attrs.get("cache_layer", o.layer or 0))
            if int(o.attrs.get("kv_heads", 0)) > kv.kv_heads or not 0 <= layer < kv.layers:
                raise BundleRefused(
                    ops_path,
                    f"op {o.name!r}: {o.attrs.get('kv_heads')} key-value heads in pool layer "
                    f"{layer}, the pool has {kv.layers} layers of {kv.kv_heads} heads",
                )
        op_tiles = _tiles(axes)
        tile_ranges.append(op_tiles)
        tops.append(_tiled_op(o, axes, op_tiles))
        ops.append(
            OpEntry(
                name=o.name,
                kind=o.kind,
                inputs=tuple(o.inputs),
                outputs=tuple(o.outputs),
                attrs=dict(o.attrs),
                layer=o.layer,
                extents=tuple(a.extent for a in axes),
                tiles=tuple(a.tile for a in axes),
                steps=tuple(a.steps for a in axes),
                reduction_axis=red if split else None,
            )
        )
    merges = {
        i: merge_units(graph, tops[i], op, sf.workers_per_gpu)
        for i, op in enumerate(ops)
        if op.reduction_axis is not None
    }
    # -- the stream: every record is a queue entry
    grouped = group_tasks(arr)
    if isinstance(grouped, str):
        raise BundleRefused(plan_path, grouped)
    assert isinstance(grouped, Grouped)
    n_tasks = len(grouped.tasks)
    if n_tasks != len(sf.tasks.name):
        raise BundleRefused(
            plan_path, f"{n_tasks} tasks in the packets, {len(sf.tasks.name)} in the schedule file"
        )
    cols = {f: arr[f].tolist() for f in (
        "opcode", "flags", "worker", "op_index", "wait_counter", "wait_threshold",
        "signal_counter", "row_start", "rows", "in_offset", "out_offset",
    )}  # fmt: skip
    n = len(cols["opcode"])
    nc = len(sf.counters.name)
    task_of = [0] * n
    for g, members in enumerate(grouped.tasks):
        for p in members:
            task_of[p] = g
    mains = set(grouped.main)
    waits: list[tuple[tuple[int, int], ...]] = []
    sigs: list[tuple[int, ...]] = []
    for p in range(n):
        wc, sc = cols["wait_counter"][p], cols["signal_counter"][p]
        for c in (wc, sc):
            if c != NO_COUNTER and not 0 <= c < nc:
                raise BundleRefused(plan_path, f"packet {p}: counter {c} does not exist ({nc})")
        waits.append(((wc, cols["wait_threshold"][p]),) if wc != NO_COUNTER else ())
        sigs.append((sc,) if sc != NO_COUNTER else ())
    nw = max([header.workers, *(w + 1 for w in cols["worker"])])
    queues: list[list[int]] = [[] for _ in range(nw)]
    for p, w in enumerate(cols["worker"]):
        queues[w].append(p)
    offs = {name: t.offset for name, t in ot.tensors.items()}
    # -- what each task packet computes
    packets: list[Packet] = []
    for g, m in enumerate(grouped.main):
        oi = cols["op_index"][m]
        if not 0 <= oi < len(ops):
            raise BundleRefused(plan_path, f"packet {m}: op {oi} outside the op table")
        op = ops[oi]
        a, k = cols["row_start"][m], cols["rows"][m]
        if cols["opcode"][m] == Opcode.LOAD:
            packets.append(Packet(g, oi, "load", ()))
            continue
        pn = partial_name(op.name)
        if cols["flags"][m] & Flag.ACCUMULATE:
            mu = merges.get(oi)
            if mu is None or a + k > len(mu):
                raise BundleRefused(
                    plan_path, f"packet {m}: merge of blocks {a}..{a + k} of {op.name!r}"
                )
            if cols["in_offset"][m] != offs[pn]:
                raise BundleRefused(plan_path, f"packet {m}: in_offset is not {pn!r}'s offset")
            units = mu[a : a + k]
            packets.append(
                Packet(
                    g,
                    oi,
                    "merge",
                    tuple(u.ranges for u in units),
                    cols=tuple(u.cols for u in units),
                )
            )
            continue
        if a + k > len(tile_ranges[oi]):
            raise BundleRefused(plan_path, f"packet {m}: tiles {a}..{a + k} of {op.name!r}")
        ranges = tuple(tile_ranges[oi][a : a + k])
        want = pn if op.reduction_axis is not None else op.outputs[0]
        if cols["out_offset"][m] != offs[want]:
            raise BundleRefused(
                plan_path,
                f"packet {m}: out_offset {cols['out_offset'][m]} but the op table puts "
                f"{want!r} at {offs[want]}",
            )
        if op.reduction_axis is not None:
            red = op.reduction_axis
            steps = tuple(r[red][0] // op.tiles[red] for r in ranges)
            packets.append(Packet(g, oi, "partial", ranges, steps))
        else:
            packets.append(Packet(g, oi, "compute", ranges))
    fe = sf.edges
    stream = Stream(
        task_of=tuple(task_of),
        runs=tuple(p in mains for p in range(n)),
        waits=tuple(waits),
        signals=tuple(sigs),
        packet=tuple(range(n)),
        queues=tuple(tuple(q) for q in queues),
        main=tuple(grouped.main),
        task_names=tuple(sf.tasks.name),
        task_workers=tuple(cols["worker"][m] for m in grouped.main),
        counter_names=tuple(sf.counters.name),
        edges=tuple((fe[i], fe[i + 1]) for i in range(0, len(fe) - 1, 2)),
        from_packets=True,
    )
    fused = _fused_argmax(ot, sf, cols, grouped.main, ops_path)
    layout = _layout(ot, tuple(ops), kv, ring, ops_path, arena, fused)
    return Plan(
        bucket,
        graph,
        None,
        None,
        tuple(ops),
        tuple(packets),
        layout,
        kv,
        ring,
        stream,
        str(bundle),
        fused,
    )


def _lm_rows(ops: tuple[OpEntry, ...], f: FusedArgmax) -> int:
    return next(o.extents[0] for o in ops if o.name == f.lm_head)


def _fused_argmax(
    ot: OpTable, sf: ScheduleFile, cols: dict[str, list[int]], main: Any, where: Path
) -> FusedArgmax | None:
    """Greedy fused into lm_head as the compiler decided it (plow/bundle/argmax.py): the op
    table's `argmax` on the lm_head and sample ops, every non-load packet of both carrying
    FUSED_ARGMAX (checkpoint E's rule, checked again here), the chunk bounds by the same rule
    from the same op table. Nothing is fused that the bundle does not say."""
    from plow.bundle.argmax import argmax_bounds, argmax_problem, fused_pair

    named = [i for i, o in enumerate(ot.ops) if o.argmax is not None]
    for m in main:
        oi = cols["op_index"][m]
        if cols["opcode"][m] == Opcode.LOAD or not 0 <= oi < len(ot.ops):
            continue
        if bool(cols["flags"][m] & Flag.FUSED_ARGMAX) != (ot.ops[oi].argmax is not None):
            raise BundleRefused(
                where,
                f"packet {m} of op {ot.ops[oi].name!r}: FUSED_ARGMAX "
                f"{'set' if cols['flags'][m] & Flag.FUSED_ARGMAX else 'clear'} but the op "
                f"table {'names no' if ot.ops[oi].argmax is None else 'names an'} argmax buffer",
            )
    problem = argmax_problem(ot, sf.workers_per_gpu)
    if problem is not None:
        raise BundleRefused(where, problem)
    pair = fused_pair(ot.ops)
    if not named or pair is None:
        return None
    lm = ot.ops[pair[0]]
    bounds = argmax_bounds(ot, lm, sf.workers_per_gpu)
    return FusedArgmax(lm.name, ot.ops[pair[1]].name, bounds)


# ----------------------------------------------------------------------------- the cache


NO_BUDGET_NS = 3_600 * 10**9  # an hour per step (per prefill token): no budget in effect


def cache_profile(
    max_position: int, max_batch: int = 8, max_prefill_tokens: int = 512, token_bytes: int = 0
) -> CompileProfile:
    """The ladder a checkpoint run on `--executor native|cpu` is compiled for: decode batches
    1, 2, 4, ... up to `max_batch` (at least 8); prefill rungs of 16 to 512 tokens
    (`plow.profile.serve_prefill_seqs`: up to the context and `max_prefill_tokens`, the
    longer ones while `token_bytes` per token fits the arena allowance)."""
    from plow.profile import serve_prefill_seqs

    ctx = min(max_position, 2048)
    batches = [1]
    while batches[-1] < max(8, max_batch):
        batches.append(min(batches[-1] * 2, max(8, max_batch)))
    return CompileProfile(
        name="cpu-executor",
        decode_batches=tuple(batches),
        prefill_seqs=serve_prefill_seqs(ctx, max_prefill_tokens, token_bytes),
        context=ctx,
        # no step budget: a budget is the user's choice (`plow compile` with a profile); the
        # plan's own bounds still hold against the target
        decode_budget_ns=NO_BUDGET_NS,
        prefill_budget_ns_per_token=NO_BUDGET_NS,
    )


def _weights_index(src: Path) -> bytes:
    """What identifies the checkpoint's weights without reading them: each safetensors file's
    name, size and header (the index of tensors, dtypes, shapes and offsets)."""
    from plow.checkpoint.loader import weight_files

    h = hashlib.sha256()
    for f in weight_files(src):
        h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with f.open("rb") as fh:
            hlen = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(hlen, 1 << 26)))
    return h.digest()


def cache_key(src: Path, target: Any, profile: CompileProfile) -> str:
    import plow
    from plow.bundle.wire import WIRE_VERSION

    h = hashlib.sha256()
    h.update((src / "config.json").read_bytes())
    h.update(_weights_index(src))
    h.update(json.dumps(target.model_dump(mode="json"), sort_keys=True).encode())
    h.update(profile.model_dump_json().encode())
    h.update(f"plow {plow.__version__} wire {WIRE_VERSION}".encode())
    h.update(_verifier_fingerprint())
    return h.hexdigest()[:32]


def _verifier_fingerprint() -> bytes:
    """What certifies a cached bundle: the oracle binary and the code that writes bundles and
    derives their payloads. A change to either compiles (and certifies) afresh, instead of
    reusing certificates of another format that `Bundle.open` would then re-check or refuse."""
    from plow.oracle.runner import oracle_binary

    h = hashlib.sha256()
    try:
        h.update(oracle_binary().read_bytes())
    except PlowError:
        h.update(b"no oracle")
    pkg = Path(__file__).resolve().parents[2]
    for sub in ("bundle", "emit", "oracle", "memory", "schedule", "tiles"):
        for f in sorted((pkg / sub).rglob("*.py")):
            h.update(f.read_bytes())
    return h.digest()


def _note(msg: str) -> None:
    print(f"plow: {msg}", file=sys.stderr)


def compile_cached(
    source: Path | str,
    *,
    target: str = "cpu",
    profile: CompileProfile | None = None,
    max_batch: int = 8,
    max_prefill_tokens: int = 512,
) -> Path:
    """The bundle of checkpoint `source` in the cache, compiled (verified, atomically) on
    first use; later calls with the same config, weights index, target and profile reuse it.
    Target "cpu" is this machine's calibration (measured on first use, cached per machine)."""
    from plow.checkpoint.loader import load_spec
    from plow.default_model import cache_dir
    from plow.emit.bundle import compile_bundle
    from plow.target import load_target
    from plow.target.calibrate import cached_cpu_target

    src = Path(source)
    spec = load_spec(src)
    # "cpu" is this machine: calibrated on first use, then cached (its workers = usable cores)
    tgt = cached_cpu_target(cache_dir(), _note) if target == "cpu" else load_target(target)
    # one prefill token's logits and widest activations, fp32 (the arena allowance's unit)
    token_bytes = 4 * (spec.vocab_size + 2 * spec.intermediate_size + 4 * spec.hidden_size)
    prof = profile or cache_profile(spec.max_position, max_batch, max_prefill_tokens, token_bytes)
    out = cache_dir() / "bundles" / cache_key(src, tgt, prof)
    if is_bundle(out) and all((out / "certificates" / f"{c}.json").is_file() for c in "AF"):
        return out  # (a cached bundle from before checkpoint A is compiled again)
    compile_bundle(src, out, tgt, prof, verify=True)
    return out
