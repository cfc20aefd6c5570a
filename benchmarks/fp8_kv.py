"""Measurement: what the opt-in narrow key-value cache (fp8_e4m3, bfloat16) of the CPU executor
costs in logits and greedy tokens, and what it saves in cache bytes, against the fp32 cache.

Models: the three tiny test fixtures (llama, qwen3, gemma3; random weights) and, unless
``--skip-default``, the embedded default model (SmolLM2-135M-Instruct,
`plow.default_model.ensure_default_model`). Per model and prompt, through `CpuEngine` (plans
compiled in memory for the `cpu` target, round-robin machine):

- fp32 reference: prefill the prompt, then `new` greedy decode steps; the logits of every step
  (the prefill's last row, then each decode) and the greedy tokens;
- per narrow dtype, *teacher-forced*: the same prompt and the fp32 run's tokens fed step by
  step, so every step sees the same inputs; max and mean |Δ logit| against the fp32 logits
  over all steps and vocabulary entries (and max |logit| for scale), and how many steps'
  argmax agrees;
- per narrow dtype, *free-running*: its own greedy tokens; the first index where they leave
  the fp32 tokens (``agree_prefix`` = `new` when they never do) and the fraction equal.

Cache bytes: bytes one token takes in the pool across layers (keys + values; fp8 includes its
fp32 per-row scale: one per layer, K/V, head and token), from `KVShape`.

Usage: ``python benchmarks/fp8_kv.py [--new N] [--skip-default]``. Writes
``results/benchmarks/fp8_kv.json`` and ``results/benchmarks/fp8_kv.md``.
"""

# ruff: noqa: E501  (report tables)
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: 2 shared cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from plow.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from plow.runtime.cpu.engine import CpuEngine  # noqa: E402
from plow.runtime.kv_cache import KVDtype  # noqa: E402
from plow.serve.engine import PrefillChunk  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "benchmarks"
PROMPTS = [
    "System: you are a terse assistant. Answer in one line, no preamble. The quick brown fox.",
    "The decode step reads every weight once. On a machine with little memory bandwidth",
]
NARROW: tuple[KVDtype, ...] = ("fp8_e4m3", "bfloat16")


def _engine(ckpt: Checkpoint, context: int, kv_dtype: KVDtype) -> CpuEngine:
    return CpuEngine.from_checkpoint(
        ckpt, max_batch=1, max_context=context, prefix_cache=False, kv_dtype=kv_dtype
    )


