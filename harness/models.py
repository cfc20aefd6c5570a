"""Resolving a workload's model reference to a checkpoint directory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from harness.workload import ModelRef
from plow.default_model import cache_dir, ensure_default_model
from plow.errors import CheckpointError, ConfigError


def fixture_dir(ref: ModelRef) -> Path:
    assert ref.fixture is not None
    f = ref.fixture
    digest = hashlib.sha256(json.dumps(f.overrides, sort_keys=True).encode()).hexdigest()[:10]
    return cache_dir() / "fixtures" / f"{f.family}-s{f.seed}-{digest}"


def resolve_model(ref: ModelRef, field: str = "model") -> Path:
    """The checkpoint directory of `ref` (converting or making it once when needed)."""
    if ref.default:
        return ensure_default_model()
    if ref.fixture is not None:
        target = fixture_dir(ref)
        if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
            return target
        from plow.testing import make_tiny_checkpoint

        tmp = target.with_name(target.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            make_tiny_checkpoint(ref.fixture.family, ref.fixture.seed, tmp, **ref.fixture.overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"field '{field}.fixture.overrides'", str(e)) from e
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target
    assert ref.path is not None
    path = Path(os.path.expandvars(os.path.expanduser(ref.path)))
    if not path.is_dir():
        raise CheckpointError(path, f"{field}: no such checkpoint directory")
    return path


def weights_sha256(directory: Path) -> str:
    """One digest over the checkpoint's safetensors files (names and bytes, sorted)."""
    h = hashlib.sha256()
    for f in sorted(directory.glob("*.safetensors")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()
