"""What the code generator proves about a program before running it, and its call-free forms.

* ``_range`` bounds every value an arrival's expression can take (the amount checks it removes
  from the generated arrival code rely on it): random expressions of draws, ``floor``,
  ``ceil``, ``min``, ``max``, ``+``, ``-`` and ``*`` are evaluated as the generated code
  evaluates them, on the draws' extreme values and random ones, and stay inside the bounds.
* ``min(a, C)`` and ``max(a, C)`` with a literal ``C`` are conditionals, not calls: the same
  value, of the same type, as the builtins.
"""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from serq import ast as A
from serq.compile import Env, _amount_range, _range, gen
from serq.parser import parse
from serq.sim import load

#: the largest double below 1 (the uniform stream is in [0, 1))
U_MAX = 1.0 - 2.0**-53


def _expr(text: str) -> A.Expr:
    prog = parse(
        "fn main() {\n  device gpu { }\n  engine E on gpu { schedule { admit waiting; } "
        "execute (10); }\n  workload { arrive poisson(0.001); init { set v = "
        + text
        + "; } }\n  server { run E prefill (1); }\n}\n"
    )
    (fn,) = prog.items
    assert isinstance(fn, A.Fn)
    for item in fn.body:
        if isinstance(item, A.Workload):
            for w in item.items:
                if isinstance(w, A.Init):
                    return w.sets[0].value
    raise AssertionError("no set")


leaf = st.one_of(
    st.integers(-50, 300).map(str),
    st.sampled_from(["0.5", "2.25", "-3.75", "1e3"]),
)


def _combine(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    two = st.tuples(children, children)
    return st.one_of(
        two.map(lambda p: f"~uniform({p[0]}, {p[1]})"),
        st.sampled_from(["~exp(200)", "~exp(0.5)"]),
        children.map(lambda a: f"floor({a})"),
        children.map(lambda a: f"ceil({a})"),
        two.map(lambda p: f"min({p[0]}, {p[1]})"),
        two.map(lambda p: f"max({p[0]}, {p[1]})"),
        two.map(lambda p: f"({p[0]} + {p[1]})"),
        two.map(lambda p: f"({p[0]} - {p[1]})"),
        two.map(lambda p: f"({p[0]} * {p[1]})"),
        children.map(lambda a: f"-({a})"),
    )


exprs = st.recursive(leaf, _combine, max_leaves=6)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(exprs, st.integers(0, 2**32 - 1))
def test_range_bounds_every_value(text: str, seed: int) -> None:
    e = _expr(text)
    r = _range(e, {}, {})
    code = gen(e, Env({}, {}, {}, {}, draws=True))
    rng = random.Random(seed)
    for mode in ("low", "high", "random", "random"):

        def u() -> float:
            return 0.0 if mode == "low" else U_MAX if mode == "high" else rng.random()  # noqa: B023

        def x() -> float:
            return 0.0 if mode == "low" else 36.7 if mode == "high" else rng.expovariate(1.0)  # noqa: B023

        env = {"_U": u, "_X": x, "_floor": math.floor, "_ceil": math.ceil}
        env |= {"_min": min, "_max": max}
        try:
            v = eval(code, env)
        except (OverflowError, ValueError):
            continue  # floor(inf) and the like: a run-time error, located by the simulator
        if r is None:
            continue
        assert r[0] <= v <= r[1], (text, code, v, r)


def test_rad_amounts_are_bounded_and_unchecked(rad_text: str) -> None:
    """RAD's prompts are 128 .. 1,152 tokens and its outputs 1 .. 512: the arrival code needs
    no amount check, no clamp and no zero-work branch."""
    vp = _expr("bcol * floor(~uniform(1, vpmax + 1))")
    vd = _expr("min(floor(~exp(200)) + 1, vdmax)")
    consts = {"bcol": 128, "vpmax": 8, "vdmax": 512}
    assert _amount_range(vp, consts, {}) == (128, 1152)
    assert _amount_range(vd, consts, {}) == (1, 512)
    src = load(text=rad_text).source
    assert "'amount'" not in src and "if _p == 0 and _d == 0:" not in src
    # a program whose amounts can be zero or huge keeps them
    other = rad_text.replace("set vd = min(floor(~exp(200)) + 1, vdmax);", "set vd = ~exp(3);")
    src = load(text=other).source
    assert "raise _Fault(5, 'amount', _d)" in src or "'amount'" in src


@given(
    st.one_of(
        st.integers(-5, 5),
        st.floats(allow_nan=True, allow_infinity=True, width=64),
        st.sampled_from([3, 3.0, -0.0, 0.0]),
    ),
    st.sampled_from(["3", "3.0", "(-2)", "0.0", "1e30"]),
)
def test_min_max_with_a_literal_is_the_builtin(a: float, lit: str) -> None:
    c = eval(lit)
    for func, py in (("min", min), ("max", max)):
        for args in (("a_", lit), (lit, "a_")):
            e = _expr(f"{func}({args[0]}, {args[1]})".replace("a_", "~uniform(0, 1)"))
            code = gen(e, Env({}, {}, {}, {}, draws=True))
            assert "_min(" not in code and "_max(" not in code, code
            code = code.replace("(0 + 1.0 * _U())", "A")
            assert "_U" not in code, code
            got = eval(code, {"A": a})
            want = py(a, c) if args[0] == "a_" else py(c, a)
            assert type(got) is type(want)
            assert got == want or (got != got and want != want) or (got is want)
            if isinstance(want, float) and want == 0.0:
                assert math.copysign(1.0, got) == math.copysign(1.0, want)
