from __future__ import annotations

from pathlib import Path

import pytest

from plow.oracle import oracle_binary


@pytest.fixture(scope="session")
def oracle() -> Path:
    try:
        return oracle_binary()
    except Exception:  # noqa: BLE001
        pytest.skip("plow-oracle not built (dune build)")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from plow.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_sched")
    return {f: make_tiny_checkpoint(f, 0, root / f) for f in ("llama", "qwen3", "gemma3")}
