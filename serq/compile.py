"""Compile a checked serQ program into one specialised Python simulation function.

Expressions are translated to Python source with constants folded in and engine state held in
plain local variables; the whole iteration loop is then generated as a single function and
compiled once with :func:`compile`. The hot loop therefore runs on local ints and floats,
without walking the AST or looking names up in dictionaries.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from serq import ast as A
from serq.checker import Info
from serq.errors import Loc, SerqError
from serq.fastpath import fast_block as _fast_block
from serq.fastpath import indent as _ind
from serq.parser import MAX_INT

Value = int | float | bool


@dataclass(frozen=True, slots=True)
class Env:
    """How names translate to Python source in one expression context."""

    consts: Mapping[str, str]
    names: Mapping[str, str] = field(default_factory=dict)
    attrs: Mapping[tuple[str, str], str] = field(default_factory=dict)
    defs: Mapping[str, A.Def] = field(default_factory=dict)
    draws: bool = False

    def with_names(self, extra: Mapping[str, str]) -> Env:
        names = dict(self.names)
        names.update(extra)
        return Env(self.consts, names, self.attrs, self.defs, self.draws)


_PY_OPS = {"||": "or", "&&": "and"}


def literal(v: Value, where: A.Node | None = None) -> str:
    """Python source for a constant value."""
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float) and not math.isfinite(v):
        raise SerqError(f"value {v} is not finite", where.loc if where is not None else None)
    text = repr(v)
    return f"({text})" if v < 0 else text


def gen(e: A.Expr, env: Env) -> str:
    """Translate a checked expression to Python source."""
    if isinstance(e, A.Num):
        return literal(e.value, e)
    if isinstance(e, A.Name):
        n = e.name
        if n == "decoding":
            return "True"
        if n in env.names:
            return env.names[n]
        if n in env.consts:
            return env.consts[n]
        raise SerqError(f"'{n}' is not available here", e.loc)  # pragma: no cover
    if isinstance(e, A.Attr):
        code = env.attrs.get((e.obj, e.attr))
        if code is None:  # pragma: no cover - the checker rejects these
            raise SerqError(f"'{e.obj}.{e.attr}' is not available here", e.loc)
        return code
    if isinstance(e, A.Unary):
        inner = gen(e.operand, env)
        return f"(not {inner})" if e.op == "!" else f"(-{inner})"
    if isinstance(e, A.Binary):
        op = _PY_OPS.get(e.op, e.op)
        left, right = gen(e.left, env), gen(e.right, env)
        if op in _MIXED_OPS:
            # an int literal meeting a float: Python converts it to the same float first, so
            # a float literal gives the same value without the conversion (and lets the
            # interpreter use its float-only fast paths)
            if _small_int_literal(left) and _is_float(e.right, env):
                left += ".0"
            elif _small_int_literal(right) and _is_float(e.left, env):
                right += ".0"
            # a comparison of a number with a float is exact and symmetric; with the float on
            # the left it is decided by float's comparison directly (swapped only when
            # neither side can draw or raise, so nothing is evaluated in another order)
            swap = op in _SWAP and _is_float(e.right, env) and not _is_float(e.left, env)
            if swap and _pure(e.left, env) and _pure(e.right, env):
                return f"({right} {_SWAP[op]} {left})"
        return f"({left} {op} {right})"
    if isinstance(e, A.Cond):
        then, cond, orelse = gen(e.then, env), gen(e.cond, env), gen(e.orelse, env)
        false = ("False", "(not True)")
        if then == "True" and orelse in false:  # a bool condition selecting a mode
            return cond
        if then in false and orelse == "True":
            return f"(not {cond})"
        return f"({then} if {cond} else {orelse})"
    if isinstance(e, A.Call):
        args = [gen(a, env) for a in e.args]
        if e.func in ("min", "max") and len(args) == 2:
            inline = _min_max_inline(e, args)
            if inline is not None:
                return inline
        if e.func in ("ceil", "floor", "min", "max"):
            return f"_{e.func}({', '.join(args)})"
        d = env.defs[e.func]
        body_env = env.with_names({p: f"({a})" for p, a in zip(d.params, args, strict=True)})
        return gen(d.body, body_env)
    if isinstance(e, A.MethodCall):
        pname = e.args[0]
        key = f"args.number:{pname.value}" if isinstance(pname, A.Str) else ""
        if key not in env.names:  # pragma: no cover - the checker rejects these
            raise SerqError("args.number is only allowed in a 'let'", e.loc)
        return env.names[key]
    if isinstance(e, A.Draw):
        if not env.draws:  # pragma: no cover - the checker rejects these
            raise SerqError("a random draw is not allowed here", e.loc)
        args = [gen(a, env) for a in e.args]
        # `_U()` and `_X()` give floats: an int literal multiplying one is written as the
        # same float (see `Binary`)
        if e.dist == "uniform":
            lo, hi = args
            span = _const_span(e.args[0], e.args[1], env)
            if span is not None:
                return f"({lo} + {span} * _U())"
            if _nodes(e.args[0], {}, lambda n: isinstance(n, A.Draw)):
                # a bound that draws is drawn once: `a + (b - a) U` reads `a` twice
                var = f"_lo{e.loc.line}_{e.loc.col}" if e.loc.line else f"_lo{id(e)}"
                return f"(({var} := {lo}) + ({hi} - {var}) * _U())"
            return f"({lo} + ({hi} - {lo}) * _U())"
        scale = args[0] + ".0" if _small_int_literal(args[0]) else args[0]
        return f"({scale} * _X())"
    raise SerqError("this expression cannot be evaluated here", e.loc)  # pragma: no cover


_MIXED_OPS = {"+", "-", "*", "<", "<=", ">", ">=", "==", "!="}
_SWAP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}
_FLOAT_LITERAL = re.compile(r"-?(\d+\.\d*(e[-+]?\d+)?|\d+e[-+]?\d+)")
_SIMPLE = re.compile(r"\(?-?[\w.]+\)?")


_NUM_LITERAL = re.compile(r"\(?-?[0-9][0-9.e+-]*\)?")


def _min_max_inline(e: A.Call, args: list[str]) -> str | None:
    """``min(a, C)`` / ``max(a, C)`` with a numeric literal ``C`` as a conditional, without a
    call: the builtin returns its first argument unless the second is strictly less (``min``)
    or greater (``max``), and so does the conditional, on the same values, evaluating ``a``
    once (``C`` is a literal, so the order of evaluation does not matter)."""
    lit = [i for i, a in enumerate(args) if _NUM_LITERAL.fullmatch(a)]
    if len(lit) != 1:
        return None
    c, a = args[lit[0]], args[1 - lit[0]]
    var = f"_mm{e.loc.line}_{e.loc.col}" if e.loc.line else f"_mm{id(e)}"
    op = "<" if e.func == "min" else ">"
    if lit[0] == 1:  # min(a, C): C if C < a else a
        return f"({c} if {c} {op} ({var} := {a}) else {var})"
    return f"({var} if ({var} := {a}) {op} {c} else {c})"  # min(C, a): a if a < C else C


def _small_int_literal(code: str) -> bool:
    """An int literal that converts to a float exactly (and without overflow)."""
    return code.isdigit() and int(code) <= 2**53


def _is_float(e: A.Expr, env: Env) -> bool:
    """Whether ``e`` always evaluates to a Python ``float`` (``False`` when unsure)."""
    if isinstance(e, A.Num):
        return isinstance(e.value, float)
    if isinstance(e, A.Name):
        if e.name in env.names:
            # the clock, in each context it is read in, is a float variable
            return e.name == "now" and env.names["now"] in ("now", "_ta", "_t")
        code = env.consts.get(e.name, "").strip("()")
        return _FLOAT_LITERAL.fullmatch(code) is not None
    if isinstance(e, A.Draw):
        return True  # `_U()` and `_X()` give floats, and so does any arithmetic with them
    if isinstance(e, A.Unary):
        return e.op == "-" and _is_float(e.operand, env)
    if isinstance(e, A.Binary):
        if e.op == "/":
            return True
        if e.op in ("+", "-", "*"):
            return _is_float(e.left, env) or _is_float(e.right, env)
    return False


def _const_span(lo: A.Expr, hi: A.Expr, env: Env) -> str | None:
    """``hi - lo`` as a float literal when both are int literals (Python would compute the
    same int and convert it to the same float when multiplying the draw)."""
    try:
        a = _eval_const(lo, dict(env.consts))
        b = _eval_const(hi, dict(env.consts))
    except SerqError:
        return None
    if not all(type(v) is int for v in (a, b)) or not abs(b - a) <= 2**53:
        return None
    return repr(float(b - a)) if b >= a else f"({float(b - a)!r})"


def _pure(e: A.Expr, env: Env) -> bool:
    """Whether evaluating ``e`` can neither draw a random number nor raise an error."""
    if isinstance(e, A.Num):
        return True
    if isinstance(e, A.Name):  # a variable or a literal, not a substituted argument
        code = env.names.get(e.name, env.consts.get(e.name, ""))
        return _SIMPLE.fullmatch(code) is not None
    if isinstance(e, A.Unary):
        return _pure(e.operand, env)
    if isinstance(e, A.Binary):
        return e.op in _MIXED_OPS and _pure(e.left, env) and _pure(e.right, env)
    return False


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True, slots=True)
class ClaimSpec:
    name: str
    given: str | None
    body: str
    claim: A.Claim


#: The most tokens one ``run`` of one request may have (above it, token counts and their sums
#: would no longer be exact as floats).
MAX_TOKENS = 2**53
#: A run stops with an error after this many iterations (``--max-iterations``): about 10 s of
#: CPU time in the plain loop.
MAX_ITERATIONS = 10_000_000
#: A run stops with an error after this many arrivals (``--max-arrivals``): a few hundred
#: bytes each.
MAX_ARRIVALS = 2_000_000


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on the work of one run, so that every run ends in bounded time and memory."""

    iterations: int = MAX_ITERATIONS
    arrivals: int = MAX_ARRIVALS


