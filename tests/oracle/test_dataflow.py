"""Checkpoint D from data flow (C10, Plow.Dataflow, Plow.Flowsweep): the oracle derives the
dependencies from the tasks' arena reads and writes, not from the schedule's edge list.

Small hand-made payloads pin the verdicts of the pairwise checker (no `order`) and of the sweep
(`order`, what `plow verify` sends at every plan size); semantic mutations of a real tiny
bundle (hashes re-forged, plan re-emitted) show that a dropped wait with its matching edge —
which the edge-list check accepts — is rejected by the sweep naming the two tasks and the
bytes; a whole Qwen3-30B-A3B plan is swept (slow); and two compiles of one checkpoint (two
processes) give byte-identical certificates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from plow.bundle.files import OpTable, ScheduleFile
from plow.bundle.manifest import MANIFEST, VOLATILE, bundle_digest
from plow.bundle.stream import group_tasks
from plow.bundle.wire import decode_plan
from plow.emit.bundle import compile_bundle
from plow.emit.verify import counter_graph_from_packets, dataflow_from_packets, verify_bundle
from plow.errors import PlowError
from plow.oracle import run_checkpoint
from plow.oracle.payloads.dataflow import BLOCK, dataflow_payload, sweep_order
from plow.profile import CompileProfile
from plow.target import load_target
from tests.emit.bundle_edit import copy_bundle, edit_rung, rungs

# -- hand-made payloads ------------------------------------------------------------------


def plan(
    workers: list[int],
    waits: list[list[int]],
    signals: list[list[int]],
    thresholds: list[int],
    keys: list[int],
    accesses: list[list[list[int]]],
    chains: list[list[Any]] | None = None,
) -> dict[str, Any]:
    """A D payload with no schedule edges: every dependency must come from data flow."""
    nw = max(workers) + 1
    queues = [[t for t, w in enumerate(workers) if w == k] for k in range(nw)]
    return {
        "tasks": [
            {"name": f"t{i}", "worker": w, "waits": wa, "signals": si}
            for i, (w, wa, si) in enumerate(zip(workers, waits, signals, strict=True))
        ],
        "queues": queues,
        "counters": [
            {"name": f"c{i}", "threshold": th, "scope": "system"} for i, th in enumerate(thresholds)
        ],
        "edges": [],
        "ranks": list(range(len(workers))),
        "dataflow": {
            "keys": keys,
            "accesses": accesses,
            "block": BLOCK,
            "chains": chains or [],
        },
    }


def test_read_after_write_needs_a_wait() -> None:
    # t0 writes bytes [0, 16); t1 (another worker, later op) reads [8, 12)
    ok = plan([0, 1], [[], [0]], [[0], []], [1], [5, 9], [[[0, 16, 1]], [[8, 12, 0]]])
    cert = run_checkpoint("D", ok)
    assert cert.accepted
    assert "Plow.Dataflowproof.checkpoint_d_flow_sound" in cert.theorems
    bad = plan([0, 1], [[], []], [[], []], [], [5, 9], [[[0, 16, 1]], [[8, 12, 0]]])
    cert = run_checkpoint("D", bad)
    assert not cert.accepted
    assert "task 0 (t0)" in (cert.reason or "") and "task 1 (t1)" in (cert.reason or "")
    assert "bytes [8, 12)" in (cert.reason or "")
    # the edge-list check alone accepts it (no edges listed): the old hole
    bad.pop("dataflow")
    assert run_checkpoint("D", bad).accepted


def test_reads_never_conflict_with_reads() -> None:
    p = plan([0, 1], [[], []], [[], []], [], [5, 9], [[[0, 16, 0]], [[8, 12, 0]]])
    assert run_checkpoint("D", p).accepted


def test_same_stage_conflict_is_a_race() -> None:
    p = plan([0, 1], [[], []], [[], []], [], [5, 5], [[[0, 16, 1]], [[12, 20, 1]]])
    cert = run_checkpoint("D", p)
    assert not cert.accepted
    assert (cert.reason or "").startswith("race:") and "bytes [12, 16)" in (cert.reason or "")


def war_plan(chains: list[list[Any]] | None) -> dict[str, Any]:
    """t0 reads [0, 8); t1 waits for t0; t2 waits for t1 and overwrites [0, 8) (write after
    read, ordered only through t1)."""
    return plan(
        [0, 1, 2],
        [[], [0], [1]],
        [[0], [1], []],
        [1, 1],
        [1, 5, 9],
        [[[0, 8, 0]], [[100, 104, 1]], [[0, 8, 1]]],
        chains,
    )


def test_write_after_read_ordered_through_a_chain() -> None:
    cert = run_checkpoint("D", war_plan(None))
    assert not cert.accepted and "task 0 (t0)" in (cert.reason or "")
    assert "task 2 (t2)" in (cert.reason or "") and "bytes [0, 8)" in (cert.reason or "")
    assert run_checkpoint("D", war_plan([[0, 2, [1]]])).accepted
    # a chain is checked link by link: t0 -> t2 directly is not a link
    assert not run_checkpoint("D", war_plan([[0, 2, []]])).accepted


def swept(p: dict[str, Any], order: list[int] | None = None) -> dict[str, Any]:
    """The payload for the sweep: the builder's topological order (or `order`), no chains."""
    tasks = p["tasks"]
    flow = dict(p["dataflow"])
    flow.pop("chains")
    flow["order"] = (
        sweep_order([t["waits"] for t in tasks], [t["signals"] for t in tasks], p["queues"])
        if order is None
        else order
    )
    return {**p, "dataflow": flow}


