"""HTTP bodies of the OpenAI-compatible surface (pydantic v2, strict).

Strict mode: a field takes only its own JSON type — `max_tokens: "10"`, `max_tokens: true`,
`max_tokens: 10.0` and `stream: "yes"` are 400s naming the field, not silently coerced (an
integer is still a valid `temperature`). Every string must be valid Unicode: JSON lets a
`\\ud800` escape through as a lone surrogate, which no tokenizer can encode, so it is refused
where it is parsed, naming the field.

Unknown fields are ignored (clients send many optional ones); the fields below are the ones
the server reads. vLLM extensions kept where the meaning is the same: `top_k` (-1 or 0 = off),
`min_p`, `ignore_eos`, `stop_token_ids`, `prompt_logprobs`, and the `/tokenize` and
`/detokenize` bodies.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

MAX_N = 16  # choices per request: each is a slot's worth of work


def _valid_unicode(s: str) -> str:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"not valid Unicode: a lone surrogate U+{ord(s[e.start]):04X} at character "
                f"{e.start}"
            ) from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]

_STRICT = ConfigDict(extra="ignore", strict=True)


def _check_strings(value: Any, where: str) -> None:
    """Lone surrogates anywhere in a free-form value (a chat message's extra fields)."""
    if isinstance(value, str):
        try:
            _valid_unicode(value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, where)
            _check_strings(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{where}.{i}")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = _STRICT

    model: Text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"json": schema} | {"regex": s}
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, k alternatives
    user: Text | None = None


class CompletionRequest(SamplingFields):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Text = "text"
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Text
    content: Text | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _extra_strings(self) -> ChatMessage:
        for k, v in (self.model_extra or {}).items():
            _check_strings(v, k)
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a completion prompt or chat messages; `model` may be omitted when
    one model is served."""

    model_config = _STRICT
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: Text | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "plow"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
