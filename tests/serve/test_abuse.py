"""What one client can do to the others (issue 19): leave a non-streaming request, send a huge
body or prompt, send loosely typed or invalid-Unicode JSON."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.checkpoint.tokenizer import Tokenizer
from plow.serve.engine import Engine, PrefillChunk
from plow.serve.http import DEFAULT_MAX_REQUEST_BYTES, Server, load_served_model, max_token_chars
from plow.serve.prefill_cost import PrefillFit
from plow.testing.fixtures import corpus_text
from tests.serve.conftest import API_KEY, LiveServer, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


class SlowEngine:
    """An engine whose decode launches take at least `decode_s` (a stand-in for a big model)."""

    def __init__(self, inner: Engine, decode_s: float) -> None:
        self.inner = inner
        self.decode_s = decode_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prefill(self, chunks: Sequence[PrefillChunk]) -> np.ndarray:
        return self.inner.prefill(chunks)

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        t0 = time.monotonic()
        out = self.inner.decode(slots, tokens)
        time.sleep(max(0.0, self.decode_s - (time.monotonic() - t0)))
        return out


@pytest.fixture(scope="module")
def slow(tiny_ckpt: Path) -> Iterator[LiveServer]:
    fit = PrefillFit(launch_s=1e-3, per_row_s=1e-5)
    m = load_served_model(tiny_ckpt, name="slow", max_num_seqs=2, max_num_batched_tokens=32,
                          prefill_fit=fit)  # fmt: skip
    m.dispatcher.engine = SlowEngine(m.dispatcher.engine, 0.02)  # type: ignore[assignment]
    srv = start_server(Server([m], api_key=API_KEY, max_request_bytes=64 << 10))
    yield srv
    stop_server(srv)


def _raw_post(url: str, path: str, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    return s


def _wait(pred: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# --------------------------------------------------------------------- abandoned requests


def test_abandoned_non_streaming_request_frees_its_slot_on_the_next_ticks(
    slow: LiveServer,
) -> None:
    d = slow.server.models["slow"].dispatcher
    slow.wait_idle("slow")
    body = {"model": "slow", "prompt": [3, 4, 5], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    sock = _raw_post(slow.url, "/v1/completions", json.dumps(body).encode())
    _wait(lambda: d.stats().running == 1)
    rid = next(iter(d._by_id))
    rec = d.record(rid)
    assert rec is not None
    _wait(lambda: rec.completion_tokens >= 3)  # tokens keep coming: no 0.5 s silence
    tick_at_close, tokens_at_close = d.tick, rec.completion_tokens
    sock.close()  # the client gives up
    after = slow.wait_idle("slow")
    assert after["plow:slots_in_use"] == 0 and after["plow:kv_cache_pages_used"] == 0
    assert rec.finish_reason == "abort"
    # freed within a few 20 ms ticks of the close, far from the 200 tokens asked for
    assert rec.freed_tick is not None and rec.freed_tick <= tick_at_close + 5
    assert rec.completion_tokens <= tokens_at_close + 5 < 200


def test_abandoned_request_still_waiting_for_a_slot_never_gets_one(slow: LiveServer) -> None:
    d = slow.server.models["slow"].dispatcher
    slow.wait_idle("slow")

    def hold(i: int) -> None:  # two streams hold both slots for about 1.2 s
        body = {"model": "slow", "prompt": [3 + i, 4], "max_tokens": 60, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{slow.url}/v1/completions", json=body, headers=HEADERS,
                          timeout=30) as r:  # fmt: skip
            for _ in r.iter_lines():
                pass

    holders = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    for t in holders:
        t.start()
    _wait(lambda: d.stats().running == 2)
    body = {"model": "slow", "prompt": [9, 9], "max_tokens": 5}
    sock = _raw_post(slow.url, "/v1/completions", json.dumps(body).encode())
    _wait(lambda: d.stats().waiting == 1)
    rid = next(r.id for r in d._waiting)
    sock.close()
    _wait(lambda: d.stats().waiting == 0)
    rec = d.record(rid)
    assert rec is not None and rec.finish_reason == "abort" and rec.admitted_tick is None
    assert d.stats().running == 2  # the others are untouched
    for t in holders:
        t.join(timeout=30)


def test_refusal_at_the_queue_bound_is_a_429_even_when_streaming(slow: LiveServer) -> None:
    """A request still waiting when the bound runs out is refused, not admitted late; the
    response starts only with the first event, so a stream gets a real 429 too."""
    d = slow.server.models["slow"].dispatcher
    adm = d.admission
    assert adm is not None
    slow.wait_idle("slow")
    old = adm.max_wait_s
    adm.max_wait_s = 0.0  # predicted 0 on an idle engine (admitted), but any wait is too long
    try:
        for stream in (False, True):
            body = {"model": "slow", "prompt": "x", "max_tokens": 2, "stream": stream}
            r = httpx.post(f"{slow.url}/v1/completions", json=body, headers=HEADERS, timeout=30)
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        adm.max_wait_s = old
    m = slow.metrics("slow")
    assert m['plow:request_refused_total{at="deadline"}'] >= 1


# --------------------------------------------------------------------- size limits


def test_body_over_the_limit_is_413_and_the_server_keeps_serving(slow: LiveServer) -> None:
    assert Server([]).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 8 << 20
    big = json.dumps({"model": "slow", "prompt": "a" * (200 << 10)}).encode()
    r = httpx.post(f"{slow.url}/v1/completions", content=big, timeout=30,
                   headers={**HEADERS, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "65536" in err["message"]
    assert err["type"] == "invalid_request_error"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "slow", "prompt": "'
        for _ in range(100):
            yield b"b" * 4096
        yield b'"}'

    r = httpx.post(f"{slow.url}/v1/completions", content=chunks(), headers=HEADERS, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    ok = httpx.post(f"{slow.url}/v1/completions", headers=HEADERS, timeout=30,
                    json={"model": "slow", "prompt": "hi", "max_tokens": 2})  # fmt: skip
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_overlong_prompt_is_refused_from_its_length_before_tokenising(
    live: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = live.server.models["tiny"]
    calls: list[int] = []
    real = m.encode

    def spy(text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(len(text))
        return real(text, add_special_tokens)

    monkeypatch.setattr(m, "encode", spy)
    prompt = "word " * 400_000  # 2 MB: under the body limit, far over the 256-token context
    t0 = time.monotonic()
    r = httpx.post(f"{live.url}/v1/completions", headers=HEADERS, timeout=60,
                   json={"model": "tiny", "prompt": prompt})  # fmt: skip
    elapsed = time.monotonic() - t0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "256" in err["message"] and str(len(prompt)) in err["message"]
    assert calls == []  # never tokenised
    assert elapsed < 10
    # a prompt just over the context by tokens still gets the exact count
    r = httpx.post(f"{live.url}/v1/completions", headers=HEADERS, timeout=60,
                   json={"model": "tiny", "prompt": "word " * 300})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert calls and "tokens" in r.json()["error"]["message"]


def test_health_answers_while_a_prompt_is_tokenised(
    live: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = live.server.models["tiny"]
    real = m.encode
    started = threading.Event()

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        started.set()
        time.sleep(1.5)  # a tokenizer busy with a big prompt (GIL released, as encode_batch)
        return real(text, add_special_tokens)

    monkeypatch.setattr(m, "encode", slow_encode)
    result: dict[str, Any] = {}

    def post() -> None:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        result["r"] = httpx.post(f"{live.url}/v1/completions", headers=HEADERS, json=body,
                                 timeout=60)  # fmt: skip

    t = threading.Thread(target=post)
    t.start()
    assert started.wait(10)
    t0 = time.monotonic()
    h = httpx.get(f"{live.url}/health", timeout=10)
    health_s = time.monotonic() - t0
    t.join(30)
    assert h.status_code == 200
    assert health_s < 0.75  # not the 1.5 s the tokenisation takes
    assert result["r"].status_code == 200


def test_chat_encoding_releases_the_gil(live: LiveServer) -> None:
    """`encode_batch` (what the server calls) lets other threads run; `encode` would not."""
    m = live.server.models["tiny"]
    text = "hello world, é ü " * 60_000
    gaps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            gaps.append(time.perf_counter() - t0)

    th = threading.Thread(target=spin)
    th.start()
    t0 = time.perf_counter()
    m.encode(text)
    total = time.perf_counter() - t0
    stop.set()
    th.join()
    assert total > 0.1  # the work is long enough to tell
    assert len(gaps) > 10 and max(gaps[1:-1] or [0.0]) < 0.8 * total


# --------------------------------------------------------------------- strict types


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 10.0}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"temperature": "0.5"}, "temperature"),
        ({"seed": "7"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"n": "2"}, "n"),
        ({"prompt": "\ud800 lone surrogate"}, "prompt"),
        ({"stop": ["ok", "\udfff"]}, "stop.1"),
        ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ],
)
def test_loose_input_is_400_naming_the_field(
    live: LiveServer, patch: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, **patch}
    raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate goes over as \ud800
    r = httpx.post(f"{live.url}/v1/completions", content=raw, timeout=30,
                   headers={**HEADERS, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["code"] is None or isinstance(err["code"], str)
    assert "Error" not in err["message"].split(":")[0]  # no Python exception name


def test_lone_surrogate_in_chat_is_400_naming_the_field(live: LiveServer) -> None:
    cases = [
        ([{"role": "user", "content": "hi \ud83d"}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
         "messages.0.content.0.text"),
        ([{"role": "user", "content": "hi", "name": "\ud800"}], "messages.0"),
    ]  # fmt: skip
    for messages, param in cases:
        raw = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 2}).encode()
        r = httpx.post(f"{live.url}/v1/chat/completions", content=raw, timeout=30,
                       headers={**HEADERS, "content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param, err
        assert "surrogate" in err["message"]


def test_error_codes_are_strings_or_null(live: LiveServer) -> None:
    r = httpx.get(f"{live.url}/v1/nope", headers=HEADERS, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{live.url}/v1/completions", headers=HEADERS, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(f"{live.url}/v1/completions", content=b"[1, 2]", timeout=10,
                   headers={**HEADERS, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{live.url}/v1/completions", content=b'{"model": NaN}', timeout=10,
                   headers={**HEADERS, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# --------------------------------------------------------------------- the length pre-check


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(text=st.text(alphabet=sorted(set(corpus_text())) + ["\u4e2d", "\U0001f600", " "],
                    max_size=400))  # fmt: skip
def test_the_character_bound_never_exceeds_the_token_count(live: LiveServer, text: str) -> None:
    """The pre-check may refuse a prompt only when it cannot fit: tokens >= chars / L."""
    m = live.server.models["tiny"]
    assert m.token_chars is not None and m.token_chars >= 1
    assert len(m.encode(text, add_special_tokens=False)) * m.token_chars >= len(text)


def test_no_character_bound_for_tokenizers_that_drop_input() -> None:
    from tokenizers import Tokenizer as HF
    from tokenizers import models, normalizers, pre_tokenizers

    def tok(pre: object = None, norm: object = None) -> Tokenizer:
        inner = HF(models.BPE({"a": 0, "[UNK]": 1}, [], unk_token="[UNK]"))
        if pre is not None:
            inner.pre_tokenizer = pre
        if norm is not None:
            inner.normalizer = norm
        return Tokenizer(inner)

    assert max_token_chars(tok()) == len("[UNK]")
    assert max_token_chars(tok(pre_tokenizers.ByteLevel())) is not None
    assert max_token_chars(tok(pre_tokenizers.Whitespace())) is None  # drops whitespace
    assert max_token_chars(tok(norm=normalizers.Strip())) is None
    strip_accents = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    assert max_token_chars(tok(norm=strip_accents)) is None
    no_unk = Tokenizer(HF(models.BPE({"a": 0}, [])))
    assert max_token_chars(no_unk) is None  # an unknown character would vanish
