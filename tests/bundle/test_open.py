"""`plow.bundle.open.check_bundle`: what an executor checks before it runs a bundle, from its
files alone — hashes, and certificate files that are accepted and carry the bundle digest. A
cross-reference `plow verify` rejects is carried by the certificate files it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plow.bundle.manifest import MANIFEST, CheckpointCertificates, read_manifest
from plow.bundle.open import BundleRefused, check_bundle
from plow.emit.bundle import compile_bundle
from plow.emit.verify import verify_bundle, write_certificates
from plow.profile import CompileProfile
from plow.target import load_target


@pytest.fixture(scope="module")
def bundle(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("open") / "b"
    prof = CompileProfile(decode_batches=(1,), prefill_seqs=())
    return compile_bundle(
        tiny_checkpoints["llama"], out, load_target("cpu"), prof, verify=True, plan_only=True
    ).out


def _copy(b: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(b, to))


def test_a_verified_bundle_passes(bundle: Path) -> None:
    assert check_bundle(bundle, read_manifest(bundle)) == []


def test_an_edited_file_is_refused_by_name(bundle: Path, tmp_path: Path) -> None:
    b = _copy(bundle, tmp_path / "b")
    (b / "tiles.json").write_text((b / "tiles.json").read_text() + " ")
    with pytest.raises(BundleRefused, match="tiles.json: sha256 differs"):
        check_bundle(b, read_manifest(b))


def test_a_cross_reference_verify_rejects_is_refused_from_the_certificates(
    bundle: Path, tmp_path: Path
) -> None:
    """The ladder's packet count edited: only the bundle-level row of `plow verify` sees it.
    Re-verified, the certificates carry the new digest, and the loader refuses them because
    they record the rejection (not by re-deriving anything)."""
    b = _copy(bundle, tmp_path / "b")
    doc = json.loads((b / MANIFEST).read_text())
    doc["ladder"][0]["packets"] += 1
    (b / MANIFEST).write_text(json.dumps(doc))
    report = verify_bundle(b)
    bad = report.first_rejection()
    assert bad is not None and bad.checkpoint == "bundle"
    write_certificates(report)
    cert = CheckpointCertificates.model_validate_json((b / "certificates" / "D.json").read_bytes())
    assert not cert.accepted and cert.reason and "packet" in cert.reason
    with pytest.raises(BundleRefused, match="not accepted: .*packet"):
        check_bundle(b, read_manifest(b))


def test_a_certificate_file_not_written_by_verify_is_refused(bundle: Path, tmp_path: Path) -> None:
    """A certificate file without the bundle-level check's mark (the compiler's own, or an
    older verify's), its sha256 re-forged in the manifest, is refused: accepted rows alone
    do not say the bundle's cross-references were checked."""
    from plow.bundle.manifest import sha256_file

    b = _copy(bundle, tmp_path / "b")
    p = b / "certificates" / "E.json"
    doc = json.loads(p.read_text())
    assert doc["bundle_checked"] is True and doc["accepted"] is True
    doc["bundle_checked"] = False
    p.write_text(json.dumps(doc))
    m = json.loads((b / MANIFEST).read_text())
    m["files"]["certificates/E.json"] = sha256_file(p)
    (b / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(BundleRefused, match=r"E\.json: not written by `plow verify`"):
        check_bundle(b, read_manifest(b))
