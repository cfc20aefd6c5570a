"""The M/D/1 admission model: formula, a simulation cross-check, window choice, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from plow.serve.admission import (
    AdmissionController,
    QueueModel,
    StepTimes,
    md1_wait,
    window_wait,
)
from plow.serve.prefill_cost import PrefillFit


def simulate_md1(lam: float, service: float, n: int = 200_000, seed: int = 0) -> float:
    """Mean wait in queue of a FIFO single server (Lindley recursion), Poisson arrivals."""
    gaps = np.random.default_rng(seed).exponential(1.0 / lam, size=n)
    w, total = 0.0, 0.0
    for a in gaps[1:]:
        w = max(0.0, w + service - a)
        total += w
    return total / (n - 1)


def test_md1_formula_known_values() -> None:
    assert md1_wait(0.5, 1.0) == pytest.approx(0.5)  # rho=0.5: 0.5 / (2 * 1 * 0.5)
    assert md1_wait(0.0, 1.0) == 0.0
    assert math.isinf(md1_wait(1.0, 1.0)) and math.isinf(md1_wait(2.0, 1.0))
    # deterministic service halves the M/M/1 queue wait rho / (mu - lambda)
    lam, s = 3.0, 0.2
    assert md1_wait(lam, s) == pytest.approx(0.5 * (lam * s) / (1 / s - lam))


@pytest.mark.parametrize("rho", [0.3, 0.7])
def test_md1_matches_a_simulated_queue(rho: float) -> None:
    service = 0.01
    lam = rho / service
    assert simulate_md1(lam, service) == pytest.approx(md1_wait(lam, service), rel=0.08)


def test_window_wait() -> None:
    assert window_wait(5.0, 0.0) == 0.0
    assert window_wait(0.0, 0.2) == pytest.approx(0.2)  # alone: waits the whole window
    assert 0.1 < window_wait(100.0, 0.2) < 0.2  # many joiners wait about half


def _model(launch_s: float, slots: int = 8) -> QueueModel:
    step = StepTimes(d0_s=0.004, d1_s=0.0005, max_batch=slots)
    fit = PrefillFit(launch_s=launch_s, per_row_s=1e-5)
    return QueueModel(step, fit, slots)


def test_window_is_zero_at_low_load_and_opens_when_launches_are_dear() -> None:
    cheap = _model(launch_s=0.0)
    assert cheap.best_window(2.0, 32, 16, cheap.window_grid()).window_s == 0.0
    dear = _model(launch_s=0.05)
    low = dear.best_window(0.5, 32, 16, dear.window_grid())
    high = dear.best_window(40.0, 32, 16, dear.window_grid())
    assert low.window_s == 0.0
    assert high.window_s > 0.0
    # the chosen window really is the grid minimiser and beats no window at high load
    grid = [dear.predict(40.0, 32, 16, w).latency_s for w in dear.window_grid()]
    assert high.latency_s == pytest.approx(min(grid))
    assert high.latency_s < dear.predict(40.0, 32, 16, 0.0).latency_s


def test_predicted_wait_grows_with_load() -> None:
    m = _model(launch_s=0.001)
    waits = [m.predict(lam, 32, 16, 0.0).wait_s for lam in (1, 10, 50, 100)]
    assert waits == sorted(waits) and waits[0] < waits[-1]


def test_refuses_when_the_backlog_exceeds_the_bound() -> None:
    ctl = AdmissionController(_model(launch_s=0.001, slots=2), max_wait_s=0.5)
    now = 100.0
    ctl._start = 0.0
    assert ctl.decide(now, waiting=0, free_slots=2).admit
    d = ctl.decide(now, waiting=200, free_slots=0)
    assert not d.admit and d.retry_after_s >= 1 and d.predicted_wait_s > 0.5
    assert "exceeds the bound" in d.reason
