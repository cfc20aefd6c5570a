"""Shared fixtures: tiny real HF checkpoints (made once per session) and real-size configs."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from plow.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny_checkpoint(f, 0, root / f) for f in ("llama", "qwen3", "gemma3")}
