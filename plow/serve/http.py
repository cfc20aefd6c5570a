"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): several models, one dispatcher each.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text), and
`GET /debug/requests/{id}` (a request's timeline in dispatcher ticks) and `GET /debug/admission`
(each model's calibrated step times, prefill fit and current M/D/1 prediction), both for tests
and benchmarks and behind the API key like /v1. Errors use the OpenAI body
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from plow.checkpoint import load_checkpoint
from plow.checkpoint.tokenizer import Tokenizer
from plow.errors import PlowError
from plow.runtime.sampler import InvalidSamplingParams, SamplingParams
from plow.serve.admission import AdmissionController, QueueModel, calibrate_step_time
from plow.serve.dispatcher import Dispatcher, GenerationEvent
from plow.serve.dispatcher import Request as GenRequest
from plow.serve.engine import Engine, ReferenceEngine
from plow.serve.metrics import ModelMetrics, render_all
from plow.serve.prefill_cost import PrefillFit, fit_prefill, load_fit, sweep_prefill
from plow.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)

# ------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, self.type, self.param, self.code, self.headers
        )


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# ------------------------------------------------------------------------------------- models


@dataclass
class ServedModel:
    name: str
    root: str
    tokenizer: Tokenizer
    dispatcher: Dispatcher
    max_context: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def engine(self) -> Engine:
        return self.dispatcher.engine