def _run(
    e: CpuEngine, prompt: list[int], new: int, feed: list[int] | None
) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the logits of every step; `feed` forces the decode inputs."""
    e.add(0, prompt)
    rows = [e.prefill([PrefillChunk(0, len(prompt))])[0]]
    toks = [int(np.argmax(rows[0]))]
    for i in range(new - 1):
        inp = feed[i] if feed is not None else toks[-1]
        rows.append(e.decode([0], [inp])[0])
        toks.append(int(np.argmax(rows[-1])))
    e.free(0)
    return toks, np.stack(rows)


def measure(name: str, ckpt: Checkpoint, new: int) -> dict[str, Any]:
    prompts = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    context = max(len(p) for p in prompts) + new
    t0 = time.perf_counter()
    ref = _engine(ckpt, context, "float32")
    base = [_run(ref, p, new, None) for p in prompts]
    kvs = ref.model.arena.kv_shape
    per_tok = {"float32": kvs.bytes // (kvs.blocks * kvs.block_size)}
    out: dict[str, Any] = {"model": name, "prompt_tokens": [len(p) for p in prompts], "new": new}
    out["dtypes"] = {}
    for dt in NARROW:
        e = _engine(ckpt, context, dt)
        k = e.model.arena.kv_shape
        per_tok[dt] = k.bytes // (k.blocks * k.block_size)
        dmax = dmean_num = 0.0
        n = 0
        lmax = 0.0
        argmax_agree = 0
        prefixes, equal = [], 0
        for p, (toks, logits) in zip(prompts, base, strict=True):
            _, tf = _run(e, p, new, toks)
            d = np.abs(tf.astype(np.float64) - logits.astype(np.float64))
            dmax = max(dmax, float(d.max()))
            dmean_num += float(d.sum())
            n += d.size
            lmax = max(lmax, float(np.abs(logits).max()))
            argmax_agree += int((tf.argmax(-1) == logits.argmax(-1)).sum())
            free, _ = _run(e, p, new, None)
            diff = [i for i, (a, b) in enumerate(zip(free, toks, strict=True)) if a != b]
            prefixes.append(diff[0] if diff else new)
            equal += sum(a == b for a, b in zip(free, toks, strict=True))
        out["dtypes"][dt] = {
            "max_abs_dlogit": dmax,
            "mean_abs_dlogit": dmean_num / n,
            "max_abs_logit": lmax,
            "teacher_forced_argmax_agree": f"{argmax_agree}/{new * len(prompts)}",
            "free_run_agree_prefix": prefixes,
            "free_run_equal": f"{equal}/{new * len(prompts)}",
            "bytes_per_token": per_tok[dt],
        }
    out["bytes_per_token_fp32"] = per_tok["float32"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _md(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Narrow key-value cache on the CPU executor: error and bytes vs the fp32 cache",
        "",
        f"`python benchmarks/fp8_kv.py --new {meta['new']}` on {meta['machine']}, {meta['date']}.",
        "Two prompts per model; teacher-forced = the fp32 run's tokens fed to both caches (same inputs each step); free-running = each cache's own greedy tokens.",
        "",
        "| model | kv dtype | bytes/token (fp32) | saving | max \\|Δ logit\\| | mean \\|Δ logit\\| | max \\|logit\\| | teacher-forced argmax agree | free-run agree prefix (per prompt) | free-run equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        f = r["bytes_per_token_fp32"]
        for dt, m in r["dtypes"].items():
            lines.append(
                f"| {r['model']} | {dt} | {m['bytes_per_token']} ({f}) | {f / m['bytes_per_token']:.2f}x | "
                f"{m['max_abs_dlogit']:.3g} | {m['mean_abs_dlogit']:.3g} | {m['max_abs_logit']:.3g} | "
                f"{m['teacher_forced_argmax_agree']} | {', '.join(map(str, m['free_run_agree_prefix']))} of {r['new']} | {m['free_run_equal']} |"
            )
    lines += [
        "",
        "## Limits",
        "",
        "- Lossy by construction: these numbers are for these prompts and models only, not a bound. The tiny fixtures have random weights, so their logits are nearly tied and greedy tokens flip on tiny perturbations (bf16 flips them too); the default model (SmolLM2-135M, real weights) is the meaningful row.",
        "- Only the cache is narrow: this step's keys and values reach attention in fp32 from the projections; keys and values of earlier steps are read back dequantised. Weights, activations and the other ops stay fp32.",
        "- fp8 scales are per row (one power-of-two fp32 scale per layer, K/V, block, head and slot), so every row's bytes depend only on that row (deterministic under every interleaving); the saving counts them (4 bytes per head_dim elements). `PagedKVCache`'s own fp8 mode, with one scale per (block, head) group, is a different (host-side) scheme, measured in docs/runtime.md.",
        "- Short contexts (prompt + new tokens under 100 positions): the error of attention over long contexts is not measured; no perplexity.",
        "- One run, single BLAS thread, on a shared 2-core machine; times are not a performance claim.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--default-new", type=int, default=16)
    ap.add_argument("--skip-default", action="store_true")
    args = ap.parse_args()
    from plow.testing import make_tiny_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fam in ("llama", "qwen3", "gemma3"):
            ck = load_checkpoint(make_tiny_checkpoint(fam, 0, Path(tmp) / fam))
            rows.append(measure(f"tiny-{fam}", ck, args.new))
            print(json.dumps(rows[-1]))
    if not args.skip_default:
        from plow.default_model import ensure_default_model

        ck = load_checkpoint(ensure_default_model())
        rows.append(measure("SmolLM2-135M", ck, args.default_new))
        print(json.dumps(rows[-1]))
    meta = {
        "new": args.new,
        "default_new": args.default_new,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d"),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fp8_kv.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (OUT / "fp8_kv.md").write_text(_md(rows, meta))


if __name__ == "__main__":
    main()
