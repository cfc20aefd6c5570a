"""`plow compile --tp N`: a tensor-parallel plan (plow/graph/shard.py: heads and MLP columns
split over the GPUs) compiles plan-only, is certified A-F by the oracle, and uses
system-scope counters exactly where a dependency crosses GPUs (the allreduce partials). The
tiny llama has 4 heads / 2 key-value heads: tp 8 plans its 8-head, 8-key-value-head variant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plow.cli import app


@pytest.mark.parametrize("tp", [2, 8])
def test_tensor_parallel_plan_is_certified(tp: int, tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / f"tp{tp}"
    cfg = json.loads((tiny_llama / "config.json").read_text())
    if tp == 8:  # heads and key-value heads must split over the GPUs
        cfg.update(num_attention_heads=8, num_key_value_heads=8)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(
        app,
        ["compile", str(tmp_path / "config.json"), "-o", str(out), "--plan-only",
         "--target", "h100", "--tp", str(tp), "--verify"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    for ck in "ABCDEF":
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
        # the crossing counters are the row-parallel partials every device's allreduce reads
        assert all(".o_proj@d" in c["name"][k] or ".down_proj@d" in c["name"][k] for k in crossing)