SWEEP = "Plow.Flowsweepproof.checkpoint_d_sweep_sound"


def test_sweep_read_after_write_needs_a_wait() -> None:
    ok = plan([0, 1], [[], [0]], [[0], []], [1], [5, 9], [[[0, 16, 1]], [[8, 12, 0]]])
    cert = run_checkpoint("D", swept(ok))
    assert cert.accepted and SWEEP in cert.theorems
    # t1's read meets one frontier entry (t0's write)
    assert cert.stats == {"accesses": 2, "comparisons": 1}
    bad = plan([0, 1], [[], []], [[], []], [], [5, 9], [[[0, 16, 1]], [[8, 12, 0]]])
    reason = run_checkpoint("D", swept(bad)).reason or ""
    assert "task 0 (t0)" in reason and "task 1 (t1)" in reason and "bytes [8, 12)" in reason
    assert "must precede" in reason


def test_sweep_orders_through_other_tasks_without_chains() -> None:
    # write after read ordered only through t1: the clocks find it, no chain is sent
    assert run_checkpoint("D", swept(war_plan(None))).accepted
    # t1 no longer waits for t0: nothing orders t0's read before t2's write
    p = war_plan(None)
    p["tasks"][1]["waits"] = []
    reason = run_checkpoint("D", swept(p)).reason or ""
    assert "task 0 (t0)" in reason and "task 2 (t2)" in reason and "bytes [0, 8)" in reason


def test_sweep_overwritten_bytes_ordered_through_the_last_writer() -> None:
    # t0 writes [0, 16), t1 (after t0) overwrites [0, 4), t2 (after t1 only) reads [0, 8):
    # t2 meets t1's entry and what is left of t0's; both happen before it
    p = plan(
        [0, 1, 2],
        [[], [0], [1]],
        [[0], [1], []],
        [1, 1],
        [1, 5, 9],
        [[[0, 16, 1]], [[0, 4, 1]], [[0, 8, 0]]],
    )
    assert run_checkpoint("D", swept(p)).accepted
    # t2 waits for nothing: unordered with t1 (the entry it meets first)
    p["tasks"][2]["waits"] = []
    assert not run_checkpoint("D", swept(p)).accepted


