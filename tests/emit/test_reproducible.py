"""Reproducible bundles: two compiles of one checkpoint, target and profile, in two processes,
give byte-identical bundles — plans, op tables, weights, certificates and manifest — when
SOURCE_DATE_EPOCH fixes the build time (the manifest's timings are left out then); without it
only the manifest's time and timings differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from plow.emit.verify import VOLATILE


def _compile(ckpt: Path, out: Path, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "plow.cli", "compile", str(ckpt), "-o", str(out), "--verify"]
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_two_processes_build_byte_identical_bundles(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = tiny_checkpoints["llama"]
    fixed = {"SOURCE_DATE_EPOCH": "1764547200"}
    _compile(ckpt, tmp_path / "a", fixed)
    _compile(ckpt, tmp_path / "b", fixed)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert any(k.startswith("certificates/") for k in a) and a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []
    man = json.loads(a["manifest.json"])
    assert man["compiled_at"] == "2025-12-01T00:00:00Z" and man["stage_seconds"] == {}
    # an ordinary build: the same files, the manifest's time and timings aside
    _compile(ckpt, tmp_path / "c", {"SOURCE_DATE_EPOCH": ""})
    c = _files(tmp_path / "c")
    assert [k for k in a if a[k] != c[k]] == ["manifest.json"]
    mc = json.loads(c["manifest.json"])
    assert mc["stage_seconds"] and {k: v for k, v in mc.items() if k not in VOLATILE} == {
        k: v for k, v in man.items() if k not in VOLATILE
    }
