"""What an executor checks before it runs a bundle (docs/bundle.md "Loading").

`check_bundle(path, manifest)` refuses (`BundleRefused`, one line naming the file or the
checkpoint) a bundle that is not what was verified:

1. every file the manifest lists is there with its sha256, and nothing unlisted was added
   (`hash_problems`); the certificate files match their sha256 in the manifest;
2. `certificates/<ckpt>.json` exists for A..F (a bundle verified before checkpoint A existed
   is refused in one line that says to recompile it), is accepted (a certificate file
   records the first rejection of its checkpoint and of `plow verify`'s bundle-level
   checks, and says it was written by that check: the compiler's own B/D files and an
   older verify's are refused), and holds an accepted certificate for every rung; a
   rejected one names the checkpoint, the bucket and the oracle's reason;
3. every certificate is bound to what runs: it carries the bundle digest (`bundle_digest`:
   the manifest, with every file's sha256, less its volatile fields) and a certificate of
   another digest is refused. A stale certificate (files edited, manifest hashes re-forged)
   is refused; `diagnose`, when the caller gives it, names what is wrong with the bundle
   (`plow verify`'s first rejection).

The checks read the bundle's files only; nothing is re-derived here (that is `plow
verify`'s job, whose verdicts the certificates carry).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from plow.bundle.manifest import (
    CHECKPOINTS,
    MANIFEST,
    CheckpointCertificates,
    Manifest,
    bundle_digest,
    certificate_file_problems,
    hash_problems,
)
from plow.errors import PlowError


class BundleRefused(PlowError):
    """The bundle is not what was verified (hash, certificate) or cannot run here."""

    exit_code = 1


NO_VERIFY_HINT = "(pass --no-verify to run it anyway)"

# `plow verify`'s first rejection of a bundle, (checkpoint, bucket, reason), or None
Diagnose = Callable[[Path], "tuple[str, str, str] | None"]


def is_bundle(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def check_bundle(bundle: Path, m: Manifest, *, diagnose: Diagnose | None = None) -> list[str]:
    """Steps 1-3 of the module docstring; raises `BundleRefused`; returns notes."""
    bundle = Path(bundle)
    problems = hash_problems(bundle, m)
    if problems:
        raise BundleRefused(bundle, f"{problems[0]} {NO_VERIFY_HINT}")
    edited = certificate_file_problems(bundle, m)
    if edited:
        raise BundleRefused(bundle, f"{edited[0]} {NO_VERIFY_HINT}")
    digest = bundle_digest(bundle)
    stale: list[str] = []
    for ck in CHECKPOINTS:
        rel = f"certificates/{ck}.json"
        p = bundle / rel
        # verified before checkpoint A existed (its other certificates are there)
        if ck == "A" and not p.is_file() and (bundle / "certificates" / "B.json").is_file():
            raise BundleRefused(
                bundle,
                f"no checkpoint A certificate ({rel} missing: nothing certifies that its op "
                "table is the model's graph); recompile it with `plow compile --verify` "
                f"{NO_VERIFY_HINT}",
            )
        if not p.is_file():
            raise BundleRefused(
                p,
                "missing: the bundle was not verified (compile with --verify or run "
                f"`plow verify {bundle}`) {NO_VERIFY_HINT}",
            )
        try:
            doc = CheckpointCertificates.model_validate_json(p.read_bytes())
        except ValueError as e:
            raise BundleRefused(p, f"unreadable certificate file: {e}") from e
        if not doc.bundle_checked:
            raise BundleRefused(
                p,
                "not written by `plow verify` (compiled without --verify, or verified by an "
                f"older plow that did not record the bundle-level checks); run `plow verify "
                f"{bundle}` {NO_VERIFY_HINT}",
            )
        for rung in m.ladder:
            cert = doc.buckets.get(rung.name)
            if cert is None:
                raise BundleRefused(p, f"no certificate for bucket {rung.name} {NO_VERIFY_HINT}")
            if cert.checkpoint != ck:
                raise BundleRefused(p, f"bucket {rung.name}: a checkpoint {cert.checkpoint} "
                                       f"certificate {NO_VERIFY_HINT}")  # fmt: skip
            if not cert.accepted:
                raise BundleRefused(
                    p,
                    f"checkpoint {ck} rejected bucket {rung.name}: {cert.reason} {NO_VERIFY_HINT}",
                )
            if cert.bundle_sha256 != digest:
                stale.append(f"{rel}: bucket {rung.name}")
        if not doc.accepted and not stale:
            raise BundleRefused(
                p, f"not accepted: {doc.reason or 'plow verify rejected the bundle'} "
                f"{NO_VERIFY_HINT}"
            )  # fmt: skip
    if stale:
        # The certificates were issued for another bundle (files edited, hashes re-forged):
        # refused. Say what is wrong with this one, if the caller can tell.
        again = diagnose(bundle) if diagnose is not None else None
        if again is not None:
            ck, bucket, reason = again
            raise BundleRefused(
                bundle / "certificates",
                f"checkpoint {ck} rejects bucket {bucket} (its certificate "
                f"is stale: the files changed since verification): {reason} "
                f"{NO_VERIFY_HINT}",
            )
        raise BundleRefused(
            bundle / "certificates",
            f"{stale[0]}: certified another bundle (the files or the manifest changed since "
            f"verification; run `plow verify {bundle}`) {NO_VERIFY_HINT}",
        )
    return []