def test_sweep_same_stage_conflict_is_a_race() -> None:
    p = plan([0, 1], [[], []], [[], []], [], [5, 5], [[[0, 16, 1]], [[12, 20, 1]]])
    reason = run_checkpoint("D", swept(p)).reason or ""
    assert reason.startswith("race:") and "bytes [12, 16)" in reason


def test_sweep_order_is_checked() -> None:
    ok = plan([0, 1], [[], [0]], [[0], []], [1], [5, 9], [[[0, 16, 1]], [[8, 12, 0]]])
    reason = run_checkpoint("D", swept(ok, [0])).reason or ""
    assert "task 1 (t1) is not in the sweep order" in reason
    reason = run_checkpoint("D", swept(ok, [1, 0])).reason or ""
    assert "task 1 (t1)" in reason and "swept before task 0 (t0)" in reason


def test_builder_sends_an_order_not_chains() -> None:
    p = war_plan(None)
    tasks = p["tasks"]
    accs = [[tuple(a) for a in acc] for acc in p["dataflow"]["accesses"]]
    p["dataflow"] = dataflow_payload(
        p["dataflow"]["keys"],
        accs,
        [t["waits"] for t in tasks],
        [t["signals"] for t in tasks],
        p["queues"],
    )
    assert p["dataflow"]["order"] == [0, 1, 2] and "chains" not in p["dataflow"]
    cert = run_checkpoint("D", p)
    assert cert.accepted and SWEEP in cert.theorems


def test_range_across_a_block_is_refused() -> None:
    p = plan([0], [[]], [[]], [], [1], [[[BLOCK - 4, BLOCK + 4, 1]]])
    cert = run_checkpoint("D", p)
    assert not cert.accepted and "crosses a block boundary" in (cert.reason or "")


# -- a real tiny bundle ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_llama: Path) -> Path:
    """The session's tiny Llama checkpoint (tests/conftest.py)."""
    return tiny_llama


PROFILE = CompileProfile(decode_batches=(1,), prefill_seqs=(8,))


