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
