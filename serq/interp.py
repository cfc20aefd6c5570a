"""The reference interpreter of serQ's executable fragment: what a program means, plainly.

The compiled simulator (:mod:`serq.compile`, :mod:`serq.fastpath`) generates one specialised
Python function per program and shortcuts runs of identical iterations; this module states
the same semantics directly on the AST, one small function per rule, for reading, for testing
the simulator against (``tests/serq/test_differential.py`` compares them iteration by
iteration), and as the text to carry over to Rocq. It is slow and does not try to be fast.

**State** (:class:`State`): the clock ``now``, the tokens ``served``, the iteration count,
every request that has arrived (:class:`Request`: its ``set`` variables, prefill and decode
tokens left, first-token time), and four sequences of request ids: ``waiting`` (arrived, not
admitted; FIFO), ``prefilling`` (admitted, prefill left; admission order), ``decoding``
(prefill done, decode left; in the order they started decoding) and ``ended`` (finished, with
the finish time; completion order). Every request that has arrived and not ended is in
exactly one of the first three between iterations.

**One iteration** (:func:`iteration`), at time ``now``:

1. arrivals at or before ``now`` join ``waiting`` (:func:`arrive`);
2. the batch is formed (:func:`form_batch`): ``tokens cap`` and the two ``only`` modes are
   evaluated on the state at the start; then ``advance`` (decoders one token each, oldest
   first when the cap binds; then the prefills in admission order, each ``min(left, each,
   room)``), then ``admit`` (the head of ``waiting`` while ``while`` holds, its phase matches
   and the cap leaves room); ``each`` is evaluated where a clause starts serving, on the batch
   so far, and ``while`` before each admission;
3. an empty batch is no iteration: the clock jumps to the next arrival;
4. the claims are checked (:func:`check_claims`), ``execute`` gives the duration, and at
   its end (:func:`finish_iteration`) decoders that served their last token end, completed
   prefills start decoding (or end), admitted decoders count their token, ``served`` grows.

Claims are predicates on (state, batch), checked every iteration until the first violation.
Numbers are Python ints and floats with Python's arithmetic, exactly as in the generated code,
so both give bit-identical times and statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from serq import ast as A
from serq.checker import Info
from serq.compile import MAX_TOKENS, Limits
from serq.errors import Loc, SerqError
from serq.parser import MAX_INT

Value = int | float | bool
INF = math.inf


# ----------------------------------------------------------------------------- expressions


@dataclass(frozen=True, slots=True)
class Thunk:
    """A ``def`` argument: evaluated where the body reads it (``def`` is a macro)."""

    expr: A.Expr
    env: Env


@dataclass(frozen=True, slots=True)
class Env:
    """What an expression reads: names (constants, variables, ``now``...), engine state
    (``running.count``...), the ``def`` functions and, in ``init``, the random draws."""

    names: Mapping[str, Value | Thunk]
    attrs: Mapping[tuple[str, str], Value] = field(default_factory=dict)
    defs: Mapping[str, A.Def] = field(default_factory=dict)
    draw: Callable[[str], float] | None = None


def ev(e: A.Expr, env: Env) -> Value:
    """The value of a checked expression; a run-time error is a located :class:`SerqError`."""
    if isinstance(e, A.Binary):
        return binary(e, env)
    if isinstance(e, A.Name):
        if e.name == "decoding":
            return True
        v = env.names[e.name]
        return ev(v.expr, v.env) if isinstance(v, Thunk) else v
    if isinstance(e, A.Attr):
        return env.attrs[e.obj, e.attr]
    if isinstance(e, A.Num):
        return e.value
    if isinstance(e, A.Unary):
        x = ev(e.operand, env)
        return (not x) if e.op == "!" else -x
    if isinstance(e, A.Cond):
        return ev(e.then, env) if ev(e.cond, env) else ev(e.orelse, env)
    if isinstance(e, A.Call):
        return call(e, env)
    if isinstance(e, A.MethodCall):  # args.number: replaced by its value when constants are made
        return env.names[f"args.number:{_param(e)}"]  # type: ignore[return-value]
    if isinstance(e, A.Draw):
        assert env.draw is not None
        args = [ev(a, env) for a in e.args]
        if e.dist == "uniform":
            lo, hi = args
            return lo + (hi - lo) * env.draw("uniform")
        return args[0] * env.draw("exp")
    raise SerqError("this expression cannot be evaluated", e.loc)  # pragma: no cover


def binary(e: A.Binary, env: Env) -> Value:
    if e.op == "&&":
        return bool(ev(e.left, env)) and bool(ev(e.right, env))
    if e.op == "||":
        return bool(ev(e.left, env)) or bool(ev(e.right, env))
    a, b = ev(e.left, env), ev(e.right, env)
    try:
        return _OPS[e.op](a, b)
    except ZeroDivisionError:
        raise SerqError("division by zero", e.loc) from None
    except (OverflowError, ValueError) as err:
        raise SerqError(f"arithmetic error: {err}", e.loc) from None


_OPS: dict[str, Callable[[Any, Any], Value]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "%": lambda a, b: a % b,
}


def call(e: A.Call, env: Env) -> Value:
    if e.func in ("min", "max"):
        args = [ev(a, env) for a in e.args]
        return min(args) if e.func == "min" else max(args)
    if e.func in ("ceil", "floor"):
        return rounded(ev(e.args[0], env), e.func, e.loc)
    d = env.defs[e.func]
    bound = {p: Thunk(a, env) for p, a in zip(d.params, e.args, strict=True)}
    return ev(d.body, Env({**env.names, **bound}, env.attrs, env.defs, env.draw))


def rounded(x: Value, how: str, loc: Loc) -> int:
    """``ceil`` or ``floor`` of ``x`` (an error for inf and NaN)."""
    try:
        return math.ceil(x) if how == "ceil" else math.floor(x)
    except (OverflowError, ValueError) as err:
        raise SerqError(f"arithmetic error: {err}", loc) from None


def _param(e: A.MethodCall) -> str:
    name = e.args[0]
    assert isinstance(name, A.Str)
    return name.value


# ----------------------------------------------------------------------------- programs


@dataclass(frozen=True, slots=True)
class ClaimDef:
    name: str
    given: A.Expr | None
    body: A.Expr


@dataclass(frozen=True, slots=True)
class Spec:
    """A program made ready to run: its constants evaluated, its parts picked out."""

    consts: dict[str, Value]
    params: dict[str, Value]
    defs: dict[str, A.Def]
    cap: A.Expr | None
    advance: A.Clause | None
    admit: A.Clause | None
    execute: A.Expr
    rate: float
    sets: tuple[A.SetVar, ...]
    number_vars: frozenset[str]
    prefill: A.Expr | None  # the token amount of `run E prefill`, if any
    decode: A.Expr | None
    observes: tuple[tuple[str, str, A.Expr], ...]  # (name, stage, value)
    claims: tuple[ClaimDef, ...]


def prepare(info: Info, overrides: Mapping[str, Value] | None = None) -> Spec:
    """Evaluate the constants (``--set`` values replace parameter defaults); pick the parts."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(info.params))
    if unknown:
        raise SerqError(f"unknown parameter '{unknown[0]}' for --set")
    consts: dict[str, Value] = {}
    params: dict[str, Value] = {}
    for let in info.const_defs:
        names: dict[str, Value | Thunk] = dict(consts)
        for call_ in _method_calls(let.value):
            pname = _param(call_)
            default = overrides[pname] if pname in overrides else constant(call_.args[1], consts)
            params[pname] = default
            names[f"args.number:{pname}"] = default
        consts[let.name] = constant(let.value, names, let.loc)
    if len(info.engines) != 1 or not info.workloads or not info.servers:
        raise SerqError("the simulator runs one engine, one workload and one server")
    (engine,) = info.engines.values()
    cap = advance = admit = None
    execute: A.Expr = A.Num(0)
    for item in engine.items:
        if isinstance(item, A.TokensCap):
            cap = item.value
        elif isinstance(item, A.Execute):
            execute = item.value
        else:
            for cl in item.clauses:
                if cl.kind == "advance":
                    advance = cl
                else:
                    admit = cl
    rate = 0.0
    sets: list[A.SetVar] = []
    for w in info.workloads[0].items:
        if isinstance(w, A.Arrive):
            rv = constant(w.rate, consts)
            if isinstance(rv, bool) or rv < 0:
                raise SerqError(f"the arrival rate must be a number >= 0, got {rv}", w.loc)
            rate = float(rv)
        else:
            sets += w.sets
    amounts: dict[str, A.Expr] = {}
    observes: list[tuple[str, str, A.Expr]] = []
    steps = info.servers[0].steps
    runs = [st for st in steps if isinstance(st, A.Run)]
    stage = "arrive"  # an observation is made when the request reaches it
    for st in steps:
        if isinstance(st, A.Run):
            amt = st.amount
            amounts[st.phase] = (
                amt.args[1] if isinstance(amt, A.Call) and amt.func == "cost" else amt
            )
            stage = "done" if st is runs[-1] else "first"
        else:
            observes.append((st.name, "done" if not runs else stage, st.value))
    number_vars = frozenset(n for n, t in info.request_vars.items() if t == "number")
    return Spec(
        consts=consts,
        params=params,
        defs={n: d.node for n, d in info.defs.items()},
        cap=cap,
        advance=advance,
        admit=admit,
        execute=execute,
        rate=rate,
        sets=tuple(sets),
        number_vars=number_vars,
        prefill=amounts.get("prefill"),
        decode=amounts.get("decode"),
        observes=tuple(observes),
        claims=tuple(ClaimDef(c.name, c.given, c.body) for c in info.claims),
    )


