"""The bundle on disk (docs/bundle.md): compile a checkpoint into a directory, atomically.

```
BUNDLE/
  manifest.json               Manifest (pydantic): model, target, profile, ladder, versions,
                              cost model per bucket, sha256 of every other file
  config.json                 the model config (the runtime rebuilds the spec from it)
  weights.safetensors         every weight the plans read (absent with --plan-only)
  tokenizer.json, tokenizer_config.json, generation_config.json   (when the source has them)
  plan/<bucket>.bin           wire v1 plan file (docs/wire.md)
  plan/<bucket>.ops.json      op table (plow.bundle.files.OpTable)
  plan/<bucket>.schedule.json schedule file (plow.bundle.files.ScheduleFile)
  certificates/<ckpt>.json    written by --verify / `plow verify` (not hashed)
```

Writing is atomic (docs/bundle.md, "Atomicity"): everything is built in
`BUNDLE.partial-HOST-PID-XXXX` next to `BUNDLE`, verified there when asked, then renamed into
place; any failure (an exception, an interrupt, SIGTERM or SIGHUP) removes the partial
directory and leaves an existing `BUNDLE` untouched, and a later compile of `BUNDLE` removes
the partial directories of compiles that were killed outright (their PID is gone). A compile
never writes over its source, and replaces an existing `BUNDLE` only when it is a bundle.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plow.bundle.manifest import (
    MANIFEST,
    TOKENIZER_FILES,
    WEIGHTS,
    CostSummary,
    LadderRung,
    Manifest,
    ModelInfo,
    WeightsInfo,
    gc_paused,
    sha256_file,
)
from plow.bundle.wire import Phase, encode_plan
from plow.compile import CompileResult, StageCallback, Timer, transf_program
from plow.emit.emit import EmittedBucket
from plow.errors import PlowError
from plow.profile import CompileProfile
from plow.target import Target

# Re-layouts applied to weights when copied into the bundle (none in emitter v1: the graph
# keeps gate and up as two linears, so no fused op wants an interleaved layout yet).
RELAYOUT: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BundleResult:
    out: Path
    manifest: Manifest
    plan: CompileResult
    emitted: tuple[EmittedBucket, ...]
    report: Any = None  # plow.emit.verify.VerifyReport when verified
    stage_seconds: dict[str, float] = field(default_factory=dict)


_ST_DTYPE = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def relaid_entry(store: Any, name: str, layout: str, sources: tuple[str, ...]) -> Any:
    """The entry of a re-laid-out weight: `interleave` (`_interleaved`) or `cat3` (R4: the
    rows of the three sources stacked in order, their byte runs one after another). Public:
    the compiler asks it which fusions' re-layouts the writer can store (`PlowError` if not)."""
    if layout == "interleave":
        return _interleaved(store, name, sources)
    if layout.startswith(("rows ", "cols ")):
        return _sliced(store, name, layout, sources[0])
    from plow.checkpoint.fp8 import FP8
    from plow.checkpoint.weights import TensorEntry

    es = [store.entry(s) for s in sources]
    e0 = es[0]
    fmt = {(e.dtype, e.shape[1:], e.quant[0] if e.quant else None) for e in es}
    if layout != "cat3" or len(fmt) != 1 or e0.dtype == FP8:
        raise PlowError(name, f"cannot lay out {', '.join(sources)} as {layout}")
    rows = sum(e.logical_shape[0] for e in es)
    quant = None if e0.quant is None else (e0.quant[0], (rows, e0.quant[1][1]))
    shape = (sum(e.shape[0] for e in es), *e0.shape[1:])
    parts = tuple(p for e in es for p in e.pieces)
    return TensorEntry(e0.file, e0.dtype, shape, e0.offset, sum(e.nbytes for e in es), parts, quant)


class Resolved:
    """`store` whose `entry` also resolves the weights `layouts` names (name -> (layout,
    sources)), so a re-laid-out weight's sources may themselves be re-laid-out: a fused op of
    a tensor-parallel plan concatenates or interleaves its device's slices."""

    def __init__(self, store: Any, layouts: dict[str, tuple[str, tuple[str, ...]]]) -> None:
        self.store, self.layouts = store, layouts

    def entry(self, name: str) -> Any:
        if name in self.layouts:
            return relaid_entry(self, name, *self.layouts[name])
        return self.store.entry(name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.store, attr)


