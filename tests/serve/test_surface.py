"""The OpenAI surface people use, through the official `openai` client: n > 1, stop strings
and stop token ids, echo, logprobs, response_format, /v1/models metadata, and vLLM's
/tokenize and /detokenize."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from plow.checkpoint import load_checkpoint
from plow.runtime.reference import generate_greedy
from tests.serve.conftest import API_KEY, LiveServer

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)


def test_n_choices_each_with_its_own_stream(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="Once upon", max_tokens=12, temperature=1.0, seed=7)
    many = client.completions.create(n=3, **kw)  # type: ignore[call-overload]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage.completion_tokens == 36 and many.usage.prompt_tokens > 0
    texts = [c.text for c in many.choices]
    assert len(set(texts)) > 1  # different seeds, different samples
    one = client.completions.create(**kw)  # type: ignore[call-overload]
    assert one.choices[0].text == texts[0]  # choice 0 is the single-choice request
    # streamed: deltas of each index add up to that choice's text
    chunks = list(client.completions.create(n=3, stream=True, **kw))  # type: ignore[call-overload]
    joined = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
              for i in range(3)]  # fmt: skip
    assert joined == texts
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(c.index for c in finals) == [0, 1, 2]


def test_chat_n_and_stream_agree(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "tell me"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, n=2,  # type: ignore[arg-type]
                                          seed=3)  # fmt: skip
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage is not None and full.usage.completion_tokens == 16
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, n=2,  # type: ignore[arg-type]
                                            seed=3, stream=True)  # fmt: skip
    parts: dict[int, str] = {0: "", 1: ""}
    for c in stream:
        for ch in c.choices:
            parts[ch.index] += ch.delta.content or ""
    assert [parts[0], parts[1]] == [c.message.content for c in full.choices]


def test_stop_strings_and_stop_token_ids(
    client: openai.OpenAI, live: LiveServer, tiny_ckpt: Path
) -> None:
    kw = dict(model="tiny", prompt="The quick brown", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    free = client.completions.create(**kw)  # type: ignore[call-overload]
    text = free.choices[0].text
    assert free.choices[0].finish_reason == "length" and len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.completions.create(stop=[stop, "\x00never"], **kw)  # type: ignore[call-overload]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.find(stop)]
    streamed = client.completions.create(stop=stop, stream=True, **kw)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    # stop token ids (vLLM's extension): the 4th greedy token ends the output
    tok = {"model": "tiny", "prompt": "The quick brown"}
    ids = httpx.post(f"{live.url}/tokenize", headers=HEADERS, json=tok, timeout=30).json()["tokens"]
    out_ids = generate_greedy(load_checkpoint(tiny_ckpt), ids, 8)
    target = out_ids[3]
    first = out_ids.index(target)
    r = client.completions.create(  # type: ignore[call-overload]
        model="tiny", prompt=ids, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [target]},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="Hello there", max_tokens=5, temperature=0)
    plain = client.completions.create(**kw)  # type: ignore[call-overload]
    echoed = client.completions.create(echo=True, **kw)  # type: ignore[call-overload]
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    streamed = client.completions.create(echo=True, stream=True, **kw)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_models_metadata(client: openai.OpenAI, live: LiveServer) -> None:
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.owned_by == "plow" and card.object == "model"
    extra = card.model_extra or {}
    assert extra["max_model_len"] == live.server.models["tiny"].max_context == 256
    assert extra["root"] == live.server.models["tiny"].root
    listed = {m.id: m for m in client.models.list()}
    assert (listed["tiny-b"].model_extra or {})["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_tokenize_and_detokenize_round_trip(live: LiveServer, client: openai.OpenAI) -> None:
    text = "Grüße, world"
    r = httpx.post(f"{live.url}/tokenize", headers=HEADERS, timeout=30,
                   json={"model": "tiny", "prompt": text})  # fmt: skip
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == 256
    # the count is what a completion is charged for the same prompt
    c = client.completions.create(model="tiny", prompt=text, max_tokens=1)
    assert c.usage.prompt_tokens == body["count"]
    d = httpx.post(f"{live.url}/detokenize", headers=HEADERS, timeout=30,
                   json={"model": "tiny", "tokens": body["tokens"]})  # fmt: skip
    assert d.status_code == 200 and d.json()["prompt"] == text
    hi = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{live.url}/tokenize", headers=HEADERS, timeout=30,
                      json={"model": "tiny", "messages": hi})  # fmt: skip
    cc = client.chat.completions.create(model="tiny", max_tokens=1,
                                        messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert cc.usage is not None and chat.json()["count"] == cc.usage.prompt_tokens
    # errors: unknown model, ids outside the vocabulary, no key
    bad = httpx.post(f"{live.url}/detokenize", headers=HEADERS, timeout=30,
                     json={"model": "tiny", "tokens": [10**9]})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    missing = httpx.post(f"{live.url}/tokenize", headers=HEADERS, timeout=30,
                         json={"prompt": "x"})  # two models served: name one  # fmt: skip
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    assert httpx.post(f"{live.url}/tokenize", json={"model": "tiny", "prompt": "x"},
                      timeout=30).status_code == 401  # fmt: skip


def test_sampling_fields_out_of_range_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    for kw in ({"logprobs": 21}, {"presence_penalty": 2.5}, {"frequency_penalty": -3.0},
               {"repetition_penalty": 0.0}, {"logprobs": True}):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=kw)
        assert e.value.body["param"] == next(iter(kw)), kw  # type: ignore[index]
    msgs = [{"role": "user", "content": "x"}]
    for kw, param in (
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
         "response_format"),
        ({"response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", max_tokens=2, messages=msgs,  # type: ignore[arg-type]
                                           extra_body=kw)  # fmt: skip
        assert e.value.body["param"] == param, kw  # type: ignore[index]


SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer", "minimum": 0,
                                                              "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_through_the_client(client: openai.OpenAI) -> None:
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    msgs = [{"role": "user", "content": "who?"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=48, n=4,  # type: ignore[arg-type]
                                          temperature=1.0, seed=11, response_format=fmt)  # type: ignore[arg-type]  # fmt: skip
    for c in full.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content or ""), SCHEMA)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=48, n=4,  # type: ignore[arg-type]
                                            temperature=1.0, seed=11, response_format=fmt,  # type: ignore[arg-type]
                                            stream=True)  # fmt: skip
    parts = ["", "", "", ""]
    for ch in stream:
        for c in ch.choices:
            parts[c.index] += c.delta.content or ""
    assert parts == [c.message.content for c in full.choices]
    # vLLM's structured_outputs: a regex on completions, a schema as a JSON string
    import re

    rx = client.completions.create(model="tiny", prompt="code:", max_tokens=20, temperature=1.0,
                                   seed=2, extra_body={"structured_outputs": {
                                       "regex": "[A-Z]{2}[0-9]{3}"}})  # fmt: skip
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", rx.choices[0].text)
    js = client.completions.create(model="tiny", prompt="p", max_tokens=48, extra_body={
        "structured_outputs": {"json": json.dumps(SCHEMA)}})  # fmt: skip
    jsonschema.validate(json.loads(js.choices[0].text), SCHEMA)
    for bad in ({"regex": "a", "json": {}}, {"grammar": "x"}, {"json": "{"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="p", max_tokens=2,
                                      extra_body={"structured_outputs": bad})  # fmt: skip
        assert e.value.body["param"] == "structured_outputs"  # type: ignore[index]
    obj = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=64,  # type: ignore[arg-type]
                                         response_format={"type": "json_object"})  # fmt: skip
    if obj.choices[0].finish_reason == "stop":  # an untrained model may run out of tokens
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:
        assert (obj.choices[0].message.content or "").startswith("{")


def test_logprobs_through_the_client(client: openai.OpenAI) -> None:
    import math

    msgs = [{"role": "user", "content": "tell me"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,  # type: ignore[arg-type]
                                          temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == full.usage.completion_tokens  # type: ignore[union-attr]
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0.0
        assert e.top_logprobs[0].logprob == e.logprob  # greedy picks the most likely token
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True)
        assert e.bytes is not None and len(e.bytes) >= 1
    # the tokens' own bytes rebuild the text, multi-byte characters split over tokens included
    raw = b"".join(bytes(e.bytes or []) for e in content)
    assert raw.decode("utf-8", errors="replace") == full.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,  # type: ignore[arg-type]
                                            temperature=0, logprobs=True, top_logprobs=3,
                                            stream=True)  # fmt: skip
    streamed = [e for ch in stream for c in ch.choices if c.logprobs and c.logprobs.content
                for e in c.logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    cmpl = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5,
                                     temperature=1.0, seed=5, logprobs=2)  # fmt: skip
    lp = cmpl.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for v, top in zip(lp.token_logprobs or [], lp.top_logprobs or [], strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) >= v - 1e-12  # top 2 of all tokens
        assert math.isfinite(v) and v <= 0.0
