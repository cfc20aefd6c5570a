"""The generated simulator against the reference interpreter, on random programs and traces.

A hypothesis strategy writes programs of the executable fragment (caps, both clauses with
random modes, guards and bounds, costs, draws, servers, observations, claims and ``given``s);
each program is run on many traces (seed, horizon, warm-up). For every trace:

* the plain generated loop (``fast=False``), traced, against :func:`serq.interp.run`: the same
  observable state after **every** iteration (batch, clock, tokens served, the waiting queue,
  each request's prefill and decode progress, completions, which claims are still checked),
  the same claim verdicts with the same counterexamples, the same statistics;
* the fast loop (runs of identical iterations, untraced) against the interpreter: the same
  iteration count, claim verdicts (iteration and time), statistics and observations;
* a run that fails fails in all three, after the same iterations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serq import interp
from serq.checker import check
from serq.compile import Fault, Limits, Model, build
from serq.errors import SerqError
from serq.parser import parse
from serq.sim import SAMPLES, TRACE_LEN, streams

LIMITS = Limits(iterations=5000, arrivals=2000)

# ------------------------------------------------------------------ random programs


def _cmp(draw: st.DrawFn, *, batch: bool) -> str:
    """A bool over the engine state (``batch`` allows the batch so far)."""
    k = draw(st.integers(0, 12))
    atoms = [
        f"running.decoding >= {k}",
        "running.decoding == running.count",
        f"running.prefilling > {k}",
        f"waiting.count > {k}",
        f"running.count < {k + 2}",
        "running.preempted == 0",
        f"now > {draw(st.integers(0, 400_000))}",
        f"served < {draw(st.integers(0, 3000))}",
    ]
    if batch:
        atoms += [f"batch.tokens < {draw(st.integers(1, 300))}", f"batch.requests <= {k}"]
    a = draw(st.sampled_from(atoms))
    shape = draw(st.integers(0, 5))
    if shape == 0:
        return f"{a} || {draw(st.sampled_from(atoms))}"
    if shape == 1:
        return f"{a} && {draw(st.sampled_from(atoms))}"
    if shape == 2:
        return f"!({a})"
    return a


def _mode(draw: st.DrawFn) -> str:
    k = draw(st.integers(2, 12))  # RAD's mode with a threshold that may exceed the cap
    rad = f"running.decoding >= {k} || running.decoding == running.count ? decoding : !decoding"
    return draw(
        st.sampled_from(
            [
                rad,
                "in_mode()",
                f"({_cmp(draw, batch=False)}) ? decoding : !decoding",
                "decoding",
                "!decoding",
            ]
        )
    )


def _bound(draw: st.DrawFn) -> str:
    n = draw(st.integers(1, 300))
    return draw(
        st.sampled_from(
            [
                str(n),
                "bcol",
                f"{n}.5",
                f"running.count + {n % 5}",
                f"max(1, {n} - batch.tokens)",
                f"{n % 40} - batch.tokens",
                f"batch.tokens + running.decoding - {n % 8}",
                f"served > {draw(st.integers(0, 5000))} ? {n} : bcol",
                f"{n} / {draw(st.integers(1, 7))}",
            ]
        )
    )


@st.composite
def programs(draw: st.DrawFn) -> str:
    """The text of a random program that type-checks."""

    # (hypothesis favours the simplest choice, 0 or the first one, and the ends of a range:
    # 0 is the productive choice)
    def some(p: int) -> bool:  # about once in p
        return draw(st.integers(0, 100 * p - 1)) >= 100 * (p - 1)

    bcol = draw(st.sampled_from([1, 4, 16, 64, 128]))
    tlin = draw(st.sampled_from([100, 400, 4000]))
    tnl = draw(st.sampled_from([0, 1, 5, 0.25]))
    rate = draw(st.sampled_from([0.00005, 0.0002, 0.0008]))
    lines = [
        'use "std/args";',
        f"let bcol = {bcol};",
        f"let tlin = {tlin};",
        f"let tnl = {tnl};",
        "fn main() {",
        f'  let rate = args.number("rate", {rate});',
        "  device gpu { }",
        f"  def in_mode() {{ {_cmp(draw, batch=False)} ? decoding : !decoding }}",
        "  def cost_of(n) { tlin * ceil(n / bcol) + tnl * n }",
        "  engine E on gpu {",
    ]
    if not some(3):
        cap = draw(st.sampled_from(["bcol", str(draw(st.integers(1, 24))), _bound(draw)]))
        lines.append(f"    tokens cap {cap};")
    clauses = []

    if not some(10):
        only = f" only ({_mode(draw)})" if not some(3) else ""
        each = f" each at most ({_bound(draw)})" if some(2) else ""
        clauses.append(f"      advance running{only}{each};")
    if True:  # without `admit` nothing would ever run
        only = f" only ({_mode(draw)})" if some(4) else ""
        cond = f" while ({_cmp(draw, batch=True)})" if some(3) else ""
        each = f" each at most ({_bound(draw)})" if some(2) else ""
        clauses.append(f"      admit waiting{only}{cond}{each};")
    lines += ["    schedule {", *clauses, "    }"]
    execute = draw(
        st.sampled_from(
            [
                "cost_of(batch.tokens)",
                "tlin * ceil(batch.tokens / bcol) + tnl * batch.tokens",
                "100 + 3 * batch.requests + tnl * batch.tokens",
                "cost_of(batch.tokens) + (now > 300000 ? 50 : 0)",
                "cost_of(batch.tokens) + served % 7",
                "57.5 + waiting.count",
                # one draw per iteration, from the streams `init` draws from
                "cost_of(batch.tokens) + ~uniform(0, 40)",
                "tnl * batch.tokens * (0.5 + ~exp(0.5)) + (batch.tokens > 64 ? ~exp(30) : 0)",
            ]
        )
    )
    lines += [f"    execute ({execute});", "  }"]
    vp = draw(
        st.sampled_from(
            [
                "bcol * floor(~uniform(1, 5))",
                "floor(~uniform(0, 300))",
                "ceil(~exp(80))",
                "0",
                "37",
                "floor(~uniform(~exp(20), 90))",
            ]
        )
    )
    vd = draw(
        st.sampled_from(
            [
                "min(floor(~exp(30)) + 1, 200)",
                "floor(~uniform(0, 12))",
                "1",
                "0",
                "floor(~exp(4))",
                "ceil(~uniform(1, 3) * 10)",
            ]
        )
    )
    lines += [
        "  workload {",
        "    arrive poisson(rate);",
        "    init {",
        "      set t0 = now;",
        f"      set vp = {vp};",
        f"      set vd = {vd};",
        "      set big = ~uniform(0, 1) < 0.3;",
        "    }",
        "  }",
    ]
    server = ["  server {"]
    if draw(st.booleans()):
        server.append("    observe at_arrival = vp + vd / 3;")
    if not some(5):
        server.append("    run E prefill (cost(E, vp));")
    if draw(st.booleans()):
        server.append("    observe first = now - t0;")
    if not some(5):
        server.append("    run E decode (cost(E, vd));")
    server += ["    observe response = now - t0;", "  }"]
    lines += server
    bodies = [
        "served * (tlin + tnl * bcol) <= bcol * now",
        "tokens == bcol || decoders == residents",
        f"tokens <= {draw(st.integers(1, 400))}",
        f"decoders <= {draw(st.integers(0, 40))}",
        f"waiting.count < {draw(st.integers(1, 30))} || batch.requests > 1",
        _cmp(draw, batch=True),
    ]
    givens = [
        "",
        "",
        "",
        " given (vp == bcol * floor(vp / bcol))",
        " given (vd > 0)",
        " given (!big)",
    ]
    for i in range(draw(st.integers(1, 3))):
        body = draw(st.sampled_from(bodies))
        g = draw(st.sampled_from(givens))
        lines.append(f"  claim c{i}{g}: every iteration of E ({body});")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ one trace, three ways


def _plain(v: Any) -> Any:
    """numpy arrays and defaultdicts as plain lists and dicts, for comparison."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return type(v)(_plain(x) for x in v)
    return v