def _sliced(store: Any, name: str, layout: str, source: str) -> Any:
    """A tensor-parallel slice of a 2-D weight (plow/graph/shard.py): `rows A:B` is one byte
    run, `cols A:B` one run per row. Float weights only (block-quantized and fp8 refused)."""
    from plow.checkpoint.fp8 import FP8
    from plow.checkpoint.weights import TensorEntry

    e = store.entry(source)
    axis, span = layout.split(" ")
    a, b = (int(v) for v in span.split(":"))
    if e.parts or e.quant is not None or e.dtype == FP8 or len(e.shape) not in (1, 2):
        raise PlowError(name, f"--tp slices float weights only; {source!r} is stored otherwise")
    shape = list(e.shape)
    item = e.dtype.itemsize
    if axis == "rows":
        rb = item * (shape[1] if len(shape) == 2 else 1)
        shape[0] = b - a
        return TensorEntry(e.file, e.dtype, tuple(shape), e.offset + a * rb, (b - a) * rb)
    rows, cols = shape
    rb = cols * item
    parts = tuple(
        TensorEntry(e.file, e.dtype, (1, b - a), e.offset + r * rb + a * item, (b - a) * item)
        for r in range(rows)
    )
    return TensorEntry(e.file, e.dtype, (rows, b - a), e.offset, rows * (b - a) * item, parts)


def _interleaved(store: Any, name: str, sources: tuple[str, ...]) -> Any:
    """The entry of a weight re-laid-out as `interleave(Wg, Wu)` (R2, plow/egraph/apply.py):
    row 2i is row i of Wg, row 2i + 1 row i of Wu — one byte run per row of each source."""
    from plow.checkpoint.fp8 import FP8
    from plow.checkpoint.weights import TensorEntry

    eg, eu = store.entry(sources[0]), store.entry(sources[1])
    rows = eg.logical_shape[0]
    same = (eg.dtype, eg.shape, eg.quant) == (eu.dtype, eu.shape, eu.quant)
    if not same or eg.parts or eu.parts or eg.dtype == FP8 or eg.shape[0] != rows:
        raise PlowError(name, f"cannot interleave {sources[0]!r} and {sources[1]!r} by rows")
    rb = eg.nbytes // rows
    parts = tuple(
        TensorEntry(e.file, e.dtype, (1, *e.shape[1:]), e.offset + i * rb, rb)
        for i in range(rows)
        for e in (eg, eu)
    )
    quant = None if eg.quant is None else (eg.quant[0], (2 * rows, eg.quant[1][1]))
    shape = (2 * rows, *eg.shape[1:])
    return TensorEntry(eg.file, eg.dtype, shape, eg.offset, 2 * eg.nbytes, parts, quant)


def copy_weights(
    source: Path,
    names: list[str],
    dest: Path,
    layouts: dict[str, tuple[str, tuple[str, ...]]] | None = None,
) -> WeightsInfo:
    """Copy the named tensors from the checkpoint's safetensors files into one file, byte for
    byte (streamed, never whole in RAM), in `names` order. `layouts`: the re-laid-out weights
    (name -> (layout, sources)) the fused ops read, built from their sources' rows."""
    from plow.checkpoint.loader import weight_files
    from plow.checkpoint.quant import METADATA_KEY as QUANT_KEY
    from plow.checkpoint.quant import write_metadata as write_quant_metadata
    from plow.checkpoint.weights import WeightStore, safetensors_header

    store = WeightStore.open(weight_files(source), where=source)
    layouts = layouts or {}
    # fp8 weights travel with their scale tensors (plow.checkpoint.fp8)
    scales = [
        sc
        for n in names
        if n not in layouts and (sc := store.fp8_scale(n)) is not None and sc not in names
    ]
    names = [*names, *scales]
    entries = [Resolved(store, layouts).entry(n) for n in names]
    # blocks are copied as blocks; the metadata says how to read them
    quant = {n: e.quant for n, e in zip(names, entries, strict=True) if e.quant is not None}
    meta = {"format": "pt", "writer": "plow"}
    if quant:
        meta[QUANT_KEY] = write_quant_metadata(quant)
    specs = [
        (n, _ST_DTYPE[e.dtype.name], e.shape, e.nbytes) for n, e in zip(names, entries, strict=True)
    ]
    pos = sum(e.nbytes for e in entries)
    files: dict[Path, Any] = {}
    try:
        with dest.open("wb") as out:
            out.write(safetensors_header(specs, meta))
            # stacked experts, interleaved rows: their parts
            for e in (p for t in entries for p in t.pieces):
                f = files.get(e.file)
                if f is None:
                    f = files[e.file] = e.file.open("rb")
                f.seek(e.offset)
                left = e.nbytes
                while left:
                    chunk = f.read(min(left, 1 << 24))
                    if not chunk:
                        raise PlowError(e.file, "safetensors file ended early")
                    out.write(chunk)
                    left -= len(chunk)
    finally:
        for f in files.values():
            f.close()
    relayout = [*RELAYOUT, *(f"{n}: {lay}" for n, (lay, _) in layouts.items() if n in names)]
    return WeightsInfo(file=WEIGHTS, tensors=len(names), bytes=pos, relayout=relayout)


