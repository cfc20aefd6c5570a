"""Targets: shipped specs, loading by name or file, validation errors, calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plow.errors import ConfigError
from plow.target import Target, calibrate_cpu, load_target, shipped_targets


def test_shipped_targets() -> None:
    assert shipped_targets() == ["b200", "cpu", "h100", "h200", "mi350x"]
    h100, h200, b200, mi = (load_target(n) for n in ("h100", "h200", "b200", "mi350x"))
    assert (h100.workers, h100.l2_partitions, h100.bandwidth_bytes_per_s) == (
        132,
        2,
        3_350_000_000_000,
    )
    assert h100.peak("bfloat16") == 989 * 10**12 and h100.l2_bytes == 50 * 2**20
    assert (h200.workers, h200.bandwidth_bytes_per_s) == (132, 4_800_000_000_000)
    assert (b200.workers, b200.bandwidth_bytes_per_s, b200.peak("bfloat16")) == (
        148,
        8 * 10**12,
        2_250 * 10**12,
    )
    assert (mi.workers, mi.l2_partitions, mi.bandwidth_bytes_per_s) == (256, 8, 8 * 10**12)
    assert 2.2e15 < mi.peak("bf16") < 2.4e15
    for t in (h100, h200, b200, mi):
        assert t.min_tile.cols == 16 and t.comment  # datasheet sources are cited
        assert t.peak("fp8") > t.peak("bf16") > t.peak("float32")


def test_load_target_from_file_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    p.write_text(load_target("h100").model_copy(update={"name": "mine"}).model_dump_json())
    assert load_target(p).name == "mine" and load_target(str(p)).workers == 132
    bad = json.loads(p.read_text())
    del bad["peak_flops_per_s"]["fp8"]
    p.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"t\.json: .*fp8"):
        load_target(p)
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_target(p)
    with pytest.raises(ConfigError, match="unknown target"):
        load_target("h900")
    with pytest.raises(ConfigError, match="target file not found"):
        load_target(tmp_path / "missing.json")


def test_validation_rejects_inconsistent_numbers() -> None:
    data = load_target("h100").model_dump()
    data["page_bytes"] = data["onchip_bytes_per_worker"] + 1
    with pytest.raises(ValueError, match="page_bytes"):
        Target.model_validate(data)
    data = load_target("h100").model_dump()
    data["workers"] = 0
    with pytest.raises(ValueError):
        Target.model_validate(data)


def test_calibrate_cpu_measures_this_machine(tmp_path: Path) -> None:
    steps: list[tuple[str, int, int]] = []
    t = calibrate_cpu(
        repeats=2, copy_bytes=16 * 2**20, gemm_n=128, on_step=lambda *a: steps.append(a)
    )
    assert t.name == "cpu" and t.workers >= 1
    assert 10**8 < t.bandwidth_bytes_per_s < 10**13  # 0.1 GB/s .. 10 TB/s: a real measurement
    assert 10**7 < t.peak("float32") < 10**14
    assert {s[0] for s in steps} >= {"memory bandwidth", "fp32 matmul"}
    p = tmp_path / "cpu.json"
    p.write_text(t.model_dump_json())
    assert load_target(p) == t


def test_cli_calibrate_target_cpu(tmp_path: Path) -> None:
    from plow.cli import app

    out = tmp_path / "cpu.json"
    r = CliRunner().invoke(app, ["calibrate", "target", "cpu", "-o", str(out), "--repeats", "1"])
    assert r.exit_code == 0, r.output
    assert load_target(out).bandwidth_bytes_per_s > 0
    r = CliRunner().invoke(app, ["calibrate", "target", "h100"])
    assert r.exit_code == 2 and "only `cpu`" in r.output
