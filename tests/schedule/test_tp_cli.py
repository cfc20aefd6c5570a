"""`plow compile --tp N`: a tensor-parallel plan compiles plan-only, is certified B-F by the
oracle, and uses system-scope counters exactly where a dependency crosses GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plow.cli import app


@pytest.mark.parametrize("tp", [2, 8])
def test_tensor_parallel_plan_is_certified(tp: int, tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / f"tp{tp}"
    res = CliRunner().invoke(
        app,
        ["compile", str(tiny_llama / "config.json"), "-o", str(out), "--plan-only",
         "--target", "h100", "--tp", str(tp), "--verify"],
    )
    assert res.exit_code == 0, res.output
    for ck in "BCDEF":
        doc = json.loads((out / "certificates" / f"{ck}.json").read_text())
        assert doc["buckets"] and all(c["verdict"] == "accept" for c in doc["buckets"].values())
    for path in (out / "plan").glob("*.schedule.json"):
        s = json.loads(path.read_text())
        assert s["gpus"] == tp
        per_gpu = s["workers_per_gpu"]
        t, c = s["tasks"], s["counters"]
        gpus_of: dict[int, set[int]] = {}
        for worker, waits, signals in zip(t["worker"], t["waits"], t["signals"], strict=True):
            for k in (*waits, *signals):
                gpus_of.setdefault(k, set()).add(worker // per_gpu)
        scopes = dict(enumerate(c["scope"]))
        crossing = {k for k, g in gpus_of.items() if len(g) > 1}
        assert crossing, "a tensor-parallel plan has edges that cross GPUs"
        assert {k for k, s_ in scopes.items() if s_ == "system"} == crossing
