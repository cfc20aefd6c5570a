"""Greedy fused into lm_head is the compiler's decision, carried in the bundle (issue 14):
the op table's `argmax` on the lm_head and sample ops, the values / index buffers in the
arena map, FUSED_ARGMAX on every non-load packet of both ops; E checks the flag per op, D's
data flow has the chunks' writes and reads, F places the buffers; the executor runs it as
loaded (no load-time transform). Mutants with the flag set on an unfused op, or cleared on a
fused one, are rejected by `plow verify` with the record and op, and refused by the loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plow.bundle.argmax import argmax_bounds
from plow.bundle.files import OpTable, ScheduleFile
from plow.bundle.open import BundleRefused
from plow.bundle.wire import Flag, Opcode, read_plan, write_plan
from plow.checkpoint import load_checkpoint
from plow.emit.bundle import compile_bundle
from plow.emit.verify import verify_bundle
from plow.oracle.payloads.dataflow import COMPUTE, MERGE, TaskUnits, task_accesses
from plow.profile import CompileProfile
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.cpu.bundle import Bundle
from plow.target import load_target
from tests.emit.bundle_edit import copy_bundle, reforge, rungs


@pytest.fixture(scope="module")
def gpu_llama(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """h100: a k-split lm_head (its merges write the logits and the chunks); the sample op
    unsplit (the tiler never splits a sample fed by an lm_head: no sample partials). Unfused:
    R19's lm_head (the final norm in its prologue) reads whole rows, and the tiler does not
    split its k here."""
    out = tmp_path_factory.mktemp("fa") / "b"
    prof = CompileProfile(decode_batches=(2,), prefill_seqs=(), fuse=False)
    return compile_bundle(
        tiny_checkpoints["llama"], out, load_target("h100"), prof, plan_only=True, verify=True
    ).out


def _files(b: Path, rung: dict[str, Any]) -> tuple[OpTable, ScheduleFile, Any]:
    ot = OpTable.model_validate_json((b / rung["ops"]).read_bytes())
    sf = ScheduleFile.model_validate_json((b / rung["schedule"]).read_bytes())
    return ot, sf, read_plan(b / rung["plan"])[1]


def _check_fused(b: Path) -> None:
    for rung in rungs(b):
        ot, sf, arr = _files(b, rung)
        fused = {o.index for o in ot.ops if o.argmax is not None}
        kinds = sorted(ot.ops[i].kind for i in fused)
        assert kinds == ["lm_head", "sample"], rung["name"]
        lm = next(o for o in ot.ops if o.kind == "lm_head")
        chunks = len(argmax_bounds(ot, lm, sf.workers_per_gpu)) - 1
        names = {x.name: x for x in sf.arena.buffers}
        for n in (f"{lm.name}#argmax", f"{lm.name}#argmax.index"):
            assert ot.tensors[n].shape == [chunks, lm.axes[0].extent]
            assert names[n].offset == ot.tensors[n].offset and names[n].region == "scratch"
        flag = (arr["flags"] & Flag.FUSED_ARGMAX) != 0
        real = (arr["opcode"] != Opcode.NOP) & (arr["opcode"] != Opcode.LOAD)
        want = real & np.isin(arr["op_index"], sorted(fused))
        assert (flag == want).all() and want.any(), rung["name"]


def test_compiler_fuses_greedy_into_lm_head_and_verify_accepts(
    tiny_bundles: dict[str, Path], gpu_llama: Path
) -> None:
    for b in (tiny_bundles["llama"], gpu_llama):
        _check_fused(b)
        assert verify_bundle(b).accepted


def test_d_data_flow_has_the_argmax_chunks(gpu_llama: Path) -> None:
    """The lm_head's logits writers write every chunk of the buffer (each once), the sample's
    merge (or its one task) reads them all: the byte model D sweeps."""
    rung = rungs(gpu_llama)[0]
    ot, sf, _ = _files(gpu_llama, rung)
    lm = next(o for o in ot.ops if o.kind == "lm_head")
    smp = next(o for o in ot.ops if o.kind == "sample")
    offs = {x.name: x.offset for x in sf.arena.buffers}
    t = ot.tensors[f"{lm.name}#argmax"]
    lo, hi = t.offset, t.offset + t.size
    cols = sf.tasks
    units = [
        TaskUnits(cols.op[i], {"load": 0, "compute": COMPUTE}.get(cols.kind[i], MERGE),
                  cols.unit_start[i], cols.unit_count[i])
        for i in range(len(cols.name))
    ]  # fmt: skip
    accs = task_accesses(ot, offs, units, sf.workers_per_gpu)
    writer = MERGE if lm.partial else COMPUTE  # a k-split lm_head's merges write the logits
    reader = MERGE if smp.partial else COMPUTE
    assert lm.partial and not smp.partial
    written = []
    for i, u in enumerate(units):
        w = [(a, z) for a, z, x in accs[i] if x == 1 and a < hi and z > lo]
        r = [(a, z) for a, z, x in accs[i] if x == 0 and a < hi and z > lo]
        if u.op == lm.index and u.stage == writer:
            written += w
        elif u.op == smp.index and u.stage == reader:
            assert sum(z - a for a, z in r) == t.size  # every chunk of every row
        else:
            assert not w and not r, cols.name[i]
    assert sorted(written)[0][0] == lo and sum(z - a for a, z in written) == t.size


def _set_flag(b: Path, rung: dict[str, Any], rec: int, on: bool) -> None:
    h, arr = read_plan(b / rung["plan"])
    arr = arr.copy()
    f = int(arr["flags"][rec])
    arr["flags"][rec] = f | Flag.FUSED_ARGMAX if on else f & ~Flag.FUSED_ARGMAX
    write_plan(b / rung["plan"], arr, phase=h.phase, batch=h.batch, seq=h.seq, workers=h.workers)
    reforge(b)


def _record(b: Path, rung: dict[str, Any], kind: str) -> tuple[int, int, str]:
    ot, _, arr = _files(b, rung)
    for r in range(len(arr)):
        oi = int(arr["op_index"][r])
        if int(arr["opcode"][r]) in (Opcode.NOP, Opcode.LOAD):
            continue
        if ot.ops[oi].kind == kind:
            return r, oi, ot.ops[oi].name
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "on", "says"),
    [
        # (every norm of the fused tiny llama is a fused op: R1's add_rmsnorm, R18, R19)
        ("add_rmsnorm", True, "set FUSED_ARGMAX but the op table names no argmax buffer"),
        ("sample", False, "lack FUSED_ARGMAX but the op table fuses the op"),
        ("lm_head", False, "lack FUSED_ARGMAX but the op table fuses the op"),
    ],
)
def test_a_flag_that_disagrees_with_the_op_table_is_rejected_and_refused(
    tiny_bundles: dict[str, Path], tmp_path: Path, kind: str, on: bool, says: str
) -> None:
    src = tiny_bundles["llama"]
    b = copy_bundle(src, tmp_path / "m")
    rung = rungs(b)[0]
    rec, oi, name = _record(b, rung, kind)
    _set_flag(b, rung, rec, on)
    rep = verify_bundle(b)
    bad = [r for r in rep.rows if r.rejected]
    assert bad and bad[0].checkpoint == "E", [(r.checkpoint, r.reason) for r in bad]
    assert f"record {rec} (" in bad[0].reason and f'of op {oi} "{name}"' in bad[0].reason
    assert says in bad[0].reason, bad[0].reason
    with pytest.raises(BundleRefused):  # the certificates no longer match
        Bundle.open(b)
    from plow.runtime.native import open_native

    for m in (CpuModel.from_bundle(b, verify=False), open_native(b, verify=False)):
        with pytest.raises(BundleRefused, match="FUSED_ARGMAX"):  # the loader's own check
            assert m.bundle is not None
            m.plan(m.bundle.ladder[[r["name"] for r in rungs(b)].index(rung["name"])])


def test_bundle_runs_the_compiled_fusion_with_unchanged_greedy_tokens(
    tiny_bundles: dict[str, Path], tiny_checkpoints: dict[str, Path]
) -> None:
    m = CpuModel.from_bundle(tiny_bundles["llama"], fuse_argmax=False)  # no say: the bundle's
    reqs = [Request((5, 17, 93, 2, 44), 6), Request((3, 250, 41), 6)]
    got = generate(m, reqs)
    assert m.plans and all(p.fused is not None for p in m.plans.values())
    assert m.machine.counts.get("sample.scan", 0) == 0
    assert m.machine.counts.get("lm_head.argmax", 0) > 0
    ckpt = load_checkpoint(tiny_checkpoints["llama"])
    ref = CpuModel(ckpt.spec, ckpt.weights, max_batch=2, fuse_argmax=False)
    assert generate(ref, reqs) == got


def test_an_argmax_buffer_named_by_another_op_is_rejected_and_refused(
    tiny_bundles: dict[str, Path], tmp_path: Path
) -> None:
    """The op table says an rmsnorm is fused too, and its packets carry the flag (E's rule is
    met): `plow verify`'s cross-check names the op; the loader refuses the rung."""
    from plow.emit.emit import emit_packets

    b = copy_bundle(tiny_bundles["llama"], tmp_path / "m")
    rung = rungs(b)[0]
    ot, sf, _ = _files(b, rung)
    i = next(o.index for o in ot.ops if o.kind == "add_rmsnorm")  # the fused norms: R1
    lm = next(o for o in ot.ops if o.kind == "lm_head")
    ops = list(ot.ops)
    ops[i] = ops[i].model_copy(update={"argmax": f"{lm.name}#argmax"})
    ot = ot.model_copy(update={"ops": ops})
    (b / rung["ops"]).write_text(ot.model_dump_json())
    h, _ = read_plan(b / rung["plan"])
    arr = emit_packets(sf, ot)
    write_plan(b / rung["plan"], arr, phase=h.phase, batch=h.batch, seq=h.seq, workers=h.workers)
    reforge(b)
    rep = verify_bundle(b)
    assert not rep.accepted
    why = rep.first_rejection()
    assert why is not None and why.checkpoint == "bundle", why
    assert f"op {ot.ops[i].name!r} (add_rmsnorm) names the argmax buffer" in why.reason
    assert rung["ops"] in why.reason
    m = CpuModel.from_bundle(b, verify=False)
    with pytest.raises(BundleRefused, match="names the argmax buffer"):
        m.plan(m.bundle.ladder[[r["name"] for r in rungs(b)].index(rung["name"])])
