"""The cost model of benchmarks/serq_predict.py: the tick fit recovers known prices, and the
jitter stream drives examples/plow_serve.sq's chain to the bins it chose, with the chain's
bin probabilities and a serial correlation when asked for one."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serq_predict as sp  # noqa: E402


def _chain(stream: sp.JitterStream) -> int:
    """The bin plow_serve.sq's jitter chain takes reading ``stream`` (0-based)."""
    for k, t in enumerate(sp.THRESH):
        if stream() < t:
            return k
    return len(sp.THRESH)


def test_jitter_stream_bins_are_the_chains() -> None:
    s = sp.JitterStream(0.0, 0.0, 7)
    got = [_chain(s) for _ in range(20000)]
    assert got == s.bins and not s.pending
    freq = np.bincount(got, minlength=12) / len(got)
    assert np.max(np.abs(freq - np.array(sp.BIN_P))) < 0.008
    assert abs(np.corrcoef(got[:-1], got[1:])[0, 1]) < 0.03  # i.i.d. without correlation


def test_jitter_stream_correlated_bins() -> None:
    s = sp.JitterStream(0.8, 0.97, 3)
    got = np.array([_chain(s) for _ in range(20000)])
    assert list(got) == s.bins
    assert np.corrcoef(got[:-1], got[1:])[0, 1] > 0.6
    assert abs(np.mean(got <= 4) - 0.5) < 0.08  # the marginal is kept (a looser bound)


def test_tick_fit_recovers_the_prices() -> None:
    rng = np.random.default_rng(0)
    tick, d0, d1, launch, tok = 2000.0, 60000.0, 9000.0, 40000.0, 12000.0
    ticks, t = [], 0.0
    for i in range(400):
        rows = int(rng.integers(0, 5))
        ptok = int(rng.integers(8, 49)) if rng.random() < 0.3 or rows == 0 else 0
        pre = (launch + tok * ptok) / 1e6 if ptok else 0.0
        dur = pre + (tick + (d0 + d1 * rows if rows else 0.0)) / 1e6
        ticks.append({"tick": i, "start_s": t, "dur_s": dur, "prefill_s": pre,
                      "decode_rows": rows, "prefill_tokens": ptok,
                      "prefill_chunks": int(ptok > 0)})  # fmt: skip
        t += dur
    f = sp.tick_costs(ticks, 48)
    for name, want in (("tick_us", tick), ("d0_us", d0), ("d1_us", d1), ("launch_us", launch),
                       ("tok_us", tok)):  # fmt: skip
        assert math.isclose(f[name], want, rel_tol=1e-6), (name, f[name], want)
    assert f["row_us"] == 0.0  # one chunk a tick: not told apart from the launch
    assert f["fit_mape_pct"] < 1e-6
