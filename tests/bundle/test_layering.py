"""The layering of the compiler-runtime contract (issue 14 item 1): `plow.bundle` is read by
every executor and by `plow verify`, so it imports nothing of the compiler; the runtime does
not import the server. Each module is imported alone in a fresh interpreter and the modules
it pulled in are listed."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import plow.bundle

COMPILER = ("plow.emit", "plow.tiles", "plow.schedule", "plow.memory", "plow.egraph")


def imported_by(module: str) -> list[str]:
    code = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _under(mods: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in mods if any(m == p or m.startswith(p + ".") for p in prefixes)]


BUNDLE_MODULES = sorted(f"plow.bundle.{m.name}" for m in pkgutil.iter_modules(plow.bundle.__path__))


def test_the_contract_has_its_modules() -> None:
    assert {"manifest", "files", "wire", "ladder", "open", "stream"} <= {
        m.rsplit(".", 1)[1] for m in BUNDLE_MODULES
    }


@pytest.mark.parametrize("module", BUNDLE_MODULES)
def test_bundle_imports_no_compiler(module: str) -> None:
    assert _under(imported_by(module), COMPILER) == []


def test_runtime_does_not_import_serve() -> None:
    mods = imported_by("plow.runtime.cpu.bundle")
    assert "plow.runtime.cpu.bundle" in mods
    assert _under(mods, ("plow.serve",)) == []
    assert _under(imported_by("plow.runtime.engine"), ("plow.serve",)) == []


def test_oracle_payloads_do_not_import_the_emitter() -> None:
    for m in ("plow.oracle.payloads.dataflow", "plow.oracle.payloads.wire"):
        assert _under(imported_by(m), ("plow.emit",)) == [], m
