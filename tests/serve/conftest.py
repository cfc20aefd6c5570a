"""Fixtures: one tiny Llama checkpoint per session, and a live server on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from plow.serve.http import Server, load_served_model
from plow.serve.metrics import parse_metrics
from plow.testing import make_tiny_checkpoint

API_KEY = "sk-plow-test"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", 0, tmp_path_factory.mktemp("serve") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_bundle_dir(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_ckpt` compiled for the cpu target: decode rungs 1, 2, 4, 8, a 16-row prefill
    rung, context 64 (verified)."""
    from plow.emit.bundle import compile_bundle
    from plow.profile import CompileProfile
    from plow.target import load_target

    out = tmp_path_factory.mktemp("serve-bundle") / "tiny-llama-bundle"
    profile = CompileProfile(
        name="serve-tests", decode_batches=(1, 2, 4, 8), prefill_seqs=(16,), context=64
    )
    compile_bundle(tiny_ckpt, out, load_target("cpu"), profile, verify=True)
    return out


@pytest.fixture(scope="session")
def tiny_ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("qwen3", 1, tmp_path_factory.mktemp("serve") / "tiny-qwen")


def model_samples(text: str, model: str) -> dict[str, float]:
    label = f'model_name="{model}"'
    out: dict[str, float] = {}
    for key, v in parse_metrics(text).items():
        name, _, rest = key.partition("{")
        labels = [x for x in rest.rstrip("}").split(",") if x]
        if label not in labels:
            continue
        others = [x for x in labels if x != label]
        out[name + ("{" + ",".join(others) + "}" if others else "")] = v
    return out


@dataclass
class LiveServer:
    url: str
    server: Server
    uv: uvicorn.Server
    thread: threading.Thread

    def metrics(self, model: str = "tiny") -> dict[str, float]:
        """One model's samples: `name` for a series labelled only by the model, otherwise
        `name{other="labels"}` (e.g. `vllm:request_success_total{finished_reason="abort"}`)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return model_samples(text, model)

    def record(self, request_id: str) -> dict[str, object]:
        r = httpx.get(
            f"{self.url}/debug/requests/{request_id}",
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=10,
        )
        r.raise_for_status()
        out: dict[str, object] = r.json()
        return out

    def wait_idle(self, model: str = "tiny", timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until no slot is bound and nothing runs or waits (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics(model)
            busy = (
                m["plow:slots_in_use"] + m["vllm:num_requests_running"]
                + m["vllm:num_requests_waiting"]
            )  # fmt: skip
            if busy == 0 or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def start_server(server: Server) -> LiveServer:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=1)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", server, uv, thread)


def stop_server(live: LiveServer) -> None:
    live.uv.should_exit = True
    live.thread.join(timeout=10)


@pytest.fixture(scope="session")
def live(tiny_ckpt: Path, tiny_ckpt_b: Path) -> Iterator[LiveServer]:
    models = [
        load_served_model(tiny_ckpt, name="tiny", max_num_seqs=4, max_num_batched_tokens=64),
        load_served_model(tiny_ckpt_b, name="tiny-b", max_num_seqs=2, max_num_batched_tokens=32),
    ]
    srv = start_server(Server(models, api_key=API_KEY, seed=0))
    yield srv
    stop_server(srv)
