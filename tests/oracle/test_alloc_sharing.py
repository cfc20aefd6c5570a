"""Checkpoint F's sharing rule in the oracle (Plow.Alloc.check_alloc_ordered, theorem
Plow.Allocproof.checkpoint_f_sound): two buffers that share bytes must have every task of
the earlier one happen before every task of the later one, by the counter protocol's
happens-before. Hand-made protocols against a brute-force closure, then a bundle whose
arena map is edited (hashes re-forged) so that two buffers whose tasks can run at once share
bytes: `plow verify` rejects it in F naming both buffers, the runtime refuses it, and no
row of `plow verify` is a verdict decided outside the oracle."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.bundle.files import OpTable, ScheduleFile
from plow.bundle.manifest import read_manifest, sha256_file
from plow.bundle.wire import read_plan, write_plan
from plow.emit.bundle import compile_bundle
from plow.emit.emit import emit_packets
from plow.emit.verify import verify_bundle
from plow.oracle import Certificate, run_checkpoint
from plow.oracle.payloads.alloc import AllocPayload, BufferPlacement, SharingProtocol
from plow.oracle.payloads.dataflow import sweep_order
from plow.profile import CompileProfile
from plow.target import load_target

F_SOUND = "Plow.Allocproof.checkpoint_f_sound"


def _buf(name: str, offset: int, live: tuple[int, int], accessors: list[int]) -> BufferPlacement:
    return BufferPlacement(
        name=name, offset=offset, size=64, align=32, live_start=live[0], live_end=live[1],
        region="activations", accessors=accessors,
    )  # fmt: skip


def _check(
    accs_a: list[int],
    accs_b: list[int],
    waits: list[list[int]],
    signals: list[list[int]],
    queues: list[list[int]],
    order: list[int] | None = None,
) -> Certificate:
    """A [0, 64) live [0, 1) and B [32, 96) live [1, 2): they share bytes [32, 64)."""
    proto = SharingProtocol(
        tasks=[f"t{k}" for k in range(len(waits))],
        waits=waits,
        signals=signals,
        queues=queues,
        order=sweep_order(waits, signals, queues) if order is None else order,
    )
    p = AllocPayload(
        arena_bytes=128,
        buffers=[_buf("A", 0, (0, 1), accs_a), _buf("B", 32, (1, 2), accs_b)],
        protocol=proto,
    )
    return run_checkpoint("F", p)


def test_ordered_by_a_counter_is_accepted() -> None:
    # t0 (worker 0) and t1 (worker 1) signal counter 0, which t2 (worker 0) waits on
    cert = _check([0, 1], [2], [[], [], [0]], [[0], [0], []], [[0, 2], [1]])
    assert cert.accepted, cert.reason
    assert F_SOUND in cert.theorems


def test_a_task_not_waited_for_is_rejected_naming_both_buffers() -> None:
    # t1 signals counter 1, which nobody waits on: t1 may still be reading A when t2 writes B
    cert = _check([0, 1], [2], [[], [], [0]], [[0], [1], []], [[0, 2], [1]])
    assert not cert.accepted
    assert cert.reason == (
        'buffers "A" (activations, live steps 0..0) and "B" (activations, live steps 1..1) '
        'share bytes [32, 64) but task 1 (t1), which touches "A", does not happen before '
        'task 2 (t2), which touches "B"'
    )


def test_queue_order_and_chains_order_tasks() -> None:
    # one queue: t0, t1, t2 in order
    assert _check([0, 1], [2], [[], [], []], [[], [], []], [[0, 1, 2]]).accepted
    # a chain across workers: t0 -> c0 -> t1 -> c1 -> t2
    assert _check([0], [2], [[], [0], [1]], [[0], [1], []], [[0], [1], [2]]).accepted
    # the reverse order is not allowed: B's tasks before A's
    assert not _check([2], [0], [[], [0], [1]], [[0], [1], []], [[0], [1], [2]]).accepted


def test_the_sweep_order_is_only_a_witness() -> None:
    # t2 swept before t0 and t1: its clock misses them, so the check rejects (never accepts
    # more than the protocol orders)
    cert = _check([0, 1], [2], [[], [], [0]], [[0], [0], []], [[0, 2], [1]], order=[2, 1, 0])
    assert not cert.accepted


def _check_map(bufs: list[BufferPlacement], waits: list[list[int]], signals: list[list[int]],
               queues: list[list[int]]) -> Certificate:  # fmt: skip
    proto = SharingProtocol(
        tasks=[f"t{k}" for k in range(len(waits))], waits=waits, signals=signals, queues=queues,
        order=sweep_order(waits, signals, queues),
    )  # fmt: skip
    return run_checkpoint("F", AllocPayload(arena_bytes=256, buffers=bufs, protocol=proto))


def test_a_partly_covered_buffer_is_still_compared() -> None:
    """A [0, 64) at step 0, B [0, 32) at step 1, C [32, 96) at step 2, one task each on
    its own worker. B covers only half of A, so C (on A's other half) must be ordered after
    A itself: through B's counter chain it is; without a wait on that chain it is not."""
    bufs = [
        BufferPlacement(
            name=n,
            offset=o,
            size=z,
            align=32,
            live_start=k,
            live_end=k + 1,
            region="activations",
            accessors=[k],
        )  # fmt: skip
        for k, (n, o, z) in enumerate((("A", 0, 64), ("B", 0, 32), ("C", 32, 64)))
    ]
    queues = [[0], [1], [2]]
    # t1 waits on c0 (t0); t2 waits on c1 (t1): A -> B -> C, so C is ordered after A too
    assert _check_map(bufs, [[], [0], [1]], [[0], [1], []], queues).accepted
    # t2 waits on nothing of t0's chain: B is ordered after A, C after nobody
    bad = _check_map(bufs, [[], [0], []], [[0], [1], []], queues)
    assert not bad.accepted
    assert bad.reason is not None and '"A"' in bad.reason and '"C"' in bad.reason


def test_a_buffer_with_tasks_and_no_live_step_is_rejected() -> None:
    bufs = [
        BufferPlacement(name="A", offset=0, size=64, align=32, live_start=0, live_end=1,
                        region="activations", accessors=[0]),
        BufferPlacement(name="E", offset=0, size=64, align=32, live_start=3, live_end=3,
                        region="activations", accessors=[1]),
    ]  # fmt: skip
    cert = _check_map(bufs, [[], [0]], [[0], []], [[0, 1]])
    assert not cert.accepted
    assert cert.reason == (
        'buffer "E" (activations) has tasks and bytes but an empty live range (steps 3..2)'
    )


@st.composite
def _protocol(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    n = draw(st.integers(2, 7))
    workers = [draw(st.integers(0, 2)) for _ in range(n)]
    queues = [[t for t in range(n) if workers[t] == w] for w in range(3)]
    signals: list[list[int]] = [[] for _ in range(n)]
    waits: list[list[int]] = [[] for _ in range(n)]
    for t in range(1, n):  # counter c = t - 1 is signalled by some earlier tasks
        for u in draw(st.sets(st.integers(0, t - 1), max_size=t)):
            signals[u].append(t - 1)
        if draw(st.booleans()):
            waits[t].append(t - 1)
    return waits, signals, queues


@given(proto=_protocol(), data=st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_matches_the_transitive_closure(
    proto: tuple[list[list[int]], list[list[int]], list[list[int]]], data: st.DataObject
) -> None:
    """With a topological sweep order the check is exact: it accepts iff every task of A is,
    or happens before, every task of B (brute-force closure of gates and queue order)."""
    waits, signals, queues = proto
    n = len(waits)
    hb = [[False] * n for _ in range(n)]
    for u, t in itertools.product(range(n), range(n)):
        gate = any(c in signals[u] for c in waits[t])
        same = any(u in q and t in q and q.index(u) < q.index(t) for q in queues)
        hb[u][t] = u != t and (gate or same)
    for k, i, j in itertools.product(range(n), range(n), range(n)):
        hb[i][j] = hb[i][j] or (hb[i][k] and hb[k][j])
    acc_a = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
    acc_b = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
    want = all(u == t or hb[u][t] for u in acc_a for t in acc_b)
    cert = _check(acc_a, acc_b, waits, signals, queues)
    assert cert.accepted == want, (cert.reason, acc_a, acc_b)


# ----------------------------------------------------------------- a real bundle

PROFILE = CompileProfile(name="test", decode_batches=(1,), prefill_seqs=(16,), context=64)
RUNG = "decode_b1_s64"


@pytest.fixture(scope="module")
def bundle(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharing") / "llama"
    compile_bundle(tiny_checkpoints["llama"], out, load_target("cpu"), PROFILE, verify=True,
                   plan_only=True)  # fmt: skip
    return out


def _forge(b: Path, *rels: str) -> None:
    man = json.loads((b / "manifest.json").read_text())
    for rel in rels:
        man["files"][rel] = sha256_file(b / rel)
    (b / "manifest.json").write_text(json.dumps(man))


def test_concurrent_buffers_sharing_bytes_are_rejected(bundle: Path, tmp_path: Path) -> None:
    """Layer 0's q projection (last read by q_rope's tasks) and k_rope's output are put on
    the same bytes: their op-order live ranges do not meet, but k_rope's tasks wait only for
    the projection, so a q_rope task on one worker may still read q while a k_rope task on
    another writes k over it. F rejects, naming both buffers; so does the runtime."""
    # compiled with verify=True: every certificate accepts, by the oracle (no "python" row)
    for ck in "ABCDEF":
        cert = json.loads((bundle / "certificates" / f"{ck}.json").read_text())
        assert cert["accepted"], ck
        assert {c["verdict"] for c in cert["buckets"].values()} == {"accept"}, ck
    f = json.loads((bundle / "certificates" / "F.json").read_text())["buckets"][RUNG]
    assert F_SOUND in f["theorems"]

    b = tmp_path / "edited"
    shutil.copytree(bundle, b)
    sched, ops, plan = (f"plan/{RUNG}.{x}" for x in ("schedule.json", "ops.json", "bin"))
    sf = json.loads((b / sched).read_text())
    ot = json.loads((b / ops).read_text())
    names = [o["name"] for o in ot["ops"]]
    q = ot["ops"][names.index("L0.q_rope")]["inputs"][0]  # L0.q_proj
    rope = ot["ops"][names.index("L0.k_rope")]["outputs"][0]
    assert names.index("L0.q_rope") < names.index("L0.k_rope")
    end = sf["arena"]["arena_bytes"]
    size = max(ot["tensors"][t]["size"] for t in (q, rope))
    for buf in sf["arena"]["buffers"]:
        if buf["name"] in (q, rope):
            buf["offset"] = end
    for t in (q, rope):
        ot["tensors"][t]["offset"] = end
    sf["arena"]["arena_bytes"] = ot["arena_bytes"] = end + -(-size // 256) * 256
    (b / sched).write_text(json.dumps(sf))
    (b / ops).write_text(json.dumps(ot))
    h, _ = read_plan(b / plan)  # packets re-emitted with the new offsets (E agrees)
    packets = emit_packets(
        ScheduleFile.model_validate_json((b / sched).read_bytes()),
        OpTable.model_validate_json((b / ops).read_bytes()),
    )
    write_plan(b / plan, packets, phase=h.phase, batch=h.batch, seq=h.seq, workers=h.workers)
    _forge(b, sched, ops, plan)

    rep = verify_bundle(b, checkpoints=("F",))
    (row,) = [r for r in rep.rows if r.checkpoint == "F" and r.bucket == RUNG]
    assert row.rejected and row.theorems == ()
    assert f'buffers "{q}" (activations' in row.reason
    assert f'and "{rope}" (activations' in row.reason
    assert "does not happen before" in row.reason
    assert "(L0.q_rope#" in row.reason and "(L0.k_rope#" in row.reason

    from plow.bundle.open import BundleRefused, check_bundle

    with pytest.raises(BundleRefused):
        check_bundle(b, read_manifest(b))