def _untraced(claims: list[Any]) -> list[Any]:
    """Claim results without the counterexample trace (an untraced run records none)."""
    return [((v[0], v[1]) if v is not None else None, g) for v, g in claims]


SIM_ERRORS = (Fault, ZeroDivisionError, OverflowError, ValueError)


@dataclass(frozen=True)
class Prepared:
    """A program ready for the three: the interpreter's spec, the plain and the fast loop."""

    spec: interp.Spec
    plain: Model
    fast: Model


def prepare(text: str) -> Prepared:
    program = parse(text)
    info = check(program, "<gen>", text)
    return Prepared(
        interp.prepare(info),
        build(program, info, None, "<gen>", fast=False, steps=True),
        build(program, info, None, "<gen>", fast=True),
    )


def compare_trace(p: Prepared, seed: int, horizon: float, warmup: float) -> int:
    """Run one trace through the interpreter, the plain loop and the fast loop; assert they
    agree; return the number of iterations."""
    spec, plain, fast = p.spec, p.plain, p.fast
    times = [horizon * (i + 1) / SAMPLES for i in range(SAMPLES)] + [math.inf]

    ref_steps: list[Any] = []
    try:
        ref: dict[str, Any] | None = interp.run(
            spec, horizon, warmup, *streams(seed, spec.rate), times, TRACE_LEN + 1, True,
            ref_steps, LIMITS,
        )  # fmt: skip
    except SerqError:
        ref = None

    def simulate(model: Any, trace: bool, steps: list[Any] | None) -> tuple[Any, Any]:
        obs: dict[str, list[float]] = {n: [] for n in model.observe_names}
        args = (horizon, warmup, *streams(seed, model.rate), times, TRACE_LEN + 1, obs, trace)
        try:
            raw = model.simulate(*args, LIMITS.iterations, LIMITS.arrivals, steps)
        except SIM_ERRORS:
            return None, None
        return _plain(raw), obs

    sim_steps: list[Any] = []
    got, obs = simulate(plain, True, sim_steps)
    assert sim_steps == ref_steps, _first_difference(sim_steps, ref_steps)
    got_fast, obs_fast = simulate(fast, False, None)
    if ref is None:
        assert got is None and got_fast is None, "the interpreter failed, the simulator did not"
        return len(ref_steps)
    assert got is not None and got_fast is not None, "the simulator failed, the interpreter did not"
    ref_obs = ref.pop("observed")
    assert got == ref
    assert obs == ref_obs
    for key in ("claims",):
        ref[key] = _untraced(ref[key])
        got_fast[key] = _untraced(got_fast[key])
    assert got_fast == ref
    assert obs_fast == ref_obs
    return int(ref["iterations"])


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"iteration {i}: simulator {x} != interpreter {y}"
    return f"lengths {len(a)} != {len(b)}"


