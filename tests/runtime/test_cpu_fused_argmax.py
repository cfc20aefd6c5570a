"""Greedy sampling fused into the lm_head reduction on the CPU executor (`FusedArgmax`): the
same tokens as the separate sample scan (and as transformers), the sample op never scans the
logits (machine work counters), ties go to the lowest id across chunks, and the bytes are
identical under random interleavings with the checking mode on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from plow.checkpoint import Checkpoint, load_checkpoint
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.cpu.machine import Mode
from plow.runtime.cpu.model import RowInput

FAMILIES = ["llama", "qwen3", "gemma3"]
PROMPTS = [(1, 2, 3, 4, 5, 6, 7), (9, 8, 7), (20, 21, 22, 23, 24)]
NEW = 8


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoints: dict[str, Path]) -> dict[str, Checkpoint]:
    return {f: load_checkpoint(tiny_checkpoints[f]) for f in FAMILIES}


def _model(ckpt: Checkpoint, target: str, **kw: object) -> CpuModel:
    return CpuModel(ckpt.spec, ckpt.weights, target=target, max_batch=4, max_context=64, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("target", ["cpu", "h100"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_tokens_equal_unfused_and_transformers_without_a_sample_scan(
    ckpts: dict[str, Checkpoint], tiny_checkpoints: dict[str, Path], family: str, target: str
) -> None:
    ckpt = ckpts[family]
    reqs = [Request(p, NEW) for p in PROMPTS]
    fused, plain = _model(ckpt, target), _model(ckpt, target, fuse_argmax=False)
    got = generate(fused, reqs)
    assert got == generate(plain, reqs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints[family], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for p, toks in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert toks == ref[0, len(p) :].tolist()
    dplan = fused.plan(fused.decode_bucket(len(PROMPTS)))
    assert dplan.fused is not None and dplan.fused.chunks >= 2
    fc, pc = fused.machine.counts, plain.machine.counts
    # the fused path reduces inside lm_head and never scans the logits in the sample op
    assert fc["sample.scan"] == 0 and fc["lm_head.argmax"] > 0 and fc["sample.fused_merge"] > 0
    # the unfused one scans the sampled row of every batch row, every step
    assert pc["sample.scan"] > 0 and pc["lm_head.argmax"] == 0
    assert pc["sample.scan"] % ckpt.spec.vocab_size == 0
    if target == "h100":  # k-split lm_head: its merges write the chunks; the tiler never
        # splits a sample op fed by an lm_head (fused by the compiler): no sample partials
        ops = {o.kind: o for o in dplan.ops}
        assert ops["lm_head"].reduction_axis is not None
        assert ops["sample"].reduction_axis is None and fc.get("sample.skipped", 0) == 0


def test_ties_across_chunks_go_to_the_lowest_id(ckpts: dict[str, Checkpoint]) -> None:
    """lm_head rows i < j in different chunks hold the same vector v, rows k < l the same -v,
    every other row zero: one of the pairs ties for the maximum, the fused pick is its lower
    id, as numpy's argmax over the whole row."""
    ckpt = ckpts["llama"]
    probe = _model(ckpt, "h100")
    f = probe.plan(probe.decode_bucket(4)).fused
    assert f is not None and f.chunks >= 4
    i, j = f.bounds[1] + 3, f.bounds[3] + 1  # chunks 1 and 3
    k, l_ = f.bounds[0] + 5, f.bounds[2] + 2  # chunks 0 and 2
    w = dict(ckpt.weights)
    lm = np.zeros_like(np.asarray(w["lm_head.weight"], dtype=np.float32))
    v = np.random.default_rng(0).standard_normal(lm.shape[1], dtype=np.float32)
    lm[[i, j]] = v
    lm[[k, l_]] = -v
    w["lm_head.weight"] = lm
    modes: list[tuple[Mode, int]] = [("round_robin", 0), ("random", 1), ("random", 2)]
    for mode, seed in modes:
        m = CpuModel(
            ckpt.spec,
            w,
            target="h100",
            max_batch=4,
            max_context=64,
            mode=mode,
            seed=seed,
            check=True,
        )
        plan = m.plan(m.decode_bucket(4))
        rows = []
        for b in range(4):
            t = m.kv.new_table()
            m.kv.reserve(t, 8)
            rows.append(RowInput(t, (2 + b,), (10 + 7 * b,)))
        m.write_inputs(plan, rows)
        m.dispatch(plan)
        logits = m.logits(plan)
        picked = m.sampled(plan).tolist()
        assert picked == [int(np.argmax(r)) for r in logits]
        for b, r in enumerate(logits):
            assert r[i] == r[j] and r[k] == r[l_]
            assert picked[b] == (i if r[i] > 0 else k), (b, r[i], r[k])


def test_fused_bytes_identical_under_random_interleavings_with_checking(
    ckpts: dict[str, Checkpoint],
) -> None:
    ckpt = ckpts["qwen3"]
    reqs = [Request(p, 4) for p in PROMPTS]
    base = _model(ckpt, "h100")
    want = generate(base, reqs)
    want_bytes = base.arena.snapshot()
    for seed in range(3):
        m = _model(ckpt, "h100", mode="random", seed=seed, check=True)
        assert generate(m, reqs) == want
        assert m.arena.snapshot() == want_bytes, f"seed {seed}"
