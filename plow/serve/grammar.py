"""Structured output: `response_format` (JSON object, JSON schema), regular expressions and
vLLM's `structured_outputs` as token masks from llguidance, a maintained grammar library
(DESIGN.md section 7: grammar masks are not written by hand here).

`GrammarCompiler` is built once per served model from its `tokenizer.json` (llguidance reads
the same Hugging Face tokenizer, with the model's vocabulary width and end-of-sequence ids);
`compile(spec)` turns one request's constraint into a `Grammar`, whose `mask(row)` sets the
logit of every token the grammar does not allow next to -inf and whose `accept(token)`
advances it. A request whose grammar is complete ends with finish reason "stop" (the
grammar's end is the model's end-of-sequence token, or the end of the grammar itself).

JSON is compact (`whitespace_flexible` off: no free whitespace between tokens), so a small
or untrained model cannot spend its budget on blanks.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plow.checkpoint.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A constraint llguidance cannot compile (bad schema, bad regex), as one line."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request asks for: `kind` is "json" (with `schema`, {} for any JSON object) or
    "regex" (with `pattern`)."""

    kind: str
    schema: dict[str, Any] | None = None
    pattern: str | None = None


def structured_constraint(spec: dict[str, Any] | None) -> Constraint | None:
    """vLLM's `structured_outputs` field: `{"json": schema}` or `{"regex": pattern}` (one of
    them), or `GrammarError`."""
    if not spec:
        return None
    keys = sorted(k for k in ("json", "regex") if spec.get(k) is not None)
    others = sorted(k for k in spec if k not in ("json", "regex") and spec[k] is not None)
    if others:
        raise GrammarError(f"unsupported key {others[0]!r} (have json, regex)")
    if len(keys) != 1:
        raise GrammarError("give exactly one of json and regex")
    if keys == ["regex"]:
        if not isinstance(spec["regex"], str):
            raise GrammarError("regex must be a string")
        return Constraint("regex", pattern=spec["regex"])
    schema = spec["json"]
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"json is not a JSON schema: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError("json must be a JSON schema object")
    return Constraint("json", schema)


def constraint_of(response_format: dict[str, Any] | None) -> Constraint | None:
    """The constraint of an OpenAI `response_format` (None for text), or `GrammarError`."""
    if response_format is None or response_format in ({}, {"type": "text"}):
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return Constraint("json", {"type": "object"})
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict):
            raise GrammarError("json_schema must be an object with a `schema`")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise GrammarError("json_schema.schema must be a JSON object")
        return Constraint("json", schema)
    if kind == "regex":  # an extension (as vLLM's structured_outputs.regex)
        pattern = response_format.get("regex")
        if not isinstance(pattern, str):
            raise GrammarError("a regex response_format needs a string `regex`")
        return Constraint("regex", pattern=pattern)
    raise GrammarError(
        f"type must be text, json_object, json_schema or regex, got {json.dumps(kind)}"
    )


@dataclass
class Grammar:
    """One request's matcher and its mask buffer."""

    matcher: Any  # llguidance.LLMatcher
    vocab_size: int
    _mask: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        from llguidance.numpy import allocate_token_bitmask

        self._mask = allocate_token_bitmask(1, self.vocab_size)

    def mask(self, row: np.ndarray) -> np.ndarray:
        """A copy of `row` with the tokens not allowed next at -inf."""
        from llguidance.numpy import apply_token_bitmask_inplace, fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._mask)
        if self.matcher.is_error():
            raise GrammarError(f"grammar: {self.matcher.get_error()}")
        out = np.array(row, dtype=np.float32, copy=True).reshape(1, -1)
        apply_token_bitmask_inplace(out, self._mask)
        return out[0]

    def accept(self, token: int) -> None:
        self.matcher.consume_token(int(token))
        if self.matcher.is_error():
            raise GrammarError(f"grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """llguidance's tokenizer for one model, built on first use (thread-safe); it also gives
    each token's bytes for the logprobs' `bytes` field."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
        self._ll: Any = None
        self._lock = threading.Lock()

    def _lltok(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance

                self._ll = llguidance.LLTokenizer(
                    self.tokenizer.inner.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos or None,
                )
            return self._ll

    def ready(self) -> None:
        """Build llguidance's tokenizer now (it can take a second on a large vocabulary: call
        it from a worker thread)."""
        self._lltok()

    def token_bytes(self, token: int) -> bytes | None:
        """A token's own bytes (a byte-level token may be part of a multi-byte character);
        None for a special token (its text is not model output)."""
        t = self._lltok()
        if t.is_special_token(int(token)):
            return None
        return bytes(t.decode_bytes([int(token)]))

    def compile(self, c: Constraint) -> Grammar:
        import llguidance

        if c.kind == "json":
            try:
                g = llguidance.LLMatcher.grammar_from_json_schema(
                    c.schema or {}, defaults={"whitespace_flexible": False}
                )
            except ValueError as e:
                raise GrammarError(f"schema: {e}") from None
        else:
            g = llguidance.LLMatcher.grammar_from_regex(c.pattern or "")
        m = llguidance.LLMatcher(self._lltok(), g, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error().splitlines()[0] if m.get_error() else "invalid")
        return Grammar(m, self.vocab_size)
