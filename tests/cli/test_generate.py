"""`plow generate --json` prints one JSON object whose tokens are the reference's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from plow.checkpoint import load_checkpoint
from plow.runtime.reference import generate_greedy


def _env(tmp_path: Path) -> dict[str, str]:
    """A private compile cache: the default executor compiles the checkpoint into it, and a
    bundle cached by another plow version in ~/.cache/plow must not decide the outcome."""
    return {**os.environ, "PLOW_CACHE": str(tmp_path / "cache")}


def test_generate_json_matches_the_library(tiny_llama: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plow.cli",
            "generate",
            str(tiny_llama),
            "--prompt",
            "The quick brown fox",
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(tmp_path),
        check=True,
    )
    out = json.loads(proc.stdout)
    ckpt = load_checkpoint(tiny_llama)
    ids = ckpt.tokenizer.encode("The quick brown fox")
    assert out["prompt_ids"] == ids
    assert out["token_ids"] == generate_greedy(ckpt, ids, 12)
    assert out["text"] == ckpt.tokenizer.decode(out["token_ids"])


def test_prompt_ids_outside_the_vocabulary_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plow.cli",
            "generate",
            str(tiny_llama),
            "--prompt-ids",
            "1,2,99999",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(tmp_path),
    )
    assert proc.returncode == 2
    assert "token id 99999 outside the vocabulary" in proc.stderr
