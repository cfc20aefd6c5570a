"""The tick split (schedule -> TickPlan -> execute -> update) and host-side sampling: logprobs
against transformers, penalties against their OpenAI definition recomputed here, and grammar
masks (llguidance) that make every response parse and validate."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections import Counter
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import transformers

from plow.checkpoint import Checkpoint, load_checkpoint
from plow.runtime.reference import forward_logits
from plow.runtime.sampler import SamplingParams
from plow.serve.dispatcher import Dispatcher, GenerationEvent, Request
from plow.serve.engine import ReferenceEngine
from plow.serve.grammar import Constraint, GrammarCompiler, GrammarError, constraint_of
from plow.serve.prefill_cost import PrefillFit
from plow.serve.sampling import Penalties, TokenLogprob
from plow.serve.scheduler import (
    Admit,
    Release,
    Running,
    SchedulerState,
    Step,
    Waiting,
    schedule,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt: Path) -> Checkpoint:
    return load_checkpoint(tiny_ckpt)


def dispatcher(ckpt: Checkpoint, slots: int = 4) -> Dispatcher:
    eng = ReferenceEngine.from_checkpoint(ckpt, max_batch=slots, max_context=128)
    return Dispatcher("t", eng, ckpt.tokenizer.decode, eos_token_ids=ckpt.spec.eos_token_ids,
                      prefill_fit=PrefillFit(launch_s=0.0, per_row_s=1e-5),
                      max_num_batched_tokens=64)  # fmt: skip


def run(d: Dispatcher, reqs: list[Request], limit: int = 2000) -> None:
    for r in reqs:
        d.submit(r)
    for _ in range(limit):
        if d._idle():
            return
        d._tick()
    raise AssertionError("dispatcher did not drain")


def request(rid: str, ids: list[int], n: int, events: list[GenerationEvent],
            **kw: object) -> Request:  # fmt: skip
    params = kw.pop("params", SamplingParams())
    return Request(rid, ids, params, n, events.append, **kw)  # type: ignore[arg-type]


def tokens(events: list[GenerationEvent]) -> list[int]:
    return [t for ev in events for t in ev.token_ids]


# ----------------------------------------------------------------------------- the split


def test_schedule_is_a_pure_function_of_the_snapshot() -> None:
    state = SchedulerState(
        tick=7, now=10.0,
        running=(
            Running("done", 1, 4, 4, 3, 11, finished=True),
            Running("gone", 3, 9, 2, 0, None, cancelled=True),
            Running("dec", 0, 5, 5, 2, 42),
            Running("pre", 4, 40, 8, 0, None),
        ),
        waiting=(
            Waiting("late", 1.0, 3), Waiting("quit", 9.0, 3, cancelled=True),
            Waiting("a", 9.5, 6), Waiting("b", 9.6, 2), Waiting("c", 9.7, 2),
        ),
        free_slots=(2,), max_num_batched_tokens=16, launch_rows=0.0, max_wait_s=5.0,
    )  # fmt: skip
    plan = schedule(state)
    assert schedule(state) == plan  # same snapshot, same plan (and the snapshot is frozen)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.tick = 8  # type: ignore[misc]
    assert plan.tick == 7
    assert plan.release == (Release("done", 1, False), Release("gone", 3, True))
    assert plan.drop == ("quit",) and plan.refuse == ("late",)  # waited 9 s > 5 s
    # free slots 1, 2, 3 go to the oldest waiting requests, lowest slot first; c waits
    assert plan.admit == (Admit("a", 1), Admit("b", 2), Admit("c", 3))
    assert plan.decode == (Step("dec", 0, 42),)  # only a request that has sampled decodes
    # one decode row leaves 15 prefill tokens: the chunks of the launch fit that budget
    assert sum(c.length for c in plan.prefill) <= 15
    assert [c.request_id for c in plan.prefill][0] == "pre"  # admission order
    for c in plan.prefill:
        left = {"pre": 32, "a": 6, "b": 2, "c": 2}[c.request_id]
        assert c.length == min(plan.chunk, left) and c.completes == (c.length == left)


def test_the_split_tick_serves_like_the_reference(ckpt: Checkpoint) -> None:
    """Greedy tokens through schedule/execute/update equal the reference's greedy decode,
    for requests that share slots, chunks and decode launches."""
    d = dispatcher(ckpt, slots=2)
    prompts = [[5, 17, 42, 99, 7], [8, 250, 31], [12, 13, 14, 15, 16, 17, 18], [3, 4]]
    events: list[list[GenerationEvent]] = [[] for _ in prompts]
    run(d, [request(f"r{i}", p, 6, events[i], stop_token_ids=frozenset())
            for i, p in enumerate(prompts)])  # fmt: skip
    for p, ev in zip(prompts, events, strict=True):
        seq = list(p)
        for _ in range(6):
            seq.append(int(np.argmax(forward_logits(ckpt, seq)[-1])))
        assert tokens(ev) == seq[len(p):]
    assert d.engine.kv_usage().pages_used == 0 and not d._active


def test_the_dispatchers_trimmed_queue_snapshot_gives_the_full_queues_plan(
    ckpt: Checkpoint,
) -> None:
    """The dispatcher snapshots only the head of a long queue (plus cancelled requests); the
    plan is the one the whole queue gives."""
    from plow.serve.admission import AdmissionController, QueueModel, StepTimes

    fit = PrefillFit(launch_s=0.0, per_row_s=1e-5)
    step = StepTimes(d0_s=1e-3, d1_s=1e-4, max_batch=4)
    adm = AdmissionController(QueueModel(step, fit, 4), max_wait_s=0.5)
    d = dispatcher(ckpt)
    d.admission = adm
    sink: list[GenerationEvent] = []
    for i in range(40):
        d.submit(request(f"q{i}", [5, 6, 7 + i], 4, sink), check=False)
    d._tick()  # four admitted
    for i in (3, 17, 33):  # one running, two waiting far back in the queue
        d.abort(f"q{i}")
    for i, r in enumerate(d._waiting):  # the oldest six waited past the bound
        if i < 6:
            assert r.record is not None
            r.record.arrival_t -= 10.0
    now = time.monotonic()
    trimmed = d._snapshot(now)
    full = dataclasses.replace(trimmed, waiting=tuple(
        Waiting(r.id, r.record.arrival_t if r.record else now, len(r.prompt_ids), r.cancelled)
        for r in d._waiting
    ))  # fmt: skip
    assert len(trimmed.waiting) < len(full.waiting)
    plan = schedule(full)
    assert schedule(trimmed) == plan
    assert plan.refuse == tuple(f"q{i}" for i in range(4, 10)) and plan.drop == ("q17", "q33")
    assert [a.request_id for a in plan.admit] == ["q10"]  # into q3's released slot


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_equal_log_softmax_of_transformers_logits(
    ckpt: Checkpoint, tiny_ckpt: Path
) -> None:
    d = dispatcher(ckpt)
    prompt = [5, 17, 42, 99, 7, 8]
    events: list[GenerationEvent] = []
    run(d, [request("lp", prompt, 8, events, logprobs=5, stop_token_ids=frozenset())])
    lps = [x for ev in events for x in ev.logprobs]
    toks = tokens(events)
    assert len(lps) == len(toks) == 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_ckpt, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + toks[:-1]])).logits[0]
    ref = torch.log_softmax(logits.double(), dim=-1).numpy()[len(prompt) - 1 :]
    for i, (x, tok) in enumerate(zip(lps, toks, strict=True)):
        assert x.token == tok
        assert x.logprob == pytest.approx(ref[i, tok], abs=1e-4)
        want = np.argsort(-ref[i], kind="stable")[:5]
        assert [t for t, _ in x.top] == want.tolist()
        np.testing.assert_allclose([v for _, v in x.top], ref[i, want], atol=1e-4)
        assert x.top[0][0] == tok  # greedy: the sampled token is the most likely one


# ----------------------------------------------------------------------------- penalties


def penalised(row: np.ndarray, prompt: list[int], out: list[int], presence: float,
              frequency: float, repetition: float) -> np.ndarray:  # fmt: skip
    """OpenAI's frequency/presence penalty and CTRL's repetition penalty, token by token."""
    z = row.astype(np.float64).copy()
    counts = Counter(out)
    for j in set(prompt) | set(out):
        z[j] = z[j] / repetition if z[j] > 0 else z[j] * repetition
    for j, c in counts.items():
        z[j] -= c * frequency + presence
    return z


@pytest.mark.parametrize(
    ("presence", "frequency", "repetition"),
    [(1.5, 0.0, 1.0), (0.0, 2.0, 1.0), (0.0, 0.0, 1.8), (0.5, 0.7, 1.3)],
)
def test_penalties_change_the_tokens_as_openai_defines_them(
    ckpt: Checkpoint, presence: float, frequency: float, repetition: float
) -> None:
    prompt = [5, 17, 42, 99, 7, 8]
    plain: list[GenerationEvent] = []
    pen: list[GenerationEvent] = []
    p = Penalties(presence, frequency, repetition)
    run(dispatcher(ckpt), [
        request("plain", prompt, 12, plain, stop_token_ids=frozenset()),
        request("pen", prompt, 12, pen, penalties=p, stop_token_ids=frozenset()),
    ])  # fmt: skip
    out = tokens(pen)
    seq = list(prompt)
    for i in range(12):
        row = forward_logits(ckpt, seq)[-1]
        z = penalised(row, prompt, out[:i], presence, frequency, repetition)
        assert out[i] == int(np.argmax(z)), f"token {i}"
        seq.append(out[i])
    assert out != tokens(plain)  # the penalties did change the greedy continuation


def test_penalty_ranges_are_checked() -> None:
    for kw in ({"presence": 2.5}, {"frequency": -3.0}, {"repetition": 0.0}):
        with pytest.raises(ValueError, match="penalty"):
            Penalties(**kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- grammar


@pytest.fixture(scope="module")
def grammars(ckpt: Checkpoint) -> GrammarCompiler:
    return GrammarCompiler(ckpt.tokenizer, ckpt.spec.vocab_size, ckpt.spec.eos_token_ids)


def test_json_schema_responses_parse_and_validate_every_time(
    ckpt: Checkpoint, grammars: GrammarCompiler
) -> None:
    c = constraint_of({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    assert c == Constraint("json", SCHEMA)
    d = dispatcher(ckpt)
    events: list[list[GenerationEvent]] = [[] for _ in range(5)]
    reqs = [
        request(f"j{i}", [5, 17, 42 + i], 64, events[i], grammar=grammars.compile(c),
                params=SamplingParams(temperature=1.0, seed=i) if i else SamplingParams())
        for i in range(5)
    ]  # fmt: skip
    run(d, reqs)
    texts = ["".join(ev.text for ev in evs) for evs in events]
    for evs, text in zip(events, texts, strict=True):
        assert evs[-1].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one canned answer
    # without the mask the model writes no JSON at all
    free: list[GenerationEvent] = []
    run(d, [request("free", [5, 17, 42], 20, free)])
    with pytest.raises(ValueError):
        json.loads("".join(ev.text for ev in free))


def test_regex_constraint_and_bad_constraints(
    ckpt: Checkpoint, grammars: GrammarCompiler
) -> None:
    c = constraint_of({"type": "regex", "regex": "[a-e]{3}-[0-9]{2}"})
    assert c is not None
    events: list[GenerationEvent] = []
    run(dispatcher(ckpt), [request("re", [5, 6], 30, events, grammar=grammars.compile(c),
                                   params=SamplingParams(temperature=1.0, seed=3))])  # fmt: skip
    assert re.fullmatch("[a-e]{3}-[0-9]{2}", "".join(ev.text for ev in events))
    assert constraint_of({"type": "text"}) is None and constraint_of(None) is None
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": 3},
                {"type": "json_schema", "json_schema": {"schema": []}}, {"type": "regex"}):
        with pytest.raises(GrammarError):
            constraint_of(bad)  # type: ignore[arg-type]
    with pytest.raises(GrammarError):
        grammars.compile(Constraint("regex", pattern="(unclosed"))


def test_logprobs_with_a_grammar_are_of_the_masked_distribution(
    ckpt: Checkpoint, grammars: GrammarCompiler
) -> None:
    """Masked tokens have probability 0: the top alternatives are all allowed tokens and
    their probabilities sum to at most 1 over the allowed set."""
    c = Constraint("regex", pattern="(ab|cd)")
    events: list[GenerationEvent] = []
    run(dispatcher(ckpt), [request("g", [5, 6], 8, events, grammar=grammars.compile(c),
                                   logprobs=20)])  # fmt: skip
    first: TokenLogprob = events[0].logprobs[0]
    allowed = {ckpt.tokenizer.decode([t]) for t, v in first.top if v > -np.inf}
    assert all("ab".startswith(s) or "cd".startswith(s) for s in allowed)
    assert np.exp([v for _, v in first.top]).sum() == pytest.approx(1.0, abs=1e-6)


def test_token_bytes_rebuild_multibyte_characters(
    ckpt: Checkpoint, grammars: GrammarCompiler
) -> None:
    text = "naïve café € 😀 über"
    ids = ckpt.tokenizer.inner.encode(text, add_special_tokens=False).ids
    pieces = [ckpt.tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some tokens hold part of a character
    raw = [grammars.token_bytes(i) for i in ids]
    assert all(b is not None for b in raw)
    assert b"".join(b for b in raw if b is not None) == text.encode()
    assert grammars.token_bytes(ckpt.spec.eos_token_ids[0]) is None  # special: no bytes


def test_top_logprobs_is_the_sorted_prefix_with_ties_by_lower_id() -> None:
    from plow.serve.sampling import top_logprobs

    rng = np.random.default_rng(0)
    for _ in range(500):  # few distinct values: many ties, also at the k-th boundary
        n, k = int(rng.integers(1, 40)), int(rng.integers(0, 45))
        lp = rng.integers(-5, 1, size=n).astype(np.float64)
        ranked = sorted(range(n), key=lambda i: (-lp[i], i))[:k]
        assert top_logprobs(lp, k) == tuple((i, float(lp[i])) for i in ranked)
