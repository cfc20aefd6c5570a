"""Semantic mutations of real tiny bundles (issue 14), each with the manifest hashes re-forged
and, where a mutation edits a schedule file or an op table, the plan file re-emitted from the
edited files (so the packets agree with the edited files: E's field rules and the
packet/schedule cross-checks of D see nothing): `plow verify` must reject every mutant with
a located reason, and accept the unmutated bundle. E's own mutations edit the plan file's
record bytes (no re-emission)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from plow.bundle.files import OpTable, ScheduleFile
from plow.bundle.manifest import MANIFEST
from plow.bundle.wire import HEADER_SIZE
from plow.emit.bundle import compile_bundle
from plow.emit.verify import VerifyReport, merge_unit_count, verify_bundle
from plow.profile import CompileProfile
from plow.target import load_target
from tests.emit.bundle_edit import (
    copy_bundle,
    drop_task,
    edit_manifest,
    edit_rung,
    reforge,
    rungs,
)

from .conftest import FAMILIES


@pytest.fixture(scope="module")
def gpu_bundles(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Plan-only tiny bundles for h200: split reductions (merge tasks), multi-tile tasks."""
    root = tmp_path_factory.mktemp("gpu_bundles")
    prof = CompileProfile(decode_batches=(1, 2), prefill_seqs=(8,))
    return {
        f: compile_bundle(
            tiny_checkpoints[f], root / f, load_target("h200"), prof, plan_only=True
        ).out
        for f in FAMILIES
    }


def rejected(report: VerifyReport, checkpoint: str) -> list[str]:
    return [r.reason for r in report.rows if r.checkpoint == checkpoint and r.rejected]


def only_rejected_by(report: VerifyReport, checkpoint: str, *needles: str) -> str:
    """The mutant is rejected, by `checkpoint` (first row), with every needle in the reason."""
    assert not report.accepted
    bad = rejected(report, checkpoint)
    assert bad, [(r.checkpoint, r.bucket, r.reason) for r in report.rows if r.rejected]
    for n in needles:
        assert n in bad[0], bad[0]
    return bad[0]


def mutant(src: Path, tmp_path: Path) -> Path:
    return copy_bundle(src, tmp_path / "mutant")


def _ops(bundle: Path, rung: dict[str, Any]) -> OpTable:
    return OpTable.model_validate_json((bundle / rung["ops"]).read_bytes())


def _sched(bundle: Path, rung: dict[str, Any]) -> ScheduleFile:
    return ScheduleFile.model_validate_json((bundle / rung["schedule"]).read_bytes())


def _multi_task_op(
    sf: ScheduleFile, kind: str = "compute", min_units: int = 1, tasks: int = 2
) -> list[int]:
    """Task indices of the first op with at least `tasks` tasks of `kind` (the first one with
    at least `min_units` units), in unit order."""
    by_op: dict[int, list[int]] = {}
    for i, (op, k) in enumerate(zip(sf.tasks.op, sf.tasks.kind, strict=True)):
        if k == kind:
            by_op.setdefault(op, []).append(i)
    for ts in by_op.values():
        ts.sort(key=lambda i: sf.tasks.unit_start[i])
        if len(ts) >= tasks and sf.tasks.unit_count[ts[0]] >= min_units:
            return ts
    raise AssertionError(f"no op with {tasks} {kind} tasks")


# ----------------------------------------------------------------- the unmutated bundles


