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


# ------------------------------------------------------------------ runs in closed form

#: claims that the closed form takes (affine in `now` and `served`), failing inside a run
CLOSED: dict[str, tuple[str, float]] = {
    # 8/9 of the token rate: fails once a prefill-heavy stretch outruns it, inside a run
    "rate_scaled": ("served * (tlin + tnl * bcol) * 9 <= bcol * now * 8", 0.0001),
    # the same negated, with the decoders on the int side
    "negated": ("!(served * (tlin + tnl * bcol) * 5 + decoders > bcol * now * 4)", 0.00003),
    # a clock and a token threshold crossed inside runs
    "clock_threshold": ("now < 7654321.5", 0.00003),
    "served_threshold": ("served <= 150000", 0.00003),
}


def _raw_claims(model: Any, horizon: float, seed: int) -> list[Any]:
    from serq.sim import DEFAULT_LIMITS, _call, check_run

    samples = check_run(model, horizon, 0.0, seed, DEFAULT_LIMITS)
    obs: dict[str, list[float]] = {n: [] for n in model.observe_names}
    raw = _call(model, horizon, 0.0, seed, samples, obs, False, DEFAULT_LIMITS)
    return [(v[0], v[1]) if v is not None else None for v, _ in raw["claims"]] + [
        raw["now"],
        raw["iterations"],
        raw["served"],
    ]


@pytest.mark.parametrize("name", sorted(CLOSED))
def test_closed_form_runs_find_the_first_failing_iteration(rad_text: str, name: str) -> None:
    """A claim failing inside a run taken in closed form is recorded at the iteration and time
    the plain loop records (untraced: the fast path's own record, not the traced replay)."""
    old = "served * (tlin + tnl * bcol) <= bcol * now"
    claim, rate = CLOSED[name]
    src = rad_text.replace(old, claim)
    assert src != rad_text
    fast = load(text=src, overrides={"rate": rate})
    plain = load(text=src, overrides={"rate": rate}, fast=False)
    assert "rend < btop" in fast.source  # the closed form is generated for this claim
    for seed in (1, 2):
        got = _raw_claims(fast, 20_000_000, seed)
        want = _raw_claims(plain, 20_000_000, seed)
        assert got == want
        # the claim fails (for each of these, at least once in a run's interior: a bisection)
        assert got[0] is not None


def test_closed_form_is_refused_where_it_would_not_be_exact() -> None:
    """Only comparisons of exact affine sides are taken; other claims are stepped."""
    import ast

    from serq.fastpath import _affine_claim

    def ok(code: str) -> bool:
        return _affine_claim(ast.parse(code, mode="eval").body)

    assert ok("(128.0 * now) >= (served * 4640)")
    assert ok("not (now * 2 < served - 3 * n_dec)")
    assert ok("served * b_tok <= 5")
    assert not ok("now * 0.2 >= served")  # the product rounds
    assert not ok("now + 1 >= served")  # the sum rounds
    assert not ok("served * served <= now")  # not affine
    assert ok("served * n_dec * 2 <= now")  # the counts are constant during a run
    assert not ok("served * now <= 5.0")  # a product of two that vary
    assert ok("now * 2.0 * 4 <= 5.0")
    assert not ok("now * 1099511627776.0 * 1073741824 <= 5.0")  # by 2**70 in all
    assert not ok("now == 5.0")  # holds on one point, not an interval reaching an end
    assert not ok("served / 2 <= now")  # a division
    assert not ok("(served < 3) or (now > 4)")  # a union of intervals
    assert not ok("len(waiting) < served")


def test_binade_bounds_the_exact_regime() -> None:
    from serq.compile import _binade

    assert _binade(0.0) == 1.0
    assert _binade(3.0) == 4.0 and _binade(4.0) == 8.0 and _binade(0.75) == 1.0
    assert _binade(2.0**53 - 1) == 2.0**53
    assert _binade(2.0**53) == 0.0  # no closed form above 2**53 (ulp > 1)
    assert _binade(float("inf")) == 0.0