def constant(e: A.Expr, names: Mapping[str, Value | Thunk], loc: Loc | None = None) -> Value:
    """A constant: finite, and an integer of at most 63 bits."""
    v = ev(e, Env(names))
    if isinstance(v, float) and not math.isfinite(v):
        raise SerqError(f"value {v} is not finite", loc or e.loc)
    if type(v) is int and abs(v) > MAX_INT:
        raise SerqError("this constant is above the limit of 2**63 - 1", e.loc)
    return v


def _method_calls(e: A.Expr) -> list[A.MethodCall]:
    if isinstance(e, A.MethodCall):
        return [e]
    kids: tuple[A.Expr, ...] = ()
    if isinstance(e, A.Unary):
        kids = (e.operand,)
    elif isinstance(e, A.Binary):
        kids = (e.left, e.right)
    elif isinstance(e, A.Cond):
        kids = (e.cond, e.then, e.orelse)
    elif isinstance(e, A.Call | A.Draw):
        kids = e.args
    return [m for k in kids for m in _method_calls(k)]


# ----------------------------------------------------------------------------- state


@dataclass(slots=True)
class Request:
    rid: int
    arrival: float
    vars: dict[str, Value]
    prefill: int  # prefill tokens left
    decode: int  # decode tokens left
    tbt_gaps: int  # decode tokens after the first output token
    first_token: float | None = None
    first_iter: int = -1  # the iteration that made the first output token (-1: none)


