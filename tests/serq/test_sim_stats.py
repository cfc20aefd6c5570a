"""The batch statistics computed from counts equal numpy's on the repeated array, bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest

from serq.sim import _pct, _pct_counts, _repeat


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_counts_match_the_array_statistics(dtype: type) -> None:
    rng = random.Random(7)
    cases: list[dict[int, int]] = [{1: 1}, {5: 2}, {3: 1, 9: 1}, {128: 40, 1: 3}, {}]
    for _ in range(300):
        keys = rng.sample(range(1, 5000), rng.randint(1, 12))
        cases.append({k: rng.choice([1, 2, 3, 17, 1000, rng.randint(1, 50000)]) for k in keys})
    for counts in cases:
        want = _pct(_repeat(counts, dtype)) if counts else {"count": 0}
        got = _pct_counts(counts, dtype)
        assert got == want, counts
        assert [type(got[k]) for k in got] == [type(want[k]) for k in want]


def test_huge_sums_take_the_array_path() -> None:
    counts = {2**40: 2**14, 3: 5}  # weighted sum above 2**53: numpy's float sum rounds
    assert _pct_counts(counts, np.int64) == _pct(_repeat(counts, np.int64))


def test_percentiles_are_numpys() -> None:
    """``_pct`` (one sort and numpy's interpolation) equals ``np.percentile``, bit for bit."""
    rng = np.random.default_rng(3)
    arrays = [np.array([2.5]), np.array([1.0, 1.0]), np.array([3.0, -1.0]), np.zeros(7)]
    for _ in range(400):
        n = int(rng.integers(1, 3000))
        kind = int(rng.integers(0, 3))
        if kind == 0:
            a = rng.exponential(1e4, n)
        elif kind == 1:
            a = rng.integers(0, 50, n).astype(float)  # many ties
        else:
            a = rng.normal(0, 1, n) * 10.0 ** float(rng.integers(-5, 12))
        arrays.append(a)
    for a in arrays:
        got = _pct(a)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        want = {"count": a.size, "mean": a.mean(), "p50": p50, "p90": p90, "p99": p99}
        want["max"] = a.max()
        assert got == {k: float(v) if k != "count" else int(v) for k, v in want.items()}
        assert _pct(a.tolist()) == got


def test_streams_do_not_depend_on_the_first_block() -> None:
    """A run's random numbers are the same whatever size its streams' first blocks have."""
    from serq.sim import BLOCK, streams

    for expected in (0, 10, 1000, BLOCK, 10**9):
        a = streams(11, 0.0003, expected)
        b = streams(11, 0.0003)
        for sa, sb in zip(a, b, strict=True):
            assert [sa() for _ in range(2 * BLOCK + 5)] == [sb() for _ in range(2 * BLOCK + 5)]
