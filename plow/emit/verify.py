"""`plow verify BUNDLE`: re-derive every checkpoint payload from the bundle's own files and
run the oracle on each (docs/bundle.md "Verify").

Nothing comes from the compiler's memory. The numbers the checks compare against come from
the named target's shipped spec (or the cpu calibration recorded in the manifest) and the
manifest's profile (`bundle_target`, `expected_numbers`), never from the file checked. Per
bucket:

- A from the op table file against the graph the bundle's `config.json` lowers to, with the
  blocks of `rewrites.json` (`plow.oracle.runner.run_checkpoint_a`, docs/egraph.md);
- B from the *plan file's task packets* (per op: unit ranges, opcode, flags) and the op
  table (axes, flops, charged cost, bytes, opcode, tensor shapes and attributes, merge-unit
  counts of split reductions): the oracle checks the tiling, that the tasks partition each
  op's tiles, that extents are the tensors' shapes and opcodes and `MASKED` the op's;
- C from the schedule file's page columns (windows per worker), the target's page budget;
- D from the *plan file's packets*: the stream is parsed back into tasks (`group_tasks`:
  per worker queue, leading wait-only `nop`s, the task packet, trailing signal-only `nop`s);
  a task waits on the counters its packets wait on, with the thresholds the packets carry,
  and signals the counters its packets signal; a counter's scope is its signalling
  packets'; queues are the packets' `worker` fields in file order; the edges are the
  schedule file's. A counter waited on with two different thresholds becomes one payload
  counter per threshold (each must equal the number of signallers). The dependencies come
  from data flow (`dataflow_from_packets`), checked by the oracle's sweep at every plan
  size; no verdict is decided in Python;
- E from the plan file's record bytes, the packets decoded from them and the op table's
  operands at their arena-map offsets (`plow.oracle.payloads.wire.emit_ops`): the oracle
  decodes the bytes itself, then checks every decoded record's offsets, column range and
  flags against the emitter's rules (Plow.Emitcheck; nothing is re-emitted);
- F from the schedule file's arena map, with sizes from the op table's shapes and dtypes
  and live ranges from the op table's op order (`plow.memory.live_ranges`), every buffer's
  accessor tasks (the packets' op and stage, the op table's operands) and D's counter
  protocol and sweep order (`plow.oracle.payloads.alloc.with_sharing`): the oracle
  requires every two buffers sharing bytes to be ordered by happens-before.

Bundle-level checks (row `bundle`): the manifest parses, every file hash matches (the
mismatching file is named), the op table's offsets equal the arena map's, the weights
file holds every weight the op tables name with its shape, the target is the shipped spec,
the files' declared numbers are the target's and the profile's, and the ladder is the
profile's with every rung's files holding its bucket. Every certificate carries the bundle
digest (`bundle_digest`), which the runtime's loader compares.
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from pydantic import ValidationError

from plow.bundle.argmax import argmax_problem
from plow.bundle.files import OpEntry, OpTable, ScheduleFile, TensorEntry
from plow.bundle.manifest import (
    CERTIFICATES,
    CHECKPOINTS,
    MANIFEST,
    WEIGHTS,
    LadderRung,
    MalformedBundle,
    Manifest,
    bundle_digest,
    certificate_file_problems,
    gc_paused,
    hash_problems,
    load_json,
    read_manifest,
    sha256_file,
)
from plow.bundle.stream import Grouped, group_tasks
from plow.bundle.wire import (
    HEADER_SIZE,
    NO_COUNTER,
    RECORD_SIZE,
    VALUE_FIELDS,
    Flag,
    Opcode,
    PacketArray,
    Phase,
    PlanHeader,
    WireError,
    decode_plan,
)
from plow.errors import ConfigError, PlanRejected, PlowError
from plow.graph import Bucket
from plow.graph import Phase as GraphPhase
from plow.memory.arena import ALIGN, alloc_payload, live_ranges
from plow.memory.onchip import TaskPages, page_windows, split_timeline
from plow.oracle import Certificate, run_checkpoint
from plow.oracle.payloads.alloc import with_sharing
from plow.oracle.payloads.counters import (
    Counter,
    CounterPayload,
    Edge,
    Task,
    with_ranks,
)
from plow.oracle.payloads.dataflow import (
    COMPUTE,
    LOAD,
    MERGE,
    TaskUnits,
    dataflow_payload,
    sweep_order,
    task_accesses,
)
from plow.oracle.payloads.wire import emit_ops
from plow.oracle.runner import run_checkpoint_a
from plow.profile import CompileProfile
from plow.target import Target, load_target, shipped_targets
from plow.target.model import dtype_bytes, rate_class

_T = TypeVar("_T")
SCOPE_NAMES = ("cta", "device", "system")  # wire scope codes 0, 1, 2


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the certificate table."""

    checkpoint: str
    bucket: str
    verdict: str  # accept / reject
    theorems: tuple[str, ...] = ()
    reason: str = ""
    certificate: Certificate | None = None
    payload: dict[str, Any] | None = None  # kept for checkpoint B (payloads/B/<bucket>.json)

    @property
    def rejected(self) -> bool:
        return self.verdict == "reject"


@dataclass(slots=True)
class VerifyReport:
    bundle: Path
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bundle_sha256: str = ""  # bundle_digest of the bundle verified

    @property
    def accepted(self) -> bool:
        return not any(r.rejected for r in self.rows)

    def first_rejection(self) -> Row | None:
        return next((r for r in self.rows if r.rejected), None)

    def raise_if_rejected(self) -> None:
        r = self.first_rejection()
        if r is not None:
            where = f"checkpoint {r.checkpoint}" + (f", bucket {r.bucket}" if r.bucket else "")
            raise PlanRejected(where, r.reason or "rejected")


# ----------------------------------------------------------------- D from the packets


@dataclass(frozen=True, slots=True)
class CounterGraph:
    """The checkpoint D instance derived from a plan file, as plain lists (the payload for
    the oracle, or the input of the Python check on large plans)."""

    names: list[str]
    workers: list[int]
    waits: list[list[int]]
    signals: list[list[int]]
    queues: list[list[int]]
    counter_names: list[str]
    thresholds: list[int]
    scopes: list[str]
    edges: list[int]  # flat (producer, consumer) pairs
    workers_per_gpu: int | None = None  # None: one GPU (the oracle's default)

    def payload(self) -> CounterPayload:
        p = CounterPayload(
            tasks=[
                Task(name=n, worker=w, waits=wa, signals=si)
                for n, w, wa, si in zip(
                    self.names, self.workers, self.waits, self.signals, strict=True
                )
            ],
            queues=self.queues,
            counters=[
                Counter(name=n, threshold=t, scope=sc)  # type: ignore[arg-type]
                for n, t, sc in zip(self.counter_names, self.thresholds, self.scopes, strict=True)
            ],
            edges=[
                Edge(producer=self.edges[k], consumer=self.edges[k + 1])
                for k in range(0, len(self.edges), 2)
            ],
        )
        p = with_ranks(p)
        return (
            p
            if self.workers_per_gpu is None
            else p.model_copy(update={"workers_per_gpu": self.workers_per_gpu})
        )

    def payload_dict(self) -> dict[str, object]:
        """`payload().model_dump(mode="json")` built directly (no model per task or edge);
        the ranks are `topological_ranks`' (`fifo_ranks`)."""
        e = self.edges
        return {
            "tasks": [
                {"name": n, "worker": w, "waits": wa, "signals": si}
                for n, w, wa, si in zip(
                    self.names, self.workers, self.waits, self.signals, strict=True
                )
            ],
            "queues": self.queues,
            "counters": [
                {"name": n, "threshold": t, "scope": sc}
                for n, t, sc in zip(self.counter_names, self.thresholds, self.scopes, strict=True)
            ],
            "edges": [
                {"producer": u, "consumer": t} for u, t in zip(e[0::2], e[1::2], strict=True)
            ],
            "ranks": fifo_ranks(self.waits, self.signals, self.queues),
            **({} if self.workers_per_gpu is None else {"workers_per_gpu": self.workers_per_gpu}),
        }