@pytest.fixture(scope="module")
def h200_bundle(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dflow_h200") / "b"
    return compile_bundle(tiny_ckpt, out, load_target("h200"), PROFILE, plan_only=True).out


def _d_reasons(bundle: Path) -> list[str]:
    return [r.reason for r in verify_bundle(bundle).rows if r.rejected]


def test_unmutated_bundle_certified_from_data_flow(h200_bundle: Path) -> None:
    rep = verify_bundle(h200_bundle)
    assert rep.accepted, [(r.checkpoint, r.reason) for r in rep.rows if r.rejected]
    d = [r for r in rep.rows if r.checkpoint == "D"]
    assert d and all(SWEEP in r.theorems for r in d)
    assert all("accesses swept" in r.reason and "frontier entries compared" in r.reason for r in d)
    assert all(r.certificate and r.certificate.stats for r in d)


def _drop_candidate(sched: dict[str, Any]) -> tuple[int, int]:
    """(producer, consumer) of an edge whose consumer is first on its worker, waits on one
    counter, and whose producer is on another worker."""
    t = sched["tasks"]
    first: dict[int, int] = {}
    for i, w in enumerate(t["worker"]):
        first.setdefault(w, i)
    e = sched["edges"]
    for u, v in zip(e[0::2], e[1::2], strict=True):
        w = t["worker"][v]
        if len(t["waits"][v]) == 1 and first[w] == v and t["worker"][u] != w:
            return u, v
    raise AssertionError("no candidate edge")


def test_dropped_wait_and_edge_rejected_before_anything_runs(
    h200_bundle: Path, tmp_path: Path
) -> None:
    b = copy_bundle(h200_bundle, tmp_path / "m")
    rung = rungs(b)[0]
    sched = json.loads((b / rung["schedule"]).read_text())
    u, v = _drop_candidate(sched)
    names = sched["tasks"]["name"]

    def drop(s: dict[str, Any]) -> None:
        s["tasks"]["waits"][v] = []
        e = s["edges"]
        keep = [(a, c) for a, c in zip(e[0::2], e[1::2], strict=True) if c != v]
        s["edges"] = [x for pair in keep for x in pair]

    edit_rung(b, rung, schedule=drop)
    rep = verify_bundle(b)
    bad = [r for r in rep.rows if r.rejected]
    # D rejects the race; F may too, where the two tasks' buffers share arena bytes
    # (with R18 the embedding writes the first norm's rows, which reuse freed bytes)
    got = [r.checkpoint for r in bad]
    assert got[0] == "D" and set(got) <= {"D", "F"}, [(r.checkpoint, r.reason) for r in bad]
    reason = bad[0].reason
    assert f"({names[u]})" in reason and f"({names[v]})" in reason
    assert "arena bytes [" in reason and "must precede" in reason
    # the edge-list checker alone (the schedule file's edges, no data flow) accepts it
    sf = ScheduleFile.model_validate_json((b / rung["schedule"]).read_bytes())
    _, arr = decode_plan((b / rung["plan"]).read_bytes())
    g = counter_graph_from_packets(arr, sf, group_tasks(arr))
    assert not isinstance(g, str)
    assert run_checkpoint("D", g.payload_dict()).accepted


def test_schedule_edges_play_no_part(h200_bundle: Path, tmp_path: Path) -> None:
    """The dependencies are derived: a schedule file with no edges at all is certified the
    same way, with the same data-flow payload."""

    def flow(bundle: Path) -> dict[str, Any]:
        rung = rungs(bundle)[0]
        ot = OpTable.model_validate_json((bundle / rung["ops"]).read_bytes())
        sf = ScheduleFile.model_validate_json((bundle / rung["schedule"]).read_bytes())
        _, arr = decode_plan((bundle / rung["plan"]).read_bytes())
        grouped = group_tasks(arr)
        assert not isinstance(grouped, str)
        g = counter_graph_from_packets(arr, sf, grouped)
        assert not isinstance(g, str)
        out = dataflow_from_packets(arr, grouped, ot, sf, g)
        assert not isinstance(out, str)
        return out

    b = copy_bundle(h200_bundle, tmp_path / "m")
    for rung in rungs(b):
        edit_rung(b, rung, schedule=lambda s: s.update(edges=[]))
    rep = verify_bundle(b)
    assert rep.accepted, [(r.checkpoint, r.reason) for r in rep.rows if r.rejected]
    assert flow(b) == flow(h200_bundle)
    assert sorted(flow(b)["order"]) == list(range(len(flow(b)["keys"])))


@pytest.mark.slow
def test_whole_moe_plan_swept_from_data_flow(tmp_path: Path) -> None:
    """Qwen3-30B-A3B decode on h200 (~45,000 tasks): D derives the dependencies from data
    flow at this size too (no fallback to the schedule file's edges)."""
    root = Path(__file__).resolve().parents[2]
    out = compile_bundle(
        root / "tests/data/configs/qwen3-30b-a3b",
        tmp_path / "q",
        load_target("h200"),
        CompileProfile(decode_batches=(1,), prefill_seqs=()),
        plan_only=True,
    ).out
    d = [r for r in verify_bundle(out, checkpoints=("D",)).rows if r.checkpoint == "D"]
    assert d and all(r.verdict == "accept" and SWEEP in r.theorems for r in d)
    tasks = int(d[0].reason.split(" tasks")[0].split()[-1])
    assert tasks > 20_000, d[0].reason


def test_swapped_wait_thresholds_rejected(h200_bundle: Path, tmp_path: Path) -> None:
    b = copy_bundle(h200_bundle, tmp_path / "m")
    rung = rungs(b)[0]
    sched = json.loads((b / rung["schedule"]).read_text())
    th = sched["counters"]["threshold"]
    i, j = next((i, j) for i in range(len(th)) for j in range(i) if th[i] != th[j])

    def swap(s: dict[str, Any]) -> None:
        t = s["counters"]["threshold"]
        t[i], t[j] = t[j], t[i]

    edit_rung(b, rung, schedule=swap)
    reasons = _d_reasons(b)
    assert reasons and any("threshold" in r for r in reasons), reasons


def test_shrunk_task_range_rejected(h200_bundle: Path, tmp_path: Path) -> None:
    b = copy_bundle(h200_bundle, tmp_path / "m")
    rung = rungs(b)[0]
    sched = json.loads((b / rung["schedule"]).read_text())
    k = next(i for i, c in enumerate(sched["tasks"]["unit_count"]) if c > 1)

    def shrink(s: dict[str, Any]) -> None:
        s["tasks"]["unit_count"][k] -= 1

    edit_rung(b, rung, schedule=shrink)
    rep = verify_bundle(b)
    bad = [r for r in rep.rows if r.rejected]
    assert bad and bad[0].checkpoint == "B", [(r.checkpoint, r.reason) for r in bad]
    assert "op " in bad[0].reason


def test_page_counts_come_from_the_op_table(h200_bundle: Path, tmp_path: Path) -> None:
    """C sizes each task's pages from its op's tile (never the schedule file's columns); a
    file that understates them is named in the bundle row."""
    b = copy_bundle(h200_bundle, tmp_path / "m")
    rung = rungs(b)[0]
    sched = json.loads((b / rung["schedule"]).read_text())
    k = next(i for i, w in enumerate(sched["pages"]["weight_pages"]) if w > 0)
    want = (sched["pages"]["weight_pages"][k], sched["pages"]["act_pages"][k])

    def understate(s: dict[str, Any]) -> None:
        s["pages"]["weight_pages"][k] = 0
        s["pages"]["act_pages"][k] = 0

    edit_rung(b, rung, schedule=understate)
    rep = verify_bundle(b)
    bundle_row = next(r for r in rep.rows if r.checkpoint == "bundle")
    assert bundle_row.rejected
    name = sched["tasks"]["name"][k]
    assert f"task {k} ({name}) declares 0 weight / 0 activation pages" in bundle_row.reason
    assert f"its tile needs {want[0]} / {want[1]}" in bundle_row.reason
    c_rows = [r for r in rep.rows if r.checkpoint == "C"]
    assert c_rows and not any(r.rejected for r in c_rows)


# -- reproducible certificates ------------------------------------------------------------

_COMPILE = (
    "import sys; from pathlib import Path; from plow.emit.bundle import compile_bundle;"
    "from plow.profile import CompileProfile; from plow.target import load_target;"
    "compile_bundle(Path(sys.argv[1]), Path(sys.argv[2]), load_target('cpu'),"
    "CompileProfile(decode_batches=(1,), prefill_seqs=(8,)), verify=True)"
)


@pytest.mark.slow
def test_certificates_reproducible_across_processes(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two compiles, in this process and another: the same files, certificates A-F included;
    with SOURCE_DATE_EPOCH (reproducible-builds.org) byte for byte, manifest included."""
    a = compile_bundle(tiny_ckpt, tmp_path / "a", load_target("cpu"), PROFILE, verify=True).out
    b = tmp_path / "b"
    subprocess.run([sys.executable, "-c", _COMPILE, str(tiny_ckpt), str(b)], check=True)
    files_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    files_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    certs = [f for f in files_a if f.startswith("certificates/")]
    assert certs == [f"certificates/{c}.json" for c in "ABCDEF"]
    for f in files_a:
        if f != MANIFEST:
            assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert bundle_digest(a) == bundle_digest(b)
    ma, mb = (json.loads((x / MANIFEST).read_bytes()) for x in (a, b))
    assert ma["stage_seconds"]  # an ordinary build records its timings
    for k in VOLATILE:
        ma.pop(k, None)
        mb.pop(k, None)
    assert ma == mb
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764547200")
    c, d = tmp_path / "c", tmp_path / "d"
    compile_bundle(tiny_ckpt, c, load_target("cpu"), PROFILE, verify=True)
    subprocess.run([sys.executable, "-c", _COMPILE, str(tiny_ckpt), str(d)], check=True)
    for f in files_a:
        assert (c / f).read_bytes() == (d / f).read_bytes(), f
    mc = json.loads((c / MANIFEST).read_bytes())
    assert mc["compiled_at"] == "2025-12-01T00:00:00Z" and mc["stage_seconds"] == {}
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(PlowError, match="SOURCE_DATE_EPOCH: must be whole seconds"):
        compile_bundle(tiny_ckpt, tmp_path / "e", load_target("cpu"), PROFILE, verify=True)
    assert not (tmp_path / "e").exists()
    ot = OpTable.model_validate_json((a / rungs(a)[0]["ops"]).read_bytes())
    assert ot.ops  # the bundle holds a real plan


# -- the streaming reader (oracle/dread.ml) ------------------------------------------------


def _oracle_raw(data: bytes) -> tuple[int, bytes]:
    from plow.oracle.runner import oracle_binary

    proc = subprocess.run([str(oracle_binary())], input=data, capture_output=True, check=False)
    return proc.returncode, proc.stdout


def test_streaming_reader_gives_the_tree_readers_answer() -> None:
    """A D payload in `plow verify`'s shape (compact, sorted: the streaming reader) and the
    same payload with "payload" before "checkpoint" (yojson's tree, the fallback) give the
    same bytes out, accepted, rejected and malformed; shapes the streaming reader does not
    read (a quoted number, a negative, an edge with another field) are the tree's answer."""
    ok = swept(plan([0, 1], [[], [0]], [[0], []], [1], [5, 9], [[[0, 16, 1]], [[8, 12, 0]]]))
    ok["edges"] = [{"producer": 0, "consumer": 1}]
    bad = json.loads(json.dumps(ok))
    bad["tasks"][1]["waits"] = []
    bad["edges"] = []

    def both(p: dict[str, Any]) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        fast = json.dumps({"checkpoint": "D", "payload": p}, separators=(",", ":"), sort_keys=True)
        tree = json.dumps({"payload": p, "checkpoint": "D"}, separators=(",", ":"))
        return _oracle_raw(fast.encode()), _oracle_raw(tree.encode())

    for p, rc in ((ok, 0), (bad, 1)):
        fast, tree = both(p)
        assert fast == tree and fast[0] == rc
    assert b"comparisons" in both(ok)[0][1]
    # a write flag 2 and an edge without its consumer: malformed, in the tree's words
    for edit in (
        lambda p: p["dataflow"]["accesses"][0][0].__setitem__(2, 2),
        lambda p: p["edges"][0].pop("consumer"),
    ):
        p = json.loads(json.dumps(ok))
        edit(p)
        fast, tree = both(p)
        assert fast == tree and fast[0] == 2
    # a quoted number (yojson's own low-level int reader would take it) is malformed
    text = json.dumps({"checkpoint": "D", "payload": ok}, separators=(",", ":"), sort_keys=True)
    quoted = text.replace('"accesses":[[[0,16,1]]', '"accesses":[[["0",16,1]]', 1)
    assert quoted != text
    rc, out = _oracle_raw(quoted.encode())
    assert rc == 2 and b"expected an integer" in out
    # an edge object with another field: the tree reader ignores it, so the answer is the same
    p = json.loads(json.dumps(ok))
    p["edges"][0]["note"] = 1
    fast, tree = both(p)
    assert fast == tree and fast[0] == 0
