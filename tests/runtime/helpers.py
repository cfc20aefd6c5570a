"""Helpers shared by the executor tests (not tests themselves)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from plow.runtime.cpu import CpuModel, RowDevice, RowInput
from plow.runtime.sampler import SamplingParams

# The four prompts the families' greedy and logit gates decode (32 tokens each); the last is
# longer than the Gemma fixtures' sliding window (8), so the window is exercised.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A counter is a small integer in memory",
    "Café, naïve, façade: 0 1 2 3",
    "The decode step reads every weight once. On a machine with little memory bandwidth",
]


def prefill_logits(m: CpuModel, ids: list[int], chunk: int = 16) -> np.ndarray:
    """The last prompt token's logits after prefilling `ids` in chunks of `chunk` tokens into a
    fresh key-value table (released afterwards); `m` is any bundle executor's model."""
    t = m.kv.new_table()
    m.kv.reserve(t, len(ids))
    last = None
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        plan = m.plan(m.prefill_bucket(1, len(part)))
        m.run_quantum(
            plan,
            [RowInput(t, tuple(range(start, start + len(part))), tuple(part))],
            [RowDevice(SamplingParams(), None, 1)],
            1,
        )
        last = m.logits(plan)[0]
    m.kv.release(t)
    assert last is not None, "an empty prompt has no logits"
    return last


def assert_logits_close(got: np.ndarray, want: np.ndarray, rel: float = 1e-4) -> None:
    """Every logit within rel * max(1, |want|) of the reference (the families' logit gate)."""
    err = np.abs(got - want)
    assert np.all(err <= rel * np.maximum(1.0, np.abs(want))), float(np.max(err))


def hf_greedy(path: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt's ids: `new` tokens (no stop at EOS),
    the checkpoint at `path` in fp32 with eager attention."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model_greedy(model, prompts, new)


def model_greedy(model: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    """`model`'s (a loaded transformers model, e.g. with de-quantized weights copied in)
    greedy continuation of each prompt's ids: `new` tokens, no stop at EOS."""
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            gen = model.generate(
                torch.tensor([p]), max_new_tokens=new, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            out.append(gen[0, len(p) :].tolist())
    return out


def rewire_wait(consumer: str, counter: str, to: str) -> Callable[[dict[str, Any]], None]:
    """A schedule edit (for `tests.emit.bundle_edit.edit_rung`): the tasks of op `consumer`
    wait on counter `to` (one the producer's own tasks wait on) instead of the producer's
    `counter`, and the schedule's edges from the producer's tasks into them are gone: they
    stay ordered after everything before the producer, and only the derived data flow can
    notice they are no longer ordered after the producer."""

    def edit(sched: dict[str, Any]) -> None:
        t, names = sched["tasks"], sched["counters"]["name"]
        c, d = names.index(counter), names.index(to)
        hit = {i for i, n in enumerate(t["name"]) if n.startswith(consumer + "#")}
        assert hit and all(c in t["waits"][i] for i in hit)
        for i in hit:
            t["waits"][i] = [d if x == c else x for x in t["waits"][i]]
        e = sched["edges"]
        pairs = zip(e[0::2], e[1::2], strict=True)
        keep = [(u, v) for u, v in pairs if not (v in hit and c in t["signals"][u])]
        sched["edges"] = [x for pair in keep for x in pair]

    return edit