def fifo_ranks(
    waits: list[list[int]], signals: list[list[int]], queues: list[list[int]]
) -> list[int]:
    """`plow.oracle.payloads.counters.topological_ranks` of a payload with these tasks and
    queues, without expanding must-precede into its (signaller, waiter) pairs.

    That function runs Kahn's algorithm (FIFO) over the pairs: a task `b` becomes ready when
    the last signaller of the counters it waits on and its queue predecessor have been taken;
    the pairs out of a task list its counter waiters in task order, then its queue successor.
    Here a counter opens when its last signaller is taken, and the tasks that become ready at
    one step are queued in that same order (counter waiters ascending, then the queue
    successor), so the ranks are the same."""
    n = len(waits)
    nc = 1 + max((c for ls in (*waits, *signals) for c in ls), default=-1)
    rem = [0] * nc  # signallers of each counter not yet taken
    for ss in signals:
        for c in dict.fromkeys(ss):
            rem[c] += 1
    waiting: list[list[int]] = [[] for _ in range(nc)]
    pending = [0] * n  # open conditions per task: closed counters + queue predecessor
    for b, ws in enumerate(waits):
        for c in dict.fromkeys(ws):
            if rem[c]:
                waiting[c].append(b)
                pending[b] += 1
    nxt: dict[int, list[int]] = {}
    for q in queues:
        for a, b in zip(q, q[1:], strict=False):
            if 0 <= a < n and 0 <= b < n:
                nxt.setdefault(a, []).append(b)
                pending[b] += 1
    ranks = [-1] * n
    ready = deque(i for i in range(n) if pending[i] == 0)
    k = 0
    while ready:
        a = ready.popleft()
        ranks[a] = k
        k += 1
        woke: list[int] = []
        for c in dict.fromkeys(signals[a]):
            rem[c] -= 1
            if rem[c] == 0:
                for b in waiting[c]:
                    pending[b] -= 1
                    if pending[b] == 0:
                        woke.append(b)
        if woke:
            woke.sort()
            ready.extend(woke)
        for b in nxt.get(a, ()):
            pending[b] -= 1
            if pending[b] == 0:
                ready.append(b)
    return [r if r >= 0 else k for r in ranks]


def counter_graph_from_packets(
    arr: PacketArray, sf: ScheduleFile, grouped: Grouped | str | None = None
) -> CounterGraph | str:
    """The checkpoint D instance of a plan file (module doc); a string is a rejection.
    `grouped`: `group_tasks(arr)` when the caller has it."""
    if grouped is None:
        grouped = group_tasks(arr)
    if isinstance(grouped, str):
        return grouped
    t = sf.tasks
    if len(grouped.tasks) != len(t.name):
        return (
            f"the plan file holds {len(grouped.tasks)} tasks but the schedule file "
            f"lists {len(t.name)}"
        )
    opi = arr["op_index"].tolist()
    wk = arr["worker"].tolist()
    wc = arr["wait_counter"].tolist()
    wt = arr["wait_threshold"].tolist()
    sc = arr["signal_counter"].tolist()
    for g, m in enumerate(grouped.main):
        if opi[m] != t.op[g] or wk[m] != t.worker[g]:
            return (
                f"task {g} ({t.name[g]}): packet {m} is op {opi[m]} on worker {wk[m]}, "
                f"the schedule file says op {t.op[g]} on worker {t.worker[g]}"
            )
    nc = len(sf.counters.name)
    variants: dict[int, list[int]] = {}  # counter -> distinct thresholds it is waited with
    for c, th in zip(wc, wt, strict=True):
        if c != NO_COUNTER:
            v = variants.setdefault(c, [])
            if th not in v:
                v.append(th)
    for c in (*variants, *(x for x in sc if x != NO_COUNTER)):
        if not 0 <= c < nc:
            return f"a packet references counter {c}, which does not exist ({nc} counters)"
    # A counter's scope is what its signalling packets' atomics use (the narrowest, if they
    # differ); a counter nobody signals keeps the schedule file's.
    scope_of: dict[int, int] = {}
    for c, code in zip(sc, arr["scope"].tolist(), strict=True):
        if c != NO_COUNTER:
            scope_of[c] = min(code, scope_of.get(c, code))
    ids: dict[tuple[int, int], int] = {}
    cnames: list[str] = []
    ths_out: list[int] = []
    scopes: list[str] = []
    all_of: list[list[int]] = []
    for c in range(nc):
        ths = variants.get(c) or [sf.counters.threshold[c]]
        mine = []
        for th in ths:
            ids[(c, th)] = len(cnames)
            mine.append(len(cnames))
            cnames.append(sf.counters.name[c] + ("" if len(ths) == 1 else f"@{th}"))
            ths_out.append(th)
            scopes.append(SCOPE_NAMES[scope_of[c]] if c in scope_of else sf.counters.scope[c])
        all_of.append(mine)
    waits = [[ids[(wc[i], wt[i])] for i in pk if wc[i] != NO_COUNTER] for pk in grouped.tasks]
    signals = [
        [v for i in pk if sc[i] != NO_COUNTER for v in all_of[sc[i]]] for pk in grouped.tasks
    ]
    nw = max([*grouped.queues, sf.workers - 1]) + 1
    if len(sf.edges) % 2:
        return "the schedule file's edge list has an odd length"
    return CounterGraph(
        names=list(t.name),
        workers=[wk[m] for m in grouped.main],
        waits=waits,
        signals=signals,
        queues=[grouped.queues.get(w, []) for w in range(nw)],
        counter_names=cnames,
        thresholds=ths_out,
        scopes=scopes,
        edges=list(sf.edges),
        workers_per_gpu=sf.workers_per_gpu,
    )


def task_units(arr: PacketArray, grouped: Grouped, ot: OpTable) -> list[TaskUnits] | str:
    """Per task (the order of `grouped.main`), its op index, stage and unit range as its task
    packet says (D's data flow and F's accessors); a string names a packet whose op index
    is outside the op table."""
    opi = arr["op_index"].tolist()
    code = arr["opcode"].tolist()
    fl = arr["flags"].tolist()
    rs = arr["row_start"].tolist()
    rows = arr["rows"].tolist()
    units: list[TaskUnits] = []
    load, accumulate = int(Opcode.LOAD), int(Flag.ACCUMULATE)  # (IntFlag's & is slow)
    for k, m in enumerate(grouped.main):
        if not 0 <= opi[m] < len(ot.ops):
            return f"task {k} (packet {m}): op index {opi[m]} outside the op table"
        stage = LOAD if code[m] == load else MERGE if fl[m] & accumulate else COMPUTE
        units.append(TaskUnits(opi[m], stage, rs[m], rows[m]))
    return units


