"""`manifest.json` and the certificate files of a bundle (docs/bundle.md "Manifest").

The manifest lists the model, the target, the profile, the ladder (per rung its files and
its cost model), the versions, and the sha256 of every other file. `bundle_digest` is what
every certificate carries and what an executor compares (`plow.bundle.open`);
`hash_problems` is the hash check `plow verify` and the loader share.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import plow
from plow.bundle.wire import WIRE_VERSION
from plow.errors import PlowError
from plow.oracle.models import Certificate

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
MANIFEST_FORMAT = 1
ORACLE_VERSION = "plow-oracle 0.1.0"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
CHECKPOINTS = ("A", "B", "C", "D", "E", "F")


class ModelInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    family: str
    source: str
    config_sha256: str
    layers: int
    hidden_size: int
    vocab_size: int
    parameters: int


class CostSummary(BaseModel):
    """The cost model's numbers for one bucket (ns)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    budget_ns: int
    bandwidth_bound_ns: float
    compute_bound_ns: float
    estimated_ns: float
    makespan_ns: float


class LadderRung(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    phase: str
    batch: int
    seq: int
    context: int
    plan: str
    ops: str
    schedule: str
    packets: int
    tasks: int
    counters: int
    arena_bytes: int
    cost: CostSummary


class Versions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    manifest: int = MANIFEST_FORMAT
    plow: str = plow.__version__
    wire: int = WIRE_VERSION
    oracle: str = ORACLE_VERSION


class WeightsInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    file: str
    tensors: int
    bytes: int
    relayout: list[str] = Field(default_factory=list)


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    format: int = MANIFEST_FORMAT
    model: ModelInfo
    target: dict[str, Any]
    profile: dict[str, Any]
    ladder: list[LadderRung]
    versions: Versions = Field(default_factory=Versions)
    plan_only: bool
    weights: WeightsInfo | None = None
    files: dict[str, str]  # relative path -> sha256 of every file but this one and certificates/
    compiled_at: str = ""
    stage_seconds: dict[str, float] = Field(default_factory=dict)


class CheckpointCertificates(BaseModel):
    """`OUT/certificates/<checkpoint>.json`: one certificate per bucket."""

    model_config = ConfigDict(frozen=True)
    checkpoint: str
    accepted: bool
    buckets: dict[str, Certificate]
    # the first rejection among this checkpoint's rows and the bundle-level checks
    # (`plow verify`); an executor refuses a certificate file that is not accepted
    reason: str | None = None
    # written by `plow verify`, which also ran the bundle-level checks; the compiler's own
    # B/D files and files of an older verify did not, so an executor refuses them
    bundle_checked: bool = False


class MalformedBundle(PlowError):
    """A bundle whose files cannot be read as a bundle (exit 2)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a compile or a verify: its full passes over
    the hundreds of thousands of small objects a large plan builds (tasks, boxes, columns)
    cost about a third of the schedule stage, and those objects are not cyclic garbage
    (reference counting still frees them). Restored on exit; nests."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_json(path: Path, model: type[BaseModel]) -> Any:
    if not path.is_file():
        raise MalformedBundle(path, "missing")
    try:
        return model.model_validate_json(path.read_bytes())
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "document"
        raise MalformedBundle(path, f"field {loc!r}: {err['msg']}") from e


# Manifest fields that change with every compile of the same inputs (not what runs).
VOLATILE = ("compiled_at", "stage_seconds")
CERTIFICATES = "certificates/"


def bundle_digest(bundle: Path) -> str:
    """The digest every certificate of a bundle carries: sha256 of the manifest as JSON
    (sorted keys, compact) without its volatile fields and without the certificates' own
    entries of `files`. The manifest holds the sha256 of every other file, so the digest
    covers the plan files, op tables, schedule files, weights, tokenizer, config and the
    manifest's ladder, target (a calibration included) and profile."""
    p = bundle / MANIFEST
    try:
        doc = json.loads(p.read_bytes())
    except (OSError, json.JSONDecodeError) as e:
        raise MalformedBundle(p, f"unreadable: {e}") from e
    if not isinstance(doc, dict):
        raise MalformedBundle(p, "not a JSON object")
    for k in VOLATILE:
        doc.pop(k, None)
    files = doc.get("files")
    if isinstance(files, dict):
        doc["files"] = {k: v for k, v in files.items() if not k.startswith(CERTIFICATES)}
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()


def certificate_file_problems(bundle: Path, m: Manifest) -> list[str]:
    """The certificate files the manifest lists that are missing or edited since `plow
    verify` wrote them (one line each)."""
    out = []
    for rel, digest in m.files.items():
        if rel.startswith(CERTIFICATES):
            p = bundle / rel
            if not p.is_file():
                out.append(f"{rel}: missing (listed in the manifest)")
            elif sha256_file(p) != digest:
                out.append(f"{rel}: sha256 differs from the manifest (edited after verification)")
    return out


def hash_problems(bundle: Path, m: Manifest) -> list[str]:
    """One line per file that is not what the manifest says: a listed file missing or of
    another sha256, a file of the bundle the manifest does not list (the manifest itself,
    `certificates/` and `payloads/` aside: `plow verify` writes those after compilation;
    `certificate_file_problems` checks the certificates)."""
    out: list[str] = []
    for rel, digest in m.files.items():
        if rel.startswith(CERTIFICATES):
            continue
        p = bundle / rel
        if not p.is_file():
            out.append(f"{rel}: listed in the manifest but missing")
        elif sha256_file(p) != digest:
            out.append(f"{rel}: sha256 differs from the manifest (edited after compilation)")
    out += [
        f"{rel}: not listed in the manifest"
        for rel in sorted(
            str(p.relative_to(bundle))
            for p in bundle.rglob("*")
            if p.is_file()
            and p.name != MANIFEST
            and not {"certificates", "payloads"} & set(p.relative_to(bundle).parts)
            and str(p.relative_to(bundle)) not in m.files
        )
    ]
    return out


def read_manifest(bundle: Path) -> Manifest:
    if not bundle.is_dir():
        raise MalformedBundle(bundle, "not a bundle directory")
    m: Manifest = load_json(bundle / MANIFEST, Manifest)
    return m
