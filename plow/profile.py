"""The compile profile: which buckets to plan and the time budget each step must fit.

A profile is data (pydantic; `--profile FILE` reads one). Budgets are per step of a bucket:
a decode step produces one token per batch row; a prefill step of `seq` tokens per row gets
`prefill_budget_ns_per_token * batch * seq`.

Prefill rungs are `prefill_batches x prefill_seqs` (rows per launch x tokens per row). A
profile file without `prefill_batches` gets `[1]`: the batch-1 prefill rungs of older files.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from plow.errors import ConfigError
from plow.graph import Bucket, Phase

# Prefill chunk lengths of the bundle a checkpoint is compiled into for `plow serve` and
# `plow generate` (`plow.runtime.cpu.bundle.cache_profile`): the large rungs run a long prompt
# as one launch (one pass over the weights, one tick) instead of several 64-token launches.
SERVE_PREFILL_SEQS: tuple[int, ...] = (16, 64, 128, 256, 512)
# what one prefill rung's activations may add to the arena: a rung longer than 64 tokens is
# kept while `seq * token_bytes` (its logits and widest activations) fits in this
SERVE_PREFILL_ARENA_BYTES = 512 << 20


def serve_prefill_seqs(
    context: int, max_tokens: int = 512, token_bytes: int = 0
) -> tuple[int, ...]:
    """The prefill chunk lengths of a serving bundle: `SERVE_PREFILL_SEQS` up to the context
    and `max_tokens` (the server's per-tick token budget: a longer rung never runs); past 64
    tokens only those whose activations (`token_bytes` per token) fit
    `SERVE_PREFILL_ARENA_BYTES`. A context under 16 tokens gets one rung of the context."""
    if context < 1 or max_tokens < 1:
        raise ValueError("context and max_tokens must be at least 1")
    top = min(context, max_tokens)
    out = tuple(
        s
        for s in SERVE_PREFILL_SEQS
        if s <= top and (s <= 64 or s * token_bytes <= SERVE_PREFILL_ARENA_BYTES)
    )
    return out or (min(context, SERVE_PREFILL_SEQS[0]),)


class CompileProfile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "default"
    decode_batches: tuple[int, ...] = (1,)
    prefill_seqs: tuple[int, ...] = ()  # prefill chunk lengths (tokens per row)
    prefill_batches: tuple[int, ...] = (1,)  # rows per prefill launch, one rung per (batch, seq)
    context: int | None = Field(default=None, ge=1)  # None: min(model positions, 4096)
    decode_budget_ns: int = Field(default=200_000_000, ge=1)  # 200 ms per decode step
    prefill_budget_ns_per_token: int = Field(default=2_000_000, ge=1)
    activation_dtype: str | None = None  # None: the weights' dtype
    kv_dtype: str | None = None  # None: the activation dtype
    # the e-graph stage's fused ops in the packets (plow/egraph/apply.py, docs/egraph.md): the
    # extraction decides by default; False (`plow compile --no-fuse`) plans the canonical ops
    fuse: bool = True

    @field_validator("decode_batches", "prefill_seqs", "prefill_batches")
    @classmethod
    def _positive(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(x < 1 for x in v):
            raise ValueError("entries must be at least 1")
        return v

    @field_validator("prefill_batches")
    @classmethod
    def _some_batch(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v:
            raise ValueError("needs at least one batch (no prefill rungs: prefill_seqs [])")
        return v

    def buckets(self, max_position: int) -> list[Bucket]:
        """The ladder this profile asks for, for a model with `max_position` positions."""
        ctx = self.context or min(max_position, 4096)
        out = [Bucket.decode(b, ctx) for b in self.decode_batches]
        out += [
            Bucket.prefill(b, s, max(ctx, s))
            for b in self.prefill_batches
            for s in self.prefill_seqs
        ]
        return out

    def budget_ns(self, bucket: Bucket) -> int:
        if bucket.phase is Phase.decode:
            return self.decode_budget_ns
        return self.prefill_budget_ns_per_token * bucket.batch * bucket.seq


def load_profile(path: Path) -> CompileProfile:
    """A profile from a JSON file; `ConfigError` names the file and the first bad field."""
    if not path.is_file():
        raise ConfigError(path, "profile file not found")
    try:
        return CompileProfile.model_validate(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ConfigError(path, f"malformed JSON: {e}") from e
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "profile"
        raise ConfigError(path, f"field {loc!r}: {err['msg']}") from e
