"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): several models, one dispatcher each.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
server-sent events), `GET /v1/models`, `GET /v1/models/{id}`, `POST /tokenize`,
`POST /detokenize` (vLLM's), `GET /health`, `GET /metrics` (Prometheus, through
`prometheus_client`), and `GET /debug/requests/{id}` (a request's timeline in dispatcher ticks)
and `GET /debug/admission` (each model's calibrated and measured step times, prefill fit and
current predictions), both for tests and benchmarks and behind the API key like /v1. Errors
use the OpenAI body `{"error": {"message", "type", "param", "code"}}` with `code` a string or
null.

What keeps one client from hurting the others:

- the body is read by an ASGI gate before any route sees it, counting bytes as they arrive:
  past `max_request_bytes` (default 8 MiB) the rest is drained without being kept and the
  answer is 413, so a 50 MB upload costs no memory;
- JSON parsing is strict (pydantic strict mode: `"10"` is not an integer, `"yes"` not a bool)
  and every string must be valid Unicode;
- a prompt that cannot fit the context is refused before tokenising when its character count
  alone proves it (a token covers at most `max_token_chars` characters for tokenizers that
  never drop input), and tokenisation (and chat-template rendering) runs in a worker thread
  through `encode_batch`, which releases the GIL, so `/health` and the running streams keep
  being served while a large prompt is tokenised;
- each request watches its connection for the whole of its life (non-streaming included):
  a client that goes away is aborted at once and its slot is freed on the dispatcher's next
  tick;
- a response starts only when the request's first event arrives (its first token, or its
  refusal at the queue-wait bound), so a refusal is a real 429 even for `stream: true`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plow.checkpoint import Checkpoint, load_checkpoint
from plow.checkpoint.tokenizer import Tokenizer
from plow.errors import PlowError
from plow.runtime.sampler import InvalidSamplingParams, SamplingParams
from plow.serve.admission import AdmissionController, QueueModel, calibrate_step_time
from plow.serve.client import EngineClient
from plow.serve.dispatcher import Dispatcher, GenerationEvent
from plow.serve.dispatcher import Request as GenRequest
from plow.serve.engine import Engine
from plow.serve.grammar import (
    Grammar,
    GrammarCompiler,
    GrammarError,
    constraint_of,
    structured_constraint,
)
from plow.serve.metrics import CONTENT_TYPE_LATEST, ModelMetrics, render_all
from plow.serve.prefill_cost import PrefillFit, fit_prefill, load_fit, sweep_prefill
from plow.serve.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
)
from plow.serve.sampling import MAX_TOP_LOGPROBS, Penalties, TokenLogprob
from plow.serve.warm import Prepared, prepare_rungs

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# After the limit, up to this many more bytes are read and dropped so that the client, still
# uploading, reads the 413 instead of a connection reset; past it the connection is closed.
DRAIN_BYTES = 64 << 20

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
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


_STATUS_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}

# ------------------------------------------------------------------------------------- models

# pre-tokenizers and normalizers that never drop input characters (so every character of the
# text is covered by some token); anything else disables the character-count pre-check
_KEEPING_PRE = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
_KEEPING_NORM = {"Prepend", "Replace", "NFD", "NFKD", "Lowercase"}


def _keeps_characters(component: Any, allowed: set[str]) -> bool:
    if component is None:
        return True
    try:
        spec = json.loads(component.__getstate__())
    except Exception:
        return False

    def ok(s: dict[str, Any]) -> bool:
        kind = s.get("type")
        if kind == "Sequence":
            parts = s.get("pretokenizers", s.get("normalizers", []))
            return all(ok(p) for p in parts)
        if kind not in allowed or s.get("behavior") == "Removed":
            return False
        if kind == "Replace":
            pattern = s.get("pattern", {})
            return "String" in pattern and len(s.get("content", "")) >= len(pattern["String"])
        return True

    return ok(spec)


def max_token_chars(tok: Tokenizer) -> int | None:
    """The most input characters one token can cover, when that bounds the token count of a
    text from below (`tokens >= ceil(chars / max_token_chars)`); None when it does not (a
    normalizer or pre-tokenizer that may drop characters, a model that drops unknown ones).

    A token's string in the vocabulary is at least as many UTF-8 bytes as the characters it
    stands for: byte-level tokens spell each byte as one (1-2 byte) character, SentencePiece
    tokens spell their characters (a space as the 3-byte `▁`), byte-fallback tokens `<0x..>`
    one byte in six, added tokens themselves."""
    try:
        return _max_token_chars(tok)
    except Exception:  # a tokenizer this code does not know: no pre-check, never a failure
        return None


def _max_token_chars(tok: Tokenizer) -> int | None:
    inner = tok.inner
    if not _keeps_characters(inner.normalizer, _KEEPING_NORM):
        return None
    if not _keeps_characters(inner.pre_tokenizer, _KEEPING_PRE):
        return None
    model = inner.model
    kind = type(model).__name__
    if kind == "BPE":
        byte_level = b'"ByteLevel"' in (
            inner.pre_tokenizer.__getstate__() if inner.pre_tokenizer is not None else b""
        )
        if not (byte_level or model.byte_fallback or model.unk_token is not None):
            return None  # an unknown character would be dropped
    elif kind not in ("WordPiece", "Unigram"):
        return None
    vocab = inner.get_vocab(with_added_tokens=True)
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1


