"""Certificates: what the oracle says about one payload (crosses a process boundary)."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict


class Verdict(str, Enum):
    accept = "accept"
    reject = "reject"


class Certificate(BaseModel):
    """The oracle's answer for one checkpoint of one plan.

    `theorems` names the Rocq theorems whose hypotheses the checker established (see
    docs/theorems.md); `payload_sha256` binds the certificate to the exact payload bytes,
    `bundle_sha256` (set by `plow verify`) to the bundle it was derived from.
    """

    model_config = ConfigDict(frozen=True)

    checkpoint: str
    verdict: Verdict
    reason: str | None
    theorems: list[str]
    payload_sha256: str
    oracle_version: str
    # The bundle the payload was derived from (`plow.bundle.manifest.bundle_digest`); None for a
    # payload checked outside a bundle (the compiler's in-memory checks, tests).
    bundle_sha256: str | None = None
    # Counts the checker reports beside its verdict (D's sweep: `accesses`, `comparisons`,
    # the frontier entries compared); diagnostics, not part of the verdict.
    stats: dict[str, int] | None = None

    @property
    def accepted(self) -> bool:
        return self.verdict is Verdict.accept
