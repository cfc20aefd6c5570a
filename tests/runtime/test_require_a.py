"""The runtime refuses a bundle without a checkpoint A certificate (one verified before A
existed): `Bundle.open` and `plow generate` say, in one line, which bundle, that A's
certificate is missing, and to recompile; `--no-verify` still runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plow.bundle.manifest import MANIFEST
from plow.bundle.open import BundleRefused
from plow.cli import app
from plow.emit.bundle import compile_bundle
from plow.profile import CompileProfile
from plow.runtime.cpu.bundle import Bundle
from plow.target import load_target
from tests.emit.bundle_edit import copy_bundle


@pytest.fixture(scope="module")
def verified(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("require_a") / "llama"
    prof = CompileProfile(decode_batches=(1,), prefill_seqs=(8,), context=32)
    compile_bundle(tiny_checkpoints["llama"], out, load_target("cpu"), prof, verify=True)
    return out


def _without_a(bundle: Path, dst: Path) -> Path:
    """The bundle as one verified before checkpoint A: no A.json, the manifest without it."""
    b = copy_bundle(bundle, dst)
    (b / "certificates" / "A.json").unlink()
    m = json.loads((b / MANIFEST).read_text())
    del m["files"]["certificates/A.json"]
    (b / MANIFEST).write_text(json.dumps(m))
    return b


def test_bundle_without_a_certificate_is_refused(verified: Path, tmp_path: Path) -> None:
    assert Bundle.open(verified).verified  # the unedited bundle opens
    b = _without_a(verified, tmp_path / "b")
    with pytest.raises(BundleRefused) as e:
        Bundle.open(b)
    msg = str(e.value)
    assert msg.startswith(f"{b}: no checkpoint A certificate"), msg
    assert "certificates/A.json missing" in msg and "recompile" in msg and "\n" not in msg
    assert Bundle.open(b, verify=False).verified is False


def test_generate_refuses_it_in_one_line(verified: Path, tmp_path: Path) -> None:
    b = _without_a(verified, tmp_path / "b")
    r = CliRunner().invoke(
        app, ["generate", str(b), "--prompt-ids", "5,17", "--max-new-tokens", "2",
              "--executor", "cpu"],
    )  # fmt: skip
    assert r.exit_code == 1, r.output
    err = r.stderr.strip()
    assert "\n" not in err and "Traceback" not in r.output, r.output
    assert str(b) in err and "no checkpoint A certificate" in err and "recompile" in err, err
