"""`plow verify`'s exit-code contract (docs/bundle.md "Verify"): a check that fails is a
rejected row naming the file (exit 1) — every cross-reference between the bundle's files
included, hashes re-forged; exit 2 only when a file cannot be read as what it is (no manifest,
JSON that does not fit its schema). One test per case that used to exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plow.bundle.manifest import MANIFEST, WEIGHTS
from plow.cli import app
from tests.emit.bundle_edit import copy_bundle, edit_json, edit_manifest, first_rung, reforge


def verify(b: Path) -> tuple[int, dict[str, Any] | None, str]:
    res = CliRunner().invoke(app, ["verify", str(b), "--json"])
    out = res.stdout.strip()
    return res.exit_code, (json.loads(out.splitlines()[0]) if out else None), res.output


def rejected(doc: dict[str, Any] | None) -> dict[str, list[str]]:
    """checkpoint -> the reasons of its rejected rows."""
    assert doc is not None
    out: dict[str, list[str]] = {}
    for r in doc["rows"]:
        if r["verdict"] == "reject":
            out.setdefault(r["checkpoint"], []).append(r["reason"])
    return out


@pytest.fixture
def b(tiny_bundles: dict[str, Path], tmp_path: Path) -> Path:
    return copy_bundle(tiny_bundles["llama"], tmp_path / "b")


def test_the_copy_is_accepted(b: Path) -> None:
    code, doc, out = verify(b)
    assert code == 0, out
    assert rejected(doc) == {}


def test_a_listed_file_missing_is_a_rejection(b: Path) -> None:
    (b / "tiles.json").unlink()
    code, doc, _ = verify(b)
    assert code == 1
    assert "tiles.json: listed in the manifest but missing" in rejected(doc)["bundle"][0]


def test_a_rung_naming_a_missing_plan_file_is_a_rejection(b: Path) -> None:
    name = first_rung(b)["name"]

    def elsewhere(m: dict[str, Any]) -> None:
        m["ladder"][0]["plan"] = "plan/nowhere.bin"

    edit_manifest(b, elsewhere)
    reforge(b)
    code, doc, _ = verify(b)
    assert code == 1
    rej = rejected(doc)
    assert "plan/nowhere.bin: missing (rung " in rej["bundle"][0]
    for ck in "ABCDEF":  # every row of that rung, each naming the file
        assert any("plan/nowhere.bin" in r for r in rej[ck]), ck
    assert doc is not None
    assert all(r["verdict"] == "reject" for r in doc["rows"] if r["bucket"] == name)


def test_a_rung_naming_a_file_outside_the_bundle_is_a_rejection(b: Path) -> None:
    rung = first_rung(b)
    (b.parent / "x.ops.json").write_bytes((b / rung["ops"]).read_bytes())

    def outside(m: dict[str, Any]) -> None:
        m["ladder"][0]["ops"] = "../x.ops.json"

    edit_manifest(b, outside)
    reforge(b)
    code, doc, _ = verify(b)
    assert code == 1
    assert "'../x.ops.json', outside the bundle" in rejected(doc)["bundle"][0]


def test_a_tensor_without_an_arena_offset_is_a_rejection(b: Path) -> None:
    rung = first_rung(b)
    ops = json.loads((b / rung["ops"]).read_text())
    victim = ops["ops"][0]["outputs"][0]

    def drop(s: dict[str, Any]) -> None:
        s["arena"]["buffers"] = [x for x in s["arena"]["buffers"] if x["name"] != victim]

    edit_json(b / rung["schedule"], drop)
    reforge(b)
    code, doc, _ = verify(b)
    assert code == 1
    rej = rejected(doc)
    where = f"{rung['schedule']}: tensor {victim!r} has no arena offset"
    assert any(where in r for r in rej["bundle"])
    assert any(where in r for r in rej["E"])
    assert any(rung["schedule"] in r and victim in r for r in rej["F"])


def test_page_columns_shorter_than_the_task_list_are_a_rejection(b: Path) -> None:
    rung = first_rung(b)

    def short(s: dict[str, Any]) -> None:
        s["pages"]["start"] = s["pages"]["start"][:-1]

    edit_json(b / rung["schedule"], short)
    reforge(b)
    code, doc, _ = verify(b)
    assert code == 1
    assert any(
        rung["schedule"] in r and "page columns do not have one entry per task" in r
        for r in rejected(doc)["C"]
    )


def test_an_arena_buffer_that_is_no_tensor_is_a_rejection(b: Path) -> None:
    rung = first_rung(b)

    def ghost(s: dict[str, Any]) -> None:
        s["arena"]["buffers"].append(
            {"name": "ghost", "region": "scratch", "offset": 0, "size": 64}
        )

    edit_json(b / rung["schedule"], ghost)
    reforge(b)
    code, doc, _ = verify(b)
    assert code == 1
    assert any(
        rung["schedule"] in r and "'ghost' is not a tensor of the op table" in r
        for r in rejected(doc)["F"]
    )


def test_a_target_that_is_no_target_is_a_rejection(b: Path) -> None:
    def bad(m: dict[str, Any]) -> None:
        m["target"]["workers"] = "many"

    edit_manifest(b, bad)
    reforge(b)
    code, doc, _ = verify(b)
    assert code == 1
    rej = rejected(doc)
    assert "manifest.json: target field 'workers'" in rej["bundle"][0]
    for ck in "BCF":  # nothing to compare against
        assert rej[ck] and all("cannot check against the target" in r for r in rej[ck]), ck


def test_a_full_bundle_without_weights_is_a_rejection(b: Path) -> None:
    (b / WEIGHTS).unlink()

    def unlist(m: dict[str, Any]) -> None:
        del m["files"][WEIGHTS]

    edit_manifest(b, unlist)
    code, doc, _ = verify(b)
    assert code == 1
    assert any(f"{WEIGHTS}: missing in a full bundle" in r for r in rejected(doc)["bundle"])


def test_an_unreadable_weights_file_is_a_rejection(b: Path) -> None:
    (b / WEIGHTS).write_bytes(b"\xff" * 64)
    reforge(b)
    code, doc, _ = verify(b)
    assert code == 1
    assert any(r.startswith(f"{WEIGHTS}: ") for r in rejected(doc)["bundle"])


def test_a_file_that_is_not_its_schema_still_exits_2(b: Path) -> None:
    rung = first_rung(b)
    (b / rung["ops"]).write_text('{"format": 1}')
    reforge(b)
    code, doc, out = verify(b)
    assert code == 2 and doc is None
    assert rung["ops"] in out and len(out.strip().splitlines()) == 1
    (b / MANIFEST).write_text("[]")
    code, _, out = verify(b)
    assert code == 2 and MANIFEST in out
