"""`serq sweep`: a grid of --set values × seeds equals the same runs made one by one, locally
(processes) and as Ray tasks; bad ranges and seeds are one-line errors."""

from __future__ import annotations

import csv
import math
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from serq import sweep as sw
from serq.cli import app
from serq.sim import run_file

HORIZON = 1_000_000.0
RATES = "rate=0.00001:0.00005:9"
SEEDS = "1..4"


def _expected(rad_path: Path) -> dict[tuple[float, int], dict[str, object]]:
    """The grid run one by one through the single-run API (what `serq run` does)."""
    out: dict[tuple[float, int], dict[str, object]] = {}
    for k in range(9):
        rate = 0.00001 + k * (0.00005 - 0.00001) / 8
        for seed in range(1, 5):
            r = run_file(rad_path, horizon=HORIZON, seed=seed, overrides={"rate": rate})
            s = r.stats
            out[(rate, seed)] = {
                "arrivals": s["arrivals"],
                "completions": s["completions"],
                "requests_per_s": s["throughput"]["requests_per_s"],
                "ttft_p50": s["ttft_us"].get("p50"),
                "ttft_p99": s["ttft_us"].get("p99"),
                "response_p90": s["response_us"].get("p90"),
                "claim_token_rate": r.claims[0].status,
                "claim_optimal_tiling": r.claims[1].status,
            }
    return out


def _close(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


@pytest.fixture(scope="module")
def expected(rad_path: Path) -> dict[tuple[float, int], dict[str, object]]:
    return _expected(rad_path)


def _check_rows(rows: list[dict[str, object]], expected: dict) -> None:
    assert len(rows) == 36
    seen = set()
    for r in rows:
        rate, seed = float(r["rate"]), int(r["seed"])  # type: ignore[arg-type]
        key = min(expected, key=lambda k: abs(k[0] - rate) + abs(k[1] - seed))
        assert key[1] == seed and math.isclose(key[0], rate, rel_tol=1e-12)
        seen.add(key)
        for col, want in expected[key].items():
            assert _close(r[col], want), (col, r[col], want)
    assert seen == set(expected)


def test_sweep_processes_csv_plot_equal_single_runs(
    rad_path: Path, tmp_path: Path, expected: dict
) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        [
            "sweep",
            str(rad_path),
            "--set",
            RATES,
            "--seeds",
            SEEDS,
            "--horizon",
            str(HORIZON),
            "--jobs",
            "2",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "36 runs (9 points x 4 seeds)" in res.output
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    with (out / "sweep.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    typed = []
    for r in rows:
        t: dict[str, object] = dict(r)
        for k in ("arrivals", "completions"):
            t[k] = int(r[k])
        for k in ("requests_per_s", "ttft_p50", "ttft_p99", "response_p90"):
            t[k] = float(r[k]) if r[k] else None
        typed.append(t)
    _check_rows(typed, expected)
    with (out / "sweep_points.csv").open(encoding="utf-8") as f:
        points = list(csv.DictReader(f))
    assert [int(p["seeds"]) for p in points] == [4] * 9
    rates = [float(p["rate"]) for p in points]
    assert rates == sorted(rates) and math.isclose(rates[0], 1e-5) and math.isclose(rates[-1], 5e-5)
    # the per-point arrivals are the mean of the four seeds' arrivals
    for p in points:
        rate = float(p["rate"])
        runs = [v for (r_, _), v in expected.items() if math.isclose(r_, rate)]
        assert math.isclose(float(p["arrivals"]), sum(v["arrivals"] for v in runs) / 4)
    # a second sweep into the same folder does not overwrite it
    again = CliRunner().invoke(
        app, ["sweep", str(rad_path), "--set", "rate=0.00001", "--out", str(out)]
    )
    assert again.exit_code == 2 and "exists already" in again.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "rate=0.00001:0.00005"], "a range is LO:HI:N"),
        (["--set", "rate=0.00001:0.00005:0"], "number of points must be an integer >= 1"),
        (["--set", "rate=0.00005:0.00001:3"], "runs backwards"),
        (["--set", "rate=a:0.1:3"], "is not a number"),
        (["--set", "nope=1:2:2"], "unknown parameter 'nope'"),
        (["--seeds", "5..2"], "runs backwards"),
        (["--seeds", "1..x"], "a range is A..B"),
        (["--seeds", "-1"], "--seeds expects"),
        (["--seeds", "1,1"], "names a seed twice"),
        (["--jobs", "0"], "--jobs must be"),
    ],
)
def test_bad_ranges_and_seeds(
    rad_path: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    res = CliRunner().invoke(app, ["sweep", str(rad_path), "--out", str(tmp_path / "o"), *args])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(rad_path) in lines[0], res.output
    assert not (tmp_path / "o").exists()


def test_unreachable_ray_address_is_one_line(rad_path: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    for address, message in ((f"127.0.0.1:{port}", "cannot connect"), ("nowhere", "expected")):
        res = CliRunner().invoke(
            app,
            [
                "sweep",
                str(rad_path),
                "--set",
                "rate=0.00001",
                "--ray",
                address,
                "--out",
                str(tmp_path / "o"),
            ],
        )
        assert res.exit_code == 2, res.output
        (line,) = res.output.strip().splitlines()
        assert f"--ray {address}: {message}" in line


def test_parse_range_values() -> None:
    assert sw.parse_range("slots=1:8:8") == ("slots", [1, 2, 3, 4, 5, 6, 7, 8])
    name, vals = sw.parse_range("rate=0.00001:0.00005:9")
    assert name == "rate" and len(vals) == 9 and math.isclose(vals[4], 0.00003)
    assert sw.parse_range("x=1,2.5") == ("x", [1, 2.5])
    assert sw.parse_seeds("1..20") == list(range(1, 21))


@pytest.mark.slow
def test_sweep_on_local_ray_equals_processes(
    rad_path: Path, tmp_path: Path, expected: dict
) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ranges = [sw.parse_range(RATES)]
        seeds = sw.parse_seeds(SEEDS)
        on_ray = sw.run_sweep(rad_path, ranges, seeds, HORIZON, ray_address="")
        procs = sw.run_sweep(rad_path, ranges, seeds, HORIZON, jobs=2)
        # the command, on the Ray session this process holds (`--ray auto` joins it)
        out = tmp_path / "ray"
        args = [
            "sweep",
            str(rad_path),
            "--set",
            RATES,
            "--seeds",
            SEEDS,
            "--horizon",
            str(HORIZON),
            "--ray",
            "auto",
            "--out",
            str(out),
        ]
        res = CliRunner().invoke(app, args)
    finally:
        ray.shutdown()
    assert res.exit_code == 0, res.output
    with (out / "sweep.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(float(r["rate"]), int(r["seed"]), int(r["arrivals"])) for r in rows] == [
        (r["rate"], r["seed"], r["arrivals"]) for r in procs.rows
    ]
    assert (out / "sweep.png").stat().st_size > 10_000 and (out / "sweep_points.csv").is_file()
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in on_ray.rows]
    assert strip == [{k: v for k, v in r.items() if k != "wall_s"} for r in procs.rows]
    assert on_ray.points == procs.points
    _check_rows(on_ray.rows, expected)
