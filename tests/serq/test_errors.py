"""Bad programs end with file:line:col, the source line, a caret, and exit status 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from serq.cli import app

CASES = [
    # (name, replace this, with this, message fragment, line of the error)
    ("undefined", "set t0 = now;", "set t0 = nowish;", "undefined name 'nowish'", None),
    (
        "arity",
        "min(floor(~exp(200)) + 1, vdmax)",
        "min(floor(~exp(200)) + 1)",
        "wrong number of arguments: 'min'",
        None,
    ),
    (
        "engine",
        "claim token_rate: every iteration of E",
        "claim token_rate: every iteration of F",
        "unknown engine 'F'",
        None,
    ),
    ("syntax", "tokens cap bcol;", "tokens cap bcol", "syntax error", None),
    (
        "type",
        "advance running only (in_mode())",
        "advance running only (bcol)",
        "'only' must be a mode, got a number",
        None,
    ),
    (
        "def-arity",
        "admit waiting only (in_mode())",
        "admit waiting only (in_mode(1))",
        "wrong number of arguments: 'in_mode'",
        None,
    ),
]


@pytest.mark.parametrize(("name", "old", "new", "fragment", "_line"), CASES)
def test_error_location_and_exit(
    rad_text: str, tmp_path: Path, name: str, old: str, new: str, fragment: str, _line: None
) -> None:
    assert old in rad_text
    src = rad_text.replace(old, new, 1)
    f = tmp_path / f"{name}.sq"
    f.write_text(src, encoding="utf-8")
    lines = src.splitlines()
    for cmd in (["check", str(f)], ["run", str(f), "--horizon", "1000"]):
        res = CliRunner().invoke(app, cmd)
        assert res.exit_code == 2, res.output
        out = res.stderr if res.stderr else res.output
        assert "Traceback" not in out
        m = re.match(rf"^{re.escape(str(f))}:(\d+):(\d+): (.*)$", out.splitlines()[0])
        assert m, out
        line, col, msg = int(m[1]), int(m[2]), m[3]
        assert fragment in msg
        # the source line and a caret under the column follow
        assert out.splitlines()[1] == "  " + lines[line - 1]
        caret = out.splitlines()[2]
        assert caret == "  " + " " * (col - 1) + "^"
        if name in ("undefined", "engine", "arity", "type", "def-arity"):
            # the caret points into the replaced text
            assert (
                lines[line - 1][col - 1 :].startswith(new.split()[-1][:1]) or new in lines[line - 1]
            )


def test_unknown_engine_points_at_name(rad_text: str, tmp_path: Path) -> None:
    src = rad_text.replace("run E decode (cost(E, vd));", "run G decode (cost(G, vd));")
    f = tmp_path / "g.sq"
    f.write_text(src, encoding="utf-8")
    res = CliRunner().invoke(app, ["check", str(f)])
    assert res.exit_code == 2
    first = res.output.splitlines()[0]
    line, col = (int(x) for x in first.split(":")[1:3])
    assert src.splitlines()[line - 1][col - 1] == "G"
    assert first.endswith("unknown engine 'G'")


def test_missing_file_and_bad_set(tmp_path: Path, rad_path: Path) -> None:
    res = CliRunner().invoke(app, ["run", str(tmp_path / "nope.sq")])
    assert res.exit_code == 2 and "no such file" in res.output
    res = CliRunner().invoke(app, ["run", str(rad_path), "--set", "nope=1"])
    assert res.exit_code == 2 and "unknown parameter 'nope'" in res.output
    res = CliRunner().invoke(app, ["run", str(rad_path), "--set", "rate"])
    assert res.exit_code == 2 and "NAME=VALUE" in res.output
    res = CliRunner().invoke(app, ["run", str(rad_path), "--horizon", "-5"])
    assert res.exit_code == 2 and "horizon" in res.output


def test_debug_shows_traceback(tmp_path: Path) -> None:
    f = tmp_path / "bad.sq"
    f.write_text("let x = ;\n", encoding="utf-8")
    res = CliRunner().invoke(app, ["check", str(f), "--debug"])
    assert res.exit_code != 0 and res.exception is not None


def test_subprocess_exit_status(tmp_path: Path) -> None:
    import subprocess
    import sys

    f = tmp_path / "bad.sq"
    f.write_text("fn main() {\n  let a = min(1);\n}\n", encoding="utf-8")
    p = subprocess.run(
        [sys.executable, "-m", "serq.cli", "check", str(f)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert p.returncode == 2
    assert p.stderr.startswith(f"{f}:2:11: wrong number of arguments")
    assert "Traceback" not in p.stderr
