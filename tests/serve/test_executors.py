"""The runtime's one executor registry (`plow.runtime.executors`): what serve, the harness and
generate open, and its refusals."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from plow.checkpoint import load_checkpoint
from plow.errors import PlowError
from plow.runtime.cpu.bundle import Bundle
from plow.runtime.engine import Engine, PrefillChunk, SamplingEngine
from plow.runtime.executors import EXECUTORS, ExecutorUnavailable, get_executor
from plow.runtime.sampler import SamplingParams


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir: Path) -> Bundle:
    return Bundle.open(tiny_bundle_dir)


def hf_greedy(ckpt_dir: Path, ids: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_the_registry_names_every_executor_and_refuses_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert set(EXECUTORS) == {"reference", "cpu", "native", "cuda", "hip"}
    bundle_kinds = {n for n, k in EXECUTORS.items() if k.runs == "bundle"}
    assert bundle_kinds == {"cpu", "native", "cuda", "hip"}
    assert [n for n, k in EXECUTORS.items() if k.plans_in_memory] == ["cpu"]
    with pytest.raises(ExecutorUnavailable, match="unknown executor") as e:
        get_executor("tpu")
    assert e.value.exit_code == 2
    monkeypatch.setenv("PLOW_ASSUME_NO_GPU", "1")
    with pytest.raises(ExecutorUnavailable, match="no GPU on this machine"):
        get_executor("cuda")
    if not os.path.exists("/dev/kfd"):
        with pytest.raises(ExecutorUnavailable, match="no AMD GPU"):
            get_executor("hip")


def test_every_runnable_executor_gives_transformers_greedy_tokens(
    bundle: Bundle, tiny_ckpt: Path
) -> None:
    """One prompt through each executor this machine runs, by the registry alone: the engine
    (prefill + greedy decode rows) and, for bundle executors, `generate`."""
    prompt = [5, 17, 93, 2, 44, 8, 61]
    want = hf_greedy(tiny_ckpt, prompt, 6)
    ckpt = load_checkpoint(tiny_ckpt)
    ran = []
    for name, kind in EXECUTORS.items():
        if kind.unavailable_reason() is not None:
            continue
        ran.append(name)
        eng = kind.open_engine(ckpt if kind.runs == "checkpoint" else bundle, max_batch=2,
                               max_context=48)  # fmt: skip
        assert isinstance(eng, Engine) and eng.kind == name
        assert isinstance(eng, SamplingEngine) == (kind.runs == "bundle")
        eng.add(1, prompt)
        toks = [int(np.argmax(eng.prefill([PrefillChunk(1, len(prompt))])[0]))]
        for _ in range(5):
            toks.append(int(np.argmax(eng.decode([1], [toks[-1]])[0])))
        assert toks == want, name
        if kind.runs == "bundle":
            out, _ = kind.generate(bundle, prompt, 6, params=SamplingParams())
            assert out == want, name
    assert {"reference", "cpu"} <= set(ran)


def test_a_source_of_the_wrong_kind_is_one_line(bundle: Bundle, tiny_ckpt: Path) -> None:
    ckpt = load_checkpoint(tiny_ckpt)
    with pytest.raises(PlowError, match="a bundle runs on"):
        EXECUTORS["reference"].open_engine(bundle, max_batch=1)
    with pytest.raises(PlowError, match="runs bundles"):
        EXECUTORS["cpu"].open_engine(ckpt, max_batch=1)
    with pytest.raises(PlowError, match="runs checkpoints"):
        EXECUTORS["reference"].open_model(bundle)