@dataclass(slots=True)
class State:
    now: float = 0.0
    served: int = 0
    iteration: int = 0
    requests: list[Request] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    prefilling: list[int] = field(default_factory=list)
    decoding: list[int] = field(default_factory=list)
    ended: list[tuple[int, float]] = field(default_factory=list)
    # claims: still checked; first violation (iteration, time, trace); first 'given' failure
    active: list[bool] = field(default_factory=list)
    violation: list[tuple[int, float, list[tuple[Any, ...]]] | None] = field(default_factory=list)
    given_failure: list[tuple[int, float] | None] = field(default_factory=list)

    @property
    def residents(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)


@dataclass(slots=True)
class Batch:
    """What one iteration serves (built by :func:`form_batch`, applied at its end)."""

    mode: bool | None  # the `only` mode shown in traces (advance's, else admit's)
    decoders: list[int] = field(default_factory=list)  # one token each
    prefills: list[tuple[int, int]] = field(default_factory=list)  # (running request, tokens)
    admitted: list[tuple[int, int]] = field(default_factory=list)  # (request, prefill tokens)
    admitted_decoders: list[int] = field(default_factory=list)  # no prefill: one decode token
    taken: int = 0  # requests admitted from the head of `waiting`
    tokens: int = 0
    requests: int = 0


def engine_env(spec: Spec, st: State, b: Batch, waiting: int) -> Env:
    """The engine context: constants, ``now``, ``served`` and the engine state fields."""
    decoding, residents = len(st.decoding), st.residents
    attrs: dict[tuple[str, str], Value] = {
        ("running", "decoding"): decoding,
        ("running", "count"): residents,
        ("running", "prefilling"): residents - decoding,
        ("running", "preempted"): 0,
        ("waiting", "count"): waiting,
        ("batch", "tokens"): b.tokens,
        ("batch", "requests"): b.requests,
    }
    names: dict[str, Value | Thunk] = {**spec.consts, "now": st.now, "served": st.served}
    return Env(names, attrs, spec.defs)


