"""Tiny fixture models: schedule, certify (checkpoint D), simulate; TP scopes; collapse."""

from __future__ import annotations

from pathlib import Path

import pytest

from plow.checkpoint import load_spec
from plow.graph import Bucket, build_graph
from plow.schedule import ScheduleOptions, build_schedule, certify_schedule, protocol_errors
from plow.schedule.ir import Schedule, TaskKind
from plow.schedule.protocol import signallers, waiters
from plow.target import load_target
from plow.tiles import tile_graph

from .helpers import run_interleaving


def _schedule(d: Path, target: str, bucket: Bucket, **opt: object) -> Schedule:
    spec = load_spec(d)
    g = build_graph(spec, bucket)
    t = load_target(target)
    return build_schedule(tile_graph(g, t), g, t, ScheduleOptions(**opt))  # type: ignore[arg-type]


BUCKETS = [Bucket.decode(1, 64), Bucket.prefill(2, 16)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("target", ["h200", "mi350x", "cpu"])
def test_tiny_models_schedule_and_certify(
    oracle: Path, tiny_dirs: dict[str, Path], family: str, target: str
) -> None:
    for bucket in BUCKETS:
        s = _schedule(tiny_dirs[family], target, bucket, loads=target != "h200")
        # Queues partition the tasks; every task's worker field names its queue.
        flat = [t for q in s.queues for t in q]
        assert sorted(flat) == list(range(len(s.tasks)))
        assert all(s.tasks[t].worker == w for w, q in enumerate(s.queues) for t in q)
        assert protocol_errors(s) == []
        sig = signallers(s)
        assert all(c.threshold == len(sig[c.id]) for c in s.counters)
        # One GPU: every counter left spans workers (same-worker ones were dropped by C4).
        assert all(c.scope == "device" for c in s.counters)
        assert [r.name for r in s.reports] == [
            "drop_implied_counters",
            "merge_same_dependency",
            "hoist_loads",
        ]
        assert 0 < s.makespan_ns < float("inf")
        _, cert = certify_schedule(s)
        assert cert.accepted, cert.reason
        assert "Plow.Countersproof.checkpoint_d_sound" in cert.theorems
        for seed in range(3):
            run_interleaving(s, seed)
        # Every op has tasks; dense models get coarse counters only (C8).
        assert {t.op for t in s.tasks} == set(s.ops)
        assert not any(d.fine for d in s.decisions)
        if target != "h200":
            assert any(t.kind is TaskKind.load for t in s.tasks)
            hoist = s.reports[2]
            # cpu: a 16 MiB L2 share per worker holds any two slabs, so loads do move.
            assert hoist.changed > 0 if target == "cpu" else (hoist.changed > 0 or hoist.note)


@pytest.mark.parametrize("tp", [2, 8])
def test_tensor_parallel_system_scope_only_across_gpus(
    oracle: Path, tiny_dirs: dict[str, Path], tp: int
) -> None:
    s = _schedule(tiny_dirs["gemma3"], "h200", Bucket.decode(1, 64), tp=tp)
    assert s.gpus == tp and protocol_errors(s) == []
    sig, wai = signallers(s), waiters(s)
    gpu = [t.gpu for t in s.tasks]
    for c in s.counters:
        crosses = any(
            gpu[u] != gpu[t] for u in sig.get(c.id, []) for t in wai.get(c.id, [])
        )
        assert (c.scope == "system") == crosses, c
    assert any(c.scope == "system" for c in s.counters)
    used = {t.gpu for t in s.tasks}
    assert used <= set(range(tp)) and len(used) >= 2  # a tiny model has too few tiles for 8
    _, cert = certify_schedule(s)
    assert cert.accepted, cert.reason


def test_fine_counters_where_slices_differ(oracle: Path, tiny_dirs: dict[str, Path]) -> None:
    s = _schedule(tiny_dirs["llama"], "h200", Bucket.prefill(2, 16), fine="always")
    assert any(c.fine for c in s.counters)
    merged = s.reports[1]
    assert merged.name == "merge_same_dependency"
    assert protocol_errors(s) == []
    _, cert = certify_schedule(s)
    assert cert.accepted, cert.reason
    coarse = _schedule(tiny_dirs["llama"], "h200", Bucket.prefill(2, 16))
    reasons = [d.reason for d in coarse.decisions]
    assert all("equal cost" in r or "every slice reads" in r for r in reasons)


def test_l2_awareness_changes_placement_not_dependencies(tiny_dirs: dict[str, Path]) -> None:
    """Placement moves tasks between partitions; the dependency edges stay the same. The
    traffic comparison is a measurement (benchmarks/counter_graph_12b.py), not a test."""
    aware = _schedule(tiny_dirs["gemma3"], "mi350x", Bucket.prefill(4, 128))
    blind = _schedule(tiny_dirs["gemma3"], "mi350x", Bucket.prefill(4, 128), l2_aware=False)
    assert aware.edges == blind.edges
    assert [t.partition for t in aware.tasks] != [t.partition for t in blind.tasks]
    assert protocol_errors(aware) == [] and protocol_errors(blind) == []


def test_compile_runs_schedule_and_checkpoint_d(
    oracle: Path, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from plow.compile import compile_plan, write_plan
    from plow.profile import CompileProfile

    res = compile_plan(tiny_dirs["qwen3"], load_target("h200"), CompileProfile(), verify=True)
    assert all(b.schedule is not None for b in res.buckets)
    certs = [b.schedule_certificate for b in res.buckets]
    assert all(c is not None and c.accepted for c in certs)
    files = write_plan(res, tmp_path)
    assert tmp_path / "certificates" / "D.json" in files
