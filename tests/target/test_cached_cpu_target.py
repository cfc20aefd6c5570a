"""The `cpu` target is this machine: calibrated on first use by `compile_cached`, then cached."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plow.target import calibrate as cal


def test_the_cpu_target_is_measured_once_then_read_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = cal.measure_bandwidth

    def counted(size: int, repeats: int, on_step: object = None) -> int:
        calls.append(size)
        return real(size // 8, 1)

    monkeypatch.setattr(cal, "measure_bandwidth", counted)
    monkeypatch.setattr(cal, "measure_matmul", lambda n, r, s=None: 7_000_000_000)
    notes: list[str] = []
    a = cal.cached_cpu_target(tmp_path, notes.append)
    b = cal.cached_cpu_target(tmp_path, notes.append)
    assert len(calls) == 1 and len(notes) == 1  # measured once, said once
    assert a == b
    assert a.workers == len(os.sched_getaffinity(0))  # plans for this machine's cores
    assert a.peak_flops_per_s["fp32"] == 7_000_000_000  # the measurement, not the shipped spec
    (f,) = (tmp_path / "targets").glob("cpu-*.json")
    f.write_text("{not json")  # a damaged cache file is ours to replace
    c = cal.cached_cpu_target(tmp_path, notes.append)
    assert len(calls) == 2 and c.workers == a.workers
    assert f.read_text().startswith("{\n")
