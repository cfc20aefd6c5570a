"""`plow inspect BUNDLE --rewrites`: the fusion report per bucket of a compiled bundle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.profile import CompileProfile
from plow.target import load_target


@pytest.fixture(scope="module")
def bundle(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rewrites") / "b"
    prof = CompileProfile(decode_batches=(1,), prefill_seqs=(8,))
    return compile_bundle(
        tiny_checkpoints["gemma3"], out, load_target("cpu"), prof, plan_only=True
    ).out


@pytest.mark.slow
def test_inspect_rewrites_json_reports_every_rung(bundle: Path) -> None:
    res = CliRunner().invoke(app, ["inspect", str(bundle), "--rewrites", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [r["bucket"] for r in out["rewrites"]] == [r["name"] for r in manifest["ladder"]]
    # the inspect numbers of the plan are the emitted graph's (what the packets hold)
    plan = json.loads(CliRunner().invoke(app, ["inspect", str(bundle), "--json"]).stdout)
    for rep, b in zip(out["rewrites"], plan["buckets"], strict=True):
        assert rep["emitted"]["ops"] == b["ops"]
        assert rep["searched"]["ops"] < rep["canonical"]["ops"]
        assert {r["id"] for r in rep["rules"] if r["matches"]} >= {"R1", "R2", "R8", "R12"}


@pytest.mark.slow
def test_inspect_rewrites_table_and_a_missing_bundle(bundle: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["inspect", str(bundle), "--rewrites"])
    assert res.exit_code == 0 and "add_rmsnorm" in res.stdout and "searched" in res.stdout
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "nope"), "--rewrites"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
