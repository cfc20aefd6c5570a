"""The numpy reference executor against HuggingFace transformers on torch CPU (the ground
truth nobody here wrote): greedy tokens equal for 32 new tokens, fp32 logits within
1e-4 × max(1, max |logit|)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from plow.checkpoint import load_checkpoint
from plow.runtime.reference import forward_logits, generate_greedy
from tests.runtime.helpers import PROMPTS

VARIANTS = ["llama", "llama_tied_sharded", "qwen3", "gemma3"]


def _hf_model(path: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints: dict[str, Path]) -> dict[str, tuple[object, object]]:
    return {
        v: (load_checkpoint(tiny_checkpoints[v]), _hf_model(tiny_checkpoints[v])) for v in VARIANTS
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant: str, loaded: dict) -> None:
    ckpt, model = loaded[variant]
    for prompt in PROMPTS:
        ids = ckpt.tokenizer.encode(prompt)
        ours = forward_logits(ckpt, ids)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
        assert ours.shape == ref.shape
        tol = 1e-4 * max(1.0, float(np.abs(ref).max()))
        err = float(np.abs(ours - ref).max())
        assert err <= tol, f"{variant} {prompt!r}: max |Δlogit| {err:.2e} > {tol:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_match_transformers(variant: str, loaded: dict) -> None:
    ckpt, model = loaded[variant]
    for prompt in PROMPTS:
        ids = ckpt.tokenizer.encode(prompt)
        ours = generate_greedy(ckpt, ids, 32)
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert ours == ref, f"{variant} {prompt!r}"


def test_decode_steps_match_a_single_prefill(loaded: dict) -> None:
    """The cache path (prefill + one-token decode steps) gives the logits of a full prefill."""
    ckpt, _ = loaded["gemma3"]
    from plow.runtime.reference import ReferenceSession

    ids = ckpt.tokenizer.encode(PROMPTS[3])
    full = forward_logits(ckpt, ids)
    session = ReferenceSession(ckpt.spec, ckpt.weights, context=len(ids))
    session.step(ids[:5])
    stepped = [session.step([t])[0] for t in ids[5:]]
    np.testing.assert_allclose(np.stack(stepped), full[5:], rtol=0, atol=1e-4)


def test_a_wrong_weight_changes_the_tokens(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The differential test can fail: perturbing one weight breaks agreement."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoints["llama"]
    dst = tmp_path / "perturbed"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = (
        tensors["model.layers.0.mlp.down_proj.weight"] * 3
    )
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    ckpt = load_checkpoint(dst)
    ids = ckpt.tokenizer.encode(PROMPTS[0])
    ref = _hf_model(src)
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(forward_logits(ckpt, ids) - logits).max() > 1e-2