@pytest.mark.parametrize("family", FAMILIES)
def test_unmutated_bundles_are_accepted(
    tiny_bundles: dict[str, Path], gpu_bundles: dict[str, Path], family: str
) -> None:
    for b in (tiny_bundles[family], gpu_bundles[family]):
        report = verify_bundle(b)
        assert report.accepted, report.first_rejection()
        b_rows = [r for r in report.rows if r.checkpoint == "B"]
        assert b_rows and all(
            "Plow.Partitionproof.check_plan_tasks_sound" in r.theorems for r in b_rows
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_units_are_the_schedules(gpu_bundles: dict[str, Path], family: str) -> None:
    """B's merge-unit count (plow.emit.verify) is the schedule's and the runtime's numbering
    (plow.schedule.regions cuts the blocks): every split op's merge tasks end at it."""
    import plow.emit.verify as V
    from plow.runtime.cpu.bundle import _graph, _tiled_op, _tiles
    from plow.runtime.cpu.plan import OpEntry as RtOp
    from plow.runtime.cpu.plan import merge_units
    from plow.schedule.regions import REDUCTION_AXIS
    from plow.tiles.ir import Axis

    assert V.REDUCTION_AXIS == REDUCTION_AXIS
    b = gpu_bundles[family]
    seen = 0
    for rung in rungs(b):
        ot, sf = _ops(b, rung), _sched(b, rung)
        graph = _graph(ot)
        for i, o in enumerate(ot.ops):
            want = merge_unit_count(o, ot.tensors, sf.workers_per_gpu)
            ends = [
                sf.tasks.unit_start[t] + sf.tasks.unit_count[t]
                for t in range(len(sf.tasks.name))
                if sf.tasks.op[t] == i and sf.tasks.kind[t] in ("merge", "allreduce")
            ]
            assert (max(ends) if ends else 0) == want, o.name
            if o.partial:
                axes = tuple(Axis(a.name, a.extent, a.tile, a.steps) for a in o.axes)
                red = REDUCTION_AXIS[o.kind]
                rt = RtOp(
                    name=o.name, kind=o.kind, inputs=tuple(o.inputs), outputs=tuple(o.outputs),
                    attrs=dict(o.attrs), layer=o.layer, extents=tuple(a.extent for a in axes),
                    tiles=tuple(a.tile for a in axes), steps=tuple(a.steps for a in axes),
                    reduction_axis=red,
                )  # fmt: skip
                top = _tiled_op(o, axes, _tiles(axes))
                assert len(merge_units(graph, top, rt, sf.workers_per_gpu)) == want
                seen += 1
    assert seen


# ----------------------------------------------------------------- B: tasks and shapes


def test_task_that_skips_a_tile(gpu_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(gpu_bundles["llama"], tmp_path)
    rung = rungs(b)[0]
    sf = _sched(b, rung)
    ts = _multi_task_op(sf, min_units=2)
    t0 = ts[0]
    start, count = sf.tasks.unit_start[t0], sf.tasks.unit_count[t0]

    def skip(d: dict[str, Any]) -> None:
        d["tasks"]["unit_count"][t0] -= 1  # its last tile now runs nowhere

    edit_rung(b, rung, schedule=skip)
    op = _ops(b, rung).ops[sf.tasks.op[t0]].name
    end = start + count
    only_rejected_by(verify_bundle(b), "B", f'op "{op}"', f"tiles {end - 1}..{end} run by no task")


def test_tile_run_twice(gpu_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(gpu_bundles["qwen3"], tmp_path)
    rung = rungs(b)[0]
    sf = _sched(b, rung)
    t0, t1 = _multi_task_op(sf)[:2]

    def overlap(d: dict[str, Any]) -> None:
        d["tasks"]["unit_start"][t1] -= 1
        d["tasks"]["unit_count"][t1] += 1

    edit_rung(b, rung, schedule=overlap)
    only_rejected_by(verify_bundle(b), "B", "run twice", f"({sf.tasks.name[t1]})")


@pytest.fixture(scope="module")
def h100_gemma3(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A plan-only h100 bundle: its lm_head's k is split (merges write the logits). Unfused:
    R19's lm_head (the final norm in its prologue) reads whole rows, and the tiler does not
    split its k here."""
    root = tmp_path_factory.mktemp("h100_bundle")
    prof = CompileProfile(decode_batches=(1,), prefill_seqs=(), fuse=False)
    return compile_bundle(
        tiny_checkpoints["gemma3"], root / "b", load_target("h100"), prof, plan_only=True
    ).out


@pytest.mark.parametrize("kind", ["compute", "merge"])
def test_dropped_task(
    gpu_bundles: dict[str, Path], h100_gemma3: Path, tmp_path: Path, kind: str
) -> None:
    """A task removed from the plan file and the schedule file alike (its counters' thresholds
    lowered, its edges gone): D and E accept; B finds its units run by no task."""
    b = mutant(gpu_bundles["gemma3"] if kind == "compute" else h100_gemma3, tmp_path)
    rung = rungs(b)[0]
    sf = _sched(b, rung)
    victim = _multi_task_op(sf, kind, tasks=2 if kind == "compute" else 1)[-1]
    if kind == "merge":  # the last op's (a k-split lm_head; greedy is fused into it, so the
        # sample op has no merges): with fused ops (add_rmsnorm) an earlier merge also
        # orders later tasks that reuse its bytes, and D rightly finds them unordered
        last = max(o for o, k in zip(sf.tasks.op, sf.tasks.kind, strict=True) if k == kind)
        victim = max(
            (i for i, o in enumerate(sf.tasks.op) if o == last and sf.tasks.kind[i] == kind),
            key=lambda i: sf.tasks.unit_start[i],
        )
    op = _ops(b, rung).ops[sf.tasks.op[victim]].name
    edit_rung(b, rung, schedule=lambda d: drop_task(d, victim))
    report = verify_bundle(b)
    assert not any(rejected(report, ck) for ck in ("D", "E", "bundle"))
    units = "tiles" if kind == "compute" else "merge units"
    only_rejected_by(report, "B", f'op "{op}"', f"{units} ", "run by no task")


def test_shrunk_extent(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    """lm_head's vocabulary axis shrunk (steps, flops and cost kept consistent, so the tiling
    alone is legal): the extent is no longer the weight's rows."""
    b = mutant(tiny_bundles["llama"], tmp_path)
    rung = rungs(b)[0]
    ot = _ops(b, rung)
    i = next(k for k, o in enumerate(ot.ops) if o.kind == "lm_head")
    n = ot.ops[i].axes[1]
    new = (n.steps - 1) * n.tile + 1  # still the same steps, the last one mostly padding

    def shrink(d: dict[str, Any]) -> None:
        o = d["ops"][i]
        o["axes"][1]["extent"] = new
        o["cost"]["flops"] = o["cost"]["flops_per_point"] * math.prod(
            a["extent"] for a in o["axes"]
        )

    edit_rung(b, rung, ops=shrink)
    only_rejected_by(
        verify_bundle(b), "B", f'op "{ot.ops[i].name}" axis 1 (n): extent {new}',
        f"the tensors' shapes give {n.extent}",
    )  # fmt: skip


def test_opcode_not_the_kind(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(tiny_bundles["qwen3"], tmp_path)
    rung = rungs(b)[0]
    ot = _ops(b, rung)
    i = next(k for k, o in enumerate(ot.ops) if o.kind == "rope")

    def recode(d: dict[str, Any]) -> None:
        d["ops"][i]["opcode"] = 4  # linear

    edit_rung(b, rung, ops=recode)
    only_rejected_by(
        verify_bundle(b), "B", f'op "{ot.ops[i].name}" (rope): op table opcode 4 (linear)'
    )


@pytest.mark.parametrize("to", [False, True])
def test_masked_flag_against_overhang(
    tiny_bundles: dict[str, Path], gpu_bundles: dict[str, Path], tmp_path: Path, to: bool
) -> None:
    # h200 decode: every compute task overhangs (1 row under 16); cpu: most do not
    b = mutant((tiny_bundles if to else gpu_bundles)["llama"], tmp_path)
    rung = rungs(b)[0]
    sf = _sched(b, rung)
    t = next(
        i for i in range(len(sf.tasks.name))
        if sf.tasks.masked[i] != to and sf.tasks.kind[i] == "compute"
    )  # fmt: skip

    def flip(d: dict[str, Any]) -> None:
        d["tasks"]["masked"][t] = to

    edit_rung(b, rung, schedule=flip)
    want = "MASKED is set but none of its tiles" if to else "MASKED is not set but one of its"
    only_rejected_by(verify_bundle(b), "B", f"({sf.tasks.name[t]})", want)


# ----------------------------------------------------------------- numbers from the target


@pytest.mark.parametrize(
    ("field", "factor"),
    [("bandwidth_bytes_per_s", 1000), ("peak_flops_per_s", 1000), ("budget_ns", 1000)],
)
def test_declared_tiling_numbers_must_be_the_targets(
    tiny_bundles: dict[str, Path], tmp_path: Path, field: str, factor: int
) -> None:
    """A plan over budget made to fit by declaring a faster machine or a larger budget in
    the op table: B compares against the target's spec and the profile, and the declared
    number is reported."""
    b = mutant(tiny_bundles["llama"], tmp_path)
    rung = rungs(b)[1]

    def faster(d: dict[str, Any]) -> None:
        d["tiling"][field] *= factor

    edit_rung(b, rung, ops=faster, reemit=False)
    only_rejected_by(verify_bundle(b), "bundle", f"{rung['ops']}: tiling {field}")


def test_manifest_target_must_be_the_shipped_spec(
    gpu_bundles: dict[str, Path], tmp_path: Path
) -> None:
    b = mutant(gpu_bundles["llama"], tmp_path)

    def faster(m: dict[str, Any]) -> None:
        m["target"]["bandwidth_bytes_per_s"] *= 10

    edit_manifest(b, faster)
    for rung in rungs(b):
        edit_rung(
            b, rung, ops=lambda d: d["tiling"].update(bandwidth_bytes_per_s=48 * 10**12),
            reemit=False,
        )  # fmt: skip
    only_rejected_by(
        verify_bundle(b), "bundle", "target 'h200' field bandwidth_bytes_per_s",
        "the shipped spec says 4800000000000",
    )  # fmt: skip


def test_page_budget_and_alignment_from_the_target(
    tiny_bundles: dict[str, Path], tmp_path: Path
) -> None:
    b = mutant(tiny_bundles["gemma3"], tmp_path)
    rung = rungs(b)[0]
    sf = _sched(b, rung)

    # every task's pages over the real budget, the budget declared large enough
    def grow(d: dict[str, Any]) -> None:
        d["pages"]["budget_pages"] *= 4
        d["pages"]["act_pages"][0] = 2 * sf.pages.budget_pages

    edit_rung(b, rung, schedule=grow, reemit=False)
    report = verify_bundle(b)
    only_rejected_by(report, "bundle", f"{rung['schedule']}: pages.budget_pages")
    only_rejected_by(report, "C", f"budget {sf.pages.budget_pages}")
    b2 = copy_bundle(tiny_bundles["gemma3"], tmp_path / "align")
    edit_rung(b2, rung, schedule=lambda d: d["arena"].update(align=8), reemit=False)
    only_rejected_by(verify_bundle(b2), "bundle", f"{rung['schedule']}: arena.align is 8")


# ----------------------------------------------------------------- the ladder


def test_rung_pointing_at_another_rungs_files(
    tiny_bundles: dict[str, Path], tmp_path: Path
) -> None:
    b = mutant(tiny_bundles["llama"], tmp_path)

    def alias(m: dict[str, Any]) -> None:
        r0, r1 = m["ladder"][0], m["ladder"][1]
        for k in ("plan", "ops", "schedule", "packets", "tasks", "counters", "arena_bytes"):
            r1[k] = r0[k]

    edit_manifest(b, alias)
    reforge(b)
    r1 = rungs(b)[1]
    only_rejected_by(verify_bundle(b), "bundle", f"rung {r1['name']!r}: plan file")


def test_rung_batch_not_its_files(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(tiny_bundles["qwen3"], tmp_path)
    edit_manifest(b, lambda m: m["ladder"][1].update(batch=3, name="decode_b3_s256"))
    reforge(b)
    why = only_rejected_by(verify_bundle(b), "bundle", "decode_b3_s256")
    assert "batch" in why or "file" in why


def test_plan_header_not_the_rung(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(tiny_bundles["gemma3"], tmp_path)
    rung = rungs(b)[1]
    path = b / rung["plan"]
    data = bytearray(path.read_bytes())
    data[20:24] = (1).to_bytes(4, "little")  # header batch 2 -> 1
    assert HEADER_SIZE == 32
    path.write_bytes(bytes(data))
    reforge(b)
    only_rejected_by(
        verify_bundle(b), "bundle", f"{rung['plan']}: header batch 1, the ladder says 2"
    )


def test_op_table_shapes_not_the_rung(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    """A batch-1 op table under the batch-2 rung (its files renamed): shapes disagree."""
    b = mutant(tiny_bundles["llama"], tmp_path)
    r0, r1 = rungs(b)[:2]
    for k in ("plan", "ops", "schedule"):
        (b / r1[k]).write_bytes((b / r0[k]).read_bytes())

    def rename(d: dict[str, Any]) -> None:
        d["bucket"], d["batch"] = r1["name"], r1["batch"]

    edit_rung(b, r1, ops=rename, schedule=lambda d: d.update(bucket=r1["name"]), reemit=False)
    only_rejected_by(
        verify_bundle(b), "bundle", f"{r1['ops']}: tensor 'ids' has shape [1, 1]",
        f"rung {r1['name']!r} needs [2, 1]",
    )  # fmt: skip


def test_ladder_is_the_profiles(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(tiny_bundles["llama"], tmp_path)
    edit_manifest(b, lambda m: m["profile"].update(decode_batches=[1, 4]))
    reforge(b)
    only_rejected_by(verify_bundle(b), "bundle", "but profile", "decode_b4_s256")


def test_manifest_is_valid_json_after_edits(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(tiny_bundles["llama"], tmp_path)
    edit_manifest(b, lambda m: None)
    reforge(b)
    assert json.loads((b / MANIFEST).read_text())["ladder"]
    assert verify_bundle(b).accepted


# ----------------------------------------------------------------- D: scopes


def _cross_worker_counter(sf: ScheduleFile, scope: str, across_gpus: bool = False) -> int:
    """A counter of `scope` whose tasks (signallers and waiters) are on two workers (GPUs)."""
    where: dict[int, set[int]] = {}
    for t in range(len(sf.tasks.name)):
        w = sf.tasks.worker[t]
        for c in (*sf.tasks.waits[t], *sf.tasks.signals[t]):
            where.setdefault(c, set()).add(w // sf.workers_per_gpu if across_gpus else w)
    return next(c for c, ws in where.items() if len(ws) > 1 and sf.counters.scope[c] == scope)


def test_cross_worker_counter_marked_cta(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(tiny_bundles["llama"], tmp_path)
    rung = rungs(b)[0]
    c = _cross_worker_counter(_sched(b, rung), "device")
    name = _sched(b, rung).counters.name[c]

    def narrow(d: dict[str, Any]) -> None:
        d["counters"]["scope"][c] = "cta"

    edit_rung(b, rung, schedule=narrow)
    report = verify_bundle(b)
    only_rejected_by(
        report, "D", f"({name}): scope cta but task", "(a cta counter is one worker's)"
    )
    assert not rejected(report, "E")


def test_cross_gpu_counter_marked_device(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    tp2 = load_target("h200").model_copy(update={"gpus": 2})
    # the llama fixture: its 2 key-value heads split over 2 GPUs (qwen3's one does not)
    src = compile_bundle(
        tiny_checkpoints["llama"], tmp_path / "tp2", tp2, CompileProfile(), plan_only=True
    ).out
    assert verify_bundle(src).accepted
    b = mutant(src, tmp_path)
    rung = rungs(b)[0]
    c = _cross_worker_counter(_sched(b, rung), "system", across_gpus=True)

    def narrow(d: dict[str, Any]) -> None:
        d["counters"]["scope"][c] = "device"

    edit_rung(b, rung, schedule=narrow)
    only_rejected_by(verify_bundle(b), "D", f"counter {c} (", "scope device", "132 workers per GPU")


# ----------------------------------------------------------------- certificates bound to the bundle


def _drop_a_task(b: Path) -> str:
    rung = rungs(b)[0]
    sf = _sched(b, rung)
    victim = _multi_task_op(sf)[-1]
    edit_rung(b, rung, schedule=lambda d: drop_task(d, victim))
    return "run by no task"


def _narrow_a_scope(b: Path) -> str:
    rung = rungs(b)[0]
    c = _cross_worker_counter(_sched(b, rung), "device")
    edit_rung(b, rung, schedule=lambda d: d["counters"]["scope"].__setitem__(c, "cta"))
    return "scope cta but task"


def _flip_masked(b: Path) -> str:
    rung = rungs(b)[0]
    sf = _sched(b, rung)
    t = next(i for i, m in enumerate(sf.tasks.masked) if not m)
    edit_rung(b, rung, schedule=lambda d: d["tasks"]["masked"].__setitem__(t, True))
    return "MASKED is set but none"


@pytest.mark.parametrize("mutate", [_drop_a_task, _narrow_a_scope, _flip_masked])
def test_mutants_are_refused_by_the_loader(
    tiny_bundles: dict[str, Path], tmp_path: Path, mutate: Any
) -> None:
    """The mutant keeps the certificates of the bundle it was made from: the loader refuses
    them (another bundle digest) and names what `plow verify` rejects."""
    from plow.bundle.open import BundleRefused
    from plow.runtime.cpu.bundle import Bundle

    b = mutant(tiny_bundles["llama"], tmp_path)
    why = mutate(b)
    assert not verify_bundle(b).accepted
    with pytest.raises(BundleRefused) as info:
        Bundle.open(b)
    msg = str(info.value)
    assert "its certificate is stale" in msg and why in msg and "\n" not in msg


def test_certificates_carry_the_bundle_digest(
    tiny_bundles: dict[str, Path], tmp_path: Path
) -> None:
    from plow.bundle.manifest import bundle_digest
    from plow.emit.verify import write_certificates

    b = mutant(tiny_bundles["qwen3"], tmp_path)
    digest = bundle_digest(b)
    m = json.loads((b / MANIFEST).read_text())
    assert {f"certificates/{ck}.json" for ck in "BCDEF"} <= set(m["files"])
    for ck in "BCDEF":
        doc = json.loads((b / "certificates" / f"{ck}.json").read_text())
        assert {c["bundle_sha256"] for c in doc["buckets"].values()} == {digest}
    # volatile fields do not change the digest; anything that runs does
    edit_manifest(b, lambda m: m.update(compiled_at="1970-01-01T00:00:00Z"))
    assert bundle_digest(b) == digest
    edit_manifest(b, lambda m: m["ladder"][0]["cost"].update(makespan_ns=1.0))
    assert bundle_digest(b) != digest
    # re-verified: new certificates, listed again; the digest is theirs
    report = verify_bundle(b)
    assert report.accepted
    write_certificates(report)
    assert json.loads((b / "certificates" / "B.json").read_text())["buckets"][rungs(b)[0]["name"]][
        "bundle_sha256"
    ] == bundle_digest(b)


def test_stale_or_foreign_or_edited_certificates_are_refused(
    tiny_bundles: dict[str, Path], tmp_path: Path
) -> None:
    from plow.bundle.open import BundleRefused
    from plow.runtime.cpu.bundle import Bundle

    # a benign manifest edit verify accepts: the certificates still name the old bundle
    b = mutant(tiny_bundles["llama"], tmp_path)
    edit_manifest(b, lambda m: m["model"].update(source="/elsewhere"))
    assert verify_bundle(b).accepted
    with pytest.raises(BundleRefused, match="certified another bundle"):
        Bundle.open(b)
    # certificates copied from another bundle
    b2 = copy_bundle(tiny_bundles["llama"], tmp_path / "foreign")
    for ck in "BCDEF":
        src = tiny_bundles["gemma3"] / "certificates" / f"{ck}.json"
        doc = json.loads(src.read_text())
        doc["buckets"] = {
            r["name"]: next(iter(doc["buckets"].values())) for r in rungs(b2)
        }  # one per rung of this bundle
        (b2 / "certificates" / f"{ck}.json").write_text(json.dumps(doc))
    reforge(b2)
    with pytest.raises(BundleRefused, match="certified another bundle|stale"):
        Bundle.open(b2)
    # a certificate file edited after verification (hash not re-forged)
    b3 = copy_bundle(tiny_bundles["llama"], tmp_path / "edited")
    p = b3 / "certificates" / "D.json"
    p.write_text(p.read_text().replace('"accept"', '"accept" ', 1))
    with pytest.raises(BundleRefused, match=r"certificates/D\.json: sha256 differs"):
        Bundle.open(b3)
    assert Bundle.open(tiny_bundles["llama"]).verified


# ---------------------------------------------------------------- E: the emitter's field rules
# Byte edits of a plan file's records (hashes re-forged, no re-emission): E decodes the
# records and checks each one's offsets against the op table's operands at their arena-map
# offsets (Plow.Emitcheck), so a pointer to the wrong buffer is named with the record, the op
# and the buffer it should point at.


def _compute_record(b: Path, rung: dict[str, Any]) -> tuple[int, int, Any]:
    """(record index, op index, op row) of the first compute packet (not a nop, load or
    merge) of an op with two inputs and no partial."""
    from plow.bundle.wire import Flag, Opcode, decode_plan

    ot = _ops(b, rung)
    _, arr = decode_plan((b / rung["plan"]).read_bytes())
    for r in range(len(arr)):
        code, fl, oi = int(arr["opcode"][r]), int(arr["flags"][r]), int(arr["op_index"][r])
        if code in (Opcode.NOP, Opcode.LOAD) or fl & Flag.ACCUMULATE:
            continue
        o = ot.ops[oi]
        if len(o.inputs) > 1 and not o.partial:
            return r, oi, o
    raise AssertionError("no compute packet of a two-input op")


def _poke_u64(b: Path, rung: dict[str, Any], rec: int, at: int, value: int) -> None:
    path = b / rung["plan"]
    data = bytearray(path.read_bytes())
    off = HEADER_SIZE + 64 * rec + at
    data[off : off + 8] = value.to_bytes(8, "little")
    path.write_bytes(bytes(data))
    reforge(b)


def test_out_offset_at_another_buffer(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(tiny_bundles["llama"], tmp_path)
    rung = rungs(b)[0]
    rec, oi, o = _compute_record(b, rung)
    ot = _ops(b, rung)
    other = ot.tensors[o.inputs[0]].offset  # the op's own input: another buffer
    assert other != ot.tensors[o.outputs[0]].offset
    _poke_u64(b, rung, rec, 56, other)
    only_rejected_by(
        verify_bundle(b), "E", f"record {rec} (compute packet of op {oi} \"{o.name}\")",
        f"field out_offset: {other} but the op table and arena map give "
        f"{ot.tensors[o.outputs[0]].offset} (the op's output \"{o.outputs[0]}\")",
    )  # fmt: skip


def test_weight_offset_of_another_op(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = mutant(tiny_bundles["llama"], tmp_path)
    rung = rungs(b)[0]
    rec, oi, o = _compute_record(b, rung)
    ot = _ops(b, rung)
    want = ot.tensors[o.inputs[1]].offset
    other = next(
        ot.tensors[p.inputs[1]].offset for p in ot.ops
        if len(p.inputs) > 1 and ot.tensors[p.inputs[1]].offset != want
        and ot.tensors[p.inputs[1]].role == "weight"
    )  # fmt: skip
    _poke_u64(b, rung, rec, 48, other)
    only_rejected_by(
        verify_bundle(b), "E", f"record {rec} (compute packet of op {oi} \"{o.name}\")",
        f"field weight_offset: {other} but the op table and arena map give {want} "
        f"(the op's second input \"{o.inputs[1]}\")",
    )  # fmt: skip
