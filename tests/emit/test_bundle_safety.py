"""Issue 19: `plow compile` loses nothing. It refuses an existing -o unless --force, never
writes over its source, replaces only bundles, removes its partial output on any failure
(SIGTERM included) and, on the next start, the partial output of compiles that were killed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plow.bundle.manifest import MANIFEST
from plow.cli import app
from plow.emit.bundle import compile_bundle, remove_stale_siblings, side_prefix
from plow.errors import PlowError
from plow.profile import CompileProfile
from plow.target import load_target


def _compile(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["compile", *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.stderr


def _one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


def _snapshot(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def ckpt(tiny_llama: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "ckpt"))


def test_existing_output_needs_force(ckpt: Path, tmp_path: Path) -> None:
    """Before: a second `plow compile -o DIR` deleted DIR and exited 0."""
    out = tmp_path / "b"
    assert _compile(str(ckpt), "-o", str(out))[0] == 0
    before = _snapshot(out)
    code, err = _compile(str(ckpt), "-o", str(out))
    _one_line(code, err, str(out), "exists: pass --force")
    assert _snapshot(out) == before
    stamp = json.loads((out / MANIFEST).read_text())["compiled_at"]
    (out / "plan" / "stray.txt").write_text("left by a user")  # goes with the old bundle
    code, err = _compile(str(ckpt), "-o", str(out), "--force")
    assert code == 0, err
    assert not (out / "plan" / "stray.txt").exists() and (out / MANIFEST).is_file()
    assert json.loads((out / MANIFEST).read_text())["compiled_at"] >= stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "ckpt"]


@pytest.mark.parametrize("force", [False, True])
def test_never_writes_over_the_source(ckpt: Path, tmp_path: Path, force: bool) -> None:
    """Before: `-o` pointed at the checkpoint deleted its weights. Now the checkpoint, a
    directory holding it and an existing directory inside it are refused, --force or not."""
    (ckpt / "sub").mkdir()
    before = _snapshot(ckpt)
    flag = ["--force"] if force else []
    for out, needle in (
        (ckpt, "is or holds the source checkpoint directory"),
        (tmp_path, "is or holds the source checkpoint directory"),
        (ckpt / "sub", "exists inside the source checkpoint directory"),
    ):
        code, err = _compile(str(ckpt), "-o", str(out), *flag)
        _one_line(code, err, needle)
    # A config.json source: its directory (which holds it) is refused too.
    code, err = _compile(str(ckpt / "config.json"), "-o", str(ckpt), "--plan-only", *flag)
    _one_line(code, err, "is or holds the source config")
    assert _snapshot(ckpt) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    # Writing a new bundle inside the checkpoint directory touches nothing there.
    assert _compile(str(ckpt), "-o", str(ckpt / "new"), *flag)[0] == 0
    assert {k: v for k, v in _snapshot(ckpt).items() if not k.startswith("new/")} == before


def test_force_replaces_only_a_bundle(ckpt: Path, tmp_path: Path) -> None:
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    code, err = _compile(str(ckpt), "-o", str(other), "--force")
    _one_line(code, err, "not a plow bundle (no manifest.json)")
    assert (other / "todo.txt").read_text() == "keep me"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _one_line(*_compile(str(ckpt), "-o", str(a_file), "--force"), "not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line(*_compile(str(ckpt), "-o", str(empty)), "pass --force")
    assert _compile(str(ckpt), "-o", str(empty), "--force")[0] == 0  # nothing to lose
    assert (empty / MANIFEST).is_file()


_KILL_AT_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from plow.emit.bundle import compile_bundle
    from plow.profile import CompileProfile
    from plow.target import load_target

    src, out, sig = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    # as from a terminal, whatever launched the tests: a background or nohup'd job inherits
    # SIGINT / SIGHUP ignored, and a compile rightly leaves an ignored signal ignored
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_stage(name, bucket, phase):
        if name == "write" and phase == "done":  # the partial directory is full
            print(next(out.parent.glob(out.name + ".partial-*")), flush=True)
            os.kill(os.getpid(), sig)

    compile_bundle(src, out, load_target("cpu"), CompileProfile(), on_stage=on_stage)
    """
)