@dataclass(frozen=True, slots=True)
class Site:
    """A construct of the program that one line of the generated code evaluates.

    A run-time error raised on that line is reported at the construct (``file:line:col``), or
    at the one division or rounding inside it that can raise such an error.
    """

    what: str  # "execute", "tokens cap", "claim 'x'", "'set vp'", ...
    expr: A.Expr
    per_request: bool  # evaluated for one request (arrival, first token, completion)
    divisions: tuple[Loc, ...] = ()  # `/` and `%` inside it, through `def` calls
    roundings: tuple[Loc, ...] = ()  # `ceil` and `floor` inside it, through `def` calls


class Fault(Exception):
    """A value the generated loop rejects itself: ``kind`` of ``value`` at site ``site``."""

    def __init__(self, site: int, kind: str, value: object) -> None:
        super().__init__(kind)
        self.site = site
        self.kind = kind
        self.value = value


@dataclass(slots=True)
class Model:
    """A compiled program: parameter values, constants and the generated simulator."""

    filename: str
    params: dict[str, Value]
    consts: dict[str, Value]
    engine: str
    rate: float
    claims: list[ClaimSpec]
    request_vars: list[str]
    observe_names: list[str]
    source: str
    simulate: Callable[..., dict[str, Any]]
    sites: list[Site] = field(default_factory=list)
    site_lines: dict[int, int] = field(default_factory=dict)  # generated line -> site
    rate_loc: Loc | None = None
    observe_locs: list[Loc] = field(default_factory=list)
    text: str | None = None  # the program's source, for diagnostics

    def runtime_error(self, err: BaseException) -> SerqError:
        """The located diagnostic for an error raised while the generated loop ran."""
        return _runtime_error(self, err)


#: The diagnostic for an expression that Python cannot compile (it nests about 200 levels at most).
TOO_DEEP = "this expression is nested too deeply for the simulator"


def _eval_const(e: A.Expr, consts: dict[str, str], names: dict[str, str] | None = None) -> Value:
    code = gen(e, Env(consts, names or {}))
    try:
        value = eval(code, {"_ceil": math.ceil, "_floor": math.floor, "_min": min, "_max": max})
    except (SyntaxError, RecursionError, MemoryError):
        raise SerqError(TOO_DEEP, e.loc) from None
    except ZeroDivisionError:
        raise SerqError("division by zero", e.loc) from None
    except (OverflowError, ValueError) as err:
        raise SerqError(f"arithmetic error: {err}", e.loc) from None
    if not isinstance(value, int | float | bool):  # pragma: no cover
        raise SerqError("not a constant", e.loc)
    if type(value) is int and abs(value) > MAX_INT:
        raise SerqError(
            f"this constant is an integer of {value.bit_length()} bits, above the limit of "
            "2**63 - 1 (write a float such as 1e30)",
            e.loc,
        )
    return value


_ENGINE_ATTRS: dict[tuple[str, str], str] = {
    ("running", "decoding"): "n_dec",
    ("running", "count"): "n_res",
    ("running", "prefilling"): "(n_res - n_dec)",
    ("running", "preempted"): "0",  # nothing preempts in the executable fragment
    ("waiting", "count"): "len(waiting)",
    ("batch", "tokens"): "b_tok",
    ("batch", "requests"): "b_req",
}


def build(
    program: A.Program,
    info: Info,
    overrides: Mapping[str, float] | None = None,
    filename: str = "<input>",
    fast: bool = True,
    steps: bool = False,
) -> Model:
    """Evaluate constants (with ``--set`` overrides) and generate the simulator.

    See :func:`_build`; a program too deep for the generator's recursion is an error.
    """
    try:
        return _build(program, info, overrides, filename, fast, steps)
    except RecursionError:
        raise SerqError("the program is nested too deeply for the simulator") from None