def dataflow_from_packets(
    arr: PacketArray,
    grouped: Grouped,
    ot: OpTable,
    sf: ScheduleFile,
    g: CounterGraph,
    flow_in: FlowInputs | None = None,
) -> dict[str, object] | str:
    """The `dataflow` part of D's payload (`plow.oracle.payloads.dataflow`): per task its
    program key and arena accesses, from its task packet (op index, opcode, flags, unit
    range), the op table and the arena map; a string names a task packet that cannot be
    read. The schedule file's edges play no part. `flow_in`: the task units and sweep order
    when already derived (`flow_inputs`, shared with F)."""
    fi = flow_inputs(arr, grouped, ot, g) if flow_in is None else flow_in
    if isinstance(fi, str):
        return fi
    units, order = fi
    offsets = {b.name: b.offset for b in sf.arena.buffers}
    try:
        accs = task_accesses(ot, offsets, units, sf.workers_per_gpu)
    except (KeyError, IndexError, ValueError, TypeError) as e:
        return f"cannot derive the tasks' reads and writes from the op table: {e!r}"
    keys = [4 * u.op + u.stage for u in units]
    return dataflow_payload(keys, accs, g.waits, g.signals, g.queues, order)


FlowInputs = tuple[list[TaskUnits], list[int]] | str


def flow_inputs(arr: PacketArray, grouped: Grouped, ot: OpTable, g: CounterGraph) -> FlowInputs:
    """What D's data flow and F's sharing rule both derive from the packets: per task its op,
    stage and unit range (`task_units`), and the sweep order of the counter protocol
    (`sweep_order`); a string names a task packet that cannot be read."""
    units = task_units(arr, grouped, ot)
    if isinstance(units, str):
        return units
    return units, sweep_order(g.waits, g.signals, g.queues)


# ----------------------------------------------------------------- the numbers B, C, F use

# Fields `plow calibrate target cpu` (and the harness's calibration) may change in the cpu
# target; any other field of a shipped target must be the shipped spec's (`gpus` is --tp).
CPU_CALIBRATED = frozenset(
    {
        "workers",
        "bandwidth_bytes_per_s",
        "peak_flops_per_s",
        "l2_bytes",
        "onchip_bytes_per_worker",
        "page_bytes",
        "tile_overhead_ns",
        "comment",
    }
)


def bundle_target(m: Manifest) -> tuple[Target | None, list[str], list[str]]:
    """The target the checks compare against, with (problems, notes); None (and the
    problem) when the manifest's target is not a target.

    A shipped target name (`h200`, ...) means the shipped spec (`plow/target/specs/`), with
    the manifest's `gpus` (the tensor-parallel degree); a manifest whose target differs from
    the spec in any other field is a problem (except `cpu`'s calibrated fields: the cpu
    target is measured, and its calibration is the one recorded in the manifest, covered by
    the bundle digest every certificate carries). A target that is not shipped is the
    manifest's own record (noted)."""
    try:
        declared = Target.model_validate(m.target)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "target"
        return None, [f"{MANIFEST}: target field {loc!r}: {err['msg']}"], []
    if declared.name not in shipped_targets():
        note = (
            f"target {declared.name!r} is not shipped: B, C and F compare against the "
            "manifest's recorded target"
        )
        return declared, [], [note]
    try:
        shipped = load_target(declared.name)
    except ConfigError as e:  # pragma: no cover - a broken installation
        raise MalformedBundle(MANIFEST, str(e)) from e
    keep = {"gpus"} | (CPU_CALIBRATED if shipped.name == "cpu" else set())
    problems = []
    want = shipped.model_dump(mode="json")
    have = declared.model_dump(mode="json")
    for k, v in want.items():
        if k not in keep and have.get(k) != v:
            problems.append(
                f"{MANIFEST}: target {declared.name!r} field {k} is {have.get(k)!r}, "
                f"the shipped spec says {v!r}"
            )
            break
    upd = {k: have[k] for k in keep}
    return shipped.model_copy(update=upd), problems, []


def rung_bucket(r: LadderRung) -> Bucket | str:
    try:
        return Bucket(GraphPhase(r.phase), r.batch, r.seq, r.context)
    except (ValueError, PlowError) as e:
        return f"rung {r.name!r}: not a bucket ({e})"


@dataclass(frozen=True, slots=True)
class Expected:
    """The plan-level numbers of one rung, from the target, the profile and the op table's
    shapes (never from the numbers the op table declares)."""

    budget_ns: int
    bandwidth_bytes_per_s: int
    peak_flops_per_s: int
    min_tile: int
    weight_bytes: int  # bytes of the weights a step reads whole, from shapes and dtypes
    activation_dtype: str
    cache_dtype: str
    budget_pages: int
    page_bytes: int
    align: int
    weight_dtype: str = "float32"


MATMUL_KINDS = ("linear", "lm_head", "expert_linear")
ROWWISE_KINDS = ("embedding", "rmsnorm", "rope", "gated_mlp", "residual_add", "sample", "router")


def expected_numbers(
    ot: OpTable,
    target: Target,
    profile: CompileProfile,
    bucket: Bucket,
    stored: Mapping[str, int] | None = None,
) -> Expected:
    """What the compiler must have used (plow.tiles.tiler: a matmul computes at the weights'
    rate, attention at the activations', the row-wise ops at fp32; the compute bound uses
    the highest rate any op uses; plow.memory: page budget, arena alignment). `stored`: the
    bytes the bundle's weights file holds per weight (plow.tiles.storage.header_weight_bytes:
    blocks, fp8 with its scales), what a step reads of it; else its shape times its dtype."""
    weights = {n: t for n, t in ot.tensors.items() if t.role == "weight"}
    wdt = next(iter(weights.values())).dtype if weights else "float32"
    act = profile.activation_dtype or wdt
    cache = profile.kv_dtype or act
    rates: set[str] = set()
    for o in ot.ops:
        if o.kind in MATMUL_KINDS:
            rates.add(rate_class(wdt))
        elif o.kind == "attention":
            rates.add(rate_class(act))
        elif o.kind in ROWWISE_KINDS:
            rates.add("fp32")
    rates = rates or {rate_class(wdt)}
    # Weights a step reads whole (T6): all but an embedding table only gathered from.
    read_whole = {n for o in ot.ops if o.kind != "embedding" for n in o.inputs if n in weights}
    return Expected(
        budget_ns=profile.budget_ns(bucket),
        # tensor parallel: the group's (plow.tiles.tiler.tile_graph: gpus x one device's)
        bandwidth_bytes_per_s=target.gpus * target.bandwidth_bytes_per_s,
        peak_flops_per_s=target.gpus * max(target.peak_flops_per_s[r] for r in rates),  # type: ignore[index]
        min_tile=target.min_tile_any_axis,
        weight_bytes=sum(
            (stored or {}).get(n, math.prod(weights[n].shape) * dtype_bytes(weights[n].dtype))
            for n in read_whole
        ),
        activation_dtype=act,
        cache_dtype=cache,
        budget_pages=target.onchip_bytes_per_worker // target.page_bytes,
        page_bytes=target.page_bytes,
        align=ALIGN,
        weight_dtype=wdt,
    )


