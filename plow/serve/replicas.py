"""`plow serve MODEL --replicas N`: N plow engines as one Ray Serve deployment behind one
OpenAI-compatible endpoint.

Ray Serve runs the cluster (placement, health checks, replacing a dead replica, the HTTP proxy);
plow adds no cluster manager. Two deployments:

* ``PlowEngine`` (N replicas): each loads the model and runs plow's own HTTP app
  (`plow.serve.http.Server`, the same routes, admission, metrics and errors as `plow serve`)
  in process, called with an ASGI scope instead of a socket (`_asgi`), its response streamed back
  chunk by chunk through a Serve streaming handle.
* ``PlowIngress`` (one replica, the HTTP entry): reads the prompt of each request (the
  completion's ``prompt``, the chat's ``messages``) and calls ``PlowEngine`` through a
  deployment handle whose request router is Ray's `PrefixCacheAffinityRouter`
  (`ray.serve.llm.request_router`): a request whose prompt shares a prefix with earlier ones goes
  to the replica that served them (its prefix tree of what each replica has seen); with no
  useful match, to the replica that holds the least; when the replicas' queues differ by more
  than ``imbalance``, to the shorter of two (Ray's power-of-two choices, least-loaded).
  A replica that dies before a response started is retried on another (``retries`` times);
  a streamed response already under way ends with an error event instead (its tokens cannot be
  taken back).

``/metrics`` is every replica's plow metrics with a ``replica`` label added to each sample, plus
the ingress' own counts: ``plow:replica_requests_total{replica, prefix}`` (requests answered by
each replica, by the first ``PREFIX_CHARS`` characters of their prompt) and
``plow:replica_retries_total``. Each replica pushes its metrics to a small named actor
(`MetricsBoard`) every ``PUSH_S`` seconds and after every request.
"""

import asyncio
import contextlib
import functools
import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

APP_NAME = "plow"
ENGINE = "PlowEngine"
BOARD = "plow-metrics-board"
#: Characters of a prompt that name its prefix in ``plow:replica_requests_total``.
PREFIX_CHARS = 16
PUSH_S = 0.5
#: Paths forwarded to the engine replicas (everything else of plow's API is answered there too).
FORWARDED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@dataclass
class Routed:
    """One HTTP request on its way to an engine replica. ``prompt`` (or, for a chat,
    ``messages``) is what `PrefixCacheAffinityRouter` matches; it never reads the body."""

    method: str
    path: str
    body: bytes
    headers: list[tuple[bytes, bytes]]
    prompt: Any = None
    query: bytes = b""
    meta: dict[str, Any] = field(default_factory=dict)


def prompt_text(path: str, body: bytes) -> str:
    """The text a request is routed on: its prompt, or its messages' contents in order (a body
    that is not JSON routes on its path, and plow's own parser reports the error)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return path
    if not isinstance(obj, dict):
        return path
    if path.endswith("/chat/completions"):
        parts = []
        for m in obj.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                parts += [p.get("text", "") for p in c if isinstance(p, dict)]
        text = "".join(parts)
    else:
        p = obj.get("prompt")
        text = (
            p
            if isinstance(p, str)
            else p[0]
            if isinstance(p, list) and p and isinstance(p[0], str)
            else json.dumps(p)
        )
    return text or path  # an empty text would divide by zero in the router's match rate


def prefix_label(text: str) -> str:
    """A short, label-safe name of a prompt's first characters."""
    return hashlib.sha1(text[:PREFIX_CHARS].encode()).hexdigest()[:10]


# ------------------------------------------------------------------------------ the engines


async def _asgi(app: Any, req: Routed) -> AsyncIterator[dict[str, Any]]:
    """Call the ASGI ``app`` with ``req``; yield its ``http.response.*`` messages as they come.
    Closing the iterator disconnects the client (plow then aborts the request)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "query_string": req.query,
        "root_path": "",
        "headers": req.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        await queue.put(msg)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await queue.put(None)

    task = asyncio.create_task(run())
    try:
        while (msg := await queue.get()) is not None:
            yield msg
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                break
        await task
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()


class EngineReplica:
    """One plow engine and its HTTP app, inside a Ray Serve replica."""

    def __init__(self, model: str, load: dict[str, Any], server: dict[str, Any]) -> None:
        from plow.serve.http import Server, load_served_model

        self._stop = threading.Event()  # first: __del__ runs after a failed __init__ too

        try:
            from ray import serve

            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (a unit test calling the class directly)
            self.replica = "local"
        self.served = load_served_model(Path(model), **load)
        self.server = Server([self.served], **server)
        self.app = self.server.app()  # its lifespan is not run: the loop is started here
        self.served.client.start()
        self._board: Any = None
        self._pusher = threading.Thread(target=self._push_loop, daemon=True)
        self._pusher.start()

    def _metrics_text(self) -> str:
        from plow.serve.metrics import render_all

        return render_all([self.served.client.metrics]).decode()

    def _push(self) -> None:
        import ray

        try:
            if self._board is None:
                self._board = ray.get_actor(BOARD, namespace=APP_NAME)
            self._board.put.remote(self.replica, self._metrics_text())
        except Exception:  # the board is not up yet (or gone at shutdown): push later
            self._board = None

    def _push_loop(self) -> None:
        while not self._stop.wait(PUSH_S):
            self._push()

    async def __call__(self, req: Routed) -> AsyncIterator[dict[str, Any]]:
        yield {"type": "replica", "replica": self.replica}
        try:
            async for msg in _asgi(self.app, req):
                yield msg
        finally:
            self._push()

    def check_health(self) -> None:
        if not self.served.client.alive:
            raise RuntimeError(f"{self.served.name}: dispatcher not running")

    def __del__(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):  # `served` is missing if __init__ failed
            self.served.client.stop()


class MetricsBoard:
    """The latest metrics text of every replica (a Ray actor, named ``BOARD``)."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.time(), text)

    def get(self) -> dict[str, tuple[float, str]]:
        return dict(self.texts)


