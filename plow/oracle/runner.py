"""Runs the extracted checker `plow-oracle` as its own process.

A separate process means a checker crash cannot corrupt a compile, and the checks can be
switched on and off. Protocol (docs/oracle.md): stdin `{"checkpoint": ID, "payload": {...}}`,
stdout one JSON verdict, exit 0 accept / 1 reject / 2 malformed input.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from plow.errors import OracleError
from plow.oracle.models import Certificate, Verdict

_REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 120.0


def oracle_binary() -> Path:
    """Locate the oracle: $PLOW_ORACLE, then the dune build in the source tree, then PATH."""
    env = os.environ.get("PLOW_ORACLE")
    candidates = [Path(env)] if env else []
    candidates.append(_REPO_ROOT / "_build" / "default" / "oracle" / "plow-oracle")
    found = shutil.which("plow-oracle")
    if found:
        candidates.append(Path(found))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise OracleError(
        "plow-oracle",
        "oracle binary not found (build it with `make oracle`, or set PLOW_ORACLE)",
    )


def payload_bytes(checkpoint: str, payload: BaseModel | dict[str, object]) -> bytes:
    """The exact bytes sent to the oracle; the certificate's hash is over these."""
    body = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    return json.dumps(
        {"checkpoint": checkpoint, "payload": body}, separators=(",", ":"), sort_keys=True
    ).encode()


def run_checkpoint(
    checkpoint: str,
    payload: BaseModel | dict[str, object],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Certificate:
    """Check one payload; returns a certificate (accepted or rejected with a reason).

    Raises `OracleError` when the oracle cannot give a verdict (missing binary, crash,
    timeout, malformed payload) — that is a bug in the producer, not a rejected plan.
    """
    data = payload_bytes(checkpoint, payload)
    binary = oracle_binary()
    try:
        proc = subprocess.run(
            [str(binary)], input=data, capture_output=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise OracleError(
            f"checkpoint {checkpoint}", f"oracle timed out after {timeout_s:g} s"
        ) from e
    try:
        answer = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise OracleError(
            f"checkpoint {checkpoint}", f"oracle exited {proc.returncode}: {tail[0]}"
        ) from e
    if proc.returncode == 2 or answer.get("verdict") == "error":
        raise OracleError(f"checkpoint {checkpoint}", str(answer.get("reason")))
    verdict = Verdict(answer["verdict"])
    if (verdict is Verdict.accept) != (proc.returncode == 0):
        raise OracleError(
            f"checkpoint {checkpoint}",
            f"oracle exit status {proc.returncode} contradicts verdict {verdict.value}",
        )
    return Certificate(
        checkpoint=checkpoint,
        verdict=verdict,
        reason=answer.get("reason"),
        theorems=list(answer.get("theorems", [])),
        payload_sha256=hashlib.sha256(data).hexdigest(),
        oracle_version=str(answer.get("oracle_version", "unknown")),
        stats=answer.get("stats"),
    )


def run_checkpoint_a(
    bundle: Path, ops_file: Path, bucket: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Certificate | str:
    """Checkpoint A on one rung of a bundle: the payload from the bundle's `config.json`
    (lowered for `bucket`), the rung's op table file and `rewrites.json`
    (`plow.oracle.payloads.rewrites`); a one-line problem when those files cannot be read."""
    from plow.oracle.payloads.rewrites import rewrites_payload

    payload = rewrites_payload(bundle, ops_file, bucket)
    if isinstance(payload, str):
        return payload
    return run_checkpoint("A", payload, timeout_s=timeout_s)
