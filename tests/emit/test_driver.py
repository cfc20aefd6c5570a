"""Issue 14, build item 4: one driver. `plow.compile.PIPELINE` is the single list of the
compile's stages: `plow compile`'s recorded timings and progress callbacks name exactly its
stages, in its order; the progress bars are derived from it; a stage it does not list is
refused; and the callers (`compile_bundle`, `compile_cached`) give the same bundle bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plow.bundle.manifest import MANIFEST
from plow.cli import app
from plow.compile import PIPELINE, Timer, progress_stages
from plow.emit.bundle import compile_bundle
from plow.profile import CompileProfile
from plow.target import load_target

PROFILE = CompileProfile(decode_batches=(1,), prefill_seqs=(8,))


def _applies(when: str, *, tp: bool, fuse: bool, verify: bool) -> bool:
    return {
        "": True,
        "tp": tp,
        "fuse": fuse,
        "verify": False,  # compile_plan(verify=True) only; a bundle certifies with A-F
        "bundle": True,
        "bundle verify": verify,
    }[when]


def _expected(*, tp: bool, fuse: bool, verify: bool) -> list[str]:
    names: list[str] = []
    for p in PIPELINE:
        if _applies(p.when, tp=tp, fuse=fuse, verify=verify) and p.name not in names:
            names.append(p.name)
    return names


def test_cli_timings_are_the_pipeline(tiny_llama: Path, tmp_path: Path) -> None:
    """`plow compile --plan-only --tp 2` records a time for every stage the driver lists that
    applies (shard and fuse included) up to the write, no other, in the driver's order."""
    out = tmp_path / "b"
    res = CliRunner().invoke(
        app,
        [
            "compile",
            str(tiny_llama),
            "-o",
            str(out),
            "--plan-only",
            "--target",
            "h200",
            "--tp",
            "2",
            "--context",
            "64",
        ],
    )
    assert res.exit_code == 0, res.output
    seconds = json.loads((out / MANIFEST).read_text())["stage_seconds"]
    # the manifest is written by the write stage, so it records the stages before it
    assert [*seconds, "write"] == _expected(tp=True, fuse=True, verify=False)
    assert "shard" in seconds and "fuse" in seconds


def test_stage_callbacks_follow_the_pipeline(tiny_llama: Path, tmp_path: Path) -> None:
    """on_stage (tensor parallel, fused): each stage starts then finishes; per bucket the
    bucket passes run in PIPELINE's order, once per compile the once passes; the bundle's
    recorded timings are the same stages."""
    events: list[tuple[str, str, str]] = []
    r = compile_bundle(
        tiny_llama,
        tmp_path / "b",
        load_target("h200").model_copy(update={"gpus": 2}),
        PROFILE,
        plan_only=True,
        on_stage=lambda *e: events.append(e),
    )
    per_bucket: dict[str, list[str]] = {}
    for i in range(0, len(events), 2):
        (n0, b0, s0), (n1, b1, s1) = events[i], events[i + 1]
        assert (n0, b0, s0, s1) == (n1, b1, "start", "done")
        per_bucket.setdefault(b0, []).append(n0)
    assert set(per_bucket) == {""} | {b.bucket.name for b in r.plan.buckets}
    once = [p.name for p in PIPELINE if p.scope == "once" and p.when != "bundle verify"]
    assert per_bucket.pop("") == once
    bucket = [p.name for p in PIPELINE if p.scope == "bucket" and p.when not in ("verify",)]
    for name, names in per_bucket.items():
        assert names == bucket, name
    assert list(r.stage_seconds) == _expected(tp=True, fuse=True, verify=False)


def test_progress_bars_and_unknown_stage() -> None:
    assert progress_stages(verify=False) == (
        ["graph", "tile", "bounds", "schedule", "pages", "arena", "emit"],
        ["write"],
    )
    assert progress_stages(verify=True)[1] == ["write", "verify"]
    with pytest.raises(RuntimeError, match="not in plow.compile.PIPELINE"):
        Timer()("lower", "", lambda: None)


@pytest.mark.slow
def test_compile_cached_is_compile_bundle(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_cached calls the same driver: with SOURCE_DATE_EPOCH, the cached bundle and a
    compile_bundle of the same inputs are the same bytes, certificates A-F included."""
    from plow.runtime.cpu.bundle import compile_cached

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764547200")
    monkeypatch.setenv("PLOW_CACHE", str(tmp_path / "cache"))
    a = compile_cached(tiny_llama, target="h200", profile=PROFILE)
    b = compile_bundle(tiny_llama, tmp_path / "b", load_target("h200"), PROFILE, verify=True).out
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert [f for f in files if f.startswith("certificates/")] == [
        f"certificates/{c}.json" for c in "ABCDEF"
    ]
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