def relabel(text: str, replica: str, seen: set[str]) -> list[str]:
    """Prometheus text lines with ``replica="..."`` added to every sample (``# HELP`` and
    ``# TYPE`` lines once per metric, tracked in ``seen``)."""
    out: list[str] = []
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("#"):
            if line not in seen:
                seen.add(line)
                out.append(line)
            continue
        key, _, val = line.rpartition(" ")
        name, brace, rest = key.partition("{")
        labels = rest[:-1] if brace else ""
        lab = f'replica="{replica}"' + ("," + labels if labels else "")
        out.append(f"{name}{{{lab}}} {val}")
    return out


# ------------------------------------------------------------------------------ the ingress

ingress_app = FastAPI(title="plow replicas", docs_url=None, redoc_url=None)


class Ingress:
    """The one HTTP entry: routes each request to an engine replica (Ray's prefix-affinity
    router), retries one whose replica died before answering, and merges the metrics."""

    def __init__(self, engine: Any, retries: int = 3) -> None:
        import ray

        self.engine = engine
        self.retries = retries
        self.counts: Counter[tuple[str, str]] = Counter()
        self.retried = 0
        self.failed = 0
        self.inflight: Counter[str] = Counter()
        self.board: Any = (
            ray.remote(MetricsBoard)
            .options(name=BOARD, namespace=APP_NAME, get_if_exists=True, num_cpus=0)
            .remote()
        )

    async def _send(self, req: Routed) -> tuple[str, dict[str, Any], Any, bool]:
        """Send ``req`` to a replica: (the replica, the response start, the body or the rest of
        the stream, whether it streams). A replica that dies before a non-streamed response is
        complete, or before a streamed one started, is retried on another."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        for attempt in range(self.retries + 1):
            gen = self.engine.options(stream=True).remote(req)
            replica: str | None = None
            streams = False
            try:
                first = await gen.__anext__()
                replica = first["replica"]
                self.inflight[replica] += 1
                start = await gen.__anext__()
                heads = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
                streams = heads.get("content-type", "").startswith("text/event-stream")
                if streams:
                    return replica, start, gen, True
                body = b"".join([msg.get("body", b"") async for msg in gen])
                return replica, start, body, False
            except (ActorDiedError, ActorUnavailableError, RayActorError):
                if attempt == self.retries:
                    self.failed += 1
                    raise
                self.retried += 1
                await asyncio.sleep(0.05 * (attempt + 1))
            finally:
                if replica is not None and not streams:
                    self.inflight[replica] -= 1
        raise AssertionError("unreachable")

    async def forward(self, request: Request) -> Response:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        body = await request.body()
        path = request.url.path
        text = prompt_text(path, body) if path in FORWARDED[:2] else path
        req = Routed(
            request.method, path, body, list(request.headers.raw), text, request.url.query.encode()
        )
        try:
            replica, start, rest, streams = await self._send(req)
        except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
            return JSONResponse(
                {"error": {"message": f"no replica answered: {e}", "type": "service_unavailable"}},
                status_code=503,
            )
        if path in FORWARDED[:2]:
            self.counts[(replica, prefix_label(text))] += 1
        headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
        headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
        headers["x-plow-replica"] = replica
        status = start["status"]
        if not streams:
            return Response(rest, status_code=status, headers=headers)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for msg in rest:
                    if msg.get("body"):
                        yield msg["body"]
            except (ActorDiedError, ActorUnavailableError, RayActorError):
                err = {"message": f"replica {replica} died mid-stream", "type": "unavailable"}
                yield f"data: {json.dumps({'error': err})}\n\n".encode()
            finally:
                self.inflight[replica] -= 1

        return StreamingResponse(chunks(), status_code=status, headers=headers)

    async def metrics_text(self) -> str:
        texts: dict[str, tuple[float, str]] = await self.board.get.remote()
        seen: set[str] = set()
        lines: list[str] = []
        for replica in sorted(texts):
            lines += relabel(texts[replica][1], replica, seen)
        lines.append(
            "# HELP plow:replica_requests_total Requests answered, by replica and "
            "prompt prefix (a hash of its first characters)."
        )
        lines.append("# TYPE plow:replica_requests_total counter")
        for (replica, prefix), n in sorted(self.counts.items()):
            lines.append(
                f'plow:replica_requests_total{{replica="{replica}",prefix="{prefix}"}} {n}'
            )
        lines.append(
            "# HELP plow:replica_retries_total Requests sent again after their "
            "replica died before answering."
        )
        lines.append("# TYPE plow:replica_retries_total counter")
        lines.append(f"plow:replica_retries_total {self.retried}")
        lines.append("# HELP plow:replica_in_flight Requests a replica has taken and not answered.")
        lines.append("# TYPE plow:replica_in_flight gauge")
        for replica, n in sorted(self.inflight.items()):
            lines.append(f'plow:replica_in_flight{{replica="{replica}"}} {n}')
        lines.append("# HELP plow:replica_failed_total Requests no replica answered (503).")
        lines.append("# TYPE plow:replica_failed_total counter")
        lines.append(f"plow:replica_failed_total {self.failed}")
        return "\n".join(lines) + "\n"


@functools.cache
def _ingress_class() -> Any:
    from ray import serve

    @serve.deployment(name="PlowIngress", ray_actor_options={"num_cpus": 0})
    @serve.ingress(ingress_app)
    class PlowIngress(Ingress):
        @ingress_app.get("/metrics")
        async def metrics(self) -> Response:
            return Response(await self.metrics_text(), media_type="text/plain; version=0.0.4")

        @ingress_app.api_route("/{path:path}", methods=["GET", "POST"])
        async def any_path(self, request: Request) -> Response:
            return await self.forward(request)

    return PlowIngress


def build_app(
    model: str | Path,
    replicas: int,
    load: dict[str, Any],
    server: dict[str, Any] | None = None,
    *,
    imbalance: float | None = None,
    retries: int = 3,
    replica_cpus: float = 1.0,
    max_ongoing_requests: int | None = None,
    router: str = "prefix",
) -> Any:
    """The Serve application: ``replicas`` engines of ``model`` (``load``: the keyword arguments
    of `load_served_model`; ``server``: those of `Server`) behind the ingress. ``router``:
    ``prefix`` (Ray's prefix-affinity router) or ``pow2`` (Ray's default, prefix-blind power of
    two choices: what the benchmark compares against)."""
    from ray import serve

    # Ray's public name, ray.serve.llm.request_router, imports all of ray.serve.llm (ray[llm]:
    # vllm, pyarrow); the router itself lives here and needs only ray[serve]
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )
    from ray.serve.config import RequestRouterConfig

    from plow.bundle.manifest import read_manifest
    from plow.bundle.open import check_bundle, is_bundle
    from plow.runtime.cpu.bundle import diagnose

    if is_bundle(Path(model)):  # refused here in one line, not in every replica's log
        check_bundle(Path(model), read_manifest(Path(model)), diagnose=diagnose)
    slots = int(load.get("max_num_seqs", 8))
    if router not in ("prefix", "pow2"):
        raise ValueError(f"router must be prefix or pow2, not {router!r}")
    config: Any = {"request_routing_stats_period_s": 1}
    if router == "prefix":
        config["request_router_class"] = PrefixCacheAffinityRouter
        # queues differing by more than a full batch (the slots): balance load, not prefixes
        limit = float(slots) if imbalance is None else imbalance
        config["request_router_kwargs"] = {"imbalanced_threshold": limit}
    deployment: Any = serve.deployment(
        EngineReplica,
        name=ENGINE,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus},
        max_ongoing_requests=max_ongoing_requests or 4 * slots,
        health_check_period_s=2,
        graceful_shutdown_timeout_s=5,
        request_router_config=RequestRouterConfig(**config),
    )
    engine = deployment.bind(str(model), load, server or {})
    # the ingress holds every request the engines may hold, and room beyond for /metrics and
    # health probes: Serve's default cap (5) would queue the whole service behind five requests
    per_engine = max_ongoing_requests or 4 * slots
    ingress = _ingress_class().options(max_ongoing_requests=replicas * per_engine + 16)
    return ingress.bind(engine, retries)


def serve_replicas(
    app: Any, host: str, port: int, address: str | None = None, blocking: bool = True
) -> Any:
    """Start (or join, ``address``) a Ray cluster, start Serve's HTTP proxy on ``host:port`` and
    run ``app`` (blocking until interrupted unless ``blocking`` is False)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address, namespace=APP_NAME, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    if not blocking:
        return serve.run(app, name=APP_NAME, route_prefix="/")
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:  # Ctrl-C: stop the replicas, not only this process
        pass
    finally:
        serve.shutdown()
    return None
