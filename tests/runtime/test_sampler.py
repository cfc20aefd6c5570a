"""Sampler: validation, seeding, greedy/stochastic batch mixing, and the distribution sampled.

Statistical tests. For fixed logits and each filter, N draws with a fixed seed are compared
with the distribution written out independently below (plain Python over the reference logits,
not the sampler's own `probabilities`) by a chi-square goodness-of-fit test at ALPHA = 1e-4.
Under a correct sampler, a test fails for a given seed with probability 1e-4, so over the
six stochastic checks in this file the false-failure rate is at most 6e-4 per choice of seed;
the seeds are fixed, so the outcome is deterministic. The p-value is the exact chi-square
survival function for an integer number of degrees of freedom (closed forms via math.erfc).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from plow.runtime.sampler import (
    InvalidSamplingParams,
    Sampler,
    SamplingParams,
    make_generator,
    probabilities,
)

ALPHA = 1e-4
N_DRAWS = 20_000

# Distinct values, no two close, so no filter boundary sits on a tie or near rounding.
LOGITS = np.array(
    [1.3, -0.4, 2.9, 0.55, -1.7, 2.2, 0.1, 1.85, -0.95, 3.4, 0.8, -2.6], dtype=np.float32
)


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square with `dof` (integer) degrees of freedom, exactly."""
    if x <= 0:
        return 1.0
    half = x / 2.0
    if dof % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, dof // 2):
            term *= half / i
            total += term
        return math.exp(-half) * total
    total = math.erfc(math.sqrt(half))
    term = math.sqrt(2.0 * x / math.pi) * math.exp(-half)
    for j in range(1, (dof - 1) // 2 + 1):
        total += term
        term *= x / (2 * j + 1)
    return total


def chi2_pvalue(counts: np.ndarray, expected_p: list[float]) -> float:
    support = [i for i, p in enumerate(expected_p) if p > 0]
    n = counts.sum()
    stat = sum((counts[i] - n * expected_p[i]) ** 2 / (n * expected_p[i]) for i in support)
    return chi2_sf(float(stat), len(support) - 1)


# -- reference distributions, written from the definitions ---------------------------------
def ref_softmax(xs: list[float]) -> list[float]:
    finite = [x for x in xs if x != -math.inf]
    m = max(finite)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def ref_distribution(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
    z = [float(x) / temperature for x in logits]
    if top_k:
        ranked = sorted(range(len(z)), key=lambda i: -z[i])
        keep = set(ranked[:top_k])
        z = [z[i] if i in keep else -math.inf for i in range(len(z))]
    p = ref_softmax(z)
    if top_p < 1.0:
        ranked = sorted(range(len(p)), key=lambda i: -p[i])
        mass, keep = 0.0, set()
        for i in ranked:  # smallest prefix whose mass reaches top_p
            keep.add(i)
            mass += p[i]
            if mass >= top_p:
                break
        p = [p[i] if i in keep else 0.0 for i in range(len(p))]
        p = [v / sum(p) for v in p]
    if min_p > 0.0:
        cut = min_p * max(p)
        p = [v if v >= cut else 0.0 for v in p]
        p = [v / sum(p) for v in p]
    return p


def draw_counts(params: SamplingParams, n: int = N_DRAWS) -> np.ndarray:
    sampler = Sampler()
    rng = make_generator(params)
    batch = np.broadcast_to(LOGITS, (n, LOGITS.shape[0]))
    ids = sampler.sample(batch, [params] * n, [rng] * n)
    return np.bincount(ids, minlength=LOGITS.shape[0])


# -- helpers' own checks ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("x", "dof", "want"),
    [(3.841458820694124, 1, 0.05), (5.991464547107979, 2, 0.05), (11.070497693516351, 5, 0.05),
     (18.307038053275146, 10, 0.05), (6.634896601021214, 1, 0.01), (30.577914166892498, 15, 0.01)],
)
def test_chi2_sf_matches_tables(x: float, dof: int, want: float) -> None:
    assert chi2_sf(x, dof) == pytest.approx(want, rel=1e-6)


def test_reference_distribution_is_what_the_sampler_uses() -> None:
    # Cross-check only (the statistical tests compare draws with ref_distribution directly).
    for kw in [dict(temperature=0.7), dict(temperature=1.0, top_k=4),
               dict(temperature=1.0, top_p=0.8), dict(temperature=1.3, min_p=0.15)]:
        got = probabilities(LOGITS, SamplingParams(**kw))  # type: ignore[arg-type]
        np.testing.assert_allclose(got, ref_distribution(LOGITS, **kw), rtol=1e-6, atol=1e-12)  # type: ignore[arg-type]


# -- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "field"),
    [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p"),
     ({"seed": -3}, "seed"), ({"seed": "7"}, "seed")],
)
def test_invalid_params_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kw)  # type: ignore[arg-type]
    assert e.value.where == field
    assert field in str(e.value)


