"""Int literals meeting floats, and swapped comparisons, evaluate exactly as written."""

from __future__ import annotations

import itertools
import math

import pytest

from serq import ast as A
from serq import compile as C

VALUES = [0, 1, 7, 2**31 + 5, 2**60 + 1, -3, 0.0, -0.0, 0.5, 1e300, -2.5, math.inf, math.nan]
OPS = ["+", "-", "*", "<", "<=", ">", ">=", "==", "!="]


def _exprs() -> list[A.Expr]:
    now, served, k = A.Name("now"), A.Name("served"), A.Num(128)
    out: list[A.Expr] = []
    for op in OPS:
        out += [A.Binary(op, k, now), A.Binary(op, now, k), A.Binary(op, served, now)]
        out += [A.Binary(op, A.Binary("*", served, A.Num(4640)), A.Binary("*", k, now))]
        out += [A.Binary(op, now, A.Binary("*", served, k))]
    return out


@pytest.mark.parametrize("expr", _exprs(), ids=str)
def test_rewritten_expression_matches_plain(expr: A.Expr, monkeypatch: pytest.MonkeyPatch) -> None:
    env = C.Env({}, {"now": "now", "served": "served"})
    fast = C.gen(expr, env)
    monkeypatch.setattr(C, "_MIXED_OPS", set())
    plain = C.gen(expr, env)
    for now, served in itertools.product([v for v in VALUES if isinstance(v, float)], VALUES):
        got = eval(fast, {}, {"now": now, "served": served})
        want = eval(plain, {}, {"now": now, "served": served})
        assert type(got) is type(want)
        assert got == want or (got != got and want != want), (fast, plain, now, served)


def test_claim_compares_with_the_float_first() -> None:
    env = C.Env({}, {"now": "now", "served": "served"})
    claim = A.Binary(
        "<=", A.Binary("*", A.Name("served"), A.Num(4640)), A.Binary("*", A.Num(128), A.Name("now"))
    )
    assert C.gen(claim, env) == "((128.0 * now) >= (served * 4640))"