def declared_number_problems(
    rung: LadderRung, ot: OpTable, sf: ScheduleFile, ex: Expected, target: Target
) -> list[str]:
    """The numbers the files declare that must be the bundle's own (first mismatch per file)."""
    out: list[str] = []
    t = ot.tiling
    for name, have, want in (
        ("budget_ns", t.budget_ns, ex.budget_ns),
        ("bandwidth_bytes_per_s", t.bandwidth_bytes_per_s, ex.bandwidth_bytes_per_s),
        ("peak_flops_per_s", t.peak_flops_per_s, ex.peak_flops_per_s),
        ("min_tile", t.min_tile, ex.min_tile),
        ("activation_dtype", t.activation_dtype, ex.activation_dtype),
        ("cache_dtype", t.cache_dtype, ex.cache_dtype),
    ):
        if have != want:
            out.append(
                f"{rung.ops}: tiling {name} is {have!r}, target {target.name!r} and the "
                f"profile give {want!r}"
            )
            break
    if t.weight_bytes < ex.weight_bytes:
        out.append(
            f"{rung.ops}: tiling weight_bytes {t.weight_bytes} below the {ex.weight_bytes} "
            "bytes of the weight tensors its ops read whole"
        )
    for name, have, want in (
        ("workers_per_gpu", sf.workers_per_gpu, target.workers),
        ("gpus", sf.gpus, target.gpus),
        ("workers", sf.workers, target.workers * target.gpus),
        ("pages.budget_pages", sf.pages.budget_pages, ex.budget_pages),
        ("pages.page_bytes", sf.pages.page_bytes, ex.page_bytes),
        ("arena.align", sf.arena.align, ex.align),
    ):
        if have != want:
            out.append(f"{rung.schedule}: {name} is {have}, target {target.name!r} gives {want}")
            break
    return out


def ladder_problems(
    rung: LadderRung,
    ot: OpTable,
    sf: ScheduleFile,
    header: PlanHeader | None,
    packets: int | None,
) -> list[str]:
    """A rung is what its name says, and its files are its own (docs/bundle.md, `bundle`)."""
    b = rung_bucket(rung)
    if isinstance(b, str):
        return [b]
    name = b.name
    out: list[str] = []
    if rung.name != name:
        out.append(
            f"rung {rung.name!r}: phase {rung.phase}, batch {rung.batch}, seq "
            f"{rung.seq}, context {rung.context} is bucket {name!r}"
        )
    for what, rel, want in (
        ("plan", rung.plan, f"plan/{rung.name}.bin"),
        ("ops", rung.ops, f"plan/{rung.name}.ops.json"),
        ("schedule", rung.schedule, f"plan/{rung.name}.schedule.json"),
    ):
        if rel != want:
            out.append(f"rung {rung.name!r}: {what} file {rel!r} is not {want!r}")
    for what, have_v, want_v in (
        ("bucket", ot.bucket, rung.name),
        ("phase", ot.phase, rung.phase),
        ("batch", ot.batch, rung.batch),
        ("seq", ot.seq, rung.seq),
        ("context", ot.context, rung.context),
    ):
        if have_v != want_v:
            out.append(
                f"{rung.ops}: {what} {have_v!r}, the ladder says {want_v!r} (rung {rung.name!r})"
            )
            break
    if sf.bucket != rung.name:
        out.append(f"{rung.schedule}: bucket {sf.bucket!r}, the ladder says {rung.name!r}")
    if header is not None:
        ph = Phase.PREFILL if rung.phase == "prefill" else Phase.DECODE
        for what, have_v, want_v in (
            ("phase", header.phase.name.lower(), ph.name.lower()),
            ("batch", header.batch, rung.batch),
            ("seq", header.seq, rung.seq),
            ("workers", header.workers, sf.workers),
        ):
            if have_v != want_v:
                out.append(
                    f"{rung.plan}: header {what} {have_v}, the ladder says {want_v} "
                    f"(rung {rung.name!r})"
                )
                break
    tpr = b.tokens_per_row
    for tname, want_s in (
        ("ids", [rung.batch, tpr]),
        ("positions", [rung.batch, tpr]),
        ("sample_index", [rung.batch]),
    ):
        te = ot.tensors.get(tname)
        if te is None or te.shape != want_s:
            out.append(
                f"{rung.ops}: tensor {tname!r} has shape "
                f"{None if te is None else te.shape}, rung {rung.name!r} needs {want_s}"
            )
            break
    for tname, te in ot.tensors.items():
        if te.role == "cache" and (
            len(te.shape) != 4 or te.shape[0] != rung.batch or te.shape[2] != rung.context
        ):
            out.append(
                f"{rung.ops}: cache {tname!r} has shape {te.shape}, rung {rung.name!r} "
                f"needs batch {rung.batch} and context {rung.context}"
            )
            break
    for what, have_n, want_n in (
        ("packets", rung.packets, packets),
        ("tasks", rung.tasks, len(sf.tasks.name)),
        ("counters", rung.counters, len(sf.counters.name)),
        ("op table arena_bytes", ot.arena_bytes, sf.arena.arena_bytes),
    ):
        if want_n is not None and have_n != want_n:
            out.append(f"rung {rung.name!r}: {what} {have_n}, the files hold {want_n}")
            break
    return out


def profile_ladder_problems(bundle: Path, m: Manifest) -> list[str]:
    """The ladder is the profile's policy for the model's config (`CompileProfile.buckets`)."""
    from plow.checkpoint.loader import spec_from_config

    try:
        prof = CompileProfile.model_validate(m.profile)
    except ValidationError as e:
        return [f"{MANIFEST}: profile does not parse: {e.errors()[0]['msg']}"]
    try:
        spec = spec_from_config(json.loads((bundle / "config.json").read_text()), "config.json")
        want = [b.name for b in prof.buckets(spec.max_position)]
    except (OSError, json.JSONDecodeError, PlowError) as e:
        return [f"config.json: cannot rebuild the ladder from the profile: {e}"]
    have = [r.name for r in m.ladder]
    if have != want:
        return [f"{MANIFEST}: ladder {have} but profile {prof.name!r} asks for {want}"]
    return []


# ----------------------------------------------------------------- checkpoint B

# The reduction axis of each split-able op kind (= plow.schedule.regions.REDUCTION_AXIS,
# which the runtime reads a merge packet's units with; a test keeps the two equal).
REDUCTION_AXIS: dict[str, int] = {
    "linear": 2,
    "lm_head": 2,
    "expert_linear": 2,
    "attention": 1,
    "sample": 1,
    "rmsnorm": 1,
    "add_rmsnorm": 1,
    "linear_glu": 2,
    "linear_qkv": 2,
}