TRACES = [
    (seed, h, w) for seed in range(4) for h, w in ((2e5, 0.0), (5e5, 1e5), (8e5, 0.0), (4e5, 3e5))
]


def test_differential_on_the_rad_program(rad_text: str) -> None:
    for seed in range(3):
        text = rad_text.replace('args.number("rate", 0.00002)', 'args.number("rate", 0.0002)')
        assert compare_trace(prepare(text), seed, 5e6, 1e6) > 500


def test_differential_nested_draw_is_drawn_once() -> None:
    """``~uniform(~exp(20), 90)``: the generated ``a + (b - a) U`` drew ``a`` twice before."""
    text = (
        "fn main() {\n  device gpu { }\n  engine E on gpu { schedule { advance running; "
        "admit waiting; } execute (10); }\n  workload { arrive poisson(0.001); init { "
        "set vp = floor(~uniform(~exp(20), 90)); } }\n  server { run E prefill (vp); }\n}\n"
    )
    assert compare_trace(prepare(text), 1, 1e6, 0.0) > 100


def _run_many(n_examples: int, traces: list[tuple[int, float, float]]) -> tuple[int, int, int]:
    counts = {"programs": 0, "traces": 0, "iterations": 0}
    seen: set[str] = set()

    @settings(
        max_examples=n_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(programs())
    def one(text: str) -> None:
        if text in seen:  # hypothesis repeats simple examples; each program is run once
            return
        seen.add(text)
        counts["programs"] += 1
        p = prepare(text)
        for seed, h, w in traces:
            counts["iterations"] += compare_trace(p, seed, h, w)
            counts["traces"] += 1

    one()
    return counts["programs"], counts["traces"], counts["iterations"]


def test_differential_random_programs_quick() -> None:
    """A dozen programs on six traces each: the differential test of every `make test` run
    that skips the slow one."""
    programs_, traces, iterations = _run_many(20, TRACES[:6])
    assert programs_ >= 12 and traces >= 72 and iterations > 5000


@pytest.mark.slow
def test_differential_random_programs() -> None:
    """At least 1,000 traces over at least 50 programs (the acceptance bar of issue 16)."""
    programs_, traces, iterations = _run_many(130, TRACES)  # 86 distinct programs
    assert programs_ >= 50 and traces >= 1000, (programs_, traces)
    print(f"{programs_} programs, {traces} traces, {iterations} iterations")
    assert iterations > 50_000


def test_differential_draw_in_execute() -> None:
    """A draw in ``execute`` is one sample per iteration, read from the streams ``init`` reads
    (after the iteration's arrivals drew theirs): the plain and the fast loop (which steps, a
    drawn duration repeating nothing) agree with the interpreter, and the draw is read."""
    text = (
        "fn main() { device cpu { } engine E on cpu { tokens cap 64; schedule { advance running "
        "each at most (32); admit waiting while (running.count - waiting.count < 4) each at "
        "most (32); } execute (200 + 5 * batch.tokens + ~exp(40) + ~uniform(0, 10)); }\n"
        "  workload { arrive poisson(0.002); init { set p = floor(~uniform(4, 60)); "
        "set o = floor(~uniform(2, 30)); } }\n"
        "  server { run E prefill (p); run E decode (o); }\n"
        "  claim c: every iteration of E (tokens <= 64); }\n"
    )
    p = prepare(text)
    assert compare_trace(p, 3, 3e5, 0.0) > 200
    no_draw = prepare(text.replace(" + ~exp(40) + ~uniform(0, 10)", " + 45"))
    times = [math.inf]
    a = interp.run(p.spec, 3e5, 0.0, *streams(3, p.spec.rate), times)
    b = interp.run(no_draw.spec, 3e5, 0.0, *streams(3, p.spec.rate), times)
    assert a["tbt"] != b["tbt"] and len(set(np.diff(sorted(a["tbt"])))) > 10


def test_draw_outside_execute_and_init_is_refused() -> None:
    text = (
        "fn main() { device cpu { } engine E on cpu { tokens cap (~exp(4)); schedule { "
        "advance running; } execute (1); }\n"
        "  workload { arrive poisson(0.002); init { } }\n"
        "  server { run E decode (3); } }\n"
    )
    with pytest.raises(SerqError, match="only allowed in a workload's init or an engine's execute"):
        check(parse(text), "<t>", text)
