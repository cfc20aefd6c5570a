"""The simulator's runs of identical iterations change nothing: the plain loop gives the same."""

from __future__ import annotations

from typing import Any

import pytest

from serq.sim import load, simulate

DISJUNCT = "every iteration of E (tokens == bcol || decoders == residents);"
VP = "set vp = bcol * floor(~uniform(1, vpmax + 1));"

#: Variants of the RAD program that take every branch of the fast path and of its guards.
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "rad": [],
    "false_claim": [(DISJUNCT, "every iteration of E (tokens == bcol);")],
    "false_rate": [("<= bcol * now);", "<= bcol * now * 0.2);")],
    "given_fails": [(VP, "set vp = 100 + bcol * floor(~uniform(1, vpmax + 1));")],
    "no_only": [("only (in_mode()) ", "")],
    "cap_below_decoders": [("tokens cap bcol;", "tokens cap 64;")],
    "cap_above_tile": [("tokens cap bcol;", "tokens cap 200;")],
    "small_advance": [
        ("each at most (bcol);\n      admit", "each at most (64);\n      admit"),
    ],
    "claim_on_queue": [
        ("(tokens == bcol || decoders == residents)", "(waiting.count < 50 || batch.requests > 3)")
    ],
    "execute_reads_now": [
        ("+ tnl * batch.tokens);", "+ tnl * batch.tokens + (now > 50000000 ? 7 : 0));")
    ],
    "cap_reads_served": [("tokens cap bcol;", "tokens cap (served > 5000000 ? 64 : bcol);")],
    "mode_reads_queue": [("running.decoding == running.count", "waiting.count == 0")],
    "odd_prompts": [(VP, "set vp = 1 + 100 * floor(~uniform(1, vpmax + 1));")],
    "no_decode": [("set vd = min(floor(~exp(200)) + 1, vdmax);", "set vd = floor(~exp(3));")],
    "no_prefill": [(VP, "set vp = bcol * floor(~uniform(0, 2));")],
    # the clock claim on float copies of `served * K`, its int fallback, and the plain loop
    "rate_huge_constant": [
        (
            "served * (tlin + tnl * bcol) <= bcol * now",
            "served * 100000000000 <= bcol * now * 20000000.0",
        )
    ],
    "rate_served_bare": [
        ("served * (tlin + tnl * bcol) <= bcol * now", "bcol * now / (tlin + tnl * bcol) >= served")
    ],
    "rate_served_squared": [
        ("served * (tlin + tnl * bcol) <= bcol * now", "served * served <= bcol * now * 1000.0")
    ],
    "observe_ints": [
        (
            "observe response = now - t0;",
            "observe response = now - t0;\n    observe work = vp + vd / 3;",
        )
    ],
}


def _strip(d: dict[str, Any]) -> dict[str, Any]:
    d.pop("wall_s")
    d["stats"].pop("sim_iterations_per_s")
    return d


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fast_path_matches_plain_loop(rad_text: str, name: str) -> None:
    src = rad_text
    for old, new in VARIANTS[name]:
        assert old in src, old
        src = src.replace(old, new)
    for rate, horizon, warmup in ((0.00003, 30_000_000, 0), (0.00006, 20_000_000, 5_000_000)):
        fast = load(text=src, overrides={"rate": rate})
        plain = load(text=src, overrides={"rate": rate}, fast=False)
        assert "for it in range" in fast.source or name in ("execute_reads_now", "cap_reads_served")
        assert "for it in range" not in plain.source
        a = _strip(simulate(fast, horizon, warmup, 3).as_dict())
        b = _strip(simulate(plain, horizon, warmup, 3).as_dict())
        assert a == b


def test_fast_path_chains_runs_and_hoists_invariant_claims() -> None:
    """RAD's fast loop chains decode runs and checks the clock-free claim once per run."""
    src = load("examples/papers/bari_rad.sq").source
    fast = src[src.index("if FAST:") : src.index("if TR:")]
    assert "while True:" in fast
    loop = fast[fast.index("for it in range") : fast.index("n = it - i0")]
    assert "_sk0" in loop and "n_dec == n_res" not in loop
    assert "served * 4640.0" in fast  # the clock claim on a float copy of `served * K`
