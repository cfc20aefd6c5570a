from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAD = ROOT / "examples" / "papers" / "bari_rad.sq"


@pytest.fixture(scope="session")
def rad_path() -> Path:
    return RAD


@pytest.fixture(scope="session")
def rad_text() -> str:
    return RAD.read_text(encoding="utf-8")