def _chunks(width: int, per_block: int) -> int:
    """Column chunks of one output block of `width` columns (plow.schedule.regions: chunks at
    least 16 wide, at most `per_block` of them)."""
    if width <= 0:
        return 0
    k = max(1, min(per_block, width // 16))
    step = -(-width // k)
    return -(-width // step)


def _last_dim(shape: list[int]) -> int:
    return shape[-1] if len(shape) >= 2 else 1


def merge_unit_count(o: OpEntry, tensors: dict[str, TensorEntry], workers: int) -> int:
    """The merge units of a split reduction, numbered as the runtime reads a merge packet's
    units (docs/wire.md: output blocks of the split reduction, `plow.schedule.regions`): one
    block per tile box off the reduction axis, each cut into column chunks of the output's
    2-D view; 0 for an op that is not split."""
    red = REDUCTION_AXIS.get(o.kind)
    ax = o.axes
    if red is None or red >= len(ax) or ax[red].steps <= 1:
        return 0
    nb = math.prod(a.steps for j, a in enumerate(ax) if j != red)
    per = max(1, workers // max(1, nb))

    def rows(j: int) -> tuple[int, int]:
        a = ax[0]
        return j * a.tile, min((j + 1) * a.tile, a.extent)

    rest0 = nb // max(1, ax[0].steps)  # blocks per step of axis 0
    if o.kind in (*MATMUL_KINDS, "linear_glu", "linear_qkv"):  # a block: one n step of out
        n = ax[1]
        widths = [min((j + 1) * n.tile, n.extent) - j * n.tile for j in range(n.steps)]
        return (nb // max(1, n.steps)) * sum(_chunks(w, per) for w in widths)
    if o.kind == "sample":
        return nb * _chunks(1, per)
    try:
        shape_in = tensors[o.inputs[0]].shape
        shape_out = tensors[o.outputs[0]].shape
    except (KeyError, IndexError):
        return 0
    total = 0
    if o.kind == "attention":
        heads, kvh, hd = (int(o.attrs.get(k) or 0) for k in ("heads", "kv_heads", "head_dim"))
        if len(shape_in) < 2 or not (heads and kvh and hd):
            return 0
        t = shape_in[1]
        grp = heads // kvh
        per_batch, block = t * heads, t * grp
        for j in range(ax[0].steps):
            a, b = rows(j)
            if b <= a:
                continue
            if a // per_batch == (b - 1) // per_batch:
                w = (((b - 1) % per_batch) // block + 1 - (a % per_batch) // block) * grp * hd
            else:
                w = heads * hd
            total += _chunks(w, per)
        return total * rest0
    if o.kind in ("rmsnorm", "add_rmsnorm"):
        ncols = _last_dim(shape_out)
        g = int(o.attrs.get("group") or ncols)
        if g <= 0:
            return 0
        per_row = max(1, ncols // g)
        cext = ax[1].extent
        for j in range(ax[0].steps):
            a, b = rows(j)
            if b <= a:
                continue
            if a // per_row == (b - 1) // per_row:
                w = ((b - 1) % per_row - a % per_row) * g + cext
            else:
                w = ncols
            total += _chunks(w, per)
        return total * rest0
    return 0


def plan_tasks(
    decoded: PacketArray, grouped: Grouped, names: list[str], nops: int
) -> dict[int, list[dict[str, int | str]]] | str:
    """Per op index, its tasks as their task packets say (sorted by start); a string names
    a task packet whose op is not in the op table."""
    opi = decoded["op_index"].tolist()
    rs = decoded["row_start"].tolist()
    rows = decoded["rows"].tolist()
    code = decoded["opcode"].tolist()
    fl = decoded["flags"].tolist()
    per: dict[int, list[dict[str, int | str]]] = {}
    for g, m in enumerate(grouped.main):
        if not 0 <= opi[m] < nops:
            return f"task {g} (packet {m}): op index {opi[m]} outside the op table ({nops} ops)"
        per.setdefault(opi[m], []).append(
            {
                "task": g,
                "name": names[g] if g < len(names) else f"#{g}",
                "start": rs[m],
                "count": rows[m],
                "opcode": code[m],
                "flags": fl[m],
            }
        )
    for ts in per.values():
        ts.sort(key=lambda t: t["start"])
    return per


def tile_payload_dict(
    ot: OpTable,
    ex: Expected,
    target: Target,
    tasks: dict[int, list[dict[str, int | str]]],
    workers: int,
) -> dict[str, Any]:
    """The checkpoint B payload of a rung (`TilePayload` JSON, built as plain dicts): per op
    its axes and cost (op table), shapes and attributes (op table's tensors), merge units,
    and tasks (plan file); the plan-level numbers from `expected_numbers` — the target's
    spec and the profile, not the op table's declared `tiling`."""
    ops = []
    for i, o in enumerate(ot.ops):
        a = o.attrs

        def num(k: str, a: dict[str, Any] = a) -> int:
            v = a.get(k)
            return int(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

        win = a.get("window")
        ops.append(
            {
                "name": o.name,
                "kind": o.kind,
                "axes": [
                    {"name": x.name, "extent": x.extent, "tile": x.tile, "steps": x.steps}
                    for x in o.axes
                ],
                "flops_per_point": o.cost.flops_per_point,
                "flops": o.cost.flops,
                "charged_cost": o.cost.charged_cost,
                "bytes": o.cost.bytes,
                "plan": {
                    "opcode": o.opcode,
                    "inputs": [ot.tensors[n].shape if n in ot.tensors else [] for n in o.inputs],
                    "outputs": [ot.tensors[n].shape if n in ot.tensors else [] for n in o.outputs],
                    "heads": num("heads"),
                    "head_dim": num("head_dim"),
                    "group": num("group"),
                    "window": win if isinstance(win, int) and win >= 0 else None,
                    "merge_units": merge_unit_count(o, ot.tensors, workers),
                    "tasks": tasks.get(i, []),
                },
            }
        )
    return {
        "ops": ops,
        "target": {
            "name": target.name,
            "bandwidth_bytes_per_s": ex.bandwidth_bytes_per_s,
            "peak_flops_per_s": ex.peak_flops_per_s,
            "min_tile": ex.min_tile,
        },
        "budget_ns": ex.budget_ns,
        "weight_bytes": ex.weight_bytes,
    }


# ----------------------------------------------------------------- the other payloads


def page_payload_from_file(
    sf: ScheduleFile,
    chunk: int = 64,
    budget_pages: int | None = None,
    counts: list[tuple[int, int]] | None = None,
) -> dict[str, object]:
    """C's payload; `budget_pages`: the target's (`expected_numbers`), default the file's;
    `counts`: per task (weight pages, activation pages) derived from the op table
    (`task_page_counts`): each task holds at least those (the file's columns when larger).
    The windows are the file's."""
    p = sf.pages
    n = len(sf.tasks.name)
    if counts is not None and len(counts) != n:
        raise MalformedBundle(f"schedule {sf.bucket}", "page counts do not match the task list")
    cols = (p.start, p.finish, p.load, p.weight_pages, p.act_pages)
    if any(len(c) != n for c in cols):
        raise MalformedBundle(
            f"schedule {sf.bucket}", "page columns do not have one entry per task"
        )
    if counts is not None:  # at least what each tile needs (the file may reserve more)
        cols = (
            p.start,
            p.finish,
            p.load,
            [max(a, c[0]) for a, c in zip(p.weight_pages, counts, strict=True)],
            [max(a, c[1]) for a, c in zip(p.act_pages, counts, strict=True)],
        )
    tasks = [TaskPages(*row) for row in zip(*cols, strict=True)]
    return split_timeline(
        p.budget_pages if budget_pages is None else budget_pages,
        page_windows(sf.tasks.worker, sf.tasks.name, tasks),
        chunk,
    )


def tile_onchip_bytes(o: OpEntry, ot: OpTable, ex: Expected) -> tuple[int, int]:
    """(weight bytes, activation bytes) one tile of op `o` holds on chip, from the op table's
    tile shape and operand shapes and the plan's dtypes (`expected_numbers`): the tiler's
    on-chip model (`plow.memory.onchip.onchip_footprint`, written again from the bundle; a test
    keeps the two equal). A matmul holds its fp32 accumulator and double-buffered 64-deep
    chunks of the input and the weight; attention its query block, a score block and
    double-buffered key/value chunks; element-wise ops one staging page."""
    a = dtype_bytes(ex.activation_dtype)
    w = dtype_bytes(ex.weight_dtype)
    c = dtype_bytes(ex.cache_dtype)
    t = [x.tile for x in o.axes]
    if o.kind in ("linear", "lm_head", "expert_linear") and len(t) == 3:
        mt, nt, kt = t
        kc = min(kt, 64)
        return 2 * nt * kc * max(a, w), mt * nt * 4 + 2 * mt * kc * max(a, w)
    if o.kind == "attention" and len(t) == 3:
        rt, st, dt = t
        q = ot.tensors[o.inputs[0]].shape
        heads, kvh = int(o.attrs["heads"]), int(o.attrs["kv_heads"])
        block = q[1] * (heads // kvh)
        kvt = min(-(-rt // block), q[0] * kvh)
        return 0, rt * dt * a + rt * min(st, 256) * 4 + 2 * min(st, 64) * dt * c * kvt
    return 0, 1


def task_page_counts(
    decoded: PacketArray, grouped: Grouped, ot: OpTable, ex: Expected
) -> list[tuple[int, int]] | str:
    """Per task (weight pages, activation pages), from its task packet's op and opcode/flags
    and `tile_onchip_bytes` in the target's pages (plow.memory.onchip.plan_pages: a load holds
    the weight slab, a merge one page, a compute task its slab and at least one page)."""
    opi = decoded["op_index"].tolist()
    code = decoded["opcode"].tolist()
    fl = decoded["flags"].tolist()
    page = max(1, ex.page_bytes)
    foot: dict[int, tuple[int, int]] = {}
    out: list[tuple[int, int]] = []
    for k, m in enumerate(grouped.main):
        if not 0 <= opi[m] < len(ot.ops):
            return f"task {k} (packet {m}): op index {opi[m]} outside the op table"
        if fl[m] & Flag.ACCUMULATE and code[m] != Opcode.LOAD:
            out.append((0, 1))
            continue
        if opi[m] not in foot:
            try:
                foot[opi[m]] = tile_onchip_bytes(ot.ops[opi[m]], ot, ex)
            except (KeyError, IndexError, ValueError, ZeroDivisionError) as e:
                return f"op {ot.ops[opi[m]].name!r}: cannot size its tile on chip ({e!r})"
        wb, ab = foot[opi[m]]
        wp = -(-max(0, wb) // page)
        if code[m] == Opcode.LOAD:
            out.append((wp, 0))
        else:
            out.append((wp, max(1, -(-max(0, ab) // page))))
    return out


def page_count_problems(sf: ScheduleFile, counts: list[tuple[int, int]]) -> list[str]:
    """The schedule file's page columns against the counts derived from the op table: a
    column below its tile's need is named (one above it only reserves more)."""
    p = sf.pages
    for i, (wp, ap) in enumerate(counts):
        if i >= len(p.weight_pages) or i >= len(p.act_pages):
            return [f"{sf.bucket}: page columns shorter than the task list"]
        if p.weight_pages[i] < wp or p.act_pages[i] < ap:
            return [
                f"schedule {sf.bucket}: task {i} ({sf.tasks.name[i]}) declares "
                f"{p.weight_pages[i]} weight / {p.act_pages[i]} activation pages, its tile "
                f"needs {wp} / {ap}"
            ]
    return []


def tensor_bytes(shape: list[int], dtype: str) -> int:
    return math.prod(shape) * dtype_bytes(dtype)


def alloc_payload_from_files(sf: ScheduleFile, ot: OpTable, align: int | None = None) -> Any:
    """F's payload; `align`: the arena alignment (`expected_numbers`), default the file's."""
    roles: dict[str, str] = {}
    scratch: dict[str, int] = {}
    for name, t in ot.tensors.items():
        if t.role == "scratch":
            continue
        roles[name] = t.role
    for o in ot.ops:
        if o.partial:
            scratch[o.partial] = o.index
    live = live_ranges([(o.inputs, o.outputs) for o in ot.ops], roles, scratch)
    # greedy fused into lm_head (plow/bundle/argmax.py): its values and index buffers live
    # from the first op naming them (the lm_head, which writes them) to the last (the sample)
    fused = [o.index for o in ot.ops if o.argmax is not None]
    for o in ot.ops:
        if o.argmax is not None:
            for name in (o.argmax, o.argmax + ".index"):
                live[name] = (min(fused), max(fused) + 1)
    bufs = []
    for b in sf.arena.buffers:
        te = ot.tensors.get(b.name)
        if te is None or b.name not in live:
            raise MalformedBundle(
                f"schedule {sf.bucket}", f"arena buffer {b.name!r} is not a tensor of the op table"
            )
        bufs.append((b.name, b.region, b.offset, tensor_bytes(te.shape, te.dtype)))
    missing = set(ot.tensors) - {b.name for b in sf.arena.buffers}
    if missing:
        raise MalformedBundle(
            f"schedule {sf.bucket}", f"tensor {sorted(missing)[0]!r} has no place in the arena map"
        )
    return alloc_payload(
        sf.arena.arena_bytes, bufs, live, sf.arena.align if align is None else align
    )


def wire_payload_dict(
    body: bytes, packets: PacketArray | None, ops: list[dict[str, object]] | None = None
) -> dict[str, object]:
    """The checkpoint E payload as a plain dict (same JSON as `WirePayload`, built without
    one pydantic model per packet): the record bytes, the packets decoded from them (none
    when they do not decode), and with `ops` the op table's offsets for the emitter rules."""
    rows: list[dict[str, object]] = []
    if packets is not None:
        cols = [packets[f].tolist() for f in VALUE_FIELDS]
        rows = [dict(zip(VALUE_FIELDS, row, strict=True)) for row in zip(*cols, strict=True)]
    out: dict[str, object] = {
        "version": 1,
        "record_size": RECORD_SIZE,
        "bytes": body.hex(),
        "packets": rows,
    }
    if ops is not None:
        out["ops"] = ops
    return out


# ----------------------------------------------------------------- verify


def _counter_graph(
    decoded: PacketArray | str, sf: ScheduleFile, grouped: Grouped | str
) -> CounterGraph | str:
    return decoded if isinstance(decoded, str) else counter_graph_from_packets(decoded, sf, grouped)


class _Once(Generic[_T]):
    """A value computed once, by the first thread that asks for it."""

    def __init__(self, fn: Callable[[], _T]) -> None:
        self._fn: Callable[[], _T] | None = fn
        self._value: _T | None = None
        self._lock = threading.Lock()

    def get(self) -> _T:
        with self._lock:
            if self._fn is not None:
                self._value, self._fn = self._fn(), None
            return cast(_T, self._value)


def _flow_inputs(
    decoded: PacketArray | str,
    grouped: Grouped | str,
    ot: OpTable,
    graph: _Once[CounterGraph | str],
) -> FlowInputs:
    g = graph.get()
    if isinstance(decoded, str) or isinstance(grouped, str) or isinstance(g, str):
        return next(x for x in (decoded, grouped, g) if isinstance(x, str))
    return flow_inputs(decoded, grouped, ot, g)


def _row(ck: str, bucket: str, cert: Certificate) -> Row:
    return Row(ck, bucket, cert.verdict.value, tuple(cert.theorems), cert.reason or "", cert)


def _bound(row: Row, digest: str) -> Row:
    """The row with its certificate bound to the bundle it was derived from."""
    if row.certificate is None:
        return row
    return replace(row, certificate=row.certificate.model_copy(update={"bundle_sha256": digest}))


def rung_file_problem(bundle: Path, rung: LadderRung) -> str | None:
    """What is wrong with the files a rung names (missing, or outside the bundle), or
    None."""
    inside = bundle.resolve()
    for rel in (rung.ops, rung.schedule, rung.plan):
        p = bundle / rel
        if not p.resolve().is_relative_to(inside):
            return f"{MANIFEST}: rung {rung.name} names {rel!r}, outside the bundle"
        if not p.is_file():
            return f"{rel}: missing (rung {rung.name} names it)"
    return None


def verify_bundle(bundle: Path, *, checkpoints: tuple[str, ...] = CHECKPOINTS) -> VerifyReport:
    """Verify a bundle directory. Every check that fails is a rejected row naming the file
    (a cross-reference, a hash, a rung's missing file, a weights file that cannot be read);
    `MalformedBundle` (exit 2) only when a file cannot be read as what it is: no bundle
    directory or manifest, a manifest, op table or schedule file that is not JSON of its
    schema."""
    with gc_paused():
        return _verify_bundle(Path(bundle), checkpoints)


def _stored_weight_bytes(bundle: Path, m: Manifest) -> dict[str, int] | None:
    """Per weight, the bytes the bundle's weights file stores (B's weight traffic); None for
    a plan-only bundle (or an unreadable file: reported with the weights below)."""
    from plow.checkpoint.weights import read_header
    from plow.tiles.storage import header_weight_bytes

    if m.plan_only or not (bundle / WEIGHTS).is_file():
        return None
    try:
        return header_weight_bytes(read_header(bundle / WEIGHTS))
    except PlowError:
        return None


def _verify_bundle(bundle: Path, checkpoints: tuple[str, ...]) -> VerifyReport:
    bundle = Path(bundle)
    m = read_manifest(bundle)
    report = VerifyReport(bundle, bundle_sha256=bundle_digest(bundle))
    # -- hashes (the certificates' are the loader's business: verify writes new ones)
    report.notes += certificate_file_problems(bundle, m)
    problems = hash_problems(bundle, m)
    declared, tproblems, tnotes = bundle_target(m)
    # a manifest target that is not a target: B, C and F have nothing to compare against
    # (their rows are rejected; the cpu spec only stands in for the sizes computed here)
    no_target = None if declared else f"cannot check against the target: {tproblems[0]}"
    target = declared or load_target("cpu")
    problems += tproblems
    report.notes += tnotes
    problems += profile_ladder_problems(bundle, m)
    try:
        profile = CompileProfile.model_validate(m.profile)
    except ValidationError:
        profile = CompileProfile()  # reported by profile_ladder_problems
    names = [r.name for r in m.ladder]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        problems.append(f"{MANIFEST}: rung {dup!r} listed twice")
    jobs: list[tuple[str, str, Callable[[], Row]]] = []
    stored = _stored_weight_bytes(bundle, m)
    tables: dict[str, OpTable] = {}
    for rung in m.ladder:
        gone = rung_file_problem(bundle, rung)
        if gone is not None:
            problems.append(gone)
            jobs += [
                (ck, rung.name, partial(Row, ck, rung.name, "reject", (), gone))
                for ck in CHECKPOINTS
                if ck in checkpoints
            ]
            continue
        ot: OpTable = load_json(bundle / rung.ops, OpTable)
        tables[rung.name] = ot
        sf: ScheduleFile = load_json(bundle / rung.schedule, ScheduleFile)
        data = (bundle / rung.plan).read_bytes()
        amap = {b.name: b.offset for b in sf.arena.buffers}
        for name, t in ot.tensors.items():
            if amap.get(name, t.offset) != t.offset:
                problems.append(
                    f"{rung.ops}: tensor {name!r} at offset {t.offset}, "
                    f"the arena map says {amap[name]}"
                )
                break
        fa = argmax_problem(ot, sf.workers_per_gpu)  # greedy fused into lm_head: who names it
        if fa is not None:
            problems.append(f"{rung.ops}: {fa}")
        e_ops: list[dict[str, object]] | str
        try:
            e_ops = emit_ops(ot.ops, amap)
        except KeyError as e:
            e_ops = f"{rung.schedule}: tensor {e.args[0]!r} has no arena offset"
            problems.append(e_ops)
        body = data[HEADER_SIZE:]
        header: PlanHeader | None = None
        try:
            header, arr = decode_plan(data)
            decoded: PacketArray | str = arr
        except WireError as e:
            decoded = f"{rung.plan}: {e}"
        bucket = rung_bucket(rung)
        problems += ladder_problems(
            rung, ot, sf, header, None if isinstance(decoded, str) else len(decoded)
        )
        ex = expected_numbers(
            ot, target, profile, bucket if isinstance(bucket, Bucket) else Bucket.decode(1, 1),
            stored,
        )  # fmt: skip
        problems += declared_number_problems(rung, ot, sf, ex, target)
        grouped: Grouped | str = decoded if isinstance(decoded, str) else group_tasks(decoded)
        counts: list[tuple[int, int]] | str | None = None
        readable = not isinstance(decoded, str) and not isinstance(grouped, str)
        if readable and len(grouped.tasks) == len(sf.tasks.name):  # type: ignore[union-attr]
            counts = task_page_counts(decoded, grouped, ot, ex)  # type: ignore[arg-type]
            if not isinstance(counts, str):
                problems += page_count_problems(sf, counts)
        name = rung.name
        # D's instance, shared by D and F (computed by whichever asks first)
        graph: _Once[CounterGraph | str] = _Once(partial(_counter_graph, decoded, sf, grouped))
        flow_in: _Once[FlowInputs] = _Once(partial(_flow_inputs, decoded, grouped, ot, graph))

        def job_b(
            ot: OpTable = ot,
            sf: ScheduleFile = sf,
            ex: Expected = ex,
            decoded: PacketArray | str = decoded,
            grouped: Grouped | str = grouped,
            name: str = name,
        ) -> Row:
            if no_target is not None:
                return Row("B", name, "reject", (), no_target)
            if isinstance(decoded, str) or isinstance(grouped, str):
                why = decoded if isinstance(decoded, str) else grouped
                return Row("B", name, "reject", (), f"cannot read the tasks: {why}")
            tasks = plan_tasks(decoded, grouped, list(sf.tasks.name), len(ot.ops))
            if isinstance(tasks, str):
                return Row("B", name, "reject", (), tasks)
            payload = tile_payload_dict(ot, ex, target, tasks, sf.workers_per_gpu)
            row = _row("B", name, run_checkpoint("B", payload, timeout_s=600))
            return replace(row, payload=payload)

        def job_c(
            sf: ScheduleFile = sf,
            ex: Expected = ex,
            name: str = name,
            counts: list[tuple[int, int]] | str | None = counts,
            where: str = rung.schedule,
        ) -> Row:
            if no_target is not None:
                return Row("C", name, "reject", (), no_target)
            if isinstance(counts, str):
                return Row("C", name, "reject", (), f"cannot size the tasks' pages: {counts}")
            try:
                payload = page_payload_from_file(sf, budget_pages=ex.budget_pages, counts=counts)
            except MalformedBundle as e:  # page columns that do not fit the task list
                return Row("C", name, "reject", (), f"{where}: {e.problem}")
            return _row("C", name, run_checkpoint("C", payload))

        def job_d(
            decoded: PacketArray | str = decoded,
            graph: _Once[CounterGraph | str] = graph,
            name: str = name,
            grouped: Grouped | str = grouped,
            ot: OpTable = ot,
            sf: ScheduleFile = sf,
            flow_in: _Once[FlowInputs] = flow_in,
        ) -> Row:
            if isinstance(decoded, str):
                return Row("D", name, "reject", (), f"cannot read the packets: {decoded}")
            g = graph.get()
            if isinstance(g, str):
                return Row("D", name, "reject", (), g)
            # every plan size: dependencies from data flow, by the oracle's sweep
            payload = g.payload_dict()
            if isinstance(grouped, str):
                return Row("D", name, "reject", (), f"cannot read the tasks: {grouped}")
            flow = dataflow_from_packets(decoded, grouped, ot, sf, g, flow_in.get())
            if isinstance(flow, str):
                return Row("D", name, "reject", (), flow)
            payload["dataflow"] = flow
            row = _row("D", name, run_checkpoint("D", payload, timeout_s=600))
            if row.rejected:
                return row
            st = (row.certificate.stats if row.certificate else None) or {}
            n_acc = sum(len(a) for a in cast(list[list[Any]], flow["accesses"]))
            why = (
                f"data flow: {len(g.names)} tasks, {st.get('accesses', n_acc)} accesses "
                f"swept, {st.get('comparisons', '?')} frontier entries compared"
            )
            return replace(row, reason=why)

        def job_e(
            body: bytes = body,
            decoded: PacketArray | str = decoded,
            e_ops: list[dict[str, object]] | str = e_ops,
            name: str = name,
        ) -> Row:
            if isinstance(e_ops, str):
                return Row("E", name, "reject", (), f"cannot read the operands: {e_ops}")
            # the decoded records (none when the Python decoder failed: the oracle's own
            # decoder then names the broken record) and the op table's offsets
            pk = decoded if not isinstance(decoded, str) else None
            return _row(
                "E", name, run_checkpoint("E", wire_payload_dict(body, pk, e_ops), timeout_s=600)
            )

        def job_f(
            sf: ScheduleFile = sf,
            ot: OpTable = ot,
            graph: _Once[CounterGraph | str] = graph,
            ex: Expected = ex,
            name: str = name,
            flow_in: _Once[FlowInputs] = flow_in,
            where: str = rung.schedule,
        ) -> Row:
            if no_target is not None:
                return Row("F", name, "reject", (), no_target)
            try:  # an arena map that does not fit the op table
                alloc = alloc_payload_from_files(sf, ot, ex.align)
            except MalformedBundle as e:
                return Row("F", name, "reject", (), f"{where}: {e.problem}")
            # shared bytes need their accessors ordered by D's protocol (docs/oracle.md, F)
            g, fi = graph.get(), flow_in.get()
            if isinstance(g, str) or isinstance(fi, str):
                why = g if isinstance(g, str) else fi
                return Row("F", name, "reject", (), f"cannot order the shared arena bytes: {why}")
            units, order = fi
            payload = with_sharing(
                alloc,
                ot,
                units,
                g.names,
                g.waits,
                g.signals,
                g.queues,
                order,
            )
            return _row("F", name, run_checkpoint("F", payload, timeout_s=600))

        def job_a(
            ops: Path = bundle / rung.ops, bk: Bucket | str = bucket, name: str = name
        ) -> Row:
            c = bk if isinstance(bk, str) else run_checkpoint_a(bundle, ops, bk)
            return Row("A", name, "reject", (), c) if isinstance(c, str) else _row("A", name, c)

        for ck, fn in (
            ("A", job_a), ("B", job_b), ("C", job_c), ("D", job_d), ("E", job_e), ("F", job_f)
        ):  # fmt: skip
            if ck in checkpoints:
                jobs.append((ck, name, fn))
    # weights
    if not m.plan_only:
        from plow.checkpoint.weights import read_header

        have: dict[str, Any] = {}
        header_read = False
        if m.weights is None or not (bundle / WEIGHTS).is_file():
            problems.append(f"{WEIGHTS}: missing in a full bundle")
        else:
            try:
                have, header_read = read_header(bundle / WEIGHTS), True
            except PlowError as e:
                problems.append(f"{WEIGHTS}: {e.problem}")
        for ot in tables.values() if header_read else ():
            for tname, t in ot.tensors.items():
                if t.role == "weight":
                    he = have.get(tname)
                    if he is None or list(he.logical_shape) != t.shape:
                        problems.append(f"{WEIGHTS}: weight {tname!r} missing or of another shape")
                        break
    report.rows.append(
        Row(
            "bundle",
            "",
            "reject" if problems else "accept",
            (),
            "; ".join(problems[:3]) or "hashes and cross-references match",
        )
    )
    # Independent oracle processes: run a few at once, the longest first (D and E on large
    # plans, then C); results are collected in job order.
    order = {ck: i for i, ck in enumerate(CHECKPOINTS)}
    first = {"D": 0, "E": 1, "C": 2}
    with ThreadPoolExecutor(max_workers=3) as pool:
        started = {
            k: pool.submit(jobs[k][2])
            for k in sorted(range(len(jobs)), key=lambda k: (first.get(jobs[k][0], 3), k))
        }
        rows = [_bound(started[k].result(), report.bundle_sha256) for k in range(len(jobs))]
    rows.sort(key=lambda r: (order[r.checkpoint], [x.name for x in m.ladder].index(r.bucket)))
    report.rows += rows
    return report


def write_certificates(report: VerifyReport) -> list[str]:
    """Write `certificates/<ckpt>.json` (one certificate per bucket, each carrying the
    bundle digest) and the checkpoint B payloads `payloads/B/<bucket>.json` (small;
    re-checkable with `run_checkpoint`), then list the certificate files' sha256 in the
    manifest's `files` (outside the digest: the digest is what they certify). Returns notes
    about previous certificates whose payload hash differs (the bundle changed since)."""
    from plow.bundle.manifest import CheckpointCertificates

    d = report.bundle / "certificates"
    d.mkdir(exist_ok=True)
    for r in report.rows:
        if r.payload is not None:
            pd = report.bundle / "payloads" / r.checkpoint
            pd.mkdir(parents=True, exist_ok=True)
            (pd / f"{r.bucket}.json").write_text(json.dumps(r.payload))
    notes: list[str] = []
    for ck in CHECKPOINTS:
        certs = {
            r.bucket: r.certificate for r in report.rows if r.checkpoint == ck and r.certificate
        }
        if not certs:
            continue
        p = d / f"{ck}.json"
        if p.is_file():
            try:
                old = CheckpointCertificates.model_validate_json(p.read_bytes())
                for b, c in certs.items():
                    prev = old.buckets.get(b)
                    if prev is not None and prev.payload_sha256 != c.payload_sha256:
                        notes.append(
                            f"certificates/{ck}.json: bucket {b} payload changed "
                            "since it was certified"
                        )
                    elif prev is not None and prev.bundle_sha256 != report.bundle_sha256:
                        notes.append(
                            f"certificates/{ck}.json: bucket {b} was certified for another "
                            "bundle digest (the manifest changed); replaced"
                        )
            except (ValidationError, json.JSONDecodeError):
                notes.append(f"certificates/{ck}.json: unreadable, replaced")
        # the bundle-level checks too: an executor trusts an accepted file alone
        rows = [r for r in report.rows if r.checkpoint in (ck, "bundle")]
        doc = CheckpointCertificates(
            checkpoint=ck,
            accepted=all(x.accepted for x in certs.values() if x is not None)
            and not any(r.rejected for r in rows),
            reason=next((r.reason for r in rows if r.rejected), None),
            buckets={b: x for b, x in certs.items() if x is not None},
            bundle_checked=True,
        )
        p.write_text(doc.model_dump_json(indent=2))
    _list_certificates(report.bundle)
    return notes


def _list_certificates(bundle: Path) -> None:
    """Record the sha256 of every `certificates/*.json` in the manifest's `files` (the
    verify hash check then covers them; the bundle digest does not change)."""
    path = bundle / MANIFEST
    doc = json.loads(path.read_bytes())
    files = {k: v for k, v in doc["files"].items() if not k.startswith(CERTIFICATES)}
    for p in sorted((bundle / "certificates").glob("*.json")):
        files[f"{CERTIFICATES}{p.name}"] = sha256_file(p)
    doc["files"] = files
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
