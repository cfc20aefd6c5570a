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


def test_executor_cuda_without_a_gpu_is_one_line_and_compiles_nothing(
    tiny_llama: Path, tmp_path: Path
) -> None:
    from plow.runtime.executors import EXECUTORS

    reason = EXECUTORS["cuda"].unavailable_reason()
    if reason is None:  # a GPU machine: this test is about the machines without one
        import pytest

        pytest.skip("a usable GPU is present")
    proc = subprocess.run(
        [sys.executable, "-m", "plow.cli", "generate", str(tiny_llama), "--prompt", "Hi",
         "--executor", "cuda"],
        capture_output=True, text=True, timeout=120, env=_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "executor cuda" in lines[0] and reason in lines[0]
    assert not (tmp_path / "cache" / "bundles").exists()  # refused before any compile


def test_the_gpu_target_of_a_device_name() -> None:
    import pytest

    from plow.errors import PlowError
    from plow.runtime.executors import gpu_target_of

    assert gpu_target_of("NVIDIA H200") == "h200"
    assert gpu_target_of("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_target_of("NVIDIA B200") == "b200"
    with pytest.raises(PlowError, match="no shipped target for this GPU"):
        gpu_target_of("NVIDIA A100-SXM4-40GB")
