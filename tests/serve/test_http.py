"""The OpenAI-compatible server against the official `openai` client, on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import API_KEY, LiveServer


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)


ABORTED = 'vllm:request_success_total{finished_reason="abort"}'
STOPPED = 'vllm:request_success_total{finished_reason="stop"}'
LENGTH = 'vllm:request_success_total{finished_reason="length"}'


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_models_health_and_metrics(live: LiveServer, client: openai.OpenAI) -> None:
    assert sorted(m.id for m in client.models.list()) == ["tiny", "tiny-b"]
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    r = httpx.get(f"{live.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}  # a valid exposition
    for name, kind in [
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:time_per_output_token_seconds", "histogram"),
        ("vllm:inter_token_latency_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("vllm:request_queue_time_seconds", "histogram"),
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:generation_tokens", "counter"),
        ("vllm:request_success", "counter"),
        ("plow:slots_in_use", "gauge"),
        ("plow:engine_tick_seconds", "histogram"),
        ("plow:request_refused", "counter"),
    ]:
        assert families[name].type == kind, name
    # one family per name with both models' samples in it, no _created series
    models = {s.labels["model_name"] for s in families["vllm:num_requests_running"].samples}
    assert models == {"tiny", "tiny-b"}
    assert "_created" not in r.text
    assert r.text.count("# TYPE vllm:num_requests_running ") == 1


def test_completion_and_stream_agree(live: LiveServer, client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="Hello world", max_tokens=24, temperature=0.8, seed=5)
    full = client.completions.create(**kw)  # type: ignore[call-overload]
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kw, stream=True,  # type: ignore[call-overload]
                                            stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    other = client.completions.create(**{**kw, "seed": 6})  # type: ignore[call-overload]
    assert other.choices[0].text != full.choices[0].text  # the seed matters


def test_chat_and_chat_stream_agree(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, seed=3)  # type: ignore[arg-type]
    assert full.choices[0].message.role == "assistant"
    assert full.usage is not None and full.usage.completion_tokens == 12
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, seed=3,  # type: ignore[arg-type]
                                            stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content


def test_second_model_is_routed_by_name(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny-b", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert r.model == "tiny-b" and r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 3


def test_arrival_while_others_decode_gets_first_token_within_a_tick(live: LiveServer) -> None:
    live.wait_idle()

    async def run() -> tuple[list[str], str]:
        async with httpx.AsyncClient(base_url=live.url, headers=auth(), timeout=60) as c:
            ids: list[str] = []
            started = asyncio.Event()

            async def long(i: int) -> None:
                body = {"model": "tiny", "prompt": [3 + i, 4, 5], "max_tokens": 60,
                        "stream": True, "temperature": 0, "ignore_eos": True}  # fmt: skip
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            if n == 0:
                                ids.append(json.loads(line[6:])["id"])
                            n += 1
                            if n == 5 and len(ids) == 2:
                                started.set()

            tasks = [asyncio.create_task(long(i)) for i in range(2)]
            await asyncio.wait_for(started.wait(), 30)
            short = {"model": "tiny", "prompt": [9, 10, 11, 12], "max_tokens": 2}
            r = await c.post("/v1/completions", json=short)
            await asyncio.gather(*tasks)
            return ids, r.json()["id"]

    long_ids, new_id = asyncio.run(run())
    new = live.record(new_id)
    olds = [live.record(i) for i in long_ids]
    prefill = len(new["prefill_ticks"])  # type: ignore[arg-type]
    # admitted at the next tick, first token when its prefill completes
    assert new["admitted_tick"] == new["arrival_tick"] + 1  # type: ignore[operator]
    assert new["first_token_tick"] <= new["arrival_tick"] + 1 + prefill  # type: ignore[operator]
    for old in olds:  # the long requests were still decoding: nobody waited for them
        assert old["first_token_tick"] < new["arrival_tick"]  # type: ignore[operator]
        assert old["finish_tick"] > new["first_token_tick"]  # type: ignore[operator]


def test_disconnect_mid_stream_frees_slot_and_pages(live: LiveServer) -> None:
    before = live.wait_idle()
    assert before["plow:kv_cache_pages_used"] == 0
    body = {"model": "tiny", "prompt": "A long story", "max_tokens": 200, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with (
        httpx.Client(base_url=live.url, headers=auth(), timeout=30) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        rid = json.loads(first[6:])["id"]
        for _ in range(3):
            next(lines)
        during = live.metrics()
    # the response is closed here: the client went away mid-stream
    after = live.wait_idle()
    assert during["plow:slots_in_use"] == 1 and during["plow:kv_cache_pages_used"] > 0
    assert after["plow:slots_in_use"] == 0 and after["plow:kv_cache_pages_used"] == 0
    assert after[ABORTED] == before[ABORTED] + 1
    rec = live.record(rid)
    assert rec["finish_reason"] == "abort" and rec["completion_tokens"] < 200  # type: ignore[operator]
    assert rec["freed_tick"] is not None


def test_64_streaming_clients_with_random_disconnects(live: LiveServer) -> None:
    before = live.wait_idle()
    rng = random.Random(1234)
    plan = [(rng.randint(3, 10), rng.random() < 0.3, rng.randint(1, 3)) for _ in range(64)]

    async def one(c: httpx.AsyncClient, i: int, n: int, leave: bool, after: int) -> str:
        body = {"model": "tiny", "prompt": [3 + i, 5, 7], "max_tokens": n, "stream": True,
                "temperature": 1.0, "seed": i, "ignore_eos": True}  # fmt: skip
        finish, done, seen = None, False, 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    seen += 1
                    ch = json.loads(line[6:])["choices"][0]
                    finish = ch["finish_reason"] or finish
                    if leave and seen >= after:
                        return "left"
        assert done and finish == "length", (finish, done)
        return "complete"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=live.url, headers=auth(), timeout=60,
                                     limits=limits) as c:  # fmt: skip
            return await asyncio.wait_for(
                asyncio.gather(*(one(c, i, *p) for i, p in enumerate(plan))), 60
            )

    outcomes = asyncio.run(run())
    after = live.wait_idle(timeout=30)
    assert after["plow:slots_in_use"] == 0 and after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0 and after["plow:kv_cache_pages_used"] == 0
    complete = outcomes.count("complete")
    # every client that stayed got its whole answer; some really left mid-stream
    assert all(
        o == "complete" for o, (_, leave, _) in zip(outcomes, plan, strict=True) if not leave
    )
    assert 5 <= outcomes.count("left") <= sum(1 for _, leave, _ in plan if leave)
    ok = sum(after[k] - before[k] for k in (STOPPED, LENGTH))
    aborted = after[ABORTED] - before[ABORTED]
    assert ok + aborted == 64 and ok >= complete  # a client may leave after its last token


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": list(range(3, 303))}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "n": 17}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": "tiny", "prompt": "x", "response_format": {"type": "xml"}}, 400,
         "response_format"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny"}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(
    live: LiveServer, body: dict[str, object], status: int, param: str
) -> None:
    r = httpx.post(f"{live.url}/v1/completions", json=body, headers=auth(), timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert err["message"] and (err["code"] is None or isinstance(err["code"], str))


def test_malformed_json_wrong_key_and_server_keeps_serving(
    live: LiveServer, client: openai.OpenAI
) -> None:
    r = httpx.post(f"{live.url}/v1/completions", content=b'{"model": "tiny", "prompt": ',
                   headers={**auth(), "content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    bad = openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert e.value.status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-5)
    r2 = client.completions.create(model="tiny", prompt="still here", max_tokens=3)
    assert r2.usage.completion_tokens == 3


def test_refusal_is_429_with_retry_after(live: LiveServer) -> None:
    adm = live.server.models["tiny-b"].dispatcher.admission
    assert adm is not None
    old = adm.max_wait_s
    adm.max_wait_s = 0.0  # every positive predicted wait is over the bound
    try:
        r = httpx.post(f"{live.url}/v1/completions", headers=auth(), timeout=30,
                       json={"model": "tiny-b", "prompt": "x", "max_tokens": 2})  # fmt: skip
    finally:
        adm.max_wait_s = old
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    ok = httpx.post(f"{live.url}/v1/completions", headers=auth(), timeout=30,
                    json={"model": "tiny-b", "prompt": "x", "max_tokens": 2})  # fmt: skip
    assert ok.status_code == 200


def test_plow_serve_subprocess(tiny_ckpt: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "plow.cli", "serve", str(tiny_ckpt), "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
           "--served-model-name", "sub", "--seed", "1", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "plow serve did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = c.completions.create(model="sub", prompt="Hi", max_tokens=4)
        assert r.usage.completion_tokens == 4 and r.model == "sub"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_plow_serve_bad_model_dir_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "plow.cli", "serve", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("plow: ")
    assert "Traceback" not in proc.stderr