def _killed_compile(src: Path, out: Path, sig: signal.Signals) -> tuple[int, Path]:
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_AT_WRITE, str(src), str(out), str(int(sig))],
        capture_output=True,
        text=True,
        timeout=180,
    )
    partial = Path(proc.stdout.strip().splitlines()[0])
    assert partial.name.startswith(f"{out.name}.partial-"), proc.stdout + proc.stderr
    return proc.returncode, partial


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_terminated_compile_removes_its_partial_output(
    ckpt: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    """Before: a killed compile left its `*.partial-*` directory (0.5 GB on SmolLM2)."""
    out = tmp_path / "b"
    compile_bundle(ckpt, out, load_target("cpu"), CompileProfile(decode_batches=(2,)))
    before = _snapshot(out)
    code, partial = _killed_compile(ckpt, out, sig)
    # Python re-raises an uncaught KeyboardInterrupt as SIGINT; ours exit 128 + the signal.
    assert code == (-signal.SIGINT if sig is signal.SIGINT else 128 + sig)
    assert not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "ckpt"]
    assert _snapshot(out) == before  # the previous bundle is untouched


def test_killed_compile_is_cleaned_up_by_the_next(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    code, dead = _killed_compile(ckpt, out, signal.SIGKILL)
    assert code == -signal.SIGKILL and dead.is_dir()  # SIGKILL cannot be caught
    m = re.fullmatch(r"b\.partial-([A-Za-z0-9]+)-(\d+)-.+", dead.name)
    assert m is not None and int(m.group(2)) != os.getpid()  # the owner's PID is in the name
    # Left alone: a live compile's partial (this process), one of another host, one without
    # an owner in its name (older plow), and another target's.
    live = tmp_path / f"{side_prefix(out, 'partial')}live"
    other_host = tmp_path / f"b.partial-otherhost-{_dead_pid()}-x"
    legacy = tmp_path / "b.partial-k2j4h1"
    other_target = tmp_path / f"{side_prefix(tmp_path / 'c', 'partial')}y".replace(
        str(os.getpid()), str(_dead_pid())
    )
    for d in (live, other_host, legacy, other_target):
        d.mkdir()
    compile_bundle(ckpt, out, load_target("cpu"), CompileProfile())
    assert not dead.exists()
    assert all(d.is_dir() for d in (live, other_host, legacy, other_target))
    assert (out / MANIFEST).is_file()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_set_aside_bundle_is_put_back(ckpt: Path, tmp_path: Path) -> None:
    """Killed between moving the old bundle aside and moving the new one in: the next start
    puts the old bundle back rather than deleting the only copy."""
    out = tmp_path / "b"
    compile_bundle(ckpt, out, load_target("cpu"), CompileProfile())
    before = _snapshot(out)
    aside = tmp_path / side_prefix(out, "old").replace(str(os.getpid()), str(_dead_pid()))
    out.rename(aside.with_name(aside.name + "123"))
    assert remove_stale_siblings(out)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "ckpt"]


def test_failed_swap_restores_the_previous_bundle(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "b"
    compile_bundle(ckpt, out, load_target("cpu"), CompileProfile())
    before = _snapshot(out)
    real = Path.rename

    def rename(self: Path, target: str | Path) -> Path:
        if ".partial-" in self.name:
            raise OSError("injected: disk went away")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        compile_bundle(ckpt, out, load_target("cpu"), CompileProfile(decode_batches=(2,)))
    monkeypatch.undo()
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "ckpt"]


def test_library_compile_refuses_the_source_too(ckpt: Path) -> None:
    """`compile_bundle` (used by the cache and the harness) keeps the same guarantees."""
    before = _snapshot(ckpt)
    with pytest.raises(PlowError, match="is or holds the source"):
        compile_bundle(ckpt, ckpt, load_target("cpu"), CompileProfile(), replace=True)
    assert _snapshot(ckpt) == before