def test_bad_logits_rejected() -> None:
    with pytest.raises(InvalidSamplingParams, match="NaN"):
        probabilities(np.array([0.0, np.nan], dtype=np.float32), SamplingParams(temperature=1.0))
    with pytest.raises(InvalidSamplingParams, match="-inf"):
        probabilities(np.full(3, -np.inf, dtype=np.float32), SamplingParams(temperature=1.0))
    with pytest.raises(InvalidSamplingParams, match="one params"):
        Sampler().sample(np.zeros((2, 3), np.float32), [SamplingParams()], [None])


# -- seeding and batch independence -------------------------------------------------------
def _decode(sampler: Sampler, rows: list[tuple[str, SamplingParams]], steps: int,
            logits_seed: int = 0) -> dict[str, list[int]]:
    """Run `steps` sampling steps; each request sees logits that depend only on (request, step)."""
    out: dict[str, list[int]] = {r: [] for r, _ in rows}
    for step in range(steps):
        batch = np.stack([
            np.random.default_rng([logits_seed, step, sum(map(ord, r))]).normal(size=50)
            .astype(np.float32) for r, _ in rows
        ])
        ids = sampler.sample_requests(batch, [r for r, _ in rows], [p for _, p in rows])
        for (r, _), t in zip(rows, ids, strict=True):
            out[r].append(int(t))
    return out


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    a = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = _decode(Sampler(), [("a", a)], 40)["a"]
    again = _decode(Sampler(), [("a", a)], 40)["a"]
    mixed = _decode(Sampler(), [
        ("g", SamplingParams()),
        ("b", SamplingParams(temperature=0.8, top_k=5, seed=99)),
        ("a", a),
        ("c", SamplingParams(temperature=1.5, min_p=0.05, seed=None)),
    ], 40)["a"]
    assert alone == again == mixed
    other = _decode(Sampler(), [("a", SamplingParams(temperature=1.0, top_p=0.9, seed=1235))], 40)
    assert other["a"] != alone  # a different seed gives a different stream (50 tokens x 40 steps)


def test_greedy_rows_unaffected_by_stochastic_rows() -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(6, 100)).astype(np.float32)
    logits[0, [3, 17, 60]] = logits[0].max() + 1.0  # a tie: lowest index wins
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(top_k=3, top_p=0.2, min_p=0.9),
              SamplingParams(temperature=2.0, seed=2),
              SamplingParams(), SamplingParams(temperature=0.5, top_k=10, seed=3)]
    s = Sampler()
    rngs = [None if p.is_greedy else make_generator(p) for p in params]
    ids = s.sample(logits, params, rngs)
    assert ids.dtype == np.int32
    assert ids[0] == 3
    for i in (0, 2, 4):
        assert ids[i] == int(np.argmax(logits[i]))
    # Swapping the stochastic rows' parameters or logits leaves greedy rows unchanged.
    logits2 = logits.copy()
    logits2[[1, 3, 5]] = rng.normal(size=(3, 100)).astype(np.float32) * 5
    ids2 = s.sample(logits2, params, [None if p.is_greedy else make_generator(p) for p in params])
    assert list(ids2[[0, 2, 4]]) == list(ids[[0, 2, 4]])