def quick_prefill_fit(engine: Engine, name: str) -> PrefillFit:
    """A small startup sweep when the model directory holds no `prefill_fit.json`."""
    top = min(64, engine.max_context)
    lengths = sorted({1, max(2, top // 8), max(3, top // 2), top})
    return fit_prefill(sweep_prefill(engine, lengths, reps=2), engine=engine.kind, model=name)


def load_served_model(
    path: Path | str,
    *,
    name: str | None = None,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 512,
    max_model_len: int | None = None,
    max_queue_wait_s: float = 60.0,
    prefill_fit: PrefillFit | None = None,
) -> ServedModel:
    """Load a checkpoint, build its engine, calibrate the step time, start nothing yet."""
    directory = Path(path)
    bundle = None
    if (directory / "manifest.json").is_file():  # a bundle: its packet streams on the CPU executor
        from plow.runtime.cpu.bundle import Bundle

        bundle = Bundle.open(directory)
        spec, tok = bundle.spec, bundle.tokenizer
    else:
        ckpt = load_checkpoint(directory)
        spec, tok = ckpt.spec, ckpt.tokenizer
    served = name or directory.name
    if max_model_len is not None and not 1 <= max_model_len <= spec.max_position:
        raise PlowError(
            "--max-model-len", f"must be in 1..{spec.max_position}, got {max_model_len}"
        )
    if max_num_seqs < 1:
        raise PlowError("--max-num-seqs", "must be at least 1")
    if max_num_batched_tokens < max_num_seqs:
        raise PlowError(
            "--max-num-batched-tokens",
            f"must be at least --max-num-seqs ({max_num_seqs}), got {max_num_batched_tokens}",
        )
    engine: Engine
    if bundle is not None:
        from plow.runtime.cpu.engine import CpuEngine

        engine = CpuEngine.from_bundle(bundle, max_batch=max_num_seqs, max_context=max_model_len)
    else:
        engine = ReferenceEngine.from_checkpoint(
            ckpt, max_batch=max_num_seqs, max_context=max_model_len
        )
    fit = prefill_fit or load_fit(directory) or quick_prefill_fit(engine, served)
    step = calibrate_step_time(engine)
    admission = AdmissionController(QueueModel(step, fit, engine.max_batch), max_queue_wait_s)
    dispatcher = Dispatcher(
        served,
        engine,
        tok.decode,
        eos_token_ids=spec.eos_token_ids,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_fit=fit,
        admission=admission,
        metrics=ModelMetrics(served),
    )
    return ServedModel(served, str(directory), tok, dispatcher, engine.max_context, spec.vocab_size)


# ------------------------------------------------------------------------------------- chat


def render_chat(tok: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not tok.chat_template:
        raise ApiError(
            400, "this model has no chat template; use /v1/completions", param="messages"
        )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    try:
        return env.from_string(tok.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok.bos_token or "",
            eos_token=tok.eos_token or "",
        )
    except jinja2.exceptions.TemplateError as e:
        raise ApiError(400, f"chat template: {e}", param="messages") from e


def _message_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for p in content:
        if p.type != "text":
            raise ApiError(400, f"content part type {p.type!r} is not supported", param="messages")
        parts.append(p.text or "")
    return "".join(parts)


# ------------------------------------------------------------------------------------- server


class _ClosingStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (done, client gone,
    cancelled) — even when the body iterator never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class _Job:
    model: ServedModel
    request_id: str
    queue: asyncio.Queue[GenerationEvent]
    prompt_tokens: int

    async def events(self) -> AsyncIterator[GenerationEvent]:
        while True:
            ev = await self.queue.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def abort(self) -> None:
        self.model.dispatcher.abort(self.request_id)


class Server:
    def __init__(
        self,
        models: Sequence[ServedModel],
        *,
        api_key: str | None = None,
        seed: int | None = None,
    ) -> None:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise PlowError("--served-model-name", f"duplicate model names: {names}")
        self.models = {m.name: m for m in models}
        self.api_key = api_key
        self.seed = seed
        self._counter = 0

    # -- request handling ---------------------------------------------------------------

    def _model(self, name: str) -> ServedModel:
        m = self.models.get(name)
        if m is None:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. Available: {', '.join(self.models)}.",
                param="model",
                code="model_not_found",
            )
        return m

    def _params(self, body: SamplingFields) -> SamplingParams:
        seed = body.seed
        if seed is None and self.seed is not None:
            self._counter += 1
            digest = hashlib.sha256(f"{self.seed}:{self._counter}".encode()).digest()
            seed = int.from_bytes(digest[:8], "little")
        top_k = body.top_k if body.top_k is not None else 0
        if top_k == -1:
            top_k = 0
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=top_k,
                top_p=1.0 if body.top_p is None else body.top_p,
                min_p=0.0 if body.min_p is None else body.min_p,
                seed=seed,
            )
        except InvalidSamplingParams as e:
            raise ApiError(400, f"{e.where} {e.problem}", param=e.where) from e

    def _common_checks(self, body: SamplingFields, max_tokens: int | None) -> None:
        if body.n != 1:
            raise ApiError(400, "n other than 1 is not supported", param="n")
        if body.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(
                400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens"
            )

    def _check_prompt(
        self, m: ServedModel, ids: list[int], max_tokens: int | None, default: int | None
    ) -> int:
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        bad = [i for i in ids if not 0 <= i < m.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
        if len(ids) >= m.max_context:
            raise ApiError(
                400,
                f"This model's maximum context length is {m.max_context} tokens; the prompt has "
                f"{len(ids)} tokens (at most {m.max_context - 1} leave room for one new token).",
                param="prompt",
                code="context_length_exceeded",
            )
        room = m.max_context - len(ids)
        if max_tokens is None:
            return room if default is None else min(default, room)
        if max_tokens > room:
            raise ApiError(
                400,
                f"This model's maximum context length is {m.max_context} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def _submit(
        self, m: ServedModel, ids: list[int], body: SamplingFields, max_tokens: int, prefix: str
    ) -> _Job:
        params = self._params(body)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()

        def sink(ev: GenerationEvent) -> None:
            with contextlib.suppress(RuntimeError):  # loop closed at shutdown
                loop.call_soon_threadsafe(queue.put_nowait, ev)

        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop_ids = frozenset() if body.ignore_eos else m.dispatcher.eos_token_ids
        rid = m.dispatcher.new_id(prefix)
        req = GenRequest(rid, ids, params, max_tokens, sink, tuple(stops), stop_ids)
        decision = m.dispatcher.submit(req)
        if not decision.admit:
            raise ApiError(
                429,
                f"server busy: {decision.reason}; retry after {decision.retry_after_s} s",
                type="rate_limit_exceeded",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(decision.retry_after_s)},
            )
        return _Job(m, rid, queue, len(ids))

    async def _collect(self, job: _Job, http_request: Request) -> tuple[str, GenerationEvent]:
        parts: list[str] = []
        it = job.events().__aiter__()
        try:
            while True:
                task = asyncio.ensure_future(it.__anext__())
                while True:
                    done, _ = await asyncio.wait({task}, timeout=0.5)
                    if done:
                        break
                    if await http_request.is_disconnected():
                        task.cancel()
                        job.abort()
                        raise ApiError(400, "client disconnected", code="client_disconnected")
                ev = task.result()
                parts.append(ev.text)
                if ev.finish_reason is not None:
                    if ev.finish_reason == "error":
                        raise ApiError(500, ev.error or "engine error", type="internal_error")
                    return "".join(parts), ev
        finally:
            job.abort()  # no-op when finished

    @staticmethod
    def _usage(ev: GenerationEvent) -> dict[str, int]:
        return {
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        }

    async def completions(self, body: CompletionRequest, http_request: Request) -> Any:
        m = self._model(body.model)
        self._common_checks(body, body.max_tokens)
        if body.echo or (body.best_of not in (None, 1)):
            raise ApiError(400, "echo and best_of are not supported", param="echo")
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ApiError(
                    400, "batched prompts are not supported: send one prompt", param="prompt"
                )
            prompt = prompt[0]
        ids = m.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(x) for x in prompt]
        max_tokens = self._check_prompt(m, ids, body.max_tokens, 16)
        job = self._submit(m, ids, body, max_tokens, "cmpl")
        created = int(time.time())
        base = {
            "id": job.request_id,
            "object": "text_completion",
            "created": created,
            "model": m.name,
        }
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:

            async def gen() -> AsyncIterator[str]:
                async for ev in job.events():
                    if ev.finish_reason == "error":
                        yield _sse({"error": {"message": ev.error, "type": "internal_error",
                                              "param": None, "code": 500}})  # fmt: skip
                        break
                    if ev.text or ev.finish_reason is not None:
                        choice = {"index": 0, "text": ev.text, "logprobs": None,
                                  "finish_reason": ev.finish_reason}  # fmt: skip
                        extra = {"usage": None} if include_usage else {}
                        yield _sse({**base, "choices": [choice], **extra})
                    if ev.finish_reason is not None and include_usage:
                        yield _sse({**base, "choices": [], "usage": self._usage(ev)})
                yield "data: [DONE]\n\n"

            return _ClosingStream(gen(), job.abort)
        text, last = await self._collect(job, http_request)
        return {
            **base,
            "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
            ],
            "usage": self._usage(last),
        }

    async def chat(self, body: ChatCompletionRequest, http_request: Request) -> Any:
        m = self._model(body.model)
        max_req = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        self._common_checks(body, max_req)
        messages = [
            {**msg.model_dump(), "content": _message_text(msg.content)} for msg in body.messages
        ]
        text = render_chat(m.tokenizer, messages, body.add_generation_prompt)
        ids = list(m.tokenizer.inner.encode(text, add_special_tokens=False).ids)
        max_tokens = self._check_prompt(m, ids, max_req, None)
        job = self._submit(m, ids, body, max_tokens, "chatcmpl")
        created = int(time.time())
        base = {"id": job.request_id, "created": created, "model": m.name}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            chunk = {**base, "object": "chat.completion.chunk"}

            async def gen() -> AsyncIterator[str]:
                extra = {"usage": None} if include_usage else {}
                first = {"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}  # fmt: skip
                yield _sse({**chunk, "choices": [first], **extra})
                async for ev in job.events():
                    if ev.finish_reason == "error":
                        yield _sse({"error": {"message": ev.error, "type": "internal_error",
                                              "param": None, "code": 500}})  # fmt: skip
                        break
                    if ev.text or ev.finish_reason is not None:
                        delta = {"content": ev.text} if ev.text else {}
                        choice = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": ev.finish_reason}  # fmt: skip
                        yield _sse({**chunk, "choices": [choice], **extra})
                    if ev.finish_reason is not None and include_usage:
                        yield _sse({**chunk, "choices": [], "usage": self._usage(ev)})
                yield "data: [DONE]\n\n"

            return _ClosingStream(gen(), job.abort)
        out, last = await self._collect(job, http_request)
        return {
            **base,
            "object": "chat.completion",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": out},
                "logprobs": None,
                "finish_reason": last.finish_reason,
            }],
            "usage": self._usage(last),
        }  # fmt: skip

    # -- app ----------------------------------------------------------------------------

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            for m in self.models.values():
                m.dispatcher.start()
            try:
                yield
            finally:
                for m in self.models.values():
                    m.dispatcher.stop()

        app = FastAPI(title="plow", lifespan=lifespan, docs_url=None, redoc_url=None)
        server = self

        @app.middleware("http")
        async def auth(request: Request, call_next: Callable[[Request], Any]) -> Any:
            path = request.url.path
            if server.api_key is not None and (path.startswith("/v1") or path.startswith("/debug")):
                header = request.headers.get("authorization", "")
                if header != f"Bearer {server.api_key}":
                    return error_response(
                        401,
                        "Incorrect API key provided.",
                        "invalid_request_error",
                        code="invalid_api_key",
                    )
            return await call_next(request)

        @app.exception_handler(ApiError)
        async def _api_error(_: Request, e: ApiError) -> JSONResponse:
            return e.response()

        @app.exception_handler(RequestValidationError)
        async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
            errs = e.errors()
            first = errs[0] if errs else {}
            loc = [str(x) for x in first.get("loc", ()) if x != "body"]
            if first.get("type") == "json_invalid":
                msg = f"malformed JSON body: {first.get('msg', '')}"
                return error_response(400, msg, param=None, code="invalid_json")

            def where(er: Any) -> str:
                return ".".join(str(x) for x in er.get("loc", ()) if x != "body") or "body"

            msg = "; ".join(f"{where(er)}: {er.get('msg')}" for er in errs[:3])
            return error_response(400, msg, param=".".join(loc) or None)

        @app.exception_handler(StarletteHTTPException)
        async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            return error_response(e.status_code, str(e.detail), kind, code=e.status_code)

        @app.exception_handler(Exception)
        async def _internal(_: Request, e: Exception) -> JSONResponse:
            return error_response(500, f"internal error: {type(e).__name__}: {e}", "internal_error")

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Any:
            return await server.completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request) -> Any:
            return await server.chat(body, request)

        @app.get("/v1/models")
        async def models() -> ModelList:
            return ModelList(data=[
                ModelCard(id=m.name, created=m.created, root=m.root, max_model_len=m.max_context)
                for m in server.models.values()
            ])  # fmt: skip

        @app.get("/health")
        async def health() -> Any:
            dead = [
                m.name
                for m in server.models.values()
                if m.dispatcher._thread is None or not m.dispatcher._thread.is_alive()
            ]
            if dead:
                return error_response(
                    503, f"dispatcher not running: {', '.join(dead)}", "internal_error"
                )
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            text = render_all([m.dispatcher.metrics for m in server.models.values()])
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/debug/admission")
        async def debug_admission() -> Any:
            out: dict[str, Any] = {}
            now = time.monotonic()
            for m in server.models.values():
                adm = m.dispatcher.admission
                if adm is None:
                    continue
                p = adm.predict(now)
                out[m.name] = {
                    "slots": adm.model.slots,
                    "max_wait_s": adm.max_wait_s,
                    "step": adm.model.step.model_dump(),
                    "prefill_fit": adm.model.prefill.model_dump(exclude={"points"}),
                    "prediction": {**asdict(p), "wait_s": p.wait_s},
                }
            return out

        @app.get("/debug/requests/{request_id}")
        async def debug_request(request_id: str) -> Any:
            for m in server.models.values():
                rec = m.dispatcher.record(request_id)
                if rec is not None:
                    return {"model": m.name, "tick": m.dispatcher.tick, **rec.as_dict()}
            raise ApiError(404, f"no record of request {request_id!r}", param="request_id")

        return app


def run_server(app: FastAPI, host: str, port: int, *, log_level: str = "warning") -> None:
    import sys

    import uvicorn

    # The dispatcher thread and the event loop share the GIL; the default 5 ms switch interval
    # would add up to 5 ms to a decode tick whenever the loop holds the GIL.
    sys.setswitchinterval(5e-4)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
