"""The RAD program of Bari et al. runs unchanged and reproduces the seed's orders of magnitude."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from serq.cli import app
from serq.sim import load, run_file, simulate

H = 100_000_000  # 100 s in µs


@pytest.mark.parametrize(
    ("rate", "expected_arrivals"),
    [(None, 2010), (0.00003, 3000)],
)
def test_rad_claims_hold_and_counts_match_seed(
    rad_path: Path, rate: float | None, expected_arrivals: int
) -> None:
    overrides = {"rate": rate} if rate is not None else None
    r = run_file(rad_path, horizon=H, warmup=0, seed=1, overrides=overrides)
    assert [c.status for c in r.claims] == ["holds", "holds"]
    assert [c.name for c in r.claims] == ["token_rate", "optimal_tiling"]
    s = r.stats
    assert 20_000 <= s["iterations"] <= 26_000
    assert all(c.iterations == s["iterations"] for c in r.claims)
    assert abs(s["arrivals"] - expected_arrivals) < 0.1 * expected_arrivals
    assert s["completions"] / s["arrivals"] > 0.95
    assert s["completions"] <= s["arrivals"]


def test_rad_cli_json(rad_path: Path) -> None:
    res = CliRunner().invoke(
        app,
        [
            "run",
            str(rad_path),
            "--horizon",
            str(H),
            "--warmup",
            "0",
            "--seed",
            "1",
            "--set",
            "rate=0.00003",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["params"] == {"rate": 0.00003}
    assert d["ok"] is True
    assert [c["status"] for c in d["claims"]] == ["holds", "holds"]
    st = d["stats"]
    for key in ("ttft_us", "tbt_us", "response_us"):
        p = st[key]
        assert p["count"] > 0 and p["p50"] <= p["p90"] <= p["p99"] <= p["max"]
    assert st["observe"]["response"]["count"] == st["response_us"]["count"]
    assert sum(h["iterations"] for h in st["batch"]["histogram"]) == st["iterations"]
    assert st["throughput"]["requests_per_s"] > 25


def test_rad_cli_table(rad_path: Path) -> None:
    res = CliRunner().invoke(app, ["run", str(rad_path), "--horizon", "20000000", "--seed", "1"])
    assert res.exit_code == 0, res.output
    assert "token_rate" in res.output and "holds (" in res.output
    assert "time to first token" in res.output


def test_reproducible_and_seed_sensitive(rad_path: Path) -> None:
    m = load(rad_path)
    a = simulate(m, 10_000_000, 0, 7).as_dict()
    b = simulate(m, 10_000_000, 0, 7).as_dict()
    c = simulate(m, 10_000_000, 0, 8).as_dict()
    for d in (a, b, c):
        d.pop("wall_s")
        d["stats"].pop("sim_iterations_per_s")
    assert a == b
    assert a["stats"]["iterations"] != c["stats"]["iterations"]


def test_above_capacity_backlog_grows(rad_path: Path) -> None:
    # Theorem 1: 128 tokens per 4640 µs; ~760 tokens per request -> ~36 requests/s.
    r = run_file(rad_path, horizon=40_000_000, seed=1, overrides={"rate": 0.00006})
    backlog = {round(b["t_us"]): b["residents"] for b in r.stats["backlog"]}
    half, end = backlog[20_000_000], backlog[40_000_000]
    assert end > 1.5 * half > 300
    # the rate claim is pathwise: it holds under any load
    assert r.claims[0].status == "holds"
    # below capacity the backlog stays small
    low = run_file(rad_path, horizon=40_000_000, seed=1)
    assert max(b["residents"] for b in low.stats["backlog"]) < 150


def test_warmup_excludes_early_requests(rad_path: Path) -> None:
    r = run_file(rad_path, horizon=20_000_000, warmup=10_000_000, seed=3)
    s = r.stats
    assert s["iterations_after_warmup"] < s["iterations"]
    assert s["response_us"]["count"] < s["completions"]
