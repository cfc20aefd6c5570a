"""Bundles of the tiny fixture checkpoints, compiled once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from plow.emit.bundle import compile_bundle
from plow.profile import CompileProfile
from plow.target import load_target

FAMILIES = ("llama", "qwen3", "gemma3")


@pytest.fixture(scope="session")
def tiny_bundles(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    target = load_target("cpu")
    prof = CompileProfile(decode_batches=(1, 2), prefill_seqs=(8,))
    return {
        f: compile_bundle(tiny_checkpoints[f], root / f, target, prof, verify=True).out
        for f in FAMILIES
    }
