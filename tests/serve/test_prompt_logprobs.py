"""Prompt logprobs: completions' `echo` with `logprobs` (OpenAI's) and vLLM's `prompt_logprobs`
(completions and chat), gated against transformers' `log_softmax` over the prompt (1e-4), on
the native executor through the engine, HTTP and the official `openai` client; an engine that
cannot give them refuses with a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from plow.runtime.engine import PrefillChunk
from plow.runtime.executors import EXECUTORS
from tests.serve.conftest import API_KEY, LiveServer, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def native_or_skip() -> None:
    why = EXECUTORS["native"].unavailable_reason()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_ckpt: Path):  # type: ignore[no-untyped-def]
    """ids -> transformers' log_softmax of the logits at every prompt position [len, V]."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, torch_dtype=torch.float32)

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            lg = hf(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(lg, -1).numpy()

    return run


@pytest.fixture(scope="module")
def native_live(tiny_bundle_dir: Path) -> Iterator[LiveServer]:
    native_or_skip()
    from plow.serve.http import Server, load_served_model
    from plow.serve.prefill_cost import PrefillFit

    m = load_served_model(tiny_bundle_dir, name="tiny", max_num_seqs=4, max_num_batched_tokens=64,
                          executor="native",
                          prefill_fit=PrefillFit(launch_s=1e-3, per_row_s=1e-5))  # fmt: skip
    srv = start_server(Server([m], api_key=API_KEY, seed=0))
    yield srv
    stop_server(srv)


def test_engine_returns_every_prompt_rows_logits(tiny_bundle_dir: Path, hf_logprobs) -> None:  # type: ignore[no-untyped-def]
    """A 23-token prompt prefilled as chunks of 20 (two launches of the 16-row rung) and 3,
    beside another slot's chunk: every row equals transformers' distribution at its position,
    and the last row is the logits `prefill` returns."""
    native_or_skip()
    from plow.serve.sampling import log_softmax

    eng = EXECUTORS["native"].open_engine(tiny_bundle_dir, max_batch=2)
    ids = np.random.default_rng(0).integers(1, 250, size=23).tolist()
    eng.add(1, ids[:9])  # the same prefix, in the prefix cache first
    eng.prefill([PrefillChunk(1, 9)])
    eng.add(0, ids, reuse_prefix=False)  # type: ignore[call-arg]
    last1, rows1 = eng.prefill_all([PrefillChunk(0, 20)], [0])  # type: ignore[attr-defined]
    last2, rows2 = eng.prefill_all([PrefillChunk(0, 3)], [0])  # type: ignore[attr-defined]
    rows = np.concatenate([rows1[0], rows2[0]])
    assert rows.shape == (23, eng.vocab_size) and np.isfinite(rows).all()
    assert (rows[19] == last1[0]).all() and (rows[22] == last2[0]).all()
    mine = np.stack([log_softmax(r) for r in rows])
    np.testing.assert_allclose(mine, hf_logprobs(ids), atol=1e-4)


def test_a_prompt_prefilled_over_several_ticks_gets_every_logprob(
    tiny_bundle_dir: Path, hf_logprobs
) -> None:  # type: ignore[no-untyped-def]
    """A 40-token prompt under a 16-token tick budget (three prefill ticks), beside a plain
    request with the same prefix: one logprob per prompt token after the first, each
    transformers' (1e-4), with its rank."""
    native_or_skip()
    from plow.runtime.sampler import SamplingParams
    from plow.serve.dispatcher import Dispatcher, GenerationEvent, Request
    from plow.serve.prefill_cost import PrefillFit

    eng = EXECUTORS["native"].open_engine(tiny_bundle_dir, max_batch=2)
    d = Dispatcher("t", eng, lambda ids: "", eos_token_ids=(), max_num_batched_tokens=16,
                   prefill_fit=PrefillFit(launch_s=0.0, per_row_s=1e-5))  # fmt: skip
    ids = np.random.default_rng(5).integers(1, 250, size=40).tolist()
    events: list[GenerationEvent] = []
    d.submit(Request("plain", ids[:20], SamplingParams(), 2, lambda ev: None))
    d.submit(Request("p", ids, SamplingParams(), 2, events.append, prompt_logprobs=2))
    while not d._idle():
        d._tick()
    rec = d.record("p")
    assert rec is not None and len(rec.prefill_ticks) >= 3
    plps = [ev.prompt_logprobs for ev in events if ev.prompt_logprobs is not None]
    assert len(plps) == 1 and len(plps[0]) == len(ids) - 1
    ref = hf_logprobs(ids)
    for j, x in enumerate(plps[0], 1):
        assert x.token == ids[j] and abs(x.logprob - ref[j - 1, ids[j]]) < 1e-4
        v = ref[j - 1, ids[j]]  # the rank, up to tokens within the tolerance of this one
        assert (ref[j - 1] > v + 1e-4).sum() + 1 <= x.rank <= (ref[j - 1] > v - 1e-4).sum() + 1
        assert abs(x.top[0][1] - ref[j - 1].max()) < 1e-4


def _ids(live: LiveServer, prompt: str) -> list[int]:
    r = httpx.post(f"{live.url}/tokenize", headers=HEADERS, timeout=30,
                   json={"model": "tiny", "prompt": prompt})  # fmt: skip
    out: list[int] = r.json()["tokens"]
    return out


def test_echo_with_logprobs_through_the_openai_client(native_live: LiveServer, hf_logprobs) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{native_live.url}/v1", api_key=API_KEY, max_retries=0)
    prompt = "Once upon a time there was a"
    ids = _ids(native_live, prompt)
    ref = hf_logprobs(ids)
    kw = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    r = client.completions.create(echo=True, **kw)  # type: ignore[call-overload]
    lp = r.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref[j - 1, ids[j]] for j in range(1, n)]
    np.testing.assert_allclose(lp.token_logprobs[1:n], want, atol=1e-4)
    for j in range(1, n):  # the likeliest alternative is transformers' most likely token
        top = max(lp.top_logprobs[j].values())
        assert abs(top - ref[j - 1].max()) < 1e-4 and 1 <= len(lp.top_logprobs[j]) <= 2
    plain = client.completions.create(**kw)  # type: ignore[call-overload]
    assert r.choices[0].text == prompt + plain.choices[0].text
    assert lp.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset[n] == len(prompt)
    # streamed: the echo chunk carries the prompt's logprobs, the rest the completion's
    chunks = list(client.completions.create(echo=True, stream=True, **kw))  # type: ignore[call-overload]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    got = [v for c in chunks if c.choices and c.choices[0].logprobs
           for v in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert text == r.choices[0].text and got == lp.token_logprobs


