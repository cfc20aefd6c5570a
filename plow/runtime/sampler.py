"""Per-row token sampling over a batch of logits: greedy, temperature, top-k, top-p, min-p.

One batch mixes greedy and stochastic rows: every row carries its own `SamplingParams` and,
when stochastic, its own `numpy.random.Generator`. A row draws exactly one uniform number from
its own generator per sampled token, so a request's tokens depend only on its seed, its logits
and how many tokens it has drawn — never on which other requests share the batch.

Filters run in the order HuggingFace's logits warpers and vLLM apply them:

1. temperature: ``z = (logits - max) / temperature``;
2. top-k: keep the tokens whose scaled logit is at least the k-th largest (ties at the
   boundary are all kept, as in HF's ``TopKLogitsWarper``);
3. top-p (nucleus): over the softmax of the survivors, sorted by decreasing probability
   (ties broken by lower token id first), keep a token when the probability mass strictly
   before it is below ``top_p``; the most probable token is always kept;
4. min-p: over the softmax of the survivors, drop tokens whose probability is below
   ``min_p * max_probability``;
5. renormalise over the survivors and draw by inverting the cumulative distribution with one
   uniform number ``u`` in ``[0, 1)``.

The arithmetic is float64 (the logits arrive as fp32); a token outside the support of the final
distribution is never returned, because the draw searches only the support.

Greedy (``temperature == 0``) is exactly ``argmax`` of the raw logits with ties going to the
lowest token id, and it ignores top-k/top-p/min-p (they cannot change the argmax). This is the
mode the emitter fuses into the lm_head reduction: ``(value, -index)`` pairs form an
associative, commutative max-reduction, so workers that each own a slice of the vocabulary
reduce their slice and a merge step picks the winner — no logits tensor is materialised and no
separate sampling pass runs. The stochastic modes need the whole row (a sort for top-p), so they
run as a separate sampler step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from plow.errors import PlowError

__all__ = [
    "InvalidSamplingParams",
    "SamplingParams",
    "Sampler",
    "greedy",
    "make_generator",
    "probabilities",
    "sample_row",
]


class InvalidSamplingParams(PlowError):
    """A sampling parameter (named in `where`) or a logits row is out of range."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples. Defaults are greedy with every filter off.

    temperature: 0 means greedy (argmax); otherwise > 0, logits are divided by it.
    top_k: 0 means off; otherwise keep the k most likely tokens (k >= 1).
    top_p: 1.0 means off; otherwise in (0, 1], keep the smallest nucleus of mass >= top_p.
    min_p: 0 means off; otherwise in [0, 1], drop tokens below min_p * max probability.
    seed: the request's seed (a non-negative int); None draws fresh OS entropy.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not np.isfinite(t) or t < 0:
            raise InvalidSamplingParams(
                "temperature", f"must be a finite number >= 0 (0 = greedy), got {t!r}"
            )
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
            raise InvalidSamplingParams("top_k", f"must be an int >= 0 (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0.0 < p <= 1.0):
            raise InvalidSamplingParams("top_p", f"must be in (0, 1] (1.0 = off), got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, int | float) or not (0.0 <= m <= 1.0):
            raise InvalidSamplingParams("min_p", f"must be in [0, 1] (0 = off), got {m!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 0):
            raise InvalidSamplingParams("seed", f"must be an int >= 0 or None, got {s!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams) -> np.random.Generator:
    """The generator a request draws from: seeded by `params.seed` (PCG64), or OS entropy."""
    return np.random.default_rng(None if params.seed is None else int(params.seed))


def _check_row(row: np.ndarray, where: str) -> np.ndarray:
    if row.ndim != 1 or row.shape[0] == 0:
        raise InvalidSamplingParams(where, f"logits row must be 1-D and non-empty, got {row.shape}")
    if np.isnan(row).any():
        raise InvalidSamplingParams(where, "logits contain NaN")
    if np.isposinf(row).any():
        raise InvalidSamplingParams(where, "logits contain +inf")
    if not np.isfinite(row).any():
        raise InvalidSamplingParams(where, "every logit is -inf; nothing can be sampled")
    return row


def greedy(row: np.ndarray) -> int:
    """argmax of one logits row; ties go to the lowest index (numpy's argmax does that)."""
    return int(np.argmax(row))


def probabilities(logits_row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The exact distribution (float64, sums to 1) that `sample_row` draws from.

    Greedy rows give a one-hot vector at the argmax.
    """
    row = _check_row(np.asarray(logits_row), "logits")
    v = row.shape[0]
    if params.is_greedy:
        out = np.zeros(v, dtype=np.float64)
        out[greedy(row)] = 1.0
        return out
    x = row.astype(np.float64)
    z = (x - x.max()) / float(params.temperature)  # -inf stays -inf; the max maps to 0
    keep = np.isfinite(z)
    # top-k: threshold at the k-th largest scaled logit.
    if 0 < params.top_k < v:
        kth = np.partition(z, v - params.top_k)[v - params.top_k]
        keep &= z >= kth
    z = np.where(keep, z, -np.inf)
    probs = np.where(keep, np.exp(z), 0.0)
    probs /= probs.sum()
    # top-p: descending by probability, ties by lower id first (stable sort of -probs).
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_p = probs[order]
        before = np.cumsum(sorted_p) - sorted_p  # mass strictly before each token
        drop_sorted = before >= params.top_p
        drop_sorted[0] = False
        drop = np.zeros(v, dtype=bool)
        drop[order] = drop_sorted
        keep &= ~drop
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    # min-p: relative to the largest remaining probability.
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def sample_row(
    logits_row: np.ndarray, params: SamplingParams, rng: np.random.Generator | None
) -> int:
    """One token for one row. Stochastic rows draw one uniform number from `rng`."""
    if params.is_greedy:
        return greedy(_check_row(np.asarray(logits_row), "logits"))
    if rng is None:
        raise InvalidSamplingParams("rng", "a stochastic row (temperature > 0) needs a generator")
    probs = probabilities(logits_row, params)
    support = np.flatnonzero(probs)
    cdf = np.cumsum(probs[support])
    u = rng.random()
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(support[min(j, support.shape[0] - 1)])


class Sampler:
    """Samples a batch row by row; holds one generator per live request.

    `register(request_id, params)` creates the request's generator from its seed (once; a
    second call returns the same generator), `release(request_id)` drops it. `sample` takes
    the generators explicitly, aligned with the rows, so the executor decides which request
    sits in which row; `sample_requests` looks them up by request id.
    """

    def __init__(self) -> None:
        self._rngs: dict[Hashable, np.random.Generator] = {}

    def register(self, request_id: Hashable, params: SamplingParams) -> np.random.Generator:
        rng = self._rngs.get(request_id)
        if rng is None:
            rng = make_generator(params)
            self._rngs[request_id] = rng
        return rng

    def release(self, request_id: Hashable) -> None:
        self._rngs.pop(request_id, None)

    def generator(self, request_id: Hashable) -> np.random.Generator:
        try:
            return self._rngs[request_id]
        except KeyError:
            raise InvalidSamplingParams(
                f"request {request_id!r}", "no generator registered for this request"
            ) from None

    def __len__(self) -> int:
        return len(self._rngs)

    def sample(
        self,
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        rngs: Sequence[np.random.Generator | None],
    ) -> np.ndarray:
        """ids[B] (int32) from logits[B, V]; row i uses params[i] and rngs[i].

        Greedy rows may pass None for their generator and never consume from it.
        """
        x = np.asarray(logits)
        if x.ndim != 2:
            raise InvalidSamplingParams("logits", f"must be [B, V], got shape {x.shape}")
        b = x.shape[0]
        if len(params) != b or len(rngs) != b:
            raise InvalidSamplingParams(
                "params", f"need one params and one rng per row: B={b}, "
                f"{len(params)} params, {len(rngs)} rngs"
            )
        out = np.empty(b, dtype=np.int32)
        for i in range(b):
            out[i] = sample_row(x[i], params[i], rngs[i])
        return out

    def sample_requests(
        self,
        logits: np.ndarray,
        request_ids: Sequence[Hashable],
        params: Sequence[SamplingParams],
    ) -> np.ndarray:
        """`sample` with each row's generator looked up (registered on first use) by id."""
        rngs = [self.register(r, p) for r, p in zip(request_ids, params, strict=True)]
        return self.sample(logits, params, rngs)
