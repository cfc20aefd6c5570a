"""Property tests: the pretty-printer round-trips, and no input crashes the front end."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serq import ast as A
from serq.checker import check
from serq.compile import build
from serq.errors import SerqError
from serq.parser import KEYWORDS, parse
from serq.pretty import pretty

# ------------------------------------------------------------------ random ASTs

names = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(lambda s: s not in KEYWORDS)
numbers = st.one_of(
    st.integers(min_value=0, max_value=10**12),
    st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False),
)
leaves = st.one_of(
    st.builds(A.Num, numbers),
    st.builds(A.Name, names),
    st.builds(A.Attr, st.sampled_from(["running", "batch", "waiting"]), names),
)


def _compound(children: st.SearchStrategy[A.Expr]) -> st.SearchStrategy[A.Expr]:
    ops = st.sampled_from(["||", "&&", "==", "!=", "<", "<=", ">", ">=", "+", "-", "*", "/", "%"])
    args = st.lists(children, max_size=3).map(tuple)
    return st.one_of(
        st.builds(A.Unary, st.sampled_from(["!", "-"]), children),
        st.builds(A.Binary, ops, children, children),
        st.builds(A.Cond, children, children, children),
        st.builds(A.Call, names, args),
        st.builds(A.Draw, names, args),
        st.builds(
            A.MethodCall, st.just("args"), names, st.tuples(st.builds(A.Str, names), children)
        ),
    )


exprs = st.recursive(leaves, _compound, max_leaves=12)
clauses = st.builds(
    A.Clause,
    st.sampled_from(["advance", "admit"]),
    names,
    st.none() | exprs,
    st.none() | exprs,
    st.none() | exprs,
)
engine_items = st.one_of(
    st.builds(A.TokensCap, exprs),
    st.builds(A.Schedule, st.lists(clauses, max_size=2).map(tuple)),
    st.builds(A.Execute, exprs),
)
main_stmts = st.one_of(
    st.builds(A.Let, names, exprs),
    st.builds(A.Device, names),
    st.builds(A.Def, names, st.lists(names, max_size=2).map(tuple), exprs),
    st.builds(A.Engine, names, names, st.lists(engine_items, max_size=3).map(tuple)),
    st.builds(
        A.Workload,
        st.lists(
            st.one_of(
                st.builds(A.Arrive, names, exprs),
                st.builds(
                    A.Init, st.lists(st.builds(A.SetVar, names, exprs), max_size=3).map(tuple)
                ),
            ),
            max_size=2,
        ).map(tuple),
    ),
    st.builds(
        A.Server,
        st.lists(
            st.one_of(
                st.builds(A.Run, names, st.sampled_from(["prefill", "decode"]), exprs),
                st.builds(A.Observe, names, exprs),
            ),
            max_size=3,
        ).map(tuple),
    ),
    st.builds(A.Claim, names, st.none() | exprs, names, exprs),
)
programs = st.builds(
    A.Program,
    st.lists(
        st.one_of(
            st.builds(A.Use, names),
            st.builds(A.Let, names, exprs),
            st.builds(A.Fn, names, st.lists(main_stmts, max_size=5).map(tuple)),
        ),
        max_size=4,
    ).map(tuple),
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs)
def test_pretty_round_trip(p: A.Program) -> None:
    text = pretty(p)
    assert parse(text) == p
    assert pretty(parse(text)) == text


def test_pretty_round_trip_rad(rad_text: str) -> None:
    p = parse(rad_text)
    assert parse(pretty(p)) == p


# ------------------------------------------------------------------ no crashes


def _front_end(text: str) -> None:
    try:
        prog = parse(text, "fuzz.sq")
        info = check(prog, "fuzz.sq", text)
        build(prog, info, None, "fuzz.sq")
    except SerqError as err:
        assert err.filename == "fuzz.sq" or err.filename is None
        assert err.message
        rendered = err.render()
        assert isinstance(rendered, str) and rendered


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs)
def test_generated_programs_never_crash_checker(p: A.Program) -> None:
    _front_end(pretty(p))


TOKENS = [
    "let",
    "fn",
    "main",
    "(",
    ")",
    "{",
    "}",
    ";",
    "=",
    "x",
    "E",
    "gpu",
    "device",
    "engine",
    "on",
    "tokens",
    "cap",
    "schedule",
    "advance",
    "admit",
    "running",
    "waiting",
    "only",
    "while",
    "each",
    "at",
    "most",
    "execute",
    "workload",
    "arrive",
    "poisson",
    "init",
    "set",
    "server",
    "run",
    "prefill",
    "decode",
    "observe",
    "claim",
    "given",
    "every",
    "iteration",
    "of",
    ":",
    "?",
    "||",
    "&&",
    "!",
    "==",
    "<=",
    "+",
    "-",
    "*",
    "/",
    "%",
    "~uniform",
    "~exp",
    "1",
    "0.5",
    "128",
    "now",
    "served",
    "decoding",
    "ceil",
    "min",
    ",",
    ".",
    '"std/args"',
    "use",
    "args.number",
    '"rate"',
    "//c\n",
    "@",
    "\n",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=40))
def test_token_soup_never_crashes(tokens: list[str]) -> None:
    _front_end(" ".join(tokens))


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_rad_never_crashes(rad_text: str, data: st.DataObject) -> None:
    text = rad_text
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        j = data.draw(st.integers(i, min(len(text), i + 30)))
        kind = data.draw(st.sampled_from(["delete", "insert", "dup", "swap"]))
        if kind == "delete":
            text = text[:i] + text[j:]
        elif kind == "insert":
            text = text[:i] + " " + data.draw(st.sampled_from(TOKENS)) + " " + text[i:]
        elif kind == "dup":
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = text[:i] + data.draw(st.text(max_size=5)) + text[j:]
    _front_end(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_arbitrary_text_never_crashes(text: str) -> None:
    _front_end(text)