def test_vllm_prompt_logprobs_on_completions_and_chat(native_live: LiveServer, hf_logprobs) -> None:  # type: ignore[no-untyped-def]
    prompt = "The quick brown fox"
    ids = _ids(native_live, prompt)
    ref = hf_logprobs(ids)
    url = native_live.url
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 1}  # fmt: skip
    pl = httpx.post(f"{url}/v1/completions", headers=HEADERS, json=body, timeout=60).json()
    pl = pl["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for j in range(1, len(ids)):
        entry = pl[j][str(ids[j])]
        assert abs(entry["logprob"] - ref[j - 1, ids[j]]) < 1e-4
        v, row = ref[j - 1, ids[j]], ref[j - 1]
        assert (row > v + 1e-4).sum() + 1 <= entry["rank"] <= (row > v - 1e-4).sum() + 1
        best = int(np.argmax(ref[j - 1]))
        assert pl[j][str(best)]["rank"] == 1
    # chat: the rendered prompt's logprobs, once, at the top level (vLLM's shape)
    msgs = [{"role": "user", "content": "hello"}]
    chat = {"model": "tiny", "messages": msgs, "max_tokens": 2, "prompt_logprobs": 0}
    out = httpx.post(f"{url}/v1/chat/completions", headers=HEADERS, json=chat, timeout=60).json()
    tok = httpx.post(f"{url}/tokenize", headers=HEADERS, timeout=30,
                     json={"model": "tiny", "messages": msgs}).json()["tokens"]  # fmt: skip
    cref = hf_logprobs(tok)
    got = [d[str(t)]["logprob"] for d, t in zip(out["prompt_logprobs"][1:], tok[1:], strict=True)]
    np.testing.assert_allclose(got, [cref[j - 1, tok[j]] for j in range(1, len(tok))], atol=1e-4)
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=HEADERS, timeout=60,
                      json={**chat, "stream": True}) as s:  # fmt: skip
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert [e["prompt_logprobs"] for e in events if "prompt_logprobs" in e] == [
        out["prompt_logprobs"]
    ]


def test_an_engine_without_prompt_logits_refuses_naming_the_field(live: LiveServer) -> None:
    """The reference engine returns only the last prompt row's logits: 400, not a guess."""
    cases = [
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "prompt_logprobs": 0}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ]  # fmt: skip
    for route, body, param in cases:
        r = httpx.post(f"{live.url}{route}", headers=HEADERS, timeout=30,
                       json={"model": "tiny", "max_tokens": 1, **body})  # fmt: skip
        assert r.status_code == 400, (route, body, r.text)
        assert r.json()["error"]["param"] == param
