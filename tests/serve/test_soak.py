"""Soak (slow tier): 256 concurrent streams with random disconnects, then a 1,000-request
burst, against a tiny bundle on the native executor behind the real HTTP server. Bounded in
time; ends with zero leaked slots, key-value pages or per-request state. The queue-wait bound
is set out of the way (3,600 s): the client's coroutines share the server's GIL here, so served
ticks are slow and admission would rightly refuse part of the load; what this soaks is
clean-up, and admission has its own tests (`test_admission.py`)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from plow.runtime.executors import EXECUTORS
from plow.serve.http import Server, load_served_model
from tests.serve.conftest import API_KEY, LiveServer, start_server, stop_server

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ABORTED = 'vllm:request_success_total{finished_reason="abort"}'
LENGTH = 'vllm:request_success_total{finished_reason="length"}'


@pytest.fixture(scope="module")
def soak(tiny_bundle_dir: Path) -> Iterator[LiveServer]:
    reason = EXECUTORS["native"].unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    out = tiny_bundle_dir
    m = load_served_model(out, name="tiny", max_num_seqs=8, max_num_batched_tokens=64,
                          max_queue_wait_s=3600.0, executor="native")  # fmt: skip
    live = start_server(Server([m], api_key=API_KEY, seed=0))
    yield live
    stop_server(live)


def assert_nothing_leaked(live: LiveServer) -> None:
    after = live.wait_idle(timeout=30)
    for k in ("plow:slots_in_use", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "plow:kv_cache_pages_used"):  # fmt: skip
        assert after[k] == 0, k
    (m,) = live.server.models.values()
    d = m.dispatcher
    assert not d._active and not d._waiting and not d._by_id  # no request state left
    assert sorted(d._free) == list(range(8))
    assert m.engine.kv_usage().pages_used == 0


def test_256_streams_with_disconnects_leak_nothing(soak: LiveServer) -> None:
    before = soak.metrics()
    rng = random.Random(19)
    plan = [(rng.randint(4, 12), rng.random() < 0.3, rng.randint(1, 3)) for _ in range(256)]

    async def one(c: httpx.AsyncClient, i: int, n: int, leave: bool, after: int) -> str:
        body = {"model": "tiny", "prompt": [3 + i % 200, 5, 7, 9], "max_tokens": n,
                "stream": True, "temperature": 1.0, "seed": i, "ignore_eos": True}  # fmt: skip
        finish, done, seen = None, False, 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    seen += 1
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                    if leave and seen >= after:
                        return "left"
        assert done and finish == "length", (finish, done)
        return "complete"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(base_url=soak.url, headers=HEADERS, timeout=120,
                                     limits=limits) as c:  # fmt: skip
            return await asyncio.wait_for(
                asyncio.gather(*(one(c, i, *p) for i, p in enumerate(plan))), 120
            )

    t0 = time.monotonic()
    outcomes = asyncio.run(run())
    assert time.monotonic() - t0 < 120
    assert_nothing_leaked(soak)
    after = soak.metrics()
    assert all(o == "complete" for o, (_, leave, _) in zip(outcomes, plan, strict=True)
               if not leave)  # fmt: skip
    assert outcomes.count("left") >= 30
    ended = sum(after[k] - before.get(k, 0.0) for k in (LENGTH, ABORTED))
    assert ended == 256  # every stream ended once, finished or aborted


async def raw_post(url: str, path: str, body: dict[str, object]) -> tuple[int, str, str]:
    """One HTTP/1.1 POST on its own connection: (status, headers, body). A bare asyncio client,
    since httpx's connection pool costs O(connections) per request and a 1,000-connection
    burst would measure the client instead of the server."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n".encode() + data
    )
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.decode().partition("\r\n\r\n")
    status = int(head.split(" ", 2)[1])
    return status, head, payload


def test_a_1000_request_burst_ends_in_answers_or_429s_and_leaks_nothing(
    soak: LiveServer,
) -> None:
    async def one(i: int) -> int:
        body = {"model": "tiny", "prompt": [7 + i % 200, 11], "max_tokens": 2,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        status, head, payload = await raw_post(soak.url, "/v1/completions", body)
        if status == 200:
            assert json.loads(payload)["usage"]["completion_tokens"] == 2
        else:
            assert status == 429 and "retry-after" in head.lower(), payload
        return status

    async def run() -> list[int]:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(1000))), 120)

    t0 = time.monotonic()
    codes = asyncio.run(run())
    assert time.monotonic() - t0 < 120
    assert len(codes) == 1000 and codes.count(200) >= 100
    assert_nothing_leaked(soak)