def claim_env(spec: Spec, st: State, b: Batch, waiting: int) -> Env:
    env = engine_env(spec, st, b, waiting)
    words = {"tokens": b.tokens, "decoders": len(st.decoding), "residents": st.residents}
    return Env({**env.names, **words}, env.attrs, env.defs)


def bound(spec: Spec, e: A.Expr | None, st: State, b: Batch, waiting: int) -> int | float:
    """A ``tokens cap`` or ``each at most``: rounded down to whole tokens, ``inf`` if absent."""
    if e is None:
        return INF
    return rounded(ev(e, engine_env(spec, st, b, waiting)), "floor", e.loc)


# ----------------------------------------------------------------------------- one iteration


def form_batch(spec: Spec, st: State) -> Batch:
    """Advance, then admit (see the module docstring); the state is not changed."""
    b = Batch(mode=None)
    cap = bound(spec, spec.cap, st, b, len(st.waiting))
    adv, adm = spec.advance, spec.admit
    env0 = engine_env(spec, st, b, len(st.waiting))
    adv_mode = bool(ev(adv.only, env0)) if adv is not None and adv.only is not None else None
    adm_mode = bool(ev(adm.only, env0)) if adm is not None and adm.only is not None else None
    b.mode = adv_mode if adv_mode is not None else adm_mode
    if adv is not None:
        if st.decoding and adv_mode is not False:
            each = bound(spec, adv.each, st, b, len(st.waiting))
            room = cap - b.tokens
            if each >= 1 and room >= 1:
                n = min(len(st.decoding), int(room) if room < INF else len(st.decoding))
                b.decoders = st.decoding[:n]
                b.tokens += n
                b.requests += n
        if st.prefilling and adv_mode is not True:
            each = bound(spec, adv.each, st, b, len(st.waiting))
            for rid in st.prefilling:
                c = min(st.requests[rid].prefill, each, cap - b.tokens)
                if c <= 0:
                    break
                b.prefills.append((rid, int(c)))
                b.tokens += int(c)
                b.requests += 1
    if adm is not None and st.waiting and b.tokens < cap:
        each = bound(spec, adm.each, st, b, len(st.waiting))
        while b.taken < len(st.waiting):  # strictly FIFO: the admitted are a prefix of waiting
            left = len(st.waiting) - b.taken
            if adm.while_ is not None and not ev(adm.while_, engine_env(spec, st, b, left)):
                break
            head = st.requests[st.waiting[b.taken]]
            if adm_mode is not None and (head.prefill == 0) != adm_mode:
                break
            room = cap - b.tokens
            if head.prefill:
                c = min(head.prefill, each, room)
                if c <= 0:
                    break
                b.admitted.append((head.rid, int(c)))
                b.tokens += int(c)
            else:
                if each < 1 or room < 1:
                    break
                b.admitted_decoders.append(head.rid)
                b.tokens += 1
            b.requests += 1
            b.taken += 1
    return b


def check_claims(spec: Spec, st: State, b: Batch, trace: list[tuple[Any, ...]]) -> None:
    """Each claim still checked must hold; the first violation is recorded, with the trace."""
    env = claim_env(spec, st, b, len(st.waiting) - b.taken)
    for i, c in enumerate(spec.claims):
        if st.active[i] and not ev(c.body, env):
            st.active[i] = False
            st.violation[i] = (st.iteration, st.now, list(trace))


def duration(
    spec: Spec, st: State, b: Batch, draw: Callable[[str], float] | None = None
) -> float:
    """The iteration's end; a draw in ``execute`` reads ``draw`` (once per iteration, after
    the arrivals up to ``now`` drew their ``init``)."""
    env = engine_env(spec, st, b, len(st.waiting) - b.taken)
    dur = ev(spec.execute, Env(env.names, env.attrs, env.defs, draw))
    if not 0 <= dur < INF:
        kind = "negative" if dur < 0 else "non-finite"
        raise SerqError(f"execute gave a {kind} duration {dur}", spec.execute.loc)
    try:
        return st.now + dur
    except OverflowError as err:
        raise SerqError(f"arithmetic error: {err}", spec.execute.loc) from None


