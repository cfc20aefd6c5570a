"""Generation through the CPU executor against HuggingFace transformers (torch CPU, eager):
greedy tokens equal for every family, a batch of 4 prompts of different lengths, 32 new
tokens each; with the prefix cache hit and multi-step on; requests joining and leaving;
seeded sampling; the serving engine, the harness runner and `plow generate --executor cpu`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

from plow.checkpoint import Checkpoint, load_checkpoint
from plow.cli import app
from plow.runtime.cpu import CpuModel, GenerationStats, Request, generate
from plow.runtime.cpu.engine import CpuEngine, CpuRunner
from plow.runtime.sampler import SamplingParams
from plow.serve.engine import Engine, PrefillChunk, ReferenceEngine

NEW = 32
CONTEXT = 160
# A shared system prefix (three full 16-token blocks for every fixture tokenizer) and
# suffixes of different lengths; the last one is longer than Gemma's sliding window.
PREFIX = "System: you are a terse assistant. Answer in one line, no preamble. "
SUFFIXES = [
    "The quick brown fox.",
    "A counter",
    "Café, naïve, façade: 0 1 2 3",
    "The decode step reads every weight once. On a machine with little memory bandwidth",
]
FAMILIES = ["llama", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def hf(
    tiny_checkpoints: dict[str, Path],
) -> dict[str, tuple[Checkpoint, list[list[int]], list[list[int]]]]:
    """Per family: the checkpoint, the prompts' ids, and transformers' greedy tokens."""
    out = {}
    for fam in FAMILIES:
        ckpt = load_checkpoint(tiny_checkpoints[fam])
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_checkpoints[fam], dtype=torch.float32, attn_implementation="eager"
        ).eval()
        prompts = [ckpt.tokenizer.encode(PREFIX + s) for s in SUFFIXES]
        refs = []
        for ids in prompts:
            with torch.no_grad():
                gen = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=NEW,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            refs.append(gen[0, len(ids) :].tolist())
        out[fam] = (ckpt, prompts, refs)
    return out


def _model(ckpt: Checkpoint, target: str = "cpu", **kw: object) -> CpuModel:
    return CpuModel(ckpt.spec, ckpt.weights, target=target, max_batch=4, max_context=CONTEXT, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("target", ["cpu", "h100"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_matches_transformers_then_prefix_hit_and_multi_step(
    hf: dict, family: str, target: str
) -> None:
    ckpt, prompts, refs = hf[family]
    assert len({len(p) for p in prompts}) == 4  # different lengths
    m = _model(ckpt, target)
    st = GenerationStats()
    out = generate(m, [Request(tuple(p), NEW) for p in prompts], stats=st)
    assert out == refs
    assert st.prefill_launches == 1 and st.decode_steps == NEW - 1  # one batch, one bucket
    assert st.prefix_tokens_skipped == 0
    # Second round on the same model: every prompt hits the cached prefix blocks, and the
    # decode loop runs 4 tokens per host round trip.
    st2 = GenerationStats()
    out2 = generate(m, [Request(tuple(p), NEW) for p in prompts], multi_step=4, stats=st2)
    assert out2 == refs
    assert st2.prefix_tokens_skipped >= 4 * 48  # three full 16-token blocks each
    assert st2.prefill_tokens == st.prefill_tokens - st2.prefix_tokens_skipped
    assert st2.decode_launches == -(-(NEW - 1) // 4) and st2.decode_steps >= NEW - 1


def test_requests_join_and_leave_between_steps(hf: dict) -> None:
    """Six requests through two slots, budgets differing: each request's tokens are its
    transformers tokens (cut at its budget), whoever shares its bucket."""
    ckpt, prompts, refs = hf["llama"]
    budgets = [5, 32, 9, 3, 17, 12]
    reqs = [Request(tuple(prompts[i % 4]), n) for i, n in enumerate(budgets)]
    st = GenerationStats()
    m = _model(ckpt)
    out = generate(m, reqs, max_batch=2, prefix_cache=False, multi_step=3, stats=st)
    for i, n in enumerate(budgets):
        assert out[i] == refs[i % 4][:n], f"request {i}"
    assert st.prefill_launches >= 3  # requests joined at different times
    assert "decode_b2_s160" in st.buckets and st.prefix_tokens_skipped == 0
    assert m.kv.pool.num_free == m.kv.pool.num_blocks  # every page came back


def test_stop_id_ends_a_request_inside_a_quantum(hf: dict) -> None:
    ckpt, prompts, refs = hf["qwen3"]
    stop = refs[0][6]
    first = refs[0].index(stop)
    out = generate(_model(ckpt), [Request(tuple(prompts[0]), NEW, stop_ids=(stop,))], multi_step=8)
    assert out[0] == refs[0][: first + 1]


def test_seeded_sampling_is_reproducible_and_batch_independent(hf: dict) -> None:
    ckpt, prompts, refs = hf["llama"]
    hot = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=11)
    solo = generate(_model(ckpt), [Request(tuple(prompts[1]), 24, hot)])[0]
    again = generate(_model(ckpt), [Request(tuple(prompts[1]), 24, hot)], multi_step=5)[0]
    assert solo == again
    other = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=12)
    assert generate(_model(ckpt), [Request(tuple(prompts[1]), 24, other)])[0] != solo
    # one batch mixing greedy and stochastic rows: greedy rows are transformers' tokens, the
    # stochastic row is its solo run (draws depend only on its own seed)
    mixed = generate(
        _model(ckpt),
        [Request(tuple(prompts[0]), 24), Request(tuple(prompts[1]), 24, hot)]
        + [Request(tuple(prompts[i]), 24) for i in (2, 3)],
    )
    assert mixed[1] == solo
    for i in (0, 2, 3):
        assert mixed[i] == refs[i][:24]


def test_engine_protocol_matches_the_reference_engine(hf: dict) -> None:
    ckpt, prompts, _ = hf["gemma3"]
    cpu = CpuEngine.from_checkpoint(ckpt, max_batch=4, max_context=CONTEXT)
    ref = ReferenceEngine.from_checkpoint(ckpt, max_batch=4, max_context=CONTEXT)
    assert isinstance(cpu, Engine) and cpu.kind == "cpu"
    a, b = prompts[3], prompts[1]
    for e in (cpu, ref):
        e.add(0, a)
        e.add(2, b)
    chunks = [[PrefillChunk(0, 7), PrefillChunk(2, len(b))], [PrefillChunk(0, len(a) - 7)]]
    for ch in chunks:
        got, want = cpu.prefill(ch), ref.prefill(ch)
        np.testing.assert_allclose(got[-1], want[-1], rtol=1e-4, atol=1e-4 * np.abs(want).max())
    toks = [int(np.argmax(got[0])), 5]
    for _ in range(3):
        got, want = cpu.decode([0, 2], toks), ref.decode([0, 2], toks)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        toks = [int(x) for x in np.argmax(got, axis=1)]
    assert cpu.positions(0) == len(a) + 3
    used = cpu.kv_usage().pages_used
    cpu.free(2)
    assert cpu.kv_usage().pages_used < used
    cpu.add(1, a)  # same prompt: its full prompt blocks come from the prefix cache
    assert cpu.prefix_tokens_skipped == (len(a) - 1) // 16 * 16 > 0
    got = cpu.prefill([PrefillChunk(1, len(a))])  # computes only the uncached tail
    fresh = ReferenceEngine.from_checkpoint(ckpt, max_batch=1, max_context=CONTEXT)
    fresh.add(0, a)
    want = fresh.prefill([PrefillChunk(0, len(a))])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_harness_runner_and_cli(
    hf: dict, tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness.executors import get_executor

    monkeypatch.setenv("PLOW_CACHE", str(tmp_path))  # --executor cpu compiles a cached bundle

    ckpt, prompts, refs = hf["llama"]
    # the cpu runner the harness wraps (the harness itself opens only a study's bundles)
    model = CpuModel(ckpt.spec, ckpt.weights, max_batch=2, max_context=CONTEXT)
    runner = CpuRunner(CpuEngine(model))
    ref = get_executor("reference").open(ckpt, max_batch=2, max_context=CONTEXT)
    got, want = runner.prefill(prompts[:2]), ref.prefill(prompts[:2])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    toks = [int(x) for x in np.argmax(got, axis=1)]
    assert toks == [refs[0][0], refs[1][0]]
    got, want = runner.decode(toks), ref.decode(toks)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

    ids = ",".join(map(str, prompts[2]))
    args = ["generate", str(tiny_checkpoints["llama"]), "--prompt-ids", ids]
    args += ["--max-new-tokens", "12", "--ignore-eos", "--json"]
    res = CliRunner().invoke(app, [*args, "--executor", "cpu"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["token_ids"] == refs[2][:12]
    hot = ["--executor", "cpu", "--temperature", "0.8", "--top-p", "0.9", "--seed", "5"]
    runs = [CliRunner().invoke(app, [*args, *hot]) for _ in range(2)]
    assert runs[0].exit_code == 0, runs[0].output
    assert json.loads(runs[0].stdout)["token_ids"] == json.loads(runs[1].stdout)["token_ids"]
    bad = CliRunner().invoke(app, [*args, "--temperature", "0.8", "--executor", "reference"])
    assert bad.exit_code == 2 and "--executor native, cpu or cuda" in bad.output