def test_greedy_probabilities_one_hot_and_tie_lowest() -> None:
    row = np.array([0.5, 2.0, -1.0, 2.0], dtype=np.float32)
    p = probabilities(row, SamplingParams())
    assert list(p) == [0.0, 1.0, 0.0, 0.0]


def test_stochastic_row_needs_generator() -> None:
    with pytest.raises(InvalidSamplingParams, match="generator"):
        Sampler().sample(LOGITS[None], [SamplingParams(temperature=1.0)], [None])


# -- the distribution sampled ---------------------------------------------------------------
CASES = [
    ("temperature", dict(temperature=1.6)),
    ("top_k", dict(temperature=1.0, top_k=4)),
    ("top_p", dict(temperature=1.0, top_p=0.9)),
    ("min_p", dict(temperature=1.3, min_p=0.15)),
    ("all", dict(temperature=1.2, top_k=7, top_p=0.9, min_p=0.05)),
]


@pytest.mark.parametrize(("name", "kw"), CASES, ids=[c[0] for c in CASES])
def test_samples_follow_the_filtered_distribution(name: str, kw: dict[str, float]) -> None:
    expected = ref_distribution(LOGITS, **kw)  # type: ignore[arg-type]
    support = [i for i, p in enumerate(expected) if p > 0]
    if name != "temperature":
        assert 1 < len(support) < LOGITS.shape[0], "the filter must cut something"
    counts = draw_counts(SamplingParams(seed=20240601 + len(name), **kw))  # type: ignore[arg-type]
    outside = [i for i in range(LOGITS.shape[0]) if expected[i] == 0]
    assert counts[outside].sum() == 0, f"drew tokens outside the support: {counts[outside]}"
    assert min(N_DRAWS * expected[i] for i in support) >= 5  # chi-square approximation valid
    p = chi2_pvalue(counts, expected)
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g} <= {ALPHA}"


def test_chi_square_detects_a_wrong_distribution() -> None:
    # Power check: top-k draws do not fit the unfiltered softmax (the test can fail).
    counts = draw_counts(SamplingParams(temperature=1.0, top_k=4, seed=5))
    wrong = ref_distribution(LOGITS, temperature=1.0)
    assert chi2_pvalue(counts, wrong) < ALPHA
    counts_t = draw_counts(SamplingParams(temperature=1.6, seed=6))
    assert chi2_pvalue(counts_t, ref_distribution(LOGITS, temperature=1.8)) < ALPHA


def test_filters_keep_at_least_one_token() -> None:
    p = probabilities(LOGITS, SamplingParams(temperature=0.05, top_p=1e-9, min_p=1.0))
    assert np.count_nonzero(p) == 1 and p[int(np.argmax(LOGITS))] == 1.0
    rng = make_generator(SamplingParams(seed=0))
    top1 = SamplingParams(temperature=1.0, top_k=1)
    ids = Sampler().sample(np.stack([LOGITS] * 200), [top1] * 200, [rng] * 200)
    assert set(ids.tolist()) == {int(np.argmax(LOGITS))}


def test_masked_tokens_never_drawn() -> None:
    row = LOGITS.copy()
    row[[2, 9]] = -np.inf  # the two largest are masked (e.g. banned tokens)
    params = SamplingParams(temperature=5.0, seed=11)
    rng = make_generator(params)
    ids = Sampler().sample(np.stack([row] * 3000), [params] * 3000, [rng] * 3000)
    assert not np.isin(ids, [2, 9]).any()
    assert len(set(ids.tolist())) == LOGITS.shape[0] - 2
