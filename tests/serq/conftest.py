from __future__ import annotations

import multiprocessing
import resource
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAD = ROOT / "examples" / "papers" / "bari_rad.sq"


@pytest.fixture(scope="session")
def rad_path() -> Path:
    return RAD


@pytest.fixture(scope="session")
def rad_text() -> str:
    return RAD.read_text(encoding="utf-8")


# ------------------------------------------------------------------ bounded runs of `serq`


@dataclass(frozen=True)
class Outcome:
    """How one ``serq`` command ended, run in a worker process with a time and memory bound."""

    exit_code: int | None  # None: it did not end within the time bound (the worker is killed)
    stdout: str
    stderr: str
    wall_s: float
    traceback: bool  # an exception escaped the command


def _worker_init(extra_bytes: int) -> None:
    # memory bound: what the (forked) worker already maps plus `extra_bytes`
    with open("/proc/self/status", encoding="ascii") as f:
        vm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    limit = vm + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _invoke(text: str | bytes, args: list[str]) -> Outcome:
    from typer.testing import CliRunner

    from serq.cli import app

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "prog.sq"
        if isinstance(text, bytes):
            f.write_bytes(text)
        else:
            f.write_text(text, encoding="utf-8")
        argv = [args[0], str(f), *args[1:]]
        t0 = time.perf_counter()
        res = CliRunner().invoke(app, argv)
        wall = time.perf_counter() - t0
        escaped = res.exception is not None and not isinstance(res.exception, SystemExit)
        out = res.stdout.replace(str(f), "prog.sq")
        err = (res.stderr or "").replace(str(f), "prog.sq")
        if escaped:
            err += "".join(traceback.format_exception(res.exception))
        return Outcome(res.exit_code, out, err, wall, escaped)


class Bounded:
    """Runs ``serq`` commands in a forked worker; a run past ``timeout_s`` kills the worker."""

    def __init__(self, extra_bytes: int = 3 << 30) -> None:
        self.extra = extra_bytes
        self.pool: Any = None

    def __call__(self, text: str | bytes, args: list[str], timeout_s: float = 20.0) -> Outcome:
        if self.pool is None:
            ctx = multiprocessing.get_context("fork")
            self.pool = ctx.Pool(1, initializer=_worker_init, initargs=(self.extra,))
        job = self.pool.apply_async(_invoke, (text, args))
        try:
            out: Outcome = job.get(timeout=timeout_s)
        except multiprocessing.TimeoutError:
            self.close()
            return Outcome(None, "", "", timeout_s, False)
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


@pytest.fixture(scope="session")
def bounded() -> Iterator[Bounded]:
    """``bounded(text, ["run", "--horizon", "1000"])``: the outcome of ``serq run FILE ...``."""
    b = Bounded()
    yield b
    b.close()