@dataclass(slots=True)
class Measures:
    """What a run records besides the state: the settings it measures with and its records."""

    horizon: float
    warmup: float
    ttft: list[float] = field(default_factory=list)
    observed: dict[str, list[float]] = field(default_factory=dict)
    batches: dict[tuple[int, int], int] = field(default_factory=dict)
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)


def finish_iteration(spec: Spec, st: State, b: Batch, end: float, m: Measures) -> None:
    """The batch's effects at the end of the iteration (time ``end``), in this order."""
    for rid in b.decoders:  # the oldest decoders, in order
        st.requests[rid].decode -= 1
    finished = [rid for rid in b.decoders if st.requests[rid].decode == 0]
    if finished:
        st.ended += [(rid, end) for rid in finished]
        st.decoding = [rid for rid in st.decoding if st.requests[rid].decode > 0]
    done: list[int] = []
    for rid, c in b.prefills:
        st.requests[rid].prefill -= c
        if st.requests[rid].prefill == 0:
            done.append(rid)
    del st.waiting[: b.taken]
    for rid, c in b.admitted:
        st.requests[rid].prefill -= c
        if st.requests[rid].prefill == 0:
            done.append(rid)
        else:
            st.prefilling.append(rid)
    if done:
        st.prefilling = [rid for rid in st.prefilling if st.requests[rid].prefill > 0]
    for rid in done:  # the prefill makes the first output token
        first_token(spec, st, st.requests[rid], end, m)
    for rid in b.admitted_decoders:
        st.requests[rid].decode -= 1
        first_token(spec, st, st.requests[rid], end, m)
    if st.now >= m.warmup:
        key = (b.requests, b.tokens)
        m.batches[key] = m.batches.get(key, 0) + 1
    st.served += b.tokens
    st.now = end
    st.iteration += 1


def first_token(spec: Spec, st: State, r: Request, t: float, m: Measures) -> None:
    r.first_token = t
    r.first_iter = st.iteration
    if r.arrival >= m.warmup and t <= m.horizon:
        m.ttft.append(t - r.arrival)
        observe(spec, r, "first", t, m)
    if r.decode > 0:
        st.decoding.append(r.rid)
    else:
        st.ended.append((r.rid, t))


def observe(spec: Spec, r: Request, stage: str, t: float, m: Measures) -> None:
    for name, when, e in spec.observes:
        if when == stage:
            v = ev(e, Env({**spec.consts, **r.vars, "now": t}, defs=spec.defs))
            m.observed[name].append(v)


def arrive(spec: Spec, st: State, t: float, draw: Callable[[str], float], m: Measures) -> None:
    """A request arrives at ``t``: its ``init``, the ``given`` of each claim, its amounts."""
    rid = len(st.requests)
    values: dict[str, Value] = {}
    for s in spec.sets:
        env = Env({**spec.consts, **values, "now": t}, defs=spec.defs, draw=draw)
        v = ev(s.value, env)
        if s.name in spec.number_vars and not -INF < v < INF:
            raise SerqError(f"'set {s.name}' gave a non-finite value {v}", s.value.loc)
        values[s.name] = v
    for i, c in enumerate(spec.claims):
        given = Env({**spec.consts, **values}, defs=spec.defs)
        if c.given is not None and st.given_failure[i] is None and not ev(c.given, given):
            st.given_failure[i] = (rid, t)
            st.active[i] = False
    amounts = []
    for e in (spec.prefill, spec.decode):
        n = 0
        if e is not None:
            n = rounded(
                ev(e, Env({**spec.consts, **values, "now": t}, defs=spec.defs)), "ceil", e.loc
            )
            if n > MAX_TOKENS:
                raise SerqError(f"a run's amount is {n} tokens, more than 2**53", e.loc)
        amounts.append(max(n, 0))
    vp, vd = amounts
    r = Request(rid, t, values, vp, vd, vd if vp > 0 else vd - 1)
    st.requests.append(r)
    if t >= m.warmup:
        observe(spec, r, "arrive", t, m)
    if vp == 0 and vd == 0:
        r.first_token = t
        st.ended.append((rid, t))
    else:
        st.waiting.append(rid)


def trace_row(st: State, b: Batch) -> tuple[Any, ...]:
    """The state a counterexample trace shows for one iteration (after forming its batch)."""
    return (st.iteration, st.now, st.served, b.tokens, b.requests, len(st.decoding),
            st.residents, len(st.waiting) - b.taken, b.mode)  # fmt: skip


