"""examples/plow_serve.sq, plow's dispatcher as a serQ program: its claims hold, and a request
alone on the node sees exactly the priced launches (TTFT one prefill launch of one padded
chunk, then one decode tick per output token)."""

from __future__ import annotations

from pathlib import Path

from serq.prove import prove_file
from serq.sim import load, simulate

PROGRAM = Path(__file__).resolve().parents[2] / "examples" / "plow_serve.sq"


def test_plow_serve_claims_hold_under_load() -> None:
    r = simulate(load(PROGRAM, overrides={"rate": 0.00001}), 3e7, 0.0, 3)
    assert [c.status for c in r.claims] == ["holds", "holds"]
    assert r.stats["completions"] > 250


def test_plow_serve_alone_pays_the_priced_launches() -> None:
    # one request every 20 s on average, each done in well under a second
    r = simulate(load(PROGRAM, overrides={"rate": 0.00000005}), 1e9, 0.0, 5)
    s = r.stats
    assert s["arrivals"] > 20
    # prefill: launch 3000 µs + 40 µs per row * one 64-row chunk (prompts are 8..48 tokens)
    assert s["ttft_us"]["p50"] == 3000 + 40 * 64
    # decode: 8000 µs + 600 µs per decoding row, one row
    assert s["tbt_us"]["p50"] == 8000 + 600


def test_plow_serve_host_costs_add_to_every_tick() -> None:
    # the host's tick cost and its per-request cost come on top of the launches
    over = {"rate": 0.00000005, "tick_us": 500, "row_us_host": 100}
    s = simulate(load(PROGRAM, overrides=over), 1e9, 0.0, 5).stats
    assert s["ttft_us"]["p50"] == 3000 + 40 * 64 + 500 + 100
    assert s["tbt_us"]["p50"] == 8000 + 600 + 500 + 100


def test_plow_serve_outside_the_proved_fragment() -> None:
    (budget, slots) = prove_file(PROGRAM)
    assert not budget.proved and "subtraction" in budget.detail
    assert not slots.proved


def test_prove_cli_json_and_exit_status() -> None:
    import json

    from typer.testing import CliRunner

    from serq.cli import app

    res = CliRunner().invoke(app, ["prove", str(PROGRAM), "--json"])
    assert res.exit_code == 1  # a claim is not proved
    out = json.loads(res.stdout)
    assert [(c["claim"], c["proved"]) for c in out["claims"]] == [
        ("token_budget", False),
        ("slot_table", False),
    ]
    assert out["claims"][0]["detail"].startswith("the engine is not exported to Rocq at ")
    # Theorem 2 is reported beside the claims, and is not about this engine
    assert out["stability"]["proved"] is False
    assert out["stability"]["detail"].startswith("the engine is not exported to Rocq at ")


def test_prove_cli_without_the_library(rad_path: Path) -> None:
    from typer.testing import CliRunner

    from serq.cli import app

    res = CliRunner().invoke(app, ["prove", str(rad_path)], env={"SERQ_ROCQ_LIB": "/nonexistent"})
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"{rad_path}: the Rocq library is not built at /nonexistent (run make proofs)"
    ]


def test_plow_serve_prefill_priced_per_prompt_token() -> None:
    # tok_us prices the prompt tokens a launch carries (unpadded): 20-token prompts, 10 µs each
    over = {"rate": 0.00000005, "tok_us": 10, "plo": 20, "phi": 20}
    s = simulate(load(PROGRAM, overrides=over), 1e9, 0.0, 5).stats
    assert s["ttft_us"]["p50"] == 3000 + 40 * 64 + 10 * 20
    assert s["tbt_us"]["p50"] == 8000 + 600  # the decode tick carries no prompt tokens
