"""The CPU executor's opt-in narrow key-value cache (fp8_e4m3, bfloat16): lossy, bounded,
deterministic, and the fp32 default unchanged.

Bounds come from `benchmarks/fp8_kv.py` (results/benchmarks/fp8_kv.md), which runs the same
configuration as `_measure` here (same prompts, 32 new tokens, context = longest prompt + 32,
prefix cache off): the asserted bounds are the measured values with 50 % headroom (errors), or
exactly the measured agreement (greedy prefixes), not a general claim."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

from plow.checkpoint import Checkpoint, load_checkpoint
from plow.cli import app
from plow.runtime.cpu import CpuModel, Request, generate
from plow.runtime.cpu.engine import CpuEngine
from plow.runtime.kv_cache import KVDtype
from plow.serve.engine import PrefillChunk

NEW = 32
PROMPTS = [  # benchmarks/fp8_kv.py PROMPTS
    "System: you are a terse assistant. Answer in one line, no preamble. The quick brown fox.",
    "The decode step reads every weight once. On a machine with little memory bandwidth",
]
# measured (results/benchmarks/fp8_kv.json): fp8 max |Δ logit|, mean |Δ logit| over both
# prompts x 32 teacher-forced steps, and the greedy free-running agreement prefix per prompt
MEASURED = {
    "llama": (2.035, 0.1643, (6, 3)),
    "qwen3": (0.460, 0.0645, (1, 8)),
    "gemma3": (0.138, 0.0106, (32, 11)),
}


def _run(e: CpuEngine, prompt: list[int], feed: list[int] | None) -> tuple[list[int], np.ndarray]:
    e.add(0, prompt)
    rows = [e.prefill([PrefillChunk(0, len(prompt))])[0]]
    toks = [int(np.argmax(rows[0]))]
    for i in range(NEW - 1):
        rows.append(e.decode([0], [feed[i] if feed is not None else toks[-1]])[0])
        toks.append(int(np.argmax(rows[-1])))
    e.free(0)
    return toks, np.stack(rows)


def _engine(ckpt: Checkpoint, prompts: list[list[int]], kv_dtype: KVDtype) -> CpuEngine:
    context = max(len(p) for p in prompts) + NEW
    return CpuEngine.from_checkpoint(
        ckpt, max_batch=1, max_context=context, prefix_cache=False, kv_dtype=kv_dtype
    )


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoints: dict[str, Path]) -> dict[str, Checkpoint]:
    return {f: load_checkpoint(tiny_checkpoints[f]) for f in MEASURED}


@pytest.mark.parametrize("family", sorted(MEASURED))
def test_fp8_logits_differ_within_the_measured_bound_and_greedy_prefix_holds(
    ckpts: dict[str, Checkpoint], family: str
) -> None:
    ckpt = ckpts[family]
    prompts = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    ref = _engine(ckpt, prompts, "float32")
    fp8 = _engine(ckpt, prompts, "fp8_e4m3")
    bf16 = _engine(ckpt, prompts, "bfloat16")
    max_d, mean_d, prefix = MEASURED[family]
    d8, d16 = [], []
    for p, want_prefix in zip(prompts, prefix, strict=True):
        toks, logits = _run(ref, p, None)
        _, got = _run(fp8, p, toks)  # teacher-forced: same inputs every step
        _, got16 = _run(bf16, p, toks)
        # the prefill step sees no cached key (this step's keys reach attention in fp32)
        assert np.array_equal(got[0], logits[0])
        d8.append(np.abs(got - logits))
        d16.append(np.abs(got16 - logits))
        free, _ = _run(fp8, p, None)
        agree = next((i for i, (a, b) in enumerate(zip(free, toks, strict=True)) if a != b), NEW)
        assert agree >= want_prefix, (family, agree)
    e8, e16 = np.concatenate(d8), np.concatenate(d16)
    assert e8.max() > 0  # lossy: the decode steps read rounded keys back
    assert e8.max() <= 1.5 * max_d and e8.mean() <= 1.5 * mean_d
    assert 0 < e16.max() < e8.max()  # bf16 (8 mantissa bits) errs less than e4m3 (3)


def test_fp8_pool_stores_bytes_and_scales_and_round_trips_within_e4m3(
    ckpts: dict[str, Checkpoint],
) -> None:
    """After one prefill (which reads no cached key, so both models store the same fp32
    projections) the fp8 pool holds e4m3 bytes with power-of-two per-row scales, and every
    dequantised element errs by at most 2^-4 of itself (+ the subnormal step 2^-9 * scale)
    against the fp32 pool; the pool is a quarter of fp32 plus one fp32 scale per row."""
    ckpt = ckpts["llama"]
    prompts = [ckpt.tokenizer.encode(PROMPTS[0])]
    ref, fp8 = _engine(ckpt, prompts, "float32"), _engine(ckpt, prompts, "fp8_e4m3")
    for e in (ref, fp8):
        e.add(0, prompts[0])
        e.prefill([PrefillChunk(0, len(prompts[0]))])
    a32, a8 = ref.model.arena, fp8.model.arena
    assert a32.kv.dtype == np.float32 and a32.kv_scale is None
    assert a8.kv.dtype == ml_dtypes.float8_e4m3fn
    k = a8.kv_shape
    assert a8.kv_words == k.data_words + k.scale_words
    assert k.data_words * 4 == a32.kv_words  # a quarter of the fp32 pool's bytes
    blocks = fp8.model.kv.pool.num_blocks - fp8.model.kv.pool.num_free
    assert blocks > 0
    scale = a8.kv_scale
    assert scale is not None
    used = np.abs(a32.kv) > 0
    s = np.broadcast_to(scale[..., None], a8.kv.shape)
    written = scale[scale > 0]
    assert written.size and np.all(np.frexp(written)[0] == 0.5)  # powers of two
    got = a8.kv.astype(np.float32) * s
    ref_v = a32.kv
    err = np.abs(got - ref_v)
    assert used.any() and err[used].max() > 0
    assert np.all(err <= 2.0**-4 * np.abs(ref_v) + 2.0**-9 * s)


def test_default_stays_fp32_and_bitwise_equal_to_explicit_fp32(
    ckpts: dict[str, Checkpoint],
) -> None:
    ckpt = ckpts["gemma3"]
    prompts = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    default = CpuEngine.from_checkpoint(ckpt, max_batch=1, max_context=100, prefix_cache=False)
    assert default.model.kv_dtype == "float32" and not default.model.lossy
    k = default.model.arena.kv_shape
    assert k.words == int(np.prod(k.shape)) and default.model.arena.kv.dtype == np.float32
    explicit = CpuEngine.from_checkpoint(
        ckpt, max_batch=1, max_context=100, prefix_cache=False, kv_dtype="float32"
    )
    t0, l0 = _run(default, prompts[1], None)
    t1, l1 = _run(explicit, prompts[1], None)
    assert t0 == t1 and l0.tobytes() == l1.tobytes()


def test_fp8_is_deterministic_under_random_interleavings_and_checking_mode(
    ckpts: dict[str, Checkpoint],
) -> None:
    """Split attention (h100 target) writes one block from several tasks: per-row scales keep
    the bytes independent of their order; the checking mode sees no race on the packed
    words."""
    ckpt = ckpts["llama"]
    prompt = tuple(ckpt.tokenizer.encode(PROMPTS[1]))

    def run(**kw: object) -> tuple[list[list[int]], bytes]:
        m = CpuModel(
            ckpt.spec,
            ckpt.weights,
            target="h100",
            max_batch=1,
            max_context=96,
            kv_dtype="fp8_e4m3",
            **kw,  # type: ignore[arg-type]
        )
        out = generate(m, [Request(prompt, 8)])
        return out, m.arena.kv.tobytes() + m.arena.kv_scale.tobytes()  # type: ignore[union-attr]

    base = run()
    for seed in range(3):
        assert run(mode="random", seed=seed, check=True) == base


def test_cli_kv_dtype_reports_lossy(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLOW_CACHE", str(tmp_path))
    args = ["generate", str(tiny_checkpoints["llama"]), "--prompt-ids", "5,6,7,8,9"]
    args += ["--max-new-tokens", "6", "--ignore-eos", "--json", "--executor", "cpu"]
    plain = CliRunner().invoke(app, args)
    assert plain.exit_code == 0, plain.output
    doc = json.loads(plain.stdout)
    assert "lossy" not in doc and "kv_dtype" not in doc
    res = CliRunner().invoke(app, [*args, "--kv-dtype", "fp8_e4m3"])
    assert res.exit_code == 0, res.output
    doc8 = json.loads(res.stdout)
    assert doc8["kv_dtype"] == "fp8_e4m3" and doc8["lossy"] is True
    assert len(doc8["token_ids"]) == 6 and doc8["token_ids"][0] == doc["token_ids"][0]
    bad = CliRunner().invoke(app, [*args[:-2], "--kv-dtype", "fp8_e4m3"])  # reference
    assert bad.exit_code != 0 and "--executor cpu" in bad.output
    # the native executor keeps a bf16 cache (and says so), not an fp8 one
    nat = [*args[:-1], "native", "--kv-dtype"]
    res16 = CliRunner().invoke(app, [*nat, "bfloat16"])
    assert res16.exit_code == 0, res16.output
    doc16 = json.loads(res16.stdout)
    assert doc16["kv_dtype"] == "bfloat16" and doc16["lossy"] is True
    assert doc16["executor"] == "native" and len(doc16["token_ids"]) == 6
    bad8 = CliRunner().invoke(app, [*nat, "fp8_e4m3"])
    assert bad8.exit_code == 2 and "fp8_e4m3 runs on --executor cpu, not native" in bad8.output
