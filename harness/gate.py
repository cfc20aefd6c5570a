"""Step (b): the correctness gate against transformers on torch CPU (fp32).

For every prompt: greedy generation of `new_tokens` on the study's executor and, separately,
on transformers (its own loop with its own key-value cache) — the two token sequences must
match. Then transformers scores the executor's sequence teacher-forced: for each generated
position, |log p_executor(token) - log p_transformers(token)| (max over positions and
prompts) must be within the tolerance, and transformers' own argmax must agree with the
executor's token at (at least) the stated fraction of positions. End-of-sequence tokens do not
stop either side, so both generate exactly `new_tokens`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from harness.executors import Runner
from harness.workload import GateSpec


class GateCheck(BaseModel):
    name: str
    value: float
    tolerance: str
    passed: bool


class PromptResult(BaseModel):
    prompt: str | None
    prompt_ids: list[int]
    executor_tokens: list[int]
    reference_tokens: list[int]
    executor_text: str
    reference_text: str
    tokens_match: bool
    first_mismatch: int | None
    max_abs_logprob_delta: float
    top1_agreement: float
    executor_logprobs: list[float]
    reference_logprobs: list[float]


class GateReport(BaseModel):
    passed: bool
    executor: str
    reference: str
    reference_model: str
    new_tokens: int
    checks: list[GateCheck]
    prompts: list[PromptResult]
    seconds: float
    reason: str | None = None


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def executor_greedy(runner: Runner, ids: Sequence[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (argmax, lowest id on ties) and their log-probabilities."""
    logits = runner.prefill([list(ids)])[0]
    toks: list[int] = []
    lps: list[float] = []
    for i in range(n):
        tok = int(np.argmax(logits))
        toks.append(tok)
        lps.append(float(log_softmax(logits)[tok]))
        if i + 1 < n:
            logits = runner.decode([tok])[0]
    return toks, lps


class TransformersReference:
    """The ground truth: the checkpoint through transformers on torch CPU, fp32."""

    def __init__(self, directory: Path) -> None:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.torch: Any = torch
        self.model: Any = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32
        ).eval()
        self.label = (
            f"transformers {transformers.__version__} on torch {torch.__version__} CPU, fp32"
        )

    def greedy(self, ids: Sequence[int], n: int) -> list[int]:
        torch = self.torch
        # transformers 5 renamed `past_key_values` to `cache` (argument and output field)
        params = inspect.signature(self.model.forward).parameters
        key = "cache" if "cache" in params else "past_key_values"
        toks: list[int] = []
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([list(ids)]), use_cache=True)
            for i in range(n):
                tok = int(torch.argmax(out.logits[0, -1]))
                toks.append(tok)
                if i + 1 < n:
                    past = getattr(out, key)
                    out = self.model(input_ids=torch.tensor([[tok]]), use_cache=True, **{key: past})
        return toks

    def teacher_forced(self, ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Log-probabilities [len(tokens), V] of each position that predicts `tokens[i]`."""
        torch = self.torch
        seq = list(ids) + list(tokens[:-1])
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([seq])).logits[0, len(ids) - 1 :]
        rows = logits.double().numpy()
        return np.stack([log_softmax(r) for r in rows])


def run_gate(
    runner: Runner,
    reference_dir: Path,
    prompts: Sequence[tuple[str | None, list[int]]],
    spec: GateSpec,
    decode_text: Callable[[list[int]], str],
    on_prompt: Callable[[PromptResult], None] | None = None,
) -> GateReport:
    t0 = time.perf_counter()
    ref = TransformersReference(reference_dir)
    n = spec.new_tokens
    results: list[PromptResult] = []
    for text, ids in prompts:
        toks, lps = executor_greedy(runner, ids, n)
        ref_toks = ref.greedy(ids, n)
        tf = ref.teacher_forced(ids, toks)
        ref_lps = [float(tf[i, t]) for i, t in enumerate(toks)]
        top1 = float(np.mean([int(np.argmax(tf[i])) == t for i, t in enumerate(toks)]))
        mismatch = next(
            (i for i, (a, b) in enumerate(zip(toks, ref_toks, strict=True)) if a != b), None
        )
        r = PromptResult(
            prompt=text,
            prompt_ids=list(ids),
            executor_tokens=toks,
            reference_tokens=ref_toks,
            executor_text=decode_text(toks),
            reference_text=decode_text(ref_toks),
            tokens_match=mismatch is None,
            first_mismatch=mismatch,
            max_abs_logprob_delta=max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)),
            top1_agreement=top1,
            executor_logprobs=lps,
            reference_logprobs=ref_lps,
        )
        results.append(r)
        if on_prompt:
            on_prompt(r)
    matched = sum(r.tokens_match for r in results)
    delta = max(r.max_abs_logprob_delta for r in results)
    agree = min(r.top1_agreement for r in results)
    checks = [
        GateCheck(
            name="greedy token match (prompts matching all tokens)",
            value=matched / len(results),
            tolerance="= 1" if spec.require_token_match else "not required",
            passed=matched == len(results) or not spec.require_token_match,
        ),
        GateCheck(
            name="max abs delta logprob of the chosen tokens",
            value=delta,
            tolerance=f"<= {spec.max_abs_logprob_delta:g}",
            passed=delta <= spec.max_abs_logprob_delta,
        ),
        GateCheck(
            name="top-1 agreement (worst prompt)",
            value=agree,
            tolerance=f">= {spec.min_top1_agreement:g}",
            passed=agree >= spec.min_top1_agreement,
        ),
    ]
    failed = [c.name for c in checks if not c.passed]
    return GateReport(
        passed=not failed,
        executor=runner.executor,
        reference=ref.label,
        reference_model=str(reference_dir),
        new_tokens=n,
        checks=checks,
        prompts=results,
        seconds=round(time.perf_counter() - t0, 3),
        reason=("failed: " + "; ".join(failed)) if failed else None,
    )