def source_date_epoch() -> int | None:
    """$SOURCE_DATE_EPOCH (reproducible-builds.org) in seconds, or None when unset."""
    raw = os.environ.get("SOURCE_DATE_EPOCH", "")
    if raw == "":
        return None
    if not raw.isdigit():
        raise PlowError("SOURCE_DATE_EPOCH", f"must be whole seconds since 1970, not {raw!r}")
    return int(raw)


def build_epoch() -> float:
    """When the bundle was built: $SOURCE_DATE_EPOCH if set (two builds of one checkpoint,
    target and profile are then byte-identical, certificates included), else now."""
    fixed = source_date_epoch()
    return time.time() if fixed is None else float(fixed)


def _phase(p: str) -> Phase:
    return Phase.PREFILL if p == "prefill" else Phase.DECODE


def write_bundle_files(
    tmp: Path,
    result: CompileResult,
    emitted: list[EmittedBucket],
    *,
    plan_only: bool,
    stage_seconds: dict[str, float],
) -> Manifest:
    """Write every file of the bundle into `tmp` and return the manifest (written last)."""
    src = Path(result.source)
    src_dir = src if src.is_dir() else src.parent
    config = src / "config.json" if src.is_dir() else src
    (tmp / "plan").mkdir(parents=True)
    shutil.copyfile(config, tmp / "config.json")
    from plow.tiles.summary import TilesFile, bucket_summary

    (tmp / "tiles.json").write_text(
        TilesFile(
            model=str(src),
            family=result.spec.family,
            target=result.target.name,
            profile=result.profile.name,
            buckets=[bucket_summary(b.tiles, b.bounds) for b in result.buckets],
        ).model_dump_json()
    )
    weights = None
    if not plan_only:
        if not src.is_dir():
            raise PlowError(src, "a full bundle needs a checkpoint directory (or pass --plan-only)")
        names: list[str] = []
        for e in emitted:
            for name, t in e.op_table.tensors.items():
                if t.role == "weight" and name not in names:
                    names.append(name)
        layouts = {
            x.weight: (x.layout, x.sources)
            for b in result.buckets
            if b.rewrites is not None
            for x in b.rewrites.layouts
        }
        for b in result.buckets:  # tensor parallel: the slices the ops record
            for op in b.graph.ops:
                for new, source, axis, lo, hi in op.attrs.get("slices", ()):
                    layouts[new] = (f"{('rows', 'cols')[axis]} {lo}:{hi}", (source,))
        weights = copy_weights(src, names, tmp / WEIGHTS, layouts)
        for f in TOKENIZER_FILES:
            if (src_dir / f).is_file():
                shutil.copyfile(src_dir / f, tmp / f)
        if not (tmp / "tokenizer.json").is_file():
            raise PlowError(
                src_dir / "tokenizer.json", "missing: a full bundle ships the tokenizer"
            )
    applied = [b.rewrites for b in result.buckets if b.rewrites is not None]
    if applied:  # the fused ops' blocks, for checkpoint A (plow/egraph/apply.py)
        from plow.egraph.apply import REWRITES_FILE, rewrites_json

        (tmp / REWRITES_FILE).write_text(rewrites_json(applied))
    rungs = []
    by_name = {b.bucket.name: b for b in result.buckets}
    for e in emitted:
        n = e.bucket.name
        plan = f"plan/{n}.bin"
        (tmp / plan).write_bytes(
            encode_plan(
                e.packets,
                phase=_phase(e.bucket.phase.value),
                batch=e.bucket.batch,
                seq=e.bucket.seq,
                workers=e.schedule.workers,
            )
        )
        (tmp / f"plan/{n}.ops.json").write_text(e.op_table.model_dump_json())
        (tmp / f"plan/{n}.schedule.json").write_text(e.schedule.model_dump_json())
        bp = by_name[n]
        rungs.append(
            LadderRung(
                name=n,
                phase=e.bucket.phase.value,
                batch=e.bucket.batch,
                seq=e.bucket.seq,
                context=e.bucket.context,
                plan=plan,
                ops=f"plan/{n}.ops.json",
                schedule=f"plan/{n}.schedule.json",
                packets=len(e.packets),
                tasks=len(e.schedule.tasks.name),
                counters=len(e.schedule.counters.name),
                arena_bytes=e.schedule.arena.arena_bytes,
                cost=CostSummary(
                    budget_ns=bp.budget_ns,
                    bandwidth_bound_ns=float(bp.bounds.bandwidth_bound_ns),
                    compute_bound_ns=float(bp.bounds.compute_bound_ns),
                    estimated_ns=float(bp.bounds.estimated_ns),
                    makespan_ns=e.schedule.makespan_ns,
                ),
            )
        )
    spec = result.spec
    files = {
        str(p.relative_to(tmp)): sha256_file(p)
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
        and p.name != MANIFEST
        and not {"certificates", "payloads"} & set(p.relative_to(tmp).parts)
    }
    manifest = Manifest(
        model=ModelInfo(
            family=spec.family,
            source=str(src),
            config_sha256=sha256_file(config),
            layers=len(spec.layers),
            hidden_size=spec.hidden_size,
            vocab_size=spec.vocab_size,
            parameters=spec.parameter_count(),
        ),
        target=result.target.model_dump(mode="json"),
        profile=result.profile.model_dump(mode="json"),
        ladder=rungs,
        plan_only=plan_only,
        weights=weights,
        files=files,
        compiled_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(build_epoch())),
        # timings are never reproducible: a reproducible build (SOURCE_DATE_EPOCH) leaves them out
        stage_seconds={}
        if source_date_epoch() is not None
        else {k: round(v, 4) for k, v in stage_seconds.items()},
    )
    (tmp / MANIFEST).write_text(manifest.model_dump_json(indent=1))
    return manifest