def _build(
    program: A.Program,
    info: Info,
    overrides: Mapping[str, float] | None,
    filename: str,
    fast: bool,
    steps: bool,
) -> Model:
    """Evaluate constants (with ``--set`` overrides) and generate the simulator.

    With ``fast`` (the default) the generated loop also steps runs of identical iterations
    (see :func:`serq.fastpath.fast_block`); ``fast=False`` generates the plain loop, with the
    same results. ``steps=True`` makes a traced run (``TR``) append the state after every
    iteration to ``STEPS`` (the differential tests compare it with :mod:`serq.interp`).
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(info.params))
    if unknown:
        known = ", ".join(sorted(info.params)) or "none"
        raise SerqError(f"unknown parameter '{unknown[0]}' for --set (parameters: {known})")

    # constants, in definition order; args.number reads the override or the default
    consts: dict[str, Value] = {}
    const_code: dict[str, str] = {}
    params: dict[str, Value] = {}
    for let in info.const_defs:
        pnames: dict[str, str] = {}
        for call in _method_calls(let.value):
            name_node = call.args[0]
            assert isinstance(name_node, A.Str)
            pname = name_node.value
            if pname in overrides:
                pvalue: Value = overrides[pname]
            else:
                pvalue = _eval_const(call.args[1], const_code)
            params[pname] = pvalue
            pnames[f"args.number:{pname}"] = literal(pvalue, call)
        value = _eval_const(let.value, const_code, pnames)
        consts[let.name] = value
        const_code[let.name] = literal(value, let)

    if len(info.engines) != 1:
        raise SerqError(
            f"the simulator runs exactly one engine; this program has {len(info.engines)}"
        )
    (engine,) = info.engines.values()
    if not info.workloads:
        raise SerqError("the program has no 'workload' to simulate")
    if not info.servers:
        raise SerqError("the program has no 'server' saying what a request runs")
    for c in info.claims:
        if c.engine != engine.name:  # pragma: no cover - one engine only
            raise SerqError(f"unknown engine '{c.engine}'", c.engine_loc)

    defs = {n: d.node for n, d in info.defs.items()}
    eng_env = Env(const_code, {"now": "now", "served": "served"}, _ENGINE_ATTRS, defs)
    claim_env = eng_env.with_names({"tokens": "b_tok", "decoders": "n_dec", "residents": "n_res"})

    # every line that evaluates a construct of the program is preceded by a comment `# @k`
    # naming it (`sites[k]`), so that a run-time error is reported at the construct
    sites: list[Site] = []
    site_ids: dict[tuple[str, int], int] = {}

    def site(what: str, expr: A.Expr, per_request: bool = False) -> int:
        key = (what, id(expr))
        if key not in site_ids:
            divs = tuple(n.loc for n in _nodes(expr, defs, partial(_may_divide_by_0, consts)))
            rounds = tuple(n.loc for n in _nodes(expr, defs, _is_rounding))
            site_ids[key] = len(sites)
            sites.append(Site(what, expr, per_request, divs, rounds))
        return site_ids[key]

    def at(what: str, expr: A.Expr, per_request: bool = False) -> str:
        return f"# @{site(what, expr, per_request)}"

    cap: str | None = None
    cap_expr: A.Expr | None = None
    exec_code = "0"
    exec_expr: A.Expr = A.Num(0)
    advance: A.Clause | None = None
    admit: A.Clause | None = None
    for item in engine.items:
        if isinstance(item, A.TokensCap):
            cap = gen(item.value, eng_env)
            cap_expr = item.value
        elif isinstance(item, A.Execute):
            # a draw in execute reads the same streams as `init`'s, once per iteration
            exec_code = gen(item.value, Env(eng_env.consts, eng_env.names, eng_env.attrs,
                                            eng_env.defs, draws=True))  # fmt: skip
            exec_expr = item.value
        else:
            for cl in item.clauses:
                if cl.kind == "advance":
                    advance = cl
                else:
                    admit = cl

    (workload,) = info.workloads
    rate_value: float = 0.0
    rate_loc: Loc | None = None
    init_sets: list[A.SetVar] = []
    for w in workload.items:
        if isinstance(w, A.Arrive):
            rv = _eval_const(w.rate, const_code)
            if isinstance(rv, bool) or rv < 0:
                raise SerqError(f"the arrival rate must be a number >= 0, got {rv}", w.loc)
            rate_value = float(rv)
            rate_loc = w.rate.loc
        else:
            init_sets.extend(w.sets)
    req_vars = [s.name for s in init_sets]

    obs_used: set[str] = set()
    for srv in info.servers:
        for step in srv.steps:
            if isinstance(step, A.Observe):
                obs_used |= _names(step.value)
    # ---------------------------------------------------------------- arrival code
    arrive: list[str] = []
    seen: dict[str, str] = {}
    for s in init_sets:
        env = Env(const_code, {"now": "_ta", **seen}, {}, defs, draws=True)
        k = site(f"'set {s.name}'", s.value, per_request=True)
        arrive += [f"# @{k}", f"v_{s.name} = {gen(s.value, env)}"]
        sets_before = {x.name: x.value for x in init_sets[: init_sets.index(s)]}
        if (
            info.request_vars.get(s.name) == "number"
            and not _is_int(s.value, consts, sets_before)
            and not (isinstance(s.value, A.Name) and s.value.name == "now")
        ):
            # a value is finite where it is made (an overflow to inf would go on silently);
            # an int always is, and so is the arrival time
            arrive += [
                f"if not -_INF < v_{s.name} < _INF:",
                f"    raise _Fault({k}, 'nonfinite', v_{s.name})",
            ]
        seen[s.name] = f"v_{s.name}"
    # a request variable set to the arrival time is the list `arr_t` already
    at_arrival = {
        s.name for s in init_sets if isinstance(s.value, A.Name) and s.value.name == "now"
    }
    for n in req_vars:
        if n in obs_used and n not in at_arrival:
            arrive.append(f"RV_{n}.append(v_{n})")
    given_env = Env(const_code, dict(seen), {}, defs)
    claims: list[ClaimSpec] = []
    for i, c in enumerate(info.claims):
        gcode = gen(c.given, given_env) if c.given is not None else None
        claims.append(ClaimSpec(c.name, gcode, gen(c.body, claim_env), c))
        if gcode is not None:
            assert c.given is not None
            arrive += [
                at(f"the 'given' of claim '{c.name}'", c.given, per_request=True),
                f"if g{i} and not {gcode}:",
                f"    g{i} = False; c{i} = False; gf{i} = (rid, _ta)",
            ]
    (server,) = info.servers
    amounts = {"prefill": "0", "decode": "0"}  # whole numbers of tokens
    amount_site: dict[str, int] = {}
    # the values an amount can take (whole tokens), where they are known before the run
    amount_range: dict[str, tuple[float, float]] = {"prefill": (0, 0), "decode": (0, 0)}
    stage_obs: dict[str, list[tuple[str, A.Expr]]] = {"arrive": [], "first": [], "done": []}
    runs = [st for st in server.steps if isinstance(st, A.Run)]
    last_run = runs[-1] if runs else None
    stage = "arrive"
    srv_env = Env(const_code, {"now": "_ta", **seen}, {}, defs)
    for st in server.steps:
        if isinstance(st, A.Run):
            amt = st.amount
            if isinstance(amt, A.Call) and amt.func == "cost":
                amt = amt.args[1]
            amounts[st.phase] = gen(amt, srv_env)
            amount_site[st.phase] = site(
                f"the amount of 'run {st.engine} {st.phase}'", amt, per_request=True
            )
            sets_all = {s.name: s.value for s in init_sets}
            if not _is_int(amt, consts, sets_all):
                amounts[st.phase] = f"_ceil({amounts[st.phase]})"  # an int already needs none
            amount_range[st.phase] = _amount_range(amt, consts, sets_all)
            stage = "done" if st is last_run else "first"
        else:
            stage_obs["done" if last_run is None else stage].append((st.name, st.value))
    observe_names = [st.name for st in server.steps if isinstance(st, A.Observe)]
    obs_env = Env(const_code, {"now": "_t", **{n: f"RV_{n}[rid]" for n in req_vars}}, {}, defs)

    observe_locs = [st.value.loc for st in server.steps if isinstance(st, A.Observe)]

    def observe(stage_name: str) -> list[str]:
        out: list[str] = []
        for name, v in stage_obs[stage_name]:
            out += [
                at(f"observe '{name}'", v, per_request=True),
                f"_o{observe_names.index(name)}({gen(v, obs_env)})",
            ]
        return out

    def finish(t: str) -> list[str]:
        # what a completion adds to the statistics is worked out after the loop (`post`)
        return ["n_res -= 1", f"fr.append(rid); ft.append({t})"]

    done_obs = observe("done")

    def first_token(t: str, remaining: str) -> list[str]:
        body = [
            f"first_t[rid] = {t}",
            f"if arr_t[rid] >= W and {t} <= H:",
            f"    ttft.append({t} - arr_t[rid])",
        ]
        obs = observe("first")
        if obs:
            body += [f"    _t = {t}"] + ["    " + o for o in obs]
        body += [
            f"_d = {remaining}",
            "if _d > 0:",
            "    _f = K + _d",
            "    dec[rid] = _f",
            "    _bl = buckets.get(_f)",
            "    if _bl is None:",
            "        buckets[_f] = [rid]",
            "        _heappush(kh, _f)",
            "    else:",
            "        _bl.append(rid)",
            "    n_dec += 1",
            "else:",
        ]
        body += _ind(finish(t), 1)
        return body

    for var, phase in (("_p", "prefill"), ("_d", "decode")):
        ka = amount_site.get(phase)
        arrive += [f"# @{ka}"] if ka is not None else []
        arrive += [f"{var} = {amounts[phase]}"]
        lo, hi = amount_range.get(phase, (-math.inf, math.inf))
        if lo >= 0 and hi <= MAX_TOKENS:
            pass  # always a whole number of tokens in range: nothing to check or clamp
        elif ka is not None:
            arrive += [
                f"if not 0 <= {var} <= {MAX_TOKENS}:",
                f"    if {var} < 0:",
                f"        {var} = 0",
                "    else:",
                f"        raise _Fault({ka}, 'amount', {var})",
            ]
        else:
            arrive += [f"if {var} < 0:", f"    {var} = 0"]
    # a request with a prompt, or with an output, never finishes at its arrival
    p_lo = amount_range.get("prefill", (0, 0))[0]
    d_lo = amount_range.get("decode", (0, 0))[0]
    arrive += [
        "arr_t.append(_ta); prem.append(_p); dtot.append(_d); first_t.append(-1.0)",
    ]
    if p_lo < 1:  # else the tokens after the first are all of the output: `gden` is `dtot`
        arrive += ["gden.append(_d if _p > 0 else _d - 1)"]
    arr_obs = observe("arrive")
    if arr_obs:
        # like every measurement, only of requests arriving after the warm-up
        arrive += ["if _ta >= W:", "    _t = _ta", *_ind(arr_obs, 1)]
    if p_lo >= 1 or d_lo >= 1:
        arrive += ["waiting.append(rid)", "n_res += 1"]
    else:
        arrive += ["if _p == 0 and _d == 0:", "    n_res += 1", "    first_t[rid] = _ta"]
        arrive += _ind(finish("_ta"), 1)
        arrive += ["else:", "    waiting.append(rid)", "    n_res += 1"]

    # ---------------------------------------------------------------- batch formation
    form: list[str] = []
    cap_code = _fold(f"_floor({cap})") if cap is not None else "_INF"
    # a constant cap (a literal after folding) is set once, before the loop
    cap_const = cap_code == "_INF" or re.fullmatch(r"\(?-?[0-9.e+]+\)?", cap_code) is not None
    if not cap_const:
        if cap_expr is not None:
            form.append(at("tokens cap", cap_expr))
        form.append(f"cap = {cap_code}")
    mode_codes: dict[str, str] = {}

    def mode_var(only: A.Expr | None, kind: str) -> str | None:
        if only is None:
            return None
        code = gen(only, eng_env)
        if code not in mode_codes:
            var = f"m{len(mode_codes)}"
            mode_codes[code] = var
            form.extend([at(f"the 'only' of {kind}", only), f"{var} = {code}"])
        return mode_codes[code]

    adv_mode = mode_var(advance.only, "advance") if advance is not None else None
    adm_mode = mode_var(admit.only, "admit") if admit is not None else None
    trace_mode = adv_mode if adv_mode is not None else (adm_mode or "None")
    # when `advance` would take a chunk of at least b_tok of a request alone in `pre`
    adm_after: str | None = None
    each_at = ""  # the marker of the advance bound, where there is one
    chain_dec: tuple[str, str] | None = None  # (decode selector, its bound) for chaining runs
    form += ["b_tok = b_req = adv = 0; pdone = adone = None; pa = -1"]
    if advance is not None:
        each = (
            _fold(f"_floor({gen(advance.each, eng_env)})") if advance.each is not None else "_INF"
        )
        each_at = (
            at("the 'each at most' of advance", advance.each) if advance.each is not None else ""
        )
        sel_dec = adv_mode or "True"
        chain_dec = (sel_dec, each)
        # prefill amounts are ints: a chunk is one unless the cap or the bound is a float
        to_int = "" if _int_literal(cap_code) and _int_literal(each) else "c = int(c); "
        sel_pre = f"not {adv_mode}" if adv_mode is not None else "True"
        if not re.search(r"\b(b_tok|b_req)\b", each):
            adm_after = f"{sel_pre} and {each} >= b_tok"
        form += [
            f"if n_dec and {sel_dec}:",
            f"    {each_at}",
            f"    e = {each}",
            "    if e >= 1:",
            "        room = cap - b_tok",
            "        if n_dec <= room:",
            "            b_tok += n_dec; b_req += n_dec; adv = 1",
            "        elif room >= 1:",
            "            adv_m = int(room); b_tok += adv_m; b_req += adv_m; adv = 2",
            f"if pre and {sel_pre}:",
            f"    {each_at}",
            f"    e = {each}",
            "    for rid in pre:",
            "        c = prem[rid]",
            "        if c > e:",
            "            c = e",
            "        room = cap - b_tok",
            "        if c > room:",
            "            c = room",
            "        if c <= 0:",
            "            break",
            f"        {to_int}prem[rid] -= c; b_tok += c; b_req += 1; pa = rid",
            "        if prem[rid] == 0:",
            "            if pdone is None:",
            "                pdone = [rid]",
            "            else:",
            "                pdone.append(rid)",
        ]
    if admit is not None:
        each2 = _fold(f"_floor({gen(admit.each, eng_env)})") if admit.each is not None else "_INF"
        cond = gen(admit.while_, eng_env) if admit.while_ is not None else "True"
        to_int2 = "" if _int_literal(cap_code) and _int_literal(each2) else "c = int(c); "
        match = f"(prem[h] == 0) == {adm_mode}" if adm_mode is not None else "True"
        each2_at = at("the 'each at most' of admit", admit.each) if admit.each is not None else ""
        cond_at = at("the 'while' of admit", admit.while_) if admit.while_ is not None else ""
        # a `while` that is a constant true (such as `running.preempted == 0`) is not tested
        cond_lines = (
            []
            if _const_true(cond)
            else [f"        {cond_at}", f"        if not {cond}:", "            break"]
        )
        form += [
            "if waiting and b_tok < cap:",
            f"    {each2_at}",
            f"    e = {each2}",
            "    while waiting:",
            *cond_lines,
            "        h = waiting[0]",
            f"        if not ({match}):",
            "            break",
            "        room = cap - b_tok",
            "        c = prem[h]",
            "        if c:",
            "            if c > e:",
            "                c = e",
            "            if c > room:",
            "                c = room",
            "            if c <= 0:",
            "                break",
            f"            {to_int2}waiting.popleft(); prem[h] -= c; b_tok += c; b_req += 1",
            "            if prem[h] == 0:",
            "                if pdone is None:",
            "                    pdone = [h]",
            "                else:",
            "                    pdone.append(h)",
            "            else:",
            "                pre.append(h)",
            "        else:",
            "            if e < 1 or room < 1:",
            "                break",
            "            waiting.popleft(); b_tok += 1; b_req += 1",
            "            if adone is None:",
            "                adone = [h]",
            "            else:",
            "                adone.append(h)",
        ]

    # ---------------------------------------------------------------- claims
    chk: list[str] = []
    for i, spec in enumerate(claims):
        chk += [
            at(f"claim '{spec.name}'", spec.claim.body),
            f"if c{i} and not {spec.body}:",
            f"    c{i} = False; v{i} = (it, now, list(trace))",
        ]

    end: list[str] = [
        "if adv == 1:",
        "    K += 1",
        "    fl = buckets.pop(K, None)",
        "    if fl is not None:",
        "        _heappop(kh)",
        "        for rid in fl:",
        "            del dec[rid]",
        "            n_dec -= 1",
    ]
    end += _ind(finish("end"), 3)
    end += [
        "elif adv == 2:",
        "    K += 1",
        "    nd = {}",
        "    i = 0",
        "    for rid, f in dec.items():",
        "        if i >= adv_m:",
        "            f += 1",
        "        nd[rid] = f",
        "        i += 1",
        "    dec = nd",
        "    buckets = {}",
        "    for rid, f in dec.items():",
        "        buckets.setdefault(f, []).append(rid)",
        "    kh = sorted(buckets)",
        "    fl = buckets.pop(K, None)",
        "    if fl is not None:",
        "        _heappop(kh)",
        "        for rid in fl:",
        "            del dec[rid]",
        "            n_dec -= 1",
    ]
    end += _ind(finish("end"), 3)
    end += ["if pdone is not None:", "    for rid in pdone:"]
    end += _ind(first_token("end", "dtot[rid]"), 2)
    # drop finished prefills from `pre`: usually just its head
    end += [
        "    if pre:",
        "        _n = 0",
        "        while pre and not prem[pre[0]]:",
        "            pre.popleft(); _n += 1",
        "        if _n < len(pdone) and pre:",
        "            pre = deque([r for r in pre if prem[r]])",
    ]
    end += ["if adone is not None:", "    for rid in adone:"]
    end += _ind(first_token("end", "dtot[rid] - 1"), 2)

    # Runs of identical iterations need a batch that is a function of the request state: no
    # formation expression nor `execute` may read the clock or the token count, and the cap
    # and modes (computed before the batch is reset) may not read the previous batch.
    reads_time = re.compile(r"\b(now|served)\b")
    reads_batch = re.compile(r"\b(b_tok|b_req)\b")
    reset = form.index("b_tok = b_req = adv = 0; pdone = adone = None; pa = -1")
    # nor draw: a drawn duration differs from one iteration to the next
    draws = re.compile(r"\b_[UX]\(\)")
    fast_ok = (
        fast
        and not draws.search(exec_code)
        and not any(reads_time.search(ln) for ln in [*form, exec_code])
        and not any(reads_batch.search(ln) for ln in form[:reset])
    )
    if any(reads_batch.search(ln) for ln in form[:reset]):
        # the cap and the modes read the batch before it is formed: it is empty (and was
        # unbound before the first iteration)
        form.insert(0, "b_tok = 0; b_req = 0")
        reset += 1
    # after an admission the batch repeats only if nothing in the formation reads the queue
    admitted: str | None = None
    if adm_after is not None and not any("len(waiting)" in ln for ln in form):
        admitted = adm_after
    # a claim that reads neither the clock nor the tokens served holds on every iteration of a
    # run if it holds on the first (everything else it can read is constant during a run)
    chk_run: list[str] = []
    chk_first: list[str] = []
    for i, spec in enumerate(claims):
        lines = chk[3 * i : 3 * i + 3]
        if reads_time.search(spec.body):
            chk_run += lines
        else:
            chk_first += lines
    # after a run, the batch the general loop would form next when the queues are empty and
    # the clock has not reached the next event: the decoders alone, or nothing to chain
    chain: list[str] | None = None
    if chain_dec is not None:
        sel, each = chain_dec
        const_each = each == "_INF" or (_int_literal(each) and int(each) >= 1)
        chain = [
            "if it >= MAXIT:",
            "    break",
            *form[:reset],
            f"if not (n_dec and {sel}):",
            "    break",
            # the bound is evaluated on an empty batch, as in the plain loop
            *([] if const_each else ["b_tok = 0; b_req = 0", each_at]),
            "if n_dec > cap:" if const_each else f"if {each} < 1 or n_dec > cap:",
            "    break",
            "b_tok = n_dec; b_req = n_dec",
        ]
    exec_site = site("execute", exec_expr)
    fast_block = (
        _fast_block(
            chk_run,
            chk_first,
            exec_code,
            exec_site,
            finish,
            first_token,
            (each_at, admitted) if admitted is not None else None,
            chain,
        )
        if fast_ok
        else []
    )

    # completions, in order: request `fr[j]` finished at `ft[j]`; those within the horizon
    # count, and those of requests that arrived after the warm-up give a response time, a time
    # between tokens (over the tokens after the first; `gden`) and the `observe`d values
    post = [
        "FT = _np.array(ft, dtype=float); FR = _np.array(fr, dtype=_np.int64)",
        "ok = FT <= H",
        "n_done = int(_np.count_nonzero(ok)); n_done_w = int(_np.count_nonzero(ok & (FT >= W)))",
        "AT = _np.array(arr_t, dtype=float)[FR]",
        "sel = ok & (AT >= W)",
        "FT = FT[sel]; FR = FR[sel]",
        "resp = FT - AT[sel]",
        f"G = _np.array({'gden' if p_lo < 1 else 'dtot'}, dtype=float)[FR]",
        "pos = G > 0",
        "tbt = (FT[pos] - _np.array(first_t, dtype=float)[FR[pos]]) / G[pos]",
    ]
    # an observed `now - t0` of a variable set to the arrival time is the response time: the
    # same float subtraction, done on the arrays
    response = {
        f"_o{observe_names.index(name)}({gen(v, obs_env)})"
        for name, v in stage_obs["done"]
        if isinstance(v, A.Binary)
        and v.op == "-"
        and isinstance(v.left, A.Name)
        and v.left.name == "now"
        and isinstance(v.right, A.Name)
        and v.right.name in at_arrival
    }
    if done_obs and all(ln.startswith("# @") or ln in response for ln in done_obs):
        post += [f"OBS[{name!r}].extend(resp.tolist())" for name, _ in stage_obs["done"]]
    elif done_obs:
        post += [
            "for rid, _t in zip(FR.tolist(), FT.tolist()):",
            *_ind(done_obs, 1),
        ]

    # the observable state after each iteration, for the differential tests (`steps=True`)
    step_hook: list[str] = []
    if steps:
        flags = "".join(f"c{i}, " for i in range(len(claims)))
        step_hook = [
            "STEPS.append((trace[-1], now, served, tuple(waiting),",
            "              tuple((r, prem[r]) for r in pre),",
            "              tuple((r, f - K) for r, f in dec.items()),",
            f"              len(fr), ({flags})))",
        ]

    claim_init = []
    for i in range(len(claims)):
        claim_init.append(f"c{i} = True; v{i} = None; g{i} = True; gf{i} = None")
    claim_out = ", ".join(f"(v{i}, gf{i})" for i in range(len(claims)))
    rv_init = [f"RV_{n} = arr_t" if n in at_arrival else f"RV_{n} = []" for n in req_vars]
    rv_init += [f"_o{i} = OBS[{name!r}].append" for i, name in enumerate(observe_names)]

    src: list[str] = [
        "def _simulate(H, W, IA, U, X, SAMPLES, TRACE_LEN, OBS, TR, MAXIT, MAXARR, STEPS=None):",
        "    _U = U; _X = X; _IA = IA",
        "    now = 0.0; served = 0; it = 0",
        "    waiting = deque(); pre = deque()",
        "    prem = []; dtot = []; arr_t = []; first_t = []; gden = []; fr = []; ft = []",
        "    dec = {}; buckets = {}; K = 0; kh = []",
        "    n_dec = 0; n_res = 0",
        "    nreq = 0; n_done = 0; n_done_w = 0",
        "    ttft = []; tbt = []; resp = []; bc = _defaultdict(int)",
        "    bcd = _defaultdict(int); bcp = _defaultdict(int); FDUR = {}; btop = 0.0",
        "    samples = []; si = 0; s_next = SAMPLES[0]",
        "    trace = deque(maxlen=TRACE_LEN); FAST = not TR",
        *_ind(claim_init, 1),
        *_ind(rv_init, 1),
        "    t_next = _IA() if INV_RATE > 0 else _INF",
        "    if t_next >= H:",
        "        t_next = _INF",
        "    tstop = _min(t_next, s_next, H)",
        *([f"    cap = {cap_code}"] if cap_const else []),
        "    while True:",
        # (`t_next` is _INF once no arrival is left; `now` could reach inf at the horizon)
        "        while t_next <= now and t_next < _INF:",
        "            _ta = t_next",
        "            rid = nreq; nreq += 1",
        "            if rid >= MAXARR:",
        "                raise _Fault(-1, 'arrivals', rid)",
        *_ind(arrive, 3),
        "            t_next = _ta + _IA()",
        "            if t_next >= H:",
        "                t_next = _INF",
        "            tstop = t_next if t_next < s_next else s_next",
        "            if H < tstop:",
        "                tstop = H",
        "        if now >= H:",
        "            break",
        "        while now >= s_next:",
        "            samples.append((s_next, n_res, len(waiting), n_dec)); si += 1",
        "            s_next = SAMPLES[si]",
        "            tstop = t_next if t_next < s_next else s_next",
        "            if H < tstop:",
        "                tstop = H",
        *_ind(form, 2),
        "        if b_tok == 0:",
        "            if t_next == _INF:",
        "                now = H",
        "                break",
        "            now = t_next",
        "            continue",
        "        if it >= MAXIT:",
        "            raise _Fault(-1, 'iterations', it)",
        *_ind(fast_block, 2),
        "        if TR:",
        f"            trace.append((it, now, served, b_tok, b_req, n_dec, n_res, len(waiting), "
        f"{trace_mode}))",
        *_ind(chk, 2),
        f"        # @{exec_site}",
        f"        dur = {exec_code}",
        "        if not 0 <= dur < _INF:",
        f"            raise _Fault({exec_site}, 'duration', dur)",
        f"        # @{exec_site}",
        "        end = now + dur",
        *_ind(end, 2),
        "        if now >= W:",
        "            bc[b_req, b_tok] += 1",
        "        served += b_tok; now = end; it += 1",
        *_ind(step_hook, 2),
        "    for k, n in bcd.items():",
        "        bc[k, k] += n",
        "    for k, n in bcp.items():",
        "        bc[1, k] += n",
        *_ind(post, 1),
        "    while s_next <= H:",
        "        samples.append((s_next, n_res, len(waiting), n_dec)); si += 1",
        "        s_next = SAMPLES[si]",
        "    return dict(now=now, served=served, iterations=it,",
        "                arrivals=nreq, completions=n_done, completions_w=n_done_w,",
        "                residents=n_res, waiting=len(waiting), decoders=n_dec,",
        "                ttft=ttft, tbt=tbt, resp=resp, batches=bc, samples=samples,",
        f"                claims=[{claim_out}])",
    ]
    source = "\n".join(ln for ln in src if ln.strip()) + "\n"
    # a rate so small that its mean gap overflows brings no arrival within any horizon
    inv_rate = 1.0 / rate_value if rate_value > 0 else 0.0
    if not math.isfinite(inv_rate):
        inv_rate = 0.0
    namespace: dict[str, Any] = {
        "_ceil": math.ceil,
        "_floor": math.floor,
        "_min": min,
        "_max": max,
        "_INF": math.inf,
        "INV_RATE": inv_rate,
        "_Fault": Fault,
        "_heappush": heapq.heappush,
        "_defaultdict": defaultdict,
        "_np": np,
        "_heappop": heapq.heappop,
        "_binade": _binade,
        "_int": int,
    }
    from collections import deque

    namespace["deque"] = deque
    site_lines: dict[int, int] = {}
    for lineno, ln in enumerate(source.splitlines(), start=1):
        mark = re.fullmatch(r"\s*# @(\d+)", ln)
        if mark:
            site_lines[lineno + 1] = int(mark[1])
    try:
        code = compile(source, f"<serq:{filename}>", "exec")
    except (SyntaxError, RecursionError, MemoryError) as err:
        bad = site_lines.get(getattr(err, "lineno", None) or 0)
        where = sites[bad].expr.loc if bad is not None else None
        raise SerqError(TOO_DEEP, where) from None
    exec(code, namespace)
    return Model(
        filename=filename,
        params=params,
        consts=consts,
        engine=engine.name,
        rate=rate_value,
        claims=claims,
        request_vars=req_vars,
        observe_names=observe_names,
        source=source,
        simulate=namespace["_simulate"],
        sites=sites,
        site_lines=site_lines,
        rate_loc=rate_loc,
        observe_locs=observe_locs,
    )


def _binade(x: float) -> float:
    """The least power of two above ``x >= 0`` when it is at most 2**53, else 0.0 (no run of
    the generated loop is then taken in closed form: ``serq.fastpath._closed_form``)."""
    _, e = math.frexp(x)
    return math.ldexp(1.0, e) if math.isfinite(x) and e <= 53 else 0.0


def _runtime_error(model: Model, err: BaseException) -> SerqError:
    """Locate an error raised by the generated loop: at the construct whose line raised it."""
    where = f"<serq:{model.filename}>"
    frame_tb = None
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == where:
            frame_tb = tb
        tb = tb.tb_next
    local: dict[str, Any] = dict(frame_tb.tb_frame.f_locals) if frame_tb is not None else {}
    k = err.site if isinstance(err, Fault) else -1
    if not isinstance(err, Fault) and frame_tb is not None:
        k = model.site_lines.get(frame_tb.tb_lineno, -1)
    s = model.sites[k] if 0 <= k < len(model.sites) else None
    what = s.what if s is not None else "the simulation"
    loc = s.expr.loc if s is not None else None
    if isinstance(err, Fault):
        v = err.value
        now = local.get("now", 0.0)
        if err.kind == "iterations":
            return SerqError(
                f"more than {v} iterations before the horizon (stopped at t = {now:g} µs): "
                "the clock barely advances; raise --max-iterations if that is meant"
            )
        if err.kind == "arrivals":
            return SerqError(
                f"more than {v} arrivals before the horizon (stopped at t = {now:g} µs); "
                "lower the rate or the horizon, or raise --max-arrivals",
                model.rate_loc,
            )
        if err.kind == "duration":
            what_v = "negative" if isinstance(v, int | float) and v < 0 else "non-finite"
            problem = f"execute gave a {what_v} duration {v}"
        elif err.kind == "amount":
            problem = f"{what} is {v} tokens, more than the limit of 2**53"
        else:
            problem = f"{what} gave a non-finite value {v}"
    elif isinstance(err, ZeroDivisionError):
        problem = f"division by zero in {what}"
        if s is not None and len(s.divisions) == 1:
            loc = s.divisions[0]
    else:
        problem = f"arithmetic error in {what}: {err}"
        if s is not None and len(s.roundings) == 1 and "integer" in str(err):
            loc = s.roundings[0]
    if s is not None and s.per_request:
        rid = local.get("rid")
        arr_t = local.get("arr_t") or []
        t = arr_t[rid] if isinstance(rid, int) and 0 <= rid < len(arr_t) else local.get("_ta")
        if isinstance(rid, int) and isinstance(t, float):
            problem += f" for request {rid} (arrived at t = {t:g} µs)"
    elif "it" in local and "now" in local:
        problem += f" at iteration {local['it']} (t = {local['now']:g} µs)"
    return SerqError(problem, loc)


def _nodes(e: A.Expr, defs: Mapping[str, A.Def], pred: Callable[[A.Expr], bool]) -> list[A.Expr]:
    """The sub-expressions of ``e`` that satisfy ``pred``, through the bodies of ``def`` calls."""
    out: list[A.Expr] = [e] if pred(e) else []
    kids: tuple[A.Expr, ...] = ()
    if isinstance(e, A.Unary):
        kids = (e.operand,)
    elif isinstance(e, A.Binary):
        kids = (e.left, e.right)
    elif isinstance(e, A.Cond):
        kids = (e.cond, e.then, e.orelse)
    elif isinstance(e, A.Call | A.Draw | A.MethodCall):
        kids = e.args
        if isinstance(e, A.Call) and e.func in defs:
            kids = (*kids, defs[e.func].body)
    for kid in kids:
        out += _nodes(kid, defs, pred)
    return out


def _may_divide_by_0(consts: Mapping[str, Value], e: A.Expr) -> bool:
    """A ``/`` or ``%`` whose divisor is not a nonzero constant."""
    if not (isinstance(e, A.Binary) and e.op in ("/", "%")):
        return False
    d = e.right
    value = (
        d.value if isinstance(d, A.Num) else consts.get(d.name, 0) if isinstance(d, A.Name) else 0
    )
    return bool(value == 0)


def _is_rounding(e: A.Expr) -> bool:
    return isinstance(e, A.Call) and e.func in ("ceil", "floor")


def _fold(code: str) -> str:
    """Evaluate ``code`` now if it reads no state (a constant), else return it unchanged."""
    try:
        value = eval(code, {"_ceil": math.ceil, "_floor": math.floor, "_min": min, "_max": max})
    except Exception:  # reads state, or fails: leave it to run time
        return code
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return literal(value)
    return code


def _const_true(code: str) -> bool:
    """Whether ``code`` reads no state and is true (so testing it can be left out)."""
    try:
        value = eval(code, {"_ceil": math.ceil, "_floor": math.floor, "_min": min, "_max": max})
    except Exception:  # reads state, or fails: tested at run time
        return False
    return value is True


def _int_literal(code: str) -> bool:
    return code.isdigit()


def _is_int(e: A.Expr, consts: Mapping[str, Value], sets: Mapping[str, A.Expr]) -> bool:
    """Whether ``e`` always evaluates to a Python ``int`` (so ``ceil`` would return it as is)."""
    if isinstance(e, A.Num):
        return isinstance(e.value, int) and not isinstance(e.value, bool)
    if isinstance(e, A.Name):
        if e.name in sets:
            inner = {k: v for k, v in sets.items() if k != e.name}  # no cycles
            return _is_int(sets[e.name], consts, inner)
        v = consts.get(e.name)
        return isinstance(v, int) and not isinstance(v, bool)
    if isinstance(e, A.Unary):
        return e.op == "-" and _is_int(e.operand, consts, sets)
    if isinstance(e, A.Binary):
        return e.op in ("+", "-", "*") and all(_is_int(x, consts, sets) for x in (e.left, e.right))
    if isinstance(e, A.Call):
        if e.func in ("ceil", "floor"):
            return True
        if e.func in ("min", "max"):
            return all(_is_int(a, consts, sets) for a in e.args)
    return False


def _amount_range(
    e: A.Expr, consts: Mapping[str, Value], sets: Mapping[str, A.Expr]
) -> tuple[float, float]:
    """Bounds on an amount of work after rounding up to whole tokens (``ceil``); infinite
    where unknown."""
    try:
        r = _range(e, consts, sets)
        if r is None:
            return (-math.inf, math.inf)
        return (
            math.ceil(r[0]) if abs(r[0]) < math.inf else r[0],
            math.ceil(r[1]) if abs(r[1]) < math.inf else r[1],
        )
    except (OverflowError, ValueError):  # a bound too large for a float
        return (-math.inf, math.inf)


def _range(
    e: A.Expr, consts: Mapping[str, Value], sets: Mapping[str, A.Expr]
) -> tuple[float, float] | None:
    """Bounds ``(lo, hi)`` on every value ``e`` takes at an arrival, or None when unknown.

    Each operation used is monotone in each argument (``+``, ``-``, ``*`` over the corners,
    ``floor``, ``ceil``, ``min``, ``max``) and so is rounding to the nearest float, so the
    operation evaluated on the bounds, in floats as the generated code evaluates it, bounds
    the rounded result: no widening is needed. A uniform draw lies between its bounds, an
    exponential one (of a mean >= 0) in ``[0, inf)``.
    """

    def ok(lo: float, hi: float) -> tuple[float, float] | None:
        return None if lo != lo or hi != hi or lo > hi else (lo, hi)  # NaN != NaN

    if isinstance(e, A.Num):
        v = e.value
        return None if isinstance(v, bool) else ok(v, v)
    if isinstance(e, A.Name):
        if e.name in sets:
            inner = {k: v for k, v in sets.items() if k != e.name}  # no cycles
            return _range(sets[e.name], consts, inner)
        c = consts.get(e.name)
        return None if c is None or isinstance(c, bool) else ok(c, c)
    if isinstance(e, A.Unary):
        r = _range(e.operand, consts, sets) if e.op == "-" else None
        return None if r is None else ok(-r[1], -r[0])
    if isinstance(e, A.Binary) and e.op in ("+", "-", "*"):
        a, b = _range(e.left, consts, sets), _range(e.right, consts, sets)
        if a is None or b is None:
            return None
        try:
            if e.op == "+":
                return ok(a[0] + b[0], a[1] + b[1])
            if e.op == "-":
                return ok(a[0] - b[1], a[1] - b[0])
            corners = [x * y for x in a for y in b]
        except OverflowError:
            return None
        return ok(min(corners), max(corners))
    if isinstance(e, A.Call) and e.func in ("floor", "ceil", "min", "max"):
        rs = [_range(x, consts, sets) for x in e.args]
        if any(r is None for r in rs):
            return None
        los = [r[0] for r in rs if r is not None]
        his = [r[1] for r in rs if r is not None]
        if e.func in ("min", "max"):
            f = min if e.func == "min" else max
            return ok(f(los), f(his))
        g = math.floor if e.func == "floor" else math.ceil
        return ok(*(float(x) if math.isinf(x) else g(x) for x in (los[0], his[0])))
    if isinstance(e, A.Draw):
        rs = [_range(x, consts, sets) for x in e.args]
        if any(r is None for r in rs):
            return None
        if e.dist == "uniform":
            # `a + (b - a) * U`, U in [0, 1): from `a` towards `b`; `b - a` may round up, so
            # the far end is widened by two ulps (the near one is exact: `a + x` for x >= 0)
            (a0, a1), (b0, b1) = (r for r in rs if r is not None)

            def up(x: float) -> float:
                return math.nextafter(math.nextafter(x, math.inf), math.inf)

            def down(x: float) -> float:
                return math.nextafter(math.nextafter(x, -math.inf), -math.inf)

            if a1 <= b0:
                return ok(a0, up(b1))
            return ok(down(min(a0, b0)), up(max(a1, b1)))
        scale = rs[0]
        return (0.0, math.inf) if scale is not None and scale[0] >= 0 else None
    return None


def _names(e: A.Expr) -> set[str]:
    if isinstance(e, A.Name):
        return {e.name}
    if isinstance(e, A.Unary):
        return _names(e.operand)
    if isinstance(e, A.Binary):
        return _names(e.left) | _names(e.right)
    if isinstance(e, A.Cond):
        return _names(e.cond) | _names(e.then) | _names(e.orelse)
    if isinstance(e, A.Call | A.Draw | A.MethodCall):
        out: set[str] = set()
        for a in e.args:
            out |= _names(a)
        return out
    return set()


def _method_calls(e: A.Expr) -> list[A.MethodCall]:
    if isinstance(e, A.MethodCall):
        return [e]
    if isinstance(e, A.Unary):
        return _method_calls(e.operand)
    if isinstance(e, A.Binary):
        return _method_calls(e.left) + _method_calls(e.right)
    if isinstance(e, A.Cond):
        return _method_calls(e.cond) + _method_calls(e.then) + _method_calls(e.orelse)
    if isinstance(e, A.Call | A.Draw):
        return [m for a in e.args for m in _method_calls(a)]
    return []
