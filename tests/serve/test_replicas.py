"""`plow serve --replicas`: two plow engines as a Ray Serve deployment behind one endpoint.

Requests sharing a prompt prefix stay on one replica (Ray's prefix-affinity router), every
request completes, the metrics carry a replica label, and killing a replica mid-run loses no
accepted request (the ingress retries it on the other)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from plow.serve.metrics import parse_metrics

A = "The quick brown fox jumps over the lazy dog, and then"
B = "Lorem ipsum dolor sit amet, consectetur adipiscing elit"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _complete(url: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _per_replica(url: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for key, v in parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text).items():
        if key.startswith("plow:replica_requests_total{"):
            labels = dict(x.split("=", 1) for x in key[key.index("{") + 1 : -1].split(","))
            out[(labels["replica"].strip('"'), labels["prefix"].strip('"'))] = v
    return out


def test_prompt_text_routes_on_prompt_or_messages() -> None:
    from plow.serve.replicas import prompt_text

    c = "/v1/completions"
    assert prompt_text(c, json.dumps({"prompt": "abc"}).encode()) == "abc"
    assert prompt_text(c, json.dumps({"prompt": ["xy", "z"]}).encode()) == "xy"
    chat = json.dumps(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ]
        }
    )
    assert prompt_text("/v1/chat/completions", chat.encode()) == "be briefhi"
    # not JSON, or nothing to route on: the path (never an empty text)
    assert prompt_text(c, b"{nope") == c
    assert prompt_text(c, json.dumps({"prompt": ""}).encode()) == c


def test_relabel_adds_the_replica_and_keeps_help_once() -> None:
    from plow.serve.replicas import relabel

    text = '# HELP x_total things\n# TYPE x_total counter\nx_total{model_name="m"} 3.0\ny 1.0\n'
    seen: set[str] = set()
    a = relabel(text, "r1", seen)
    b = relabel(text, "r2", seen)
    assert a == [
        "# HELP x_total things",
        "# TYPE x_total counter",
        'x_total{replica="r1",model_name="m"} 3.0',
        'y{replica="r1"} 1.0',
    ]
    assert b == ['x_total{replica="r2",model_name="m"} 3.0', 'y{replica="r2"} 1.0']
    merged = parse_metrics("\n".join(a + b))
    assert merged['x_total{replica="r2",model_name="m"}'] == 3.0


def test_asgi_call_streams_and_disconnects() -> None:
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from plow.serve.replicas import Routed, _asgi

    app = FastAPI()
    closed: list[bool] = []

    @app.post("/echo")
    async def echo(body: dict[str, int]) -> dict[str, int]:
        return {"n": body["n"] + 1}

    @app.get("/count")
    async def count() -> StreamingResponse:
        async def gen():  # type: ignore[no-untyped-def]
            try:
                for i in range(1000):
                    yield f"{i}\n"
                    await asyncio.sleep(0.001)
            finally:
                closed.append(True)

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def main() -> tuple[list[dict[str, object]], list[bytes]]:
        hdr = [(b"content-type", b"application/json")]
        msgs = [m async for m in _asgi(app, Routed("POST", "/echo", b'{"n": 41}', hdr))]
        got: list[bytes] = []
        stream = _asgi(app, Routed("GET", "/count", b"", []))
        async for m in stream:
            if m.get("body"):
                got.append(m["body"])  # type: ignore[arg-type]
            if len(got) == 3:
                break
        await stream.aclose()  # the client goes away: the app's generator is closed
        return msgs, got

    msgs, got = asyncio.run(main())
    assert msgs[0]["type"] == "http.response.start" and msgs[0]["status"] == 200
    assert json.loads(b"".join(m.get("body", b"") for m in msgs[1:])) == {"n": 42}  # type: ignore[arg-type]
    assert got == [b"0\n", b"1\n", b"2\n"] and closed == [True]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_replicas_prefix_affinity_and_a_killed_replica(tiny_bundle_dir: Path) -> None:
    ray = pytest.importorskip("ray")
    from ray import serve

    from plow.serve import replicas as rp

    t0 = time.monotonic()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=rp.APP_NAME)
    try:
        port = _port()
        load = {"name": "tiny", "max_num_seqs": 4, "max_num_batched_tokens": 64, "executor": "cpu"}
        rp.serve_replicas(rp.build_app(tiny_bundle_dir, 2, load), "127.0.0.1", port, blocking=False)
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic() - t0

        # 1. two prefixes, alternating: each stays on one replica, and the two differ
        seen: dict[str, set[str]] = {A: set(), B: set()}
        for i in range(5):
            for p in (A, B):
                r = _complete(url, f"{p} {i}")
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["finish_reason"] == "length"
                seen[p].add(r.headers["x-plow-replica"])
        assert len(seen[A]) == 1 and len(seen[B]) == 1 and seen[A] != seen[B], seen
        (ra,), (rb,) = seen[A], seen[B]
        # the same, read through the metrics: per replica and prefix, 5 requests each
        counts = _per_replica(url)
        assert sorted(counts.values()) == [5.0, 5.0]
        assert {r for r, _ in counts} == {ra, rb}
        # each replica's own engine metrics, labelled by replica: 5 requests finished on each
        deadline = time.monotonic() + 10
        while True:
            m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
            done = {
                r: sum(
                    v
                    for k, v in m.items()
                    if k.startswith("vllm:request_success_total") and f'replica="{r}"' in k
                )
                for r in (ra, rb)
            }
            if done == {ra: 5.0, rb: 5.0} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert done == {ra: 5.0, rb: 5.0}

        # 2. kill A's replica while A's requests run on it: none is lost
        results: list[httpx.Response | BaseException] = []
        lock = threading.Lock()

        def send(p: str) -> None:
            try:
                r = _complete(url, p, max_tokens=24 if p.startswith(A) else 12)
            except BaseException as e:  # noqa: BLE001 - recorded, asserted below
                r = e  # type: ignore[assignment]
            with lock:
                results.append(r)

        # many more than the replica runs at once (max_num_seqs 4), so that it still holds
        # taken, unanswered requests when the kill lands even on a slow, loaded machine
        n_a = 24
        threads = [threading.Thread(target=send, args=(f"{A} again {i}",)) for i in range(n_a)]
        threads += [threading.Thread(target=send, args=(f"{B} again {i}",)) for i in range(2)]
        for t in threads:
            t.start()
        # kill it once it has taken some of them (the ingress' in-flight count says so)
        deadline = time.monotonic() + 20
        while True:
            m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
            if m.get(f'plow:replica_in_flight{{replica="{ra}"}}', 0) >= 2:
                break
            assert time.monotonic() < deadline, f"replica {ra} never held two requests: {m}"
            time.sleep(0.02)
        victim = ray.get_actor(f"SERVE_REPLICA::{rp.APP_NAME}#{rp.ENGINE}#{ra}", namespace="serve")
        ray.kill(victim, no_restart=True)
        for t in threads:
            t.join(timeout=60)
        assert len(results) == n_a + 2
        bad = [r for r in results if not isinstance(r, httpx.Response) or r.status_code != 200]
        assert not bad, [r.text if isinstance(r, httpx.Response) else r for r in bad]
        ok = [r for r in results if isinstance(r, httpx.Response)]
        assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in ok)
        m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
        retried = m["plow:replica_retries_total"]
        answered_by_a = sum(1 for r in ok if r.headers["x-plow-replica"] == ra)
        # the kill came while A's requests were on their way to (or running on) its replica:
        # some were sent again, and every one of them was answered by the survivor
        assert retried >= 1 and answered_by_a < n_a, (retried, answered_by_a)
        assert m["plow:replica_failed_total"] == 0
        print(
            f"replicas: started in {started:.1f} s, {retried:g} retried, "
            f"{answered_by_a} answered by the killed replica before it died"
        )
    finally:
        serve.shutdown()
        ray.shutdown()
    assert time.monotonic() - t0 < 150


def test_replicas_flag_errors_are_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from plow.cli import app

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    res = CliRunner().invoke(app, ["serve", str(a), str(b), "--replicas", "2"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == ["plow: --replicas: serves one model, got 2"]
    res = CliRunner().invoke(app, ["serve", str(tmp_path / "nope"), "--replicas", "2"])
    assert res.exit_code == 2 and "not a checkpoint directory" in res.output
    res = CliRunner().invoke(app, ["serve", str(a), "--replicas", "0"])
    assert res.exit_code == 2 and "--replicas" in res.output


def test_an_unverified_bundle_is_refused_before_any_replica_starts(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    """Each replica would refuse it in its own log while Serve reports only "Deploying
    application plow failed": the driver refuses it first, in one line naming the file."""
    import shutil

    from typer.testing import CliRunner

    from plow.cli import app

    b = tmp_path / "unverified"
    shutil.copytree(tiny_bundle_dir, b)
    (b / "certificates" / "D.json").unlink()
    res = CliRunner().invoke(app, ["serve", str(b), "--replicas", "2"])
    assert res.exit_code == 1  # a refused bundle, as without --replicas
    (line,) = res.output.strip().splitlines()
    assert "certificates/D.json" in line and "missing" in line
    assert "--no-verify" not in line and "verified bundles only" in line