@dataclass
class ServedModel:
    name: str
    root: str
    tokenizer: Tokenizer
    dispatcher: Dispatcher
    max_context: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))
    token_chars: int | None = None  # max_token_chars(tokenizer), set by load_served_model
    eos_token_ids: tuple[int, ...] = ()
    _grammars: GrammarCompiler | None = None
    _pieces: dict[int, str] = field(default_factory=dict)

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def piece(self, token: int) -> str:
        """A token's text alone (the logprobs' `token`), as the tokenizer decodes it."""
        s = self._pieces.get(token)
        if s is None:
            s = self._pieces[token] = self.tokenizer.decode([token])
        return s

    def chat_logprobs(self, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat's `logprobs.content`: per token its text (decoded alone), logprob, bytes (the
        token's own bytes, so a multi-byte character split over tokens can be rebuilt), and
        the top alternatives in the same shape."""

        def entry(tok: int, lp: float) -> dict[str, Any]:
            t = self.piece(tok)
            raw = self.grammars.token_bytes(tok)
            return {"token": t, "logprob": lp,
                    "bytes": list(t.encode("utf-8") if raw is None else raw)}  # fmt: skip

        return [
            {**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
            for x in lps
        ]

    def completion_logprobs(self, lps: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        """Completions' `logprobs`: tokens, token_logprobs, top_logprobs (token text ->
        logprob), text_offset (characters into the completion)."""
        tokens = [self.piece(x.token) for x in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [self._top_dict(x.top) for x in lps],
            "text_offset": offsets,
        }

    def _top_dict(self, top: Sequence[tuple[int, float]]) -> dict[str, float]:
        """Completions' `top_logprobs` entry: token text -> logprob; tokens that decode to the
        same text (byte pieces of one character) keep the likeliest one's value."""
        out: dict[str, float] = {}
        for t, v in top:
            out.setdefault(self.piece(t), v)
        return out

    def echo_logprobs(
        self, ids: Sequence[int], plps: Sequence[TokenLogprob], k: int
    ) -> dict[str, Any]:
        """Completions' `logprobs` of an echoed prompt (OpenAI's): one entry per prompt token,
        the first `None` (nothing precedes it), `text_offset` from 0."""
        tokens = [self.piece(t) for t in ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        top: list[dict[str, float] | None] = [None]
        top += [self._top_dict(x.top) for x in plps]
        return {
            "tokens": tokens,
            "token_logprobs": [None] + [x.logprob for x in plps],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def vllm_prompt_logprobs(
        self, ids: Sequence[int], plps: Sequence[TokenLogprob]
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token `None` (the first) or {token id: {logprob,
        rank, decoded_token}} holding the prompt token and the top alternatives (rank 1..k)."""
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for x in plps:
            d = {
                str(t): {"logprob": v, "rank": r, "decoded_token": self.piece(t)}
                for r, (t, v) in enumerate(x.top, 1)
            }
            d.setdefault(
                str(x.token),
                {"logprob": x.logprob, "rank": x.rank, "decoded_token": self.piece(x.token)},
            )
            out.append(d)
        assert len(out) == len(ids)
        return out

    @property
    def engine(self) -> Engine:
        """The engine (for the loader's report and tests; the server never uses it)."""
        return self.dispatcher.engine

    @property
    def client(self) -> EngineClient:
        """All the HTTP server uses of the model's engine side (`plow.serve.client`)."""
        return self.dispatcher

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as `Tokenizer.encode` (a BOS when the tokenizer adds one)
        with `add_special_tokens`. Through `encode_batch`, which releases the GIL (`encode`
        holds it for the whole call): run it in a worker thread."""
        enc = self.tokenizer.inner.encode_batch([text], add_special_tokens=False)[0]
        ids: list[int] = list(enc.ids)
        tok = self.tokenizer
        if add_special_tokens and tok.add_bos and tok.bos_token is not None:
            bos = tok.inner.token_to_id(tok.bos_token)
            if bos is not None:
                ids = [bos, *ids]
        return ids


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
    executor: str | None = None,
    threads: int | None = None,
    on_rung: Callable[[int, int, Prepared], None] | None = None,
) -> ServedModel:
    """Load a checkpoint or a bundle, build its engine, calibrate the step time, start nothing
    yet. `executor` names an executor of the runtime's registry (`plow.runtime.executors`):
    `native` (a bundle's packet streams on the C++ kernel; a checkpoint is compiled into a
    cached, verified bundle first; `plow serve`'s default), `cpu` (the same bundles on the
    numpy emulator), `cuda` (on an NVIDIA GPU), `reference` (a checkpoint's per-op forward).
    None: `cpu` for a bundle, `reference` for a checkpoint. `threads`: the native machine's
    host threads per step (None: the usable cores). Every rung of the engine is prepared
    (loaded, bound, one warm launch) before anything else runs (`plow.serve.warm`;
    `on_rung(i, n, prepared)` reports each), so no request pays for a rung's first use."""
    from plow.checkpoint.gguf import gguf_checkpoint
    from plow.runtime.cpu.bundle import Bundle, compile_cached
    from plow.runtime.executors import EXECUTORS, checkpoint_target, get_executor

    directory = gguf_checkpoint(Path(path))  # a .gguf file: imported once, blocks kept
    is_bundle = (directory / "manifest.json").is_file()
    if executor is None:
        executor = "cpu" if is_bundle else "reference"
    if executor not in EXECUTORS:
        raise PlowError("--executor", f"must be one of {', '.join(EXECUTORS)}, not {executor!r}")
    kind = get_executor(executor)  # an executor this machine cannot run: one line, exit 2
    served = name or (Path(path).stem if Path(path).suffix.lower() == ".gguf" else directory.name)
    if max_num_seqs < 1:
        raise PlowError("--max-num-seqs", "must be at least 1")
    if max_num_batched_tokens < max_num_seqs:
        raise PlowError(
            "--max-num-batched-tokens",
            f"must be at least --max-num-seqs ({max_num_seqs}), got {max_num_batched_tokens}",
        )
    source: Bundle | Checkpoint
    if is_bundle:  # a bundle: its packet streams
        if kind.runs != "bundle":
            raise PlowError(directory, "a bundle runs on --executor native, cpu or cuda")
        source = Bundle.open(directory)
        spec, tok = source.spec, source.tokenizer
    else:
        ckpt = load_checkpoint(directory)
        spec, tok = ckpt.spec, ckpt.tokenizer
        source = ckpt
        if kind.runs == "bundle":
            tgt = checkpoint_target(executor)  # cuda: the present GPU's target
            # prefill rungs up to the tick's token budget: a long prompt is one launch
            source = Bundle.open(compile_cached(
                directory, target=tgt, max_batch=max_num_seqs,
                max_prefill_tokens=max_num_batched_tokens,
            ))  # fmt: skip
    if max_model_len is not None and not 1 <= max_model_len <= spec.max_position:
        raise PlowError(
            "--max-model-len", f"must be in 1..{spec.max_position}, got {max_model_len}"
        )
    if threads is None:
        engine = kind.open_engine(source, max_batch=max_num_seqs, max_context=max_model_len)
    elif executor != "native":
        raise PlowError("--threads", f"sets the native executor's host threads, not {executor}'s")
    elif threads < 1:
        raise PlowError("--threads", f"must be at least 1, got {threads}")
    else:
        assert isinstance(source, Bundle)
        engine = kind.engine_of(kind.open_model(
            source, max_batch=max_num_seqs, max_context=max_model_len, threads=threads
        ))  # fmt: skip
    prepared = prepare_rungs(engine, on_rung)
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
    dispatcher.prepared = prepared
    return ServedModel(
        served, str(directory), tok, dispatcher, engine.max_context, spec.vocab_size,
        token_chars=max_token_chars(tok), eos_token_ids=tuple(spec.eos_token_ids),
    )  # fmt: skip


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


# ------------------------------------------------------------------------------------- bodies

B = TypeVar("B", bound=BaseModel)

_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param(loc: Sequence[Any]) -> str | None:
    """The field path of a validation error, without pydantic's union-member tags."""
    out: list[str] = []
    for x in loc:
        if isinstance(x, str) and (x in _UNION_TAGS or "[" in x or x == "body"):
            continue
        out.append(str(x))
    return ".".join(out) or None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_body(model: type[B], raw: bytes) -> B:
    """Strict JSON → `model`, every failure a 400 with the OpenAI error body."""
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, NaN, too deep
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        # for a union, the member that matches the value's JSON type says the most
        specific = [er for er in errs if not er["type"].endswith("_type")] or errs
        first = specific[0]
        msg = "; ".join(f"{_param(er['loc']) or 'body'}: {er['msg']}" for er in specific[:3])
        raise ApiError(400, msg, param=_param(first["loc"])) from None


# ------------------------------------------------------------------------------------- the gate


def _protected(path: str) -> bool:
    return path.startswith(("/v1", "/debug", "/tokenize", "/detokenize"))


class _Gate:
    """Pure ASGI in front of the routes: the API key, then the body, read here under the size
    limit (counted as it arrives, never buffered past the limit) and replayed to the app; the
    receive channel after the body goes straight through, so a route can watch it for the
    client's disconnect."""

    def __init__(self, app: ASGIApp, server: Server) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        srv = self.server
        headers = Headers(scope=scope)
        if (
            srv.api_key is not None
            and _protected(scope["path"])
            and headers.get("authorization", "") != f"Bearer {srv.api_key}"
        ):
            resp = error_response(401, "Incorrect API key provided.", code="invalid_api_key")
            await resp(scope, receive, send)
            return
        limit = srv.max_request_bytes
        over = False
        with contextlib.suppress(ValueError):
            over = int(headers.get("content-length", "0")) > limit
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            more = bool(msg.get("more_body", False))
            if over or size > limit:
                over = True
                chunks.clear()
                if size > limit + DRAIN_BYTES:
                    break
            elif body:
                chunks.append(body)
        if over:
            resp = error_response(
                413,
                f"request body larger than the limit of {limit} bytes",
                code="request_too_large",
                headers={"Connection": "close"},
            )
            await resp(scope, receive, send)
            return
        data = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


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


# Characters str.splitlines() breaks on that json.dumps(ensure_ascii=False) leaves raw:
# a client reading the stream line by line (httpx's iter_lines) would split a data line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(obj: Any) -> str:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return f"data: {body}\n\n"


def _stream_error(ev: GenerationEvent) -> str:
    kind = "rate_limit_exceeded" if ev.finish_reason == "refused" else "internal_error"
    return _sse({"error": {"message": ev.error or ev.finish_reason, "type": kind,
                           "param": None, "code": kind}})  # fmt: skip


class _Mailbox:
    """Events from the dispatcher thread to one event loop, one loop wake-up per burst: the
    first event posted while none is pending schedules a drain (`call_soon_threadsafe`, a
    write to the loop's self-pipe); the events posted before the drain runs (a tick's rows)
    join it. So a tick of b streams wakes the loop once, not b times; each queue still gets
    its events in the order they were posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []

    def post(self, queue: asyncio.Queue[Any], item: Any) -> None:
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:  # a drain is already scheduled
                return
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


@dataclass
class _Job:
    """The n requests (one per choice) of one HTTP request, their events on one queue, and
    a task watching the connection that aborts them all when the client goes away."""

    model: ServedModel
    request_ids: list[str]
    queue: asyncio.Queue[tuple[int, GenerationEvent]]
    prompt_tokens: int
    watcher: asyncio.Task[None] | None = None
    disconnected: bool = False
    _open: int = 0

    def __post_init__(self) -> None:
        self._open = len(self.request_ids)

    def watch(self, http_request: Request) -> None:
        async def run() -> None:
            while True:
                msg = await http_request.receive()
                if msg["type"] == "http.disconnect":
                    self.disconnected = True
                    self.abort()
                    return

        self.watcher = asyncio.ensure_future(run())

    async def events(self) -> AsyncIterator[tuple[int, GenerationEvent]]:
        """(choice index, event) until every choice has finished."""
        while self._open:
            i, ev = await self.queue.get()
            if ev.finish_reason is not None:
                self._open -= 1
            yield i, ev

    def abort(self) -> None:
        for rid in self.request_ids:
            self.model.client.abort(rid)

    def close(self) -> None:
        """Abort whatever still runs (no-op for finished requests) and stop watching."""
        self.abort()
        if self.watcher is not None:
            self.watcher.cancel()


def _raise_for(ev: GenerationEvent) -> None:
    if ev.finish_reason == "refused":
        retry = ev.retry_after_s or 1
        raise ApiError(
            429,
            f"server busy: {ev.error}; retry after {retry} s",
            type="rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry)},
        )
    if ev.finish_reason == "error":
        raise ApiError(500, ev.error or "engine error", type="internal_error")
    if ev.finish_reason == "abort":
        raise ApiError(400, "client disconnected", code="client_disconnected")


class Server:
    def __init__(
        self,
        models: Sequence[ServedModel],
        *,
        api_key: str | None = None,
        seed: int | None = None,
        max_request_bytes: int | None = None,
    ) -> None:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise PlowError("--served-model-name", f"duplicate model names: {names}")
        self.models = {m.name: m for m in models}
        self.api_key = api_key
        self.seed = seed
        if max_request_bytes is None:
            env = os.environ.get("PLOW_MAX_REQUEST_BYTES")
            try:
                max_request_bytes = int(env) if env else DEFAULT_MAX_REQUEST_BYTES
            except ValueError as e:
                raise PlowError("PLOW_MAX_REQUEST_BYTES", f"not an integer: {env!r}") from e
        if max_request_bytes < 1:
            raise PlowError("--max-request-bytes", f"must be at least 1, got {max_request_bytes}")
        self.max_request_bytes = max_request_bytes
        self._counter = 0
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}

    # -- request handling ---------------------------------------------------------------

    def _model(self, name: str | None) -> ServedModel:
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise ApiError(400, "several models are served: name one", param="model")
        m = self.models.get(name)
        if m is None:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. Available: {', '.join(self.models)}.",
                param="model",
                code="model_not_found",
            )
        return m

    def _params(self, body: SamplingFields, index: int) -> SamplingParams:
        seed = body.seed
        if seed is not None:
            seed += index  # choice i of n: its own stream, choice 0 the single-choice one
        elif self.seed is not None:
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
        if not 1 <= body.n <= MAX_N:
            raise ApiError(400, f"n must be in 1..{MAX_N}, got {body.n}", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(
                400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens"
            )
        bad_ids = [t for t in body.stop_token_ids or [] if t < 0]
        if bad_ids:
            raise ApiError(400, f"token id {bad_ids[0]} is negative", param="stop_token_ids")

    @staticmethod
    def _logprobs(body: SamplingFields, chat: bool) -> int | None:
        """How many top alternatives per token (None: no logprobs), to each API's spec:
        chat has `logprobs: bool` and `top_logprobs: 0..20`; completions `logprobs: 0..20`."""
        lp, top = body.logprobs, body.top_logprobs
        if chat:
            if lp is not None and not isinstance(lp, bool):
                raise ApiError(400, "logprobs must be a boolean (use top_logprobs for a count)",
                               param="logprobs")  # fmt: skip
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top}",
                               param="top_logprobs")  # fmt: skip
            if top and not lp:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return (top or 0) if lp else None
        if isinstance(lp, bool):
            raise ApiError(400, "logprobs must be an integer on /v1/completions",
                           param="logprobs")  # fmt: skip
        if lp is not None and not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {lp}",
                           param="logprobs")  # fmt: skip
        return lp

    @staticmethod
    def _prompt_logprobs(m: ServedModel, body: SamplingFields, echo: int | None) -> int | None:
        """How many alternatives per prompt token (None: no prompt logprobs): vLLM's
        `prompt_logprobs`, or completions' `echo` with `logprobs` (`echo`: that count). A
        model whose engine cannot return every prompt position's logits refuses it."""
        k = body.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {k}",
                           param="prompt_logprobs")  # fmt: skip
        want = max(x for x in (k, echo) if x is not None) if (k, echo) != (None, None) else None
        if want is not None and not getattr(m.client, "prompt_logits", False):
            field_ = "prompt_logprobs" if k is not None else "logprobs"
            raise ApiError(400, f"{field_}: model {m.name!r} cannot give the prompt's logprobs "
                           "(its engine returns only the last prompt position's logits)",
                           param=field_)  # fmt: skip
        return want

    @staticmethod
    def _penalties(body: SamplingFields) -> Penalties:
        try:
            return Penalties(
                0.0 if body.presence_penalty is None else body.presence_penalty,
                0.0 if body.frequency_penalty is None else body.frequency_penalty,
                1.0 if body.repetition_penalty is None else body.repetition_penalty,
            )
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=param) from e

    async def _grammars(self, m: ServedModel, body: SamplingFields) -> list[Grammar | None]:
        """One compiled constraint per choice (llguidance, in a worker thread)."""
        try:
            c = constraint_of(body.response_format)
        except GrammarError as e:
            raise ApiError(400, f"response_format: {e}", param="response_format") from e
        try:
            c2 = structured_constraint(body.structured_outputs)
        except GrammarError as e:
            raise ApiError(400, f"structured_outputs: {e}", param="structured_outputs") from e
        if c is not None and c2 is not None:
            raise ApiError(400, "give response_format or structured_outputs, not both",
                           param="structured_outputs")  # fmt: skip
        c = c or c2
        if c is None:
            return [None] * body.n

        def work() -> list[Grammar | None]:
            return [m.grammars.compile(c) for _ in range(body.n)]

        try:
            return await asyncio.to_thread(work)
        except GrammarError as e:
            raise ApiError(400, f"response_format: {e}", param="response_format") from e

    @staticmethod
    def _too_long(m: ServedModel, tokens: int, what: str = "") -> ApiError:
        return ApiError(
            400,
            f"This model's maximum context length is {m.max_context} tokens; the prompt has "
            f"{what or f'{tokens} tokens'} (at most {m.max_context - 1} leave room for one "
            f"new token).",
            param="prompt",
            code="context_length_exceeded",
        )

    def _precheck_chars(self, m: ServedModel, text: str, param: str = "prompt") -> None:
        """Refuse, without tokenising, a text whose length alone proves it overflows."""
        per = m.token_chars
        if per is not None and len(text) > per * (m.max_context - 1):
            least = -(-len(text) // per)
            err = self._too_long(
                m, least, f"{len(text)} characters, so at least {least} tokens (one token "
                f"covers at most {per} characters of this tokenizer)",
            )  # fmt: skip
            err.param = param
            raise err

    async def _tokenize(
        self, m: ServedModel, text: str, add_special_tokens: bool, param: str
    ) -> list[int]:
        self._precheck_chars(m, text, param)
        try:
            return await asyncio.to_thread(m.encode, text, add_special_tokens)
        except UnicodeError as e:  # a surrogate the body checks did not see
            raise ApiError(400, f"{param}: not valid Unicode text ({e})", param=param) from e

    async def _chat_ids(
        self, m: ServedModel, messages: list[Any], add_generation_prompt: bool
    ) -> list[int]:
        dicts = [{**msg.model_dump(), "content": _message_text(msg.content)} for msg in messages]

        def work() -> list[int]:
            text = render_chat(m.tokenizer, dicts, add_generation_prompt)
            self._precheck_chars(m, text, "messages")
            return m.encode(text, add_special_tokens=False)

        try:
            return await asyncio.to_thread(work)
        except UnicodeError as e:
            raise ApiError(400, f"messages: not valid Unicode text ({e})", param="messages") from e

    def _check_prompt(
        self, m: ServedModel, ids: list[int], max_tokens: int | None, default: int | None
    ) -> int:
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(ids) >= m.max_context:
            raise self._too_long(m, len(ids))
        bad = [i for i in ids if not 0 <= i < m.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
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

    def _mailbox(self) -> _Mailbox:
        """The running loop's mailbox (one per loop: the dispatcher threads post into it)."""
        loop = asyncio.get_running_loop()
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = _Mailbox(loop)
        return box

    def _submit(
        self,
        m: ServedModel,
        ids: list[int],
        body: SamplingFields,
        max_tokens: int,
        prefix: str,
        http_request: Request,
        *,
        logprobs: int | None = None,
        grammars: Sequence[Grammar | None] = (),
        prompt_logprobs: int | None = None,
    ) -> _Job:
        mailbox = self._mailbox()
        penalties = self._penalties(body)
        queue: asyncio.Queue[tuple[int, GenerationEvent]] = asyncio.Queue()
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop_ids = frozenset(body.stop_token_ids or ()) | (
            frozenset() if body.ignore_eos else m.client.eos_token_ids
        )
        params = [self._params(body, i) for i in range(body.n)]
        rids: list[str] = []
        job = _Job(m, rids, queue, len(ids))
        for i in range(body.n):

            def sink(ev: GenerationEvent, i: int = i) -> None:
                mailbox.post(queue, (i, ev))

            rid = m.client.new_id(prefix)
            req = GenRequest(
                rid, ids, params[i], max_tokens, sink, tuple(stops), stop_ids, penalties,
                logprobs, grammars[i] if grammars else None, prompt_logprobs,
            )  # fmt: skip
            decision = m.client.submit(req)
            if not decision.admit:
                job.abort()  # the choices already queued
                raise ApiError(
                    429,
                    f"server busy: {decision.reason}; retry after {decision.retry_after_s} s",
                    type="rate_limit_exceeded",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(decision.retry_after_s)},
                )
            rids.append(rid)
        job._open = len(rids)
        job.watch(http_request)
        return job

    async def _collect(
        self, job: _Job, n: int
    ) -> tuple[
        list[str], list[GenerationEvent], list[list[TokenLogprob]], list[list[TokenLogprob]]
    ]:
        """Each choice's text, last event, logprobs and prompt logprobs."""
        parts: list[list[str]] = [[] for _ in range(n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        plps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        last: list[GenerationEvent | None] = [None] * n
        try:
            async for i, ev in job.events():
                if ev.finish_reason in ("refused", "error", "abort"):
                    _raise_for(ev)
                parts[i].append(ev.text)
                lps[i].extend(ev.logprobs)
                if ev.prompt_logprobs is not None:
                    plps[i] = list(ev.prompt_logprobs)
                if ev.finish_reason is not None:
                    last[i] = ev
        finally:
            job.close()
        done = [ev for ev in last if ev is not None]
        assert len(done) == n
        return ["".join(p) for p in parts], done, lps, plps

    async def _first(self, job: _Job) -> tuple[int, GenerationEvent]:
        """Wait for the job's first event before answering: a refusal or an error that comes
        before any token still gets its own HTTP status."""
        try:
            i, ev = await job.queue.get()
            if ev.finish_reason is not None:
                job._open -= 1
                if ev.finish_reason in ("refused", "error", "abort"):
                    _raise_for(ev)
            return i, ev
        except BaseException:
            job.close()
            raise

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def completions(self, raw: bytes, http_request: Request) -> Any:
        body = parse_body(CompletionRequest, raw)
        m = self._model(body.model)
        self._common_checks(body, body.max_tokens)
        logprobs = self._logprobs(body, chat=False)
        if body.best_of not in (None, 1, body.n):
            raise ApiError(400, "best_of other than n is not supported", param="best_of")
        echo_k = logprobs if body.echo else None
        prompt_k = self._prompt_logprobs(m, body, echo_k)
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ApiError(
                    400, "batched prompts are not supported: send one prompt", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await self._tokenize(m, prompt, True, "prompt")
        else:
            if len(prompt) >= m.max_context:
                raise self._too_long(m, len(prompt))
            ids = list(prompt)
        max_tokens = self._check_prompt(m, ids, body.max_tokens, 16)
        echo = ""
        if body.echo:
            echo = prompt if isinstance(prompt, str) else m.tokenizer.decode(ids)
        grammars = await self._grammars(m, body)
        job = self._submit(m, ids, body, max_tokens, "cmpl", http_request,
                           logprobs=logprobs, grammars=grammars,
                           prompt_logprobs=prompt_k)  # fmt: skip
        created = int(time.time())

        def choice_logprobs(
            plps: Sequence[TokenLogprob] | None, lps: Sequence[TokenLogprob], offset: int
        ) -> dict[str, Any] | None:
            """Completions' `logprobs` of a choice's part: the echoed prompt's (when `plps`
            is given) followed by its tokens' from character `offset`."""
            if logprobs is None:
                return None
            out = m.completion_logprobs(lps, offset)
            if plps is not None and body.echo:
                head = m.echo_logprobs(ids, plps, logprobs)
                out = {key: head[key] + out[key] for key in out}
            return out

        def prompt_field(plps: Sequence[TokenLogprob] | None) -> dict[str, Any]:
            if body.prompt_logprobs is None or plps is None:
                return {}
            return {"prompt_logprobs": m.vllm_prompt_logprobs(ids, plps)}

        base = {
            "id": job.request_ids[0],
            "object": "text_completion",
            "created": created,
            "model": m.name,
        }
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        n = len(job.request_ids)
        if body.stream:
            first = await self._first(job)

            async def gen() -> AsyncIterator[str]:
                extra = {"usage": None} if include_usage else {}
                if echo and prompt_k is None:
                    for i in range(n):
                        choice = {"index": i, "text": echo, "logprobs": None,
                                  "finish_reason": None}  # fmt: skip
                        yield _sse({**base, "choices": [choice], **extra})
                completion = 0
                offsets = [len(echo) if body.echo else 0] * n

                async def all_events() -> AsyncIterator[tuple[int, GenerationEvent]]:
                    yield first
                    async for x in job.events():
                        yield x

                async for i, ev in all_events():
                    if ev.finish_reason in ("refused", "error"):
                        yield _stream_error(ev)
                        break
                    if ev.prompt_logprobs is not None:  # a choice's first event: its prompt
                        lp = choice_logprobs(ev.prompt_logprobs, (), 0) if body.echo else None
                        choice = {
                            "index": i,
                            "text": echo,
                            "logprobs": lp,
                            "finish_reason": None,
                            **prompt_field(ev.prompt_logprobs),
                        }
                        yield _sse({**base, "choices": [choice], **extra})
                    if ev.text or ev.logprobs or ev.finish_reason is not None:
                        lp = None
                        if logprobs is not None:
                            lp = m.completion_logprobs(ev.logprobs, offsets[i])
                            offsets[i] += sum(len(t) for t in lp["tokens"])
                        choice = {"index": i, "text": ev.text, "logprobs": lp,
                                  "finish_reason": ev.finish_reason}  # fmt: skip
                        yield _sse({**base, "choices": [choice], **extra})
                    if ev.finish_reason is not None:
                        completion += ev.completion_tokens
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": self._usage(len(ids), completion)})
                yield "data: [DONE]\n\n"

            return _ClosingStream(gen(), job.close)
        texts, lasts, lps, plps = await self._collect(job, n)
        got = [plps[i] if prompt_k is not None else None for i in range(n)]
        return {
            **base,
            "choices": [
                {"index": i, "text": echo + texts[i],
                 "logprobs": choice_logprobs(got[i], lps[i], len(echo) if body.echo else 0),
                 "finish_reason": lasts[i].finish_reason, **prompt_field(got[i])}
                for i in range(n)
            ],
            "usage": self._usage(len(ids), sum(ev.completion_tokens for ev in lasts)),
        }  # fmt: skip

    async def chat(self, raw: bytes, http_request: Request) -> Any:
        body = parse_body(ChatCompletionRequest, raw)
        m = self._model(body.model)
        max_req = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        self._common_checks(body, max_req)
        logprobs = self._logprobs(body, chat=True)
        if logprobs is not None:  # token bytes come from llguidance's tokenizer: build it
            await asyncio.to_thread(m.grammars.ready)
        ids = await self._chat_ids(m, body.messages, body.add_generation_prompt)
        max_tokens = self._check_prompt(m, ids, max_req, None)
        grammars = await self._grammars(m, body)
        prompt_k = self._prompt_logprobs(m, body, None)
        job = self._submit(m, ids, body, max_tokens, "chatcmpl", http_request,
                           logprobs=logprobs, grammars=grammars,
                           prompt_logprobs=prompt_k)  # fmt: skip
        created = int(time.time())
        base = {"id": job.request_ids[0], "created": created, "model": m.name}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        n = len(job.request_ids)
        if body.stream:
            first = await self._first(job)
            chunk = {**base, "object": "chat.completion.chunk"}

            async def gen() -> AsyncIterator[str]:
                extra = {"usage": None} if include_usage else {}
                for i in range(n):
                    role = {"index": i, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}  # fmt: skip
                    yield _sse({**chunk, "choices": [role], **extra})
                completion = 0

                async def all_events() -> AsyncIterator[tuple[int, GenerationEvent]]:
                    yield first
                    async for x in job.events():
                        yield x

                async for i, ev in all_events():
                    if ev.finish_reason in ("refused", "error"):
                        yield _stream_error(ev)
                        break
                    if ev.prompt_logprobs is not None and i == 0:  # vLLM: once, top level
                        yield _sse({**chunk, "choices": [], **extra,
                                    "prompt_logprobs": m.vllm_prompt_logprobs(
                                        ids, ev.prompt_logprobs)})  # fmt: skip
                    if ev.text or ev.logprobs or ev.finish_reason is not None:
                        delta = {"content": ev.text} if ev.text else {}
                        lp = (
                            {"content": m.chat_logprobs(ev.logprobs)}
                            if logprobs is not None else None
                        )  # fmt: skip
                        choice = {"index": i, "delta": delta, "logprobs": lp,
                                  "finish_reason": ev.finish_reason}  # fmt: skip
                        yield _sse({**chunk, "choices": [choice], **extra})
                    if ev.finish_reason is not None:
                        completion += ev.completion_tokens
                if include_usage:
                    usage = self._usage(len(ids), completion)
                    yield _sse({**chunk, "choices": [], "usage": usage})
                yield "data: [DONE]\n\n"

            return _ClosingStream(gen(), job.close)
        texts, lasts, lps, plps = await self._collect(job, n)
        prompt_part = (
            {"prompt_logprobs": m.vllm_prompt_logprobs(ids, plps[0])} if prompt_k is not None
            else {}
        )  # fmt: skip
        return {
            **base,
            **prompt_part,
            "object": "chat.completion",
            "choices": [{
                "index": i,
                "message": {"role": "assistant", "content": texts[i]},
                "logprobs": (
                    {"content": m.chat_logprobs(lps[i])} if logprobs is not None else None
                ),
                "finish_reason": lasts[i].finish_reason,
            } for i in range(n)],
            "usage": self._usage(len(ids), sum(ev.completion_tokens for ev in lasts)),
        }  # fmt: skip

    async def tokenize(self, raw: bytes) -> Any:
        body = parse_body(TokenizeRequest, raw)
        m = self._model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            ids = await self._tokenize(m, body.prompt, body.add_special_tokens, "prompt")
        else:
            assert body.messages is not None
            ids = await self._chat_ids(m, body.messages, body.add_generation_prompt)
        return {"count": len(ids), "max_model_len": m.max_context, "tokens": ids}

    async def detokenize(self, raw: bytes) -> Any:
        body = parse_body(DetokenizeRequest, raw)
        m = self._model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < m.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": await asyncio.to_thread(m.tokenizer.decode, body.tokens)}

    def card(self, m: ServedModel) -> ModelCard:
        return ModelCard(id=m.name, created=m.created, root=m.root, max_model_len=m.max_context)

    # -- app ----------------------------------------------------------------------------

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            for m in self.models.values():
                m.client.start()
            try:
                yield
            finally:
                for m in self.models.values():
                    m.client.stop()

        app = FastAPI(title="plow", lifespan=lifespan, docs_url=None, redoc_url=None)
        app.add_middleware(_Gate, server=self)
        server = self

        @app.exception_handler(ApiError)
        async def _api_error(_: Request, e: ApiError) -> JSONResponse:
            return e.response()

        @app.exception_handler(RequestValidationError)
        async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
            errs = e.errors()
            first = errs[0] if errs else {}
            msg = "; ".join(f"{_param(er.get('loc', ())) or 'body'}: {er.get('msg')}"
                            for er in errs[:3])  # fmt: skip
            return error_response(400, msg, param=_param(first.get("loc", ())))

        @app.exception_handler(StarletteHTTPException)
        async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            code = _STATUS_CODES.get(e.status_code)
            return error_response(e.status_code, str(e.detail), kind, code=code)

        @app.exception_handler(Exception)
        async def _internal(_: Request, e: Exception) -> JSONResponse:
            return error_response(500, f"internal error: {type(e).__name__}: {e}", "internal_error")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await server.completions(await request.body(), request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await server.chat(await request.body(), request)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Any:
            return await server.tokenize(await request.body())

        @app.post("/detokenize")
        async def detokenize(request: Request) -> Any:
            return await server.detokenize(await request.body())

        @app.get("/v1/models")
        async def models() -> ModelList:
            return ModelList(data=[server.card(m) for m in server.models.values()])

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str) -> ModelCard:
            return server.card(server._model(model_id))

        @app.get("/health")
        async def health() -> Any:
            dead = [m.name for m in server.models.values() if not m.client.alive]
            if dead:
                return error_response(
                    503, f"dispatcher not running: {', '.join(dead)}", "internal_error"
                )
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics() -> Response:
            text = render_all([m.client.metrics for m in server.models.values()])
            return Response(text, media_type=CONTENT_TYPE_LATEST)

        @app.get("/debug/admission")
        async def debug_admission() -> Any:
            out: dict[str, Any] = {}
            now = time.monotonic()
            for m in server.models.values():
                adm = m.client.admission
                if adm is None:
                    continue
                p = adm.predict(now)
                est = adm.estimate
                out[m.name] = {
                    "slots": adm.model.slots,
                    "max_wait_s": adm.max_wait_s,
                    "step": adm.model.step.model_dump(),
                    "prefill_fit": adm.model.prefill.model_dump(exclude={"points"}),
                    "measured": {
                        "decode_factor": est.decode_factor,
                        "prefill_factor": est.prefill_factor,
                        "decode_ticks": est.decode_seen,
                        "prefill_launches": est.prefill_seen,
                        "full_batch_tick_s": est.decode_tick_s(adm.model.slots),
                    },
                    "predicted_wait_now_s": m.client.predicted_wait(),
                    "prediction": {**asdict(p), "wait_s": p.wait_s},
                }
            return out

        @app.get("/debug/ticks")
        async def debug_ticks() -> Any:
            """Each model's last ticks (`plow serve --debug-ticks N`): start, duration, the
            prefill launch's seconds, decode rows, prefill tokens and chunks, admissions."""
            logs = {m.name: m.dispatcher.tick_log for m in server.models.values()}
            if all(log is None for log in logs.values()):
                raise ApiError(404, "tick records are off: start plow serve with --debug-ticks N")
            # a copy first: the dispatcher thread appends while this reads
            return {name: list(log.copy()) if log is not None else None
                    for name, log in logs.items()}  # fmt: skip

        @app.get("/debug/requests/{request_id}")
        async def debug_request(request_id: str) -> Any:
            for m in server.models.values():
                rec = m.client.record(request_id)
                if rec is not None:
                    return {"model": m.name, "tick": m.client.tick, **rec.as_dict()}
            raise ApiError(404, f"no record of request {request_id!r}", param="request_id")

        return app


def run_server(app: FastAPI, host: str, port: int, *, log_level: str = "warning") -> None:
    import sys

    import uvicorn

    # The dispatcher thread and the event loop share the GIL; the default 5 ms switch interval
    # would add up to 5 ms to a decode tick whenever the loop holds the GIL.
    sys.setswitchinterval(5e-4)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