def snapshot(st: State, row: tuple[Any, ...]) -> tuple[Any, ...]:
    """The observable state after an iteration (compared with the simulator's ``STEPS``)."""
    return (
        row,
        st.now,
        st.served,
        tuple(st.waiting),
        tuple((rid, st.requests[rid].prefill) for rid in st.prefilling),
        tuple((rid, st.requests[rid].decode) for rid in st.decoding),
        len(st.ended),
        tuple(st.active),
    )


# ----------------------------------------------------------------------------- a run


def run(
    spec: Spec,
    horizon: float,
    warmup: float,
    arrivals: Callable[[], float],
    uniform: Callable[[], float],
    exponential: Callable[[], float],
    sample_times: list[float],
    trace_len: int = 5,
    trace: bool = False,
    steps: list[tuple[Any, ...]] | None = None,
    limits: Limits | None = None,
    final: list[State] | None = None,
) -> dict[str, Any]:
    """Simulate ``spec`` until ``horizon``, reading the three random streams as the generated
    simulator does; return the same record as ``Model.simulate`` (``raw`` in :mod:`serq.sim`).
    ``final``, when given, gets the run's last state appended (every request, with the
    iteration of its first token: ``benchmarks/serq_predict.py`` reads it).
    """
    limits = limits or Limits()
    st = State()
    n = len(spec.claims)
    st.active, st.violation, st.given_failure = [True] * n, [None] * n, [None] * n
    m = Measures(horizon, warmup, observed={name: [] for name, _, _ in spec.observes})
    recent: list[tuple[Any, ...]] = []

    def draw(dist: str) -> float:
        return uniform() if dist == "uniform" else exponential()

    def next_arrival(after: float) -> float:
        t = after + arrivals() if spec.rate > 0 and math.isfinite(1 / spec.rate) else INF
        return INF if t >= horizon else t

    t_next = next_arrival(0.0)
    si = 0
    while True:
        while t_next <= st.now and t_next < INF:
            if len(st.requests) >= limits.arrivals:
                raise SerqError(f"more than {limits.arrivals} arrivals before the horizon")
            arrive(spec, st, t_next, draw, m)
            t_next = next_arrival(t_next)
        if st.now >= horizon:
            break
        while st.now >= sample_times[si]:
            m.samples.append((sample_times[si], st.residents, len(st.waiting), len(st.decoding)))
            si += 1
        b = form_batch(spec, st)
        if b.tokens == 0:
            if t_next == INF:
                st.now = horizon
                break
            st.now = t_next
            continue
        if st.iteration >= limits.iterations:
            raise SerqError(f"more than {limits.iterations} iterations before the horizon")
        row = trace_row(st, b)
        if trace:
            recent = [*recent, row][-trace_len:]
        check_claims(spec, st, b, recent)
        end = duration(spec, st, b, draw)
        finish_iteration(spec, st, b, end, m)
        if steps is not None:
            steps.append(snapshot(st, row))
    while sample_times[si] <= horizon:
        m.samples.append((sample_times[si], st.residents, len(st.waiting), len(st.decoding)))
        si += 1
    if final is not None:
        final.append(st)
    return record(spec, st, m)


def record(spec: Spec, st: State, m: Measures) -> dict[str, Any]:
    """The statistics of a run, computed from the completions in the order they happened."""
    done = [(rid, t) for rid, t in st.ended if t <= m.horizon]
    measured = [(st.requests[rid], t) for rid, t in done if st.requests[rid].arrival >= m.warmup]
    for r, t in measured:
        observe(spec, r, "done", t, m)
    ftimes = [(r, t) for r, t in measured if r.tbt_gaps > 0]
    return {
        "now": st.now,
        "served": st.served,
        "iterations": st.iteration,
        "arrivals": len(st.requests),
        "completions": len(done),
        "completions_w": sum(1 for _, t in done if t >= m.warmup),
        "residents": st.residents,
        "waiting": len(st.waiting),
        "decoders": len(st.decoding),
        "ttft": m.ttft,
        "tbt": [(t - r.first_token) / float(r.tbt_gaps) for r, t in ftimes],  # type: ignore[operator]
        "resp": [t - r.arrival for r, t in measured],
        "batches": m.batches,
        "samples": m.samples,
        "claims": list(zip(st.violation, st.given_failure, strict=True)),
        "observed": m.observed,
    }
