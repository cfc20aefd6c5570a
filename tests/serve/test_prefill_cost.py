"""The prefill cost fit and the chunk-size choice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from plow.serve.prefill_cost import (
    PrefillFit,
    choose_chunk_size,
    fit_prefill,
    ladder,
    plan_cost,
)


def test_fit_recovers_a_line_and_reports_residuals() -> None:
    pts = [(n, 0.004 + 5e-5 * n) for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    fit = fit_prefill(pts)
    assert abs(fit.launch_s - 0.004) < 1e-9 and abs(fit.per_row_s - 5e-5) < 1e-12
    assert abs(fit.launch_rows - 80.0) < 1e-6
    assert fit.max_abs_residual_s < 1e-9 and fit.r2 > 0.999999
    noisy = fit_prefill([(n, t * (1.1 if n == 8 else 1.0)) for n, t in pts])
    assert noisy.max_abs_residual_s > 1e-5
    assert [p.rows for p in noisy.points] == [p[0] for p in pts]


def test_fit_survives_a_sweep_without_slope() -> None:
    fit = fit_prefill([(1, 0.01), (8, 0.009), (64, 0.008)])
    assert fit.per_row_s > 0 and fit.launch_s >= 0


def test_launch_cost_decides_between_many_small_and_few_padded_chunks() -> None:
    cheap = choose_chunk_size([100], 128, launch_rows=0.0)
    dear = choose_chunk_size([100], 128, launch_rows=1000.0)
    assert (cheap.chunk, cheap.launches, cheap.padded_rows) == (16, 7, 112)  # least padding
    assert (dear.chunk, dear.launches, dear.padded_rows) == (128, 1, 128)  # fewest launches
    # three prompts of 40 with a budget of 128: 64-row chunks need 2 launches, 128-row ones 3
    assert choose_chunk_size([40, 40, 40], 128, launch_rows=1000.0).launches == 2


@settings(max_examples=200, deadline=None)
@given(
    remaining=st.lists(st.integers(1, 300), min_size=1, max_size=8),
    budget=st.integers(1, 512),
    launch_rows=st.floats(0, 500),
)
def test_choice_is_the_minimum_over_candidates(
    remaining: list[int], budget: int, launch_rows: float
) -> None:
    best = choose_chunk_size(remaining, budget, launch_rows)
    assert 1 <= best.chunk <= budget
    for c in ladder(budget):
        assert best.cost_rows <= plan_cost(remaining, c, budget, launch_rows).cost_rows + 1e-9
    # every chunk is covered and a launch never exceeds the budget
    assert best.padded_rows >= sum(remaining)
    assert best.launches * budget >= best.padded_rows
    assert best.launches >= max(-(-n // best.chunk) for n in remaining)


def test_calibrate_prefill_cli_writes_the_fit(tmp_path: Path, tiny_ckpt: Path) -> None:
    out = tmp_path / "fit.json"
    proc = subprocess.run(
        [sys.executable, "-m", "plow.cli", "calibrate", "prefill", str(tiny_ckpt),
         "--lengths", "1,4,16", "--reps", "1", "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    fit = PrefillFit.model_validate(json.loads(out.read_text()))
    assert [p.rows for p in fit.points] == [1, 4, 16]
    assert fit.per_row_s > 0
    assert "residual" in proc.stderr


def test_calibrate_prefill_cli_bad_input_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "plow.cli", "calibrate", "prefill", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("plow: ") and "Traceback" not in proc.stderr
