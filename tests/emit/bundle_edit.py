"""Helpers that edit a bundle the way an attacker (or a bug) would, re-forging the hashes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from plow.emit.bundle import MANIFEST, sha256_file


def copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def reforge(bundle: Path) -> None:
    """Recompute every hash in the manifest (so only the checkpoints can notice an edit)."""
    m = json.loads((bundle / MANIFEST).read_text())
    m["files"] = {rel: sha256_file(bundle / rel) for rel in m["files"]}
    (bundle / MANIFEST).write_text(json.dumps(m))


def first_rung(bundle: Path) -> dict[str, Any]:
    rung: dict[str, Any] = json.loads((bundle / MANIFEST).read_text())["ladder"][0]
    return rung


def edit_json(path: Path, fn: Any) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