def _check_full_source(src: Path) -> None:
    """A full bundle needs weights and a tokenizer that fit the config: say so before planning
    (and so before anything is written). Every tensor the config implies is in the safetensors
    files with its shape, and `tokenizer.json` loads with `tokenizers` and fits the vocabulary
    (`plow.checkpoint.load_checkpoint`, the checks `generate` and `serve` make)."""
    from plow.checkpoint.loader import load_checkpoint, weight_files

    if not src.is_dir():
        raise PlowError(src, "a full bundle needs a checkpoint directory: pass --plan-only")
    try:
        weight_files(src)
    except PlowError as e:
        raise PlowError(src, f"{e.problem}: pass --plan-only to plan from the config alone") from e
    if not (src / "tokenizer.json").is_file():
        raise PlowError(src / "tokenizer.json", "missing: a full bundle ships the tokenizer")
    load_checkpoint(src)


# ----------------------------------------------------------------- where the bundle goes

PARTIAL, OLD = "partial", "old"


class CompileTerminated(SystemExit):
    """SIGTERM or SIGHUP arrived during a compile: raised from the signal handler (so every
    `finally` runs and the partial output is removed); exits with status 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name


@contextmanager
def signals_raise() -> Iterator[None]:
    """While compiling, SIGTERM and SIGHUP raise `CompileTerminated` instead of killing the
    process on the spot (their default), so the partial directory is cleaned up. Only in the
    main thread, and only for signals nobody else handles; restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise CompileTerminated(signum)

    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            saved[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


def _host() -> str:
    return "".join(c for c in socket.gethostname() if c.isalnum())[:32] or "host"


def side_prefix(out: Path, kind: str) -> str:
    """The name prefix of `out`'s partial (`kind` "partial") or set-aside ("old") directory
    made by this process: the host and PID say who owns it."""
    return f"{out.name}.{kind}-{_host()}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def remove_stale_siblings(out: Path) -> list[Path]:
    """Remove `out`'s partial and set-aside directories left by compiles on this host whose
    process is gone (killed outright: SIGKILL, a power cut); a set-aside `out` whose swap was
    cut short is renamed back to `out` instead. Directories of live compiles, of other hosts
    and without an owner in their name are left alone. Returns what was removed or restored."""
    parent = out.parent
    pat = re.compile(rf"{re.escape(out.name)}\.({PARTIAL}|{OLD})-([A-Za-z0-9]+)-(\d+)-.+")
    done: list[Path] = []
    try:
        siblings = sorted(parent.iterdir())
    except OSError:
        return done
    for p in siblings:
        m = pat.fullmatch(p.name)
        if m is None or m.group(2) != _host() or _pid_alive(int(m.group(3))):
            continue
        if p.is_symlink() or not p.is_dir():
            continue
        if m.group(1) == OLD and not out.exists() and (p / MANIFEST).is_file():
            try:
                p.rename(out)
                done.append(p)
                continue
            except OSError:
                pass
        shutil.rmtree(p, ignore_errors=True)
        done.append(p)
    return done


def check_destination(source: Path, out: Path, *, replace: bool) -> None:
    """Refuse (one line, `PlowError`) to write `out` when that could lose data: `out` is the
    source checkpoint directory or holds the source; `out` exists inside the source directory;
    `out` exists and `replace` is off; `out` exists and is not a bundle (no manifest.json; an
    empty directory is fine) or is a symbolic link."""
    out, src = Path(out), Path(source)
    dst, src_r = out.resolve(), src.resolve()
    what = "checkpoint directory" if src_r.is_dir() else "config"
    if src_r == dst or src_r.is_relative_to(dst):
        raise PlowError(out, f"is or holds the source {what} {src}: refusing to write over it")
    if not (out.exists() or out.is_symlink()):
        return
    if src_r.is_dir() and dst.is_relative_to(src_r):
        raise PlowError(out, f"exists inside the source {what} {src}: refusing to replace it")
    if out.is_symlink():
        raise PlowError(out, "exists and is a symbolic link: refusing to replace it")
    if not out.is_dir():
        raise PlowError(out, "exists and is not a directory")
    if not replace:
        raise PlowError(out, "exists: pass --force to replace it")
    if not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise PlowError(
            out, "exists and is not a plow bundle (no manifest.json): refusing to replace it"
        )


def compile_bundle(
    source: Path,
    out: Path,
    target: Target,
    profile: CompileProfile,
    *,
    verify: bool = False,
    plan_only: bool = False,
    replace: bool = True,
    on_stage: StageCallback | None = None,
) -> BundleResult:
    """Compile `source` into the bundle directory `out` (atomically; see the module doc).

    `replace`: an existing bundle at `out` is replaced (`plow compile` passes `--force`);
    off, an existing `out` is refused. Never replaced, whatever `replace` says: the source (or
    a directory holding it or inside it) and a directory that is not a bundle.

    Raises `PlanRejected` (exit 1) when a bound or (with `verify`) a checkpoint rejects the
    plan; `out` is then left as it was. With $SOURCE_DATE_EPOCH set the bundle is
    reproducible: the same inputs give the same bytes (docs/bundle.md).
    """
    source_date_epoch()  # a malformed value is refused before any work
    with gc_paused(), signals_raise():
        return _compile_bundle(
            source,
            out,
            target,
            profile,
            verify=verify,
            plan_only=plan_only,
            replace=replace,
            on_stage=on_stage,
        )


def _compile_bundle(
    source: Path,
    out: Path,
    target: Target,
    profile: CompileProfile,
    *,
    verify: bool,
    plan_only: bool,
    replace: bool,
    on_stage: StageCallback | None,
) -> BundleResult:
    timed = Timer(on_stage)  # the driver's stages (plow.compile.PIPELINE), then write, verify
    seconds = timed.seconds
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlowError(out, f"cannot create the parent directory: {e.strerror or e}") from e
    check_destination(Path(source), out, replace=replace)
    remove_stale_siblings(out)
    if not plan_only:
        _check_full_source(Path(source))
    result, emitted = transf_program(Path(source), target, profile, emit=True, timer=timed)
    tmp = Path(tempfile.mkdtemp(prefix=side_prefix(out, PARTIAL), dir=parent))
    old: Path | None = None
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        manifest = timed(
            "write",
            "",
            lambda: write_bundle_files(
                tmp, result, emitted, plan_only=plan_only, stage_seconds=seconds
            ),
        )
        report = None
        if verify:
            from plow.emit.verify import verify_bundle, write_certificates

            report = timed("verify", "", verify_bundle, tmp)
            report.raise_if_rejected()
            write_certificates(report)
            report.bundle = out
        # The destination may have changed during a long compile: check it again.
        check_destination(Path(source), out, replace=replace)
        if out.exists():
            set_aside = parent / f"{side_prefix(out, OLD)}{time.monotonic_ns()}"
            out.rename(set_aside)
            old = set_aside
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            old.rename(out)  # put the previous bundle back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)  # if cut short: removed by the next compile
    return BundleResult(out, manifest, result, tuple(emitted), report, seconds)
