"""A request's host-side sampling: logprobs, penalties and a grammar mask around
`plow.runtime.sampler`.

Engines return logits rows; the dispatcher turns each row into a token here. Per row, in
vLLM v1's order:

1. the grammar mask (`plow.serve.grammar`, from llguidance): tokens the grammar does not
   allow next get logit -inf;
2. logprobs, when asked: ``log_softmax`` of the row after step 1 and before anything else
   (vLLM's default "raw" logprobs: the model's distribution, not the one the penalties and
   temperature reshape), in float64; the sampled token's logprob and the `top_logprobs` most
   likely tokens (ties: lower id first);
3. penalties, as OpenAI and vLLM define them. With ``c[j]`` the number of times token ``j``
   occurs in the request's generated tokens and ``P`` the set of tokens in its prompt or its
   generated tokens:

   - repetition (CTRL / HuggingFace, ``r > 0``): for ``j`` in ``P``, ``l[j] / r`` when
     ``l[j] > 0`` else ``l[j] * r``;
   - frequency: ``l[j] -= frequency_penalty * c[j]``;
   - presence: ``l[j] -= presence_penalty * (c[j] > 0)``;

4. temperature / top-k / top-p / min-p and the draw (`plow.runtime.sampler.sample_row`: one
   uniform number from the request's own generator per token, so a request's tokens never
   depend on its batch neighbours).

A plain request (no logprobs, no penalties, no grammar) is exactly `sample_row` of the raw
row: nothing is copied or computed for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from plow.runtime.sampler import SamplingParams, make_generator, sample_row

if TYPE_CHECKING:
    from plow.serve.grammar import Grammar

MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs (chat) and vLLM's default max_logprobs


@dataclass(frozen=True, slots=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        for name, v, lo, hi in (
            ("presence_penalty", self.presence, -2.0, 2.0),
            ("frequency_penalty", self.frequency, -2.0, 2.0),
        ):
            if not (np.isfinite(v) and lo <= v <= hi):
                raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {v!r}")
        r = self.repetition
        if not (np.isfinite(r) and 0.0 < r <= 2.0):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {r!r}")

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0


def apply_penalties(
    row: np.ndarray,
    prompt: Sequence[int] | np.ndarray,
    generated: Counter[int],
    p: Penalties,
) -> np.ndarray:
    """The penalised copy of `row` (float64), module docstring step 3. `prompt`: the prompt's
    token ids (repeats allowed; a caller may pass them already unique)."""
    out = np.asarray(row, dtype=np.float64).copy()
    if p.repetition != 1.0:
        seen = np.union1d(
            np.asarray(prompt, dtype=np.int64), np.fromiter(generated, dtype=np.int64)
        )
        if seen.size:
            v = out[seen]
            out[seen] = np.where(v > 0, v / p.repetition, v * p.repetition)
    if generated and (p.frequency != 0.0 or p.presence != 0.0):
        ids = np.fromiter(generated.keys(), dtype=np.int64)
        counts = np.fromiter(generated.values(), dtype=np.float64)
        out[ids] -= p.frequency * counts + p.presence
    return out


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's logprob and the most likely alternatives at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0  # 1 + how many tokens are more likely (0: not computed)


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_logprobs(lp: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` largest entries of `lp`, descending, ties by lower id first. Linear in the
    vocabulary: the k-th largest value found by partition, then only the entries at least as
    large (all of a tie at the boundary) are sorted."""
    if k <= 0:
        return ()
    n = lp.shape[0]
    if k < n:
        kth = np.partition(lp, n - k)[n - k]
        cand = np.flatnonzero(lp >= kth)
    else:
        cand = np.arange(n)
    order = cand[np.lexsort((cand, -lp[cand]))][:k]
    return tuple((int(i), float(lp[i])) for i in order)


@dataclass
class RequestSampler:
    """One request's sampling state (module docstring). `logprobs`: None for none, else how
    many top alternatives to report per token (0 = the sampled token's logprob only)."""

    params: SamplingParams
    prompt: tuple[int, ...] = ()
    penalties: Penalties = Penalties()
    logprobs: int | None = None
    grammar: Grammar | None = None
    rng: np.random.Generator | None = None
    counts: Counter[int] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.rng is None and not self.params.is_greedy:
            self.rng = make_generator(self.params)
        self._prompt_set = np.unique(np.asarray(self.prompt, dtype=np.int64))
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")

    @property
    def plain(self) -> bool:
        return self.logprobs is None and not self.penalties.active and self.grammar is None

    def sample(self, row: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """The next token from one logits row, and its logprobs when asked; then `accept`."""
        if self.plain:
            return sample_row(row, self.params, self.rng), None
        x = np.asarray(row, dtype=np.float32)
        if self.grammar is not None:
            x = self.grammar.mask(x)
        lp = log_softmax(x) if self.logprobs is not None else None
        z = apply_penalties(x, self._prompt_set, self.counts, self.penalties) if (
            self.penalties.active
        ) else x
        tok = sample_row(z, self.params, self.rng)
        self.accept(tok)
        info = None
        if lp is not None:
            info = TokenLogprob(tok, float(lp[tok]), top_logprobs(lp, self.logprobs or 0))
        return tok, info

    def accept(self, tok: int) -> None:
        self.counts[tok] += 1
        if self.grammar is not None:
            self.grammar.accept(tok)

    @property
    def grammar_done(self) -> bool:
        """The grammar reached its end: nothing more may be generated."""
        return self.grammar is not None and self.grammar.done


def prompt_logprobs(
    rows: np.ndarray, next_tokens: Sequence[int], k: int
) -> list[TokenLogprob]:
    """The logprobs of the prompt tokens that follow `len(next_tokens)` positions: row `j` of
    `rows` is the model's logits after position `j`, `next_tokens[j]` the prompt token at
    position `j + 1`. Raw `log_softmax` (float64) of each row, as the generated tokens'
    (no grammar mask: the prompt is not generated), with its rank and `k` top alternatives."""
    out = []
    for row, tok in zip(rows, next_tokens, strict=False):
        lp = log_softmax(row)
        v = lp[int(tok)]
        out.append(
            TokenLogprob(int(tok), float(v), top_logprobs(lp, k), int((lp > v).sum()) + 1)
        )
    return out
