"""Compile + verify through real bundles: acceptance, and rejections with located reasons
for edits made after compilation (the hash catches plain edits; with the hashes re-forged
the checkpoints catch semantic ones)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plow.bundle.manifest import MANIFEST, WEIGHTS, Manifest
from plow.bundle.wire import HEADER_SIZE, NO_COUNTER, read_plan
from plow.checkpoint.weights import read_header
from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.emit.verify import verify_bundle
from plow.errors import PlowError
from plow.profile import CompileProfile
from plow.target import load_target
from tests.emit.bundle_edit import copy_bundle, edit_json, first_rung, reforge

from .conftest import FAMILIES

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def run_verify(bundle: Path) -> tuple[int, dict[str, Any] | None, str]:
    res = CliRunner().invoke(app, ["verify", str(bundle), "--json"])
    try:
        doc = json.loads(res.stdout.strip().splitlines()[0]) if res.stdout.strip() else None
    except json.JSONDecodeError:
        doc = None
    return res.exit_code, doc, res.output


def reasons(doc: dict[str, Any] | None, checkpoint: str) -> list[str]:
    assert doc is not None
    return [
        r["reason"]
        for r in doc["rows"]
        if r["checkpoint"] == checkpoint and r["verdict"] == "reject"
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_bundle_compiles_and_verifies(tiny_bundles: dict[str, Path], family: str) -> None:
    b = tiny_bundles[family]
    m = Manifest.model_validate_json((b / MANIFEST).read_text())
    assert [r.name for r in m.ladder] == ["decode_b1_s256", "decode_b2_s256", "prefill_b1_s8_c256"]
    assert not m.plan_only and m.weights is not None
    assert (b / "tokenizer.json").is_file() and (b / "config.json").is_file()
    assert set(m.files) >= {WEIGHTS, "tokenizer.json", *(r.plan for r in m.ladder)}
    # Every weight the op tables name is in the weights file with its shape.
    have = read_header(b / WEIGHTS)
    ops = json.loads((b / m.ladder[0].ops).read_text())
    weights = {n: t for n, t in ops["tensors"].items() if t["role"] == "weight"}
    assert weights and all(list(have[n].shape) == t["shape"] for n, t in weights.items())
    # Certificates written by --verify, all accepting.
    for ck in "BCDEF":
        cert = json.loads((b / "certificates" / f"{ck}.json").read_text())
        assert cert["accepted"] and set(cert["buckets"]) == {r.name for r in m.ladder}
    code, doc, _ = run_verify(b)
    assert code == 0 and doc is not None and doc["accepted"]
    assert {r["checkpoint"] for r in doc["rows"]} == {"bundle", "A", "B", "C", "D", "E", "F"}


def test_hash_mismatch_names_the_file(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(tiny_bundles["llama"], tmp_path / "b")
    rung = first_rung(b)
    p = b / rung["ops"]
    text = p.read_text()
    edited = text.replace('"kind":', '"kind": ', 1)  # the same JSON, other bytes
    assert edited != text
    p.write_text(edited)
    code, doc, _ = run_verify(b)
    assert code == 1
    assert any(rung["ops"] in r and "sha256" in r for r in reasons(doc, "bundle"))


def _packet_with_wait(bundle: Path, rung: dict[str, Any]) -> tuple[int, int]:
    _, arr = read_plan(bundle / rung["plan"])
    for i in range(arr.size):
        if arr["wait_counter"][i] != NO_COUNTER and arr["wait_threshold"][i] >= 1:
            return i, int(arr["wait_threshold"][i])
    raise AssertionError("no waiting packet")


def test_lowered_threshold_rejected_by_d(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    """A packet's wait threshold is D's to check (E decodes the record and checks its offsets,
    column range and flags against the op table; it re-emits nothing)."""
    b = copy_bundle(tiny_bundles["qwen3"], tmp_path / "b")
    rung = first_rung(b)
    i, th = _packet_with_wait(b, rung)
    path = b / rung["plan"]
    data = bytearray(path.read_bytes())
    off = HEADER_SIZE + 64 * i + 16  # wait_threshold
    data[off : off + 4] = (th - 1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    reforge(b)
    code, doc, _ = run_verify(b)
    assert code == 1
    assert not reasons(doc, "bundle")  # the hashes were re-forged: only the checkpoints see it
    d = reasons(doc, "D")
    assert d and f"threshold {th - 1} but {th} tasks signal it" in d[0]
    assert not reasons(doc, "E")


def test_truncated_plan_rejected(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(tiny_bundles["llama"], tmp_path / "b")
    rung = first_rung(b)
    path = b / rung["plan"]
    data = path.read_bytes()[:-10]
    path.write_bytes(data)
    reforge(b)
    code, doc, _ = run_verify(b)
    assert code == 1
    n = len(data) - HEADER_SIZE
    assert any(f"truncated: {n} bytes is not a multiple of 64" in r for r in reasons(doc, "E"))
    assert reasons(doc, "D")


@pytest.mark.parametrize(
    ("field_offset", "value", "expected"),
    [
        (3, 5, "field reserved0: reserved bytes not zero (field value 5)"),
        (0, 250, "field opcode: unknown opcode 250"),
    ],
)
def test_corrupted_record_rejected_with_location(
    tiny_bundles: dict[str, Path], tmp_path: Path, field_offset: int, value: int, expected: str
) -> None:
    b = copy_bundle(tiny_bundles["gemma3"], tmp_path / "b")
    rung = first_rung(b)
    path = b / rung["plan"]
    data = bytearray(path.read_bytes())
    rec = 7
    data[HEADER_SIZE + 64 * rec + field_offset] = value
    path.write_bytes(bytes(data))
    reforge(b)
    code, doc, _ = run_verify(b)
    assert code == 1
    e = reasons(doc, "E")
    assert e and e[0].startswith(f"record {rec} (byte offset {64 * rec + field_offset})")
    assert expected in e[0]


def _arena_edit(bundle: Path, fn: Any) -> None:
    edit_json(bundle / first_rung(bundle)["schedule"], lambda d: fn(d["arena"]))
    reforge(bundle)


def _buf(arena: dict[str, Any], region: str) -> dict[str, Any]:
    b: dict[str, Any] = next(x for x in arena["buffers"] if x["region"] == region)
    return b


def test_overlapping_live_buffers_rejected_by_f(
    tiny_bundles: dict[str, Path], tmp_path: Path
) -> None:
    b = copy_bundle(tiny_bundles["llama"], tmp_path / "b")

    def clash(a: dict[str, Any]) -> None:
        _buf(a, "activations")["offset"] = _buf(a, "weights")["offset"]  # weights are always live

    _arena_edit(b, clash)
    code, doc, _ = run_verify(b)
    assert code == 1
    f = reasons(doc, "F")
    assert f and "overlap while both live" in f[0]


def test_buffer_past_the_end_rejected_by_f(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(tiny_bundles["llama"], tmp_path / "b")

    def shrink(a: dict[str, Any]) -> None:
        a["arena_bytes"] = 256

    _arena_edit(b, shrink)
    code, doc, _ = run_verify(b)
    assert code == 1
    f = reasons(doc, "F")
    assert f and "past the arena end 256" in f[0]


def test_misaligned_buffer_rejected_by_f(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(tiny_bundles["llama"], tmp_path / "b")

    def shift(a: dict[str, Any]) -> None:
        _buf(a, "kv")["offset"] += 8

    _arena_edit(b, shift)
    code, doc, _ = run_verify(b)
    assert code == 1
    f = reasons(doc, "F")
    assert f and "misaligned" in f[0] and "multiple of its alignment 256" in f[0]


def test_onchip_over_budget_rejected_by_c(tiny_bundles: dict[str, Path], tmp_path: Path) -> None:
    b = copy_bundle(tiny_bundles["qwen3"], tmp_path / "b")

    def grow(d: dict[str, Any]) -> None:
        d["pages"]["act_pages"][3] = d["pages"]["budget_pages"] + 1

    edit_json(b / first_rung(b)["schedule"], grow)
    reforge(b)
    code, doc, _ = run_verify(b)
    assert code == 1
    c = reasons(doc, "C")
    assert c and "pages live, budget" in c[0]


def test_malformed_bundle_exits_2(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    code, _, out = run_verify(tmp_path / "b")
    assert code == 2 and "manifest.json" in out


def test_failed_compile_leaves_no_bundle(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    target, prof = load_target("cpu"), CompileProfile()
    out = tmp_path / "out"
    for stage in ("emit", "write"):

        def boom(name: str, bucket: str, phase: str, stage: str = stage) -> None:
            if name == stage and phase == "start":
                raise PlowError("test", f"injected failure in {stage}")

        with pytest.raises(PlowError, match="injected"):
            compile_bundle(tiny_checkpoints["llama"], out, target, prof, on_stage=boom)
        assert not out.exists()
        assert list(tmp_path.iterdir()) == []  # no partial directory left behind
    # An existing bundle is untouched by a failed compile, and replaced by a good one.
    compile_bundle(tiny_checkpoints["llama"], out, target, prof)
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*")}

    def late(name: str, bucket: str, phase: str) -> None:
        if name == "write" and phase == "done":
            raise PlowError("test", "injected failure after writing")

    with pytest.raises(PlowError, match="injected"):
        compile_bundle(tiny_checkpoints["qwen3"], out, target, prof, on_stage=late)
    assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert json.loads((out / MANIFEST).read_text())["model"]["family"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    compile_bundle(tiny_checkpoints["qwen3"], out, target, prof)
    assert json.loads((out / MANIFEST).read_text())["model"]["family"] == "qwen3"


def test_rejected_verify_leaves_no_bundle(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import plow.emit.verify as V

    monkeypatch.setattr(V, "tensor_bytes", lambda shape, dtype: 1 << 40)  # every buffer too big
    out = tmp_path / "out"
    with pytest.raises(PlowError, match="checkpoint F"):
        compile_bundle(
            tiny_checkpoints["llama"], out, load_target("cpu"), CompileProfile(), verify=True
        )
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_inspect_json(tiny_bundles: dict[str, Path]) -> None:
    res = CliRunner().invoke(app, ["inspect", str(tiny_bundles["gemma3"]), "--json"])
    assert res.exit_code == 0
    info = json.loads(res.stdout)
    b = info["buckets"][0]
    assert b["packets"] == b["tasks"] + b["nop_packets"]
    assert 0 < b["op_edges_after_reduction"] <= b["op_edges"] <= b["edges"]
    assert 0 < b["onchip_peak_pages_max"] <= b["onchip_budget_pages"]
    r = b["arena_bytes_by_region"]
    assert r["weights"] > 0 and r["kv"] > 0 and b["arena_bytes"] >= r["weights"] + r["kv"]


@pytest.mark.slow
def test_plan_only_12b_config(tmp_path: Path) -> None:
    out = tmp_path / "g12"
    res = compile_bundle(
        CONFIGS / "gemma-3-12b", out, load_target("h200"), CompileProfile(), plan_only=True
    )
    m = res.manifest
    assert m.plan_only and m.weights is None and not (out / WEIGHTS).exists()
    assert m.model.layers == 48
    report = verify_bundle(out)
    assert report.accepted, report.first_rejection()
