"""Issue 19, the command line over bundles: `inspect` checks the manifest hashes before it
reports, `generate`'s `--no-verify` suggestion holds where it is given (and where a bundle
cannot run at all, no flag is suggested and `--no-verify` is a one-line error, not a
traceback), and `serve --max-num-seqs` never silently shrinks to what a bundle's ladder has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plow.bundle.manifest import MANIFEST, WEIGHTS, sha256_file
from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.profile import CompileProfile
from plow.target import load_target


@pytest.fixture(scope="module")
def batch1_bundle(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A verified bundle whose ladder has one decode rung, batch 1."""
    out = tmp_path_factory.mktemp("cli-bundles") / "b1"
    prof = CompileProfile(decode_batches=(1,), prefill_seqs=(8,))
    return compile_bundle(tiny_llama, out, load_target("cpu"), prof, verify=True).out


def _invoke(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(app, list(args))
    # A traceback would surface here as an exception other than the exit.
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res.exit_code, res.stdout, res.stderr


def _line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _reforge(bundle: Path) -> None:
    m = json.loads((bundle / MANIFEST).read_text())
    m["files"] = {rel: sha256_file(bundle / rel) for rel in m["files"]}
    (bundle / MANIFEST).write_text(json.dumps(m))


def _plan(bundle: Path) -> str:
    rung: dict[str, Any] = json.loads((bundle / MANIFEST).read_text())["ladder"][0]
    return str(rung["plan"])


# ---------------------------------------------------------------------------------- inspect


def test_inspect_of_an_intact_bundle_reports(batch1_bundle: Path) -> None:
    code, out, _ = _invoke("inspect", str(batch1_bundle), "--json")
    assert code == 0 and json.loads(out)["buckets"]


def test_inspect_with_a_deleted_plan_file_names_it(batch1_bundle: Path, tmp_path: Path) -> None:
    """Before: a FileNotFoundError traceback."""
    b = _copy(batch1_bundle, tmp_path / "b")
    (b / _plan(b)).unlink()
    code, _, err = _invoke("inspect", str(b))
    assert code == 2
    line = _line(err)
    assert _plan(b) in line and "missing" in line


@pytest.mark.parametrize("victim", ["plan", "ops", "schedule", "tiles.json"])
def test_inspect_of_a_corrupted_bundle_fails(
    batch1_bundle: Path, tmp_path: Path, victim: str
) -> None:
    """Before: `inspect` reported a corrupted bundle happily, exit 0."""
    b = _copy(batch1_bundle, tmp_path / "b")
    rung = json.loads((b / MANIFEST).read_text())["ladder"][0]
    rel = rung.get(victim, victim)
    data = bytearray((b / rel).read_bytes())
    data[len(data) // 2] ^= 0x20  # one flipped bit
    (b / rel).write_bytes(bytes(data))
    code, out, err = _invoke("inspect", str(b), "--json")
    assert code == 2 and out == ""
    line = _line(err)
    assert rel in line
    if victim in ("plan", "tiles.json"):  # still well-formed: only the hash can tell
        assert "sha256 differs from the manifest" in line


# ------------------------------------------------------------------------- --no-verify


def _generate(bundle: Path, *flags: str) -> tuple[int, str, str]:
    return _invoke(
        "generate", str(bundle), "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
        "--executor", "cpu", "--json", *flags,
    )  # fmt: skip


def test_the_no_verify_suggestion_holds_where_it_is_given(
    batch1_bundle: Path, tmp_path: Path
) -> None:
    b = _copy(batch1_bundle, tmp_path / "b")
    (b / "tiles.json").write_text((b / "tiles.json").read_text() + " ")  # edited, harmless
    code, _, err = _generate(b)
    assert code == 1 and "pass --no-verify to run it anyway" in _line(err)
    code, out, err = _generate(b, "--no-verify")
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 2


def test_mismatched_weights_suggest_no_flag_and_do_not_traceback(
    batch1_bundle: Path, tmp_path: Path
) -> None:
    """Before: 'weight missing or of another shape (pass --no-verify ...)', and --no-verify
    then died in the executor with a numpy broadcast traceback."""
    from safetensors.numpy import load_file, save_file

    b = _copy(batch1_bundle, tmp_path / "b")
    t = load_file(b / WEIGHTS)
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:61]  # fewer rows
    save_file(t, b / WEIGHTS, metadata={"format": "pt"})
    for flags in ((), ("--no-verify",)):
        code, _, err = _generate(b, *flags)
        line = _line(err)
        assert code == 2, err
        assert "--no-verify to run it anyway" not in line
        assert "'model.embed_tokens.weight' has shape [61, 64]" in line
        assert "cannot run, even with --no-verify" in line
    _reforge(b)  # hashes re-forged: only the structural check stands between it and a crash
    code, _, err = _generate(b, "--no-verify")
    assert code == 2 and "cannot run" in _line(err)


def test_a_config_that_does_not_fit_the_plan_is_one_line(
    batch1_bundle: Path, tmp_path: Path
) -> None:
    b = _copy(batch1_bundle, tmp_path / "b")
    cfg = json.loads((b / "config.json").read_text())
    cfg["vocab_size"] = 500
    (b / "config.json").write_text(json.dumps(cfg))
    for flags in ((), ("--no-verify",)):
        code, _, err = _generate(b, *flags)
        assert code == 2
        line = _line(err)
        assert "config.json" in line and "vocab_size 500, the plan was compiled for 317" in line


def test_compile_refuses_weights_that_do_not_fit_the_config(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The root of the vocabulary mismatch: such a bundle can no longer be compiled."""
    d = _copy(tiny_llama, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 500
    (d / "config.json").write_text(json.dumps(cfg))
    code, _, err = _invoke("compile", str(d), "-o", str(tmp_path / "out"))
    assert code == 2
    assert "'model.embed_tokens.weight' has shape [317, 64], expected [500, 64]" in _line(err)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- serve --max-num-seqs


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import plow.serve.http as http

    started: list[Any] = []
    monkeypatch.setattr(http, "run_server", lambda app, host, port, **kw: started.append(app))
    return started


def test_serve_refuses_more_slots_than_the_ladder_runs(
    batch1_bundle: Path, no_server: list[Any]
) -> None:
    """Before: --max-num-seqs 8 on a batch-1 ladder silently served 1 slot."""
    code, _, err = _invoke("serve", str(batch1_bundle), "--max-num-seqs", "8")
    assert code == 2 and not no_server
    line = _line(err)
    assert "--max-num-seqs" in line and "decode batches up to 1" in line
    assert "--max-num-seqs 1 or less" in line


def test_serve_a_bundle_with_its_ladder_s_batch(batch1_bundle: Path, no_server: list[Any]) -> None:
    for flags in ((), ("--max-num-seqs", "1")):
        code, _, err = _invoke("serve", str(batch1_bundle), *flags)
        assert code == 0, err
        assert "native engine, 1 slots" in err  # plow serve runs native by default
    assert len(no_server) == 2


def test_serve_a_checkpoint_with_the_slots_asked(tiny_llama: Path, no_server: list[Any]) -> None:
    code, _, err = _invoke("serve", str(tiny_llama), "--max-num-seqs", "12")
    assert code == 0, err
    assert "12 slots" in err and len(no_server) == 1
