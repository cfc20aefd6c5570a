"""Helpers that edit a bundle the way an attacker (or a bug) would, re-forging the hashes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from plow.bundle.manifest import MANIFEST, sha256_file


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


def rungs(bundle: Path) -> list[dict[str, Any]]:
    ladder: list[dict[str, Any]] = json.loads((bundle / MANIFEST).read_text())["ladder"]
    return ladder


def edit_manifest(bundle: Path, fn: Any) -> None:
    """Edit manifest.json (the hashes are re-forged afterwards by `reforge`)."""
    edit_json(bundle / MANIFEST, fn)


def edit_rung(
    bundle: Path,
    rung: dict[str, Any],
    *,
    ops: Any = None,
    schedule: Any = None,
    reemit: bool = True,
) -> None:
    """Edit a rung's op table and/or schedule file, then (with `reemit`) rewrite its plan file
    from them with the emitter, so the packets, the schedule file and the op table agree (E and
    D see nothing), and re-forge the manifest hashes: only a semantic check can notice."""
    from plow.bundle.files import OpTable, ScheduleFile
    from plow.bundle.wire import read_plan, write_plan
    from plow.emit.emit import emit_packets

    if ops is not None:
        edit_json(bundle / rung["ops"], ops)
    if schedule is not None:
        edit_json(bundle / rung["schedule"], schedule)
    if reemit:
        h, _ = read_plan(bundle / rung["plan"])
        packets = emit_packets(
            ScheduleFile.model_validate_json((bundle / rung["schedule"]).read_bytes()),
            OpTable.model_validate_json((bundle / rung["ops"]).read_bytes()),
        )
        write_plan(
            bundle / rung["plan"], packets, phase=h.phase, batch=h.batch, seq=h.seq,
            workers=h.workers,
        )  # fmt: skip
        sched = json.loads((bundle / rung["schedule"]).read_text())

        def counts(m: dict[str, Any]) -> None:  # the ladder's counts follow the files
            for r in m["ladder"]:
                if r["name"] == rung["name"]:
                    r["packets"], r["tasks"] = len(packets), len(sched["tasks"]["name"])

        edit_json(bundle / MANIFEST, counts)
    reforge(bundle)


TASK_COLUMNS = (
    "name", "op", "kind", "unit_start", "unit_count", "worker", "waits", "signals", "est_ns",
    "partial", "masked",
)  # fmt: skip
PAGE_COLUMNS = ("start", "finish", "load", "weight_pages", "act_pages")


def drop_task(sched: dict[str, Any], i: int) -> None:
    """Remove task `i` from a schedule file as a consistent scheduler would have: its columns,
    its edges (later tasks renumbered), one signaller fewer on each counter it signals (so
    the thresholds stay exact: D accepts)."""
    t = sched["tasks"]
    for c in t["signals"][i]:
        sched["counters"]["threshold"][c] -= 1
    for col in TASK_COLUMNS:
        del t[col][i]
    for col in PAGE_COLUMNS:
        del sched["pages"][col][i]
    e = sched["edges"]
    pairs = [(e[k], e[k + 1]) for k in range(0, len(e), 2)]
    keep = [(u - (u > i), v - (v > i)) for u, v in pairs if i not in (u, v)]
    sched["edges"] = [x for pair in keep for x in pair]
