"""The embedded default model (SmolLM2-135M, dequantized from its shipped Q4_1 GGUF) on the
native executor: `plow generate` works out of the box on it (no step budget rejects it), and
3 prompts x 32 greedy tokens equal transformers'. Slow tier: the first run converts the model
(about a minute) and compiles + certifies its bundle."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from plow.checkpoint import load_checkpoint
from plow.default_model import ensure_default_model
from plow.runtime.cpu import Request, generate
from plow.runtime.cpu.bundle import compile_cached
from plow.runtime.native import open_native

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]
NEW = 32

pytestmark = pytest.mark.slow


def test_default_model_native_tokens_equal_transformers() -> None:
    src = ensure_default_model()
    ckpt = load_checkpoint(src)
    ids = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    want = []
    for p in ids:
        with torch.no_grad():
            gen = ref.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        want.append(gen[0, len(p) :].tolist())
    m = open_native(compile_cached(src), max_batch=4)
    assert generate(m, [Request(tuple(p), NEW) for p in ids]) == want


def test_plow_generate_runs_the_default_model_out_of_the_box() -> None:
    src = ensure_default_model()
    r = subprocess.run(
        [sys.executable, "-m", "plow.cli", "generate", str(src), "--prompt",
         "The capital of France is", "--max-new-tokens", "4", "--json"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["executor"] == "native" and len(doc["token_ids"]) == 4
    assert "Paris" in doc["text"]
