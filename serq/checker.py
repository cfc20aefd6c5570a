"""Name resolution and simple types for serQ programs, separate from the parser.

Types are ``number``, ``bool`` and ``mode`` (the request phase selected by ``only (P)``:
``decoding`` or ``!decoding``), plus ``string`` for parameter names. Every expression is
checked in a *context* that fixes what it may read:

=========  ===========================================================================
context    may read
=========  ===========================================================================
const      ``let`` constants, ``args.number`` (top-level and ``fn main`` ``let``; rates)
engine     constants, engine state (``running.*``, ``waiting.count``, ``batch.*``),
           ``now``, ``served``, ``decoding``, calls of ``def`` functions
init       constants, ``now`` (the arrival time), random draws, earlier ``set`` variables
server     constants, ``now``, the request's ``set`` variables
given      constants, the request's ``set`` variables
claim      the engine context plus ``tokens``, ``decoders``, ``residents``
=========  ===========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from serq import ast as A
from serq.errors import Loc, SerqError

Type = Literal["number", "bool", "mode", "string"]


class Ctx(Enum):
    CONST = "constant"
    ENGINE = "engine"
    INIT = "init"
    SERVER = "server"
    GIVEN = "given"
    CLAIM = "claim"
    DEF = "def"


#: Engine state fields, readable in engine and claim contexts (all numbers).
STATE_FIELDS: dict[str, frozenset[str]] = {
    "running": frozenset({"decoding", "prefilling", "count", "preempted"}),
    "waiting": frozenset({"count"}),
    "batch": frozenset({"tokens", "requests"}),
}

#: Claim vocabulary: the kernel's words for engine state.
CLAIM_WORDS = {
    "tokens": "batch.tokens",
    "decoders": "running.decoding",
    "residents": "running.count",
}

BUILTIN_FUNCS: dict[str, tuple[int, int]] = {
    "ceil": (1, 1),
    "floor": (1, 1),
    "min": (2, 8),
    "max": (2, 8),
}
DISTRIBUTIONS: dict[str, int] = {"uniform": 2, "exp": 1}
MODULES = {"std/args": "args"}

_STATE_CTX = (Ctx.ENGINE, Ctx.CLAIM, Ctx.DEF)
_NOW_CTX = (Ctx.ENGINE, Ctx.CLAIM, Ctx.DEF, Ctx.INIT, Ctx.SERVER)


@dataclass(frozen=True, slots=True)
class Param:
    """A program parameter read with ``args.number(name, default)``."""

    name: str
    default: A.Expr
    loc: Loc


@dataclass(slots=True)
class DefInfo:
    node: A.Def
    type: Type
    reads_state: bool
    reads_now: bool


@dataclass(slots=True)
class Info:
    """What the checker learned about a program: its symbols, in definition order."""

    consts: dict[str, Type] = field(default_factory=dict)
    const_defs: list[A.Let] = field(default_factory=list)
    params: dict[str, Param] = field(default_factory=dict)
    defs: dict[str, DefInfo] = field(default_factory=dict)
    devices: dict[str, A.Device] = field(default_factory=dict)
    engines: dict[str, A.Engine] = field(default_factory=dict)
    request_vars: dict[str, Type] = field(default_factory=dict)
    workloads: list[A.Workload] = field(default_factory=list)
    servers: list[A.Server] = field(default_factory=list)
    claims: list[A.Claim] = field(default_factory=list)
    modules: set[str] = field(default_factory=set)


def _loc_of(node: A.Node) -> Loc:
    return node.loc


class _Checker:
    def __init__(self) -> None:
        self.info = Info()
        self.where: dict[str, tuple[str, Loc]] = {}
        self.def_params: tuple[str, ...] = ()
        self.def_reads_state = False
        self.def_reads_now = False
        self.init_vars: dict[str, Type] | None = None
        self.in_execute = False  # checking an engine's execute: random draws allowed

    # ------------------------------------------------------------------ helpers
    def declare(self, name: str, kind: str, loc: Loc) -> None:
        if name in self.where:
            prev_kind, prev = self.where[name]
            raise SerqError(f"'{name}' is already defined ({prev_kind} at line {prev.line})", loc)
        if name in BUILTIN_FUNCS or name in ("decoding", "now", "served", "cost"):
            raise SerqError(f"'{name}' is a builtin and cannot be redefined", loc)
        self.where[name] = (kind, loc)

    def expect(self, e: A.Expr, ctx: Ctx, want: Type, what: str) -> None:
        got = self.expr(e, ctx)
        if got != want:
            raise SerqError(f"{what} must be a {want}, got a {got}", _loc_of(e))

    # ------------------------------------------------------------------ expressions
    def expr(self, e: A.Expr, ctx: Ctx) -> Type:
        if isinstance(e, A.Num):
            return "number"
        if isinstance(e, A.Str):
            raise SerqError("a string is only allowed as the name in args.number", e.loc)
        if isinstance(e, A.Name):
            return self.name(e, ctx)
        if isinstance(e, A.Attr):
            return self.attr(e, ctx)
        if isinstance(e, A.Unary):
            t = self.expr(e.operand, ctx)
            if e.op == "!":
                if t not in ("bool", "mode"):
                    raise SerqError(f"'!' expects a bool or a mode, got a {t}", e.loc)
                return t
            if t != "number":
                raise SerqError(f"unary '-' expects a number, got a {t}", e.loc)
            return "number"
        if isinstance(e, A.Binary):
            lt = self.expr(e.left, ctx)
            rt = self.expr(e.right, ctx)
            if e.op in ("||", "&&"):
                if lt != "bool" or rt != "bool":
                    raise SerqError(f"'{e.op}' expects bool operands, got {lt} and {rt}", e.loc)
                return "bool"
            if e.op in ("==", "!="):
                if lt != rt:
                    raise SerqError(f"'{e.op}' compares a {lt} with a {rt}", e.loc)
                return "bool"
            if e.op in ("<", "<=", ">", ">="):
                if lt != "number" or rt != "number":
                    raise SerqError(f"'{e.op}' expects numbers, got {lt} and {rt}", e.loc)
                return "bool"
            if lt != "number" or rt != "number":
                raise SerqError(f"'{e.op}' expects numbers, got {lt} and {rt}", e.loc)
            return "number"
        if isinstance(e, A.Cond):
            ct = self.expr(e.cond, ctx)
            if ct != "bool":
                raise SerqError(f"the condition of '?:' must be a bool, got a {ct}", e.cond.loc)
            a = self.expr(e.then, ctx)
            b = self.expr(e.orelse, ctx)
            if a != b:
                raise SerqError(f"the branches of '?:' differ: {a} and {b}", e.loc)
            return a
        if isinstance(e, A.Call):
            return self.call(e, ctx)
        if isinstance(e, A.MethodCall):
            return self.method(e, ctx)
        if isinstance(e, A.Draw):
            if ctx is not Ctx.INIT and not (ctx is Ctx.ENGINE and self.in_execute):
                raise SerqError(
                    f"a random draw '~{e.dist}' is only allowed in a workload's init or an "
                    "engine's execute",
                    e.loc,
                )
            if e.dist not in DISTRIBUTIONS:
                known = ", ".join(sorted(DISTRIBUTIONS))
                raise SerqError(f"unknown distribution '{e.dist}' (known: {known})", e.loc)
            n = DISTRIBUTIONS[e.dist]
            self.arity("~" + e.dist, n, n, e.args, e.loc)
            for arg in e.args:
                self.expect(arg, ctx, "number", f"an argument of ~{e.dist}")
            return "number"
        raise SerqError(f"unknown expression {type(e).__name__}")  # pragma: no cover

    def arity(self, name: str, lo: int, hi: int, args: tuple[A.Expr, ...], loc: Loc) -> None:
        n = len(args)
        if lo <= n <= hi:
            return
        if lo == hi:
            want = f"{lo} argument" + ("" if lo == 1 else "s")
        else:
            want = f"{lo} to {hi} arguments"
        raise SerqError(f"wrong number of arguments: '{name}' takes {want}, got {n}", loc)

    def name(self, e: A.Name, ctx: Ctx) -> Type:
        n = e.name
        if n == "decoding":
            return "mode"
        if n == "now":
            if ctx not in _NOW_CTX:
                raise SerqError(f"'now' is not available in a {ctx.value} expression", e.loc)
            if ctx is Ctx.DEF:
                self.def_reads_now = True
            return "number"
        if n == "served":
            if ctx not in _STATE_CTX:
                raise SerqError(
                    f"'served' is engine state, not available in a {ctx.value} expression", e.loc
                )
            if ctx is Ctx.DEF:
                self.def_reads_state = True
            return "number"
        if ctx is Ctx.DEF and n in self.def_params:
            return "number"
        if ctx is Ctx.INIT and self.init_vars is not None and n in self.init_vars:
            return self.init_vars[n]
        if n in self.info.consts:
            return self.info.consts[n]
        if ctx in (Ctx.SERVER, Ctx.GIVEN) and n in self.info.request_vars:
            return self.info.request_vars[n]
        if n in CLAIM_WORDS:
            if ctx is Ctx.CLAIM:
                return "number"
            raise SerqError(
                f"'{n}' is claim vocabulary (= {CLAIM_WORDS[n]}), only available in a claim",
                e.loc,
            )
        if n in self.where:
            kind, _ = self.where[n]
            if kind == "request variable":
                raise SerqError(
                    f"'{n}' is a request variable, not available in a {ctx.value} expression",
                    e.loc,
                )
            raise SerqError(f"'{n}' is a {kind}, not a value", e.loc)
        if n in BUILTIN_FUNCS or n == "cost":
            raise SerqError(f"'{n}' is a function, not a value", e.loc)
        raise SerqError(f"undefined name '{n}'", e.loc)

    def attr(self, e: A.Attr, ctx: Ctx) -> Type:
        fields = STATE_FIELDS.get(e.obj)
        if fields is None:
            if e.obj == "args" or e.obj in self.info.modules:
                raise SerqError(f"'{e.obj}.{e.attr}' is a function; call it", e.loc)
            raise SerqError(f"undefined name '{e.obj}'", e.loc)
        if e.attr not in fields:
            known = ", ".join(f"{e.obj}.{f}" for f in sorted(fields))
            raise SerqError(f"undefined name '{e.obj}.{e.attr}' (known: {known})", e.loc)
        if ctx not in _STATE_CTX:
            raise SerqError(
                f"'{e.obj}.{e.attr}' is engine state, not available in a {ctx.value} expression",
                e.loc,
            )
        if ctx is Ctx.DEF:
            self.def_reads_state = True
        return "number"

    def call(self, e: A.Call, ctx: Ctx) -> Type:
        f = e.func
        if f in BUILTIN_FUNCS:
            lo, hi = BUILTIN_FUNCS[f]
            self.arity(f, lo, hi, e.args, e.loc)
            for a in e.args:
                self.expect(a, ctx, "number", f"an argument of {f}")
            return "number"
        if f == "cost":
            raise SerqError("cost(ENGINE, tokens) is only allowed as the amount of a 'run'", e.loc)
        d = self.info.defs.get(f)
        if d is None:
            if f in self.where:
                kind, _ = self.where[f]
                raise SerqError(f"'{f}' is a {kind}, not a function", e.loc)
            raise SerqError(f"undefined function '{f}'", e.loc)
        n = len(d.node.params)
        self.arity(f, n, n, e.args, e.loc)
        for a in e.args:
            if isinstance(a, A.Draw) or _has_draw(a):
                raise SerqError("a random draw cannot be passed to a def", a.loc)
            self.expect(a, ctx, "number", f"an argument of {f}")
        if d.reads_state and ctx not in _STATE_CTX:
            raise SerqError(
                f"'{f}' reads engine state and cannot be called in a {ctx.value} expression",
                e.loc,
            )
        if d.reads_now and ctx not in _NOW_CTX:
            raise SerqError(
                f"'{f}' reads 'now' and cannot be called in a {ctx.value} expression", e.loc
            )
        if ctx is Ctx.DEF:
            self.def_reads_state |= d.reads_state
            self.def_reads_now |= d.reads_now
        return d.type

    def method(self, e: A.MethodCall, ctx: Ctx) -> Type:
        if e.obj != "args":
            raise SerqError(f"undefined name '{e.obj}'", e.loc)
        if "args" not in self.info.modules:
            raise SerqError("'args' needs 'use \"std/args\";'", e.loc)
        if e.method != "number":
            raise SerqError(f"unknown function 'args.{e.method}' (known: args.number)", e.loc)
        self.arity("args.number", 2, 2, e.args, e.loc)
        if ctx is not Ctx.CONST:
            raise SerqError("args.number is only allowed in a 'let'", e.loc)
        name, default = e.args
        if not isinstance(name, A.Str):
            raise SerqError("the first argument of args.number must be a string literal", name.loc)
        if not name.value.isidentifier():
            raise SerqError(f"parameter name {name.value!r} is not an identifier", name.loc)
        self.expect(default, ctx, "number", "the default of args.number")
        if name.value in self.info.params:
            prev = self.info.params[name.value]
            raise SerqError(
                f"parameter '{name.value}' is already read at line {prev.loc.line}", name.loc
            )
        self.info.params[name.value] = Param(name.value, default, e.loc)
        return "number"

    # ------------------------------------------------------------------ statements
    def let(self, s: A.Let) -> None:
        t = self.expr(s.value, Ctx.CONST)
        if t == "string":  # pragma: no cover - strings never type as values
            raise SerqError("a let cannot hold a string", s.loc)
        self.declare(s.name, "constant", s.loc)
        self.info.consts[s.name] = t
        self.info.const_defs.append(s)

    def program(self, p: A.Program) -> Info:
        mains = 0
        for item in p.items:
            if isinstance(item, A.Use):
                if item.path not in MODULES:
                    known = ", ".join(f'"{m}"' for m in MODULES)
                    raise SerqError(f'unknown module "{item.path}" (known: {known})', item.loc)
                self.info.modules.add(MODULES[item.path])
            elif isinstance(item, A.Let):
                self.let(item)
            else:
                if item.name != "main":
                    raise SerqError(f"only 'fn main' is supported, not 'fn {item.name}'", item.loc)
                mains += 1
                if mains > 1:
                    raise SerqError("'fn main' is defined twice", item.loc)
                for stmt in item.body:
                    self.stmt(stmt)
        return self.info

    def stmt(self, s: A.MainStmt) -> None:
        if isinstance(s, A.Let):
            self.let(s)
        elif isinstance(s, A.Device):
            self.declare(s.name, "device", s.loc)
            self.info.devices[s.name] = s
        elif isinstance(s, A.Def):
            self.define(s)
        elif isinstance(s, A.Engine):
            self.engine(s)
        elif isinstance(s, A.Workload):
            self.workload(s)
        elif isinstance(s, A.Server):
            self.server(s)
        else:
            self.claim(s)

    def define(self, s: A.Def) -> None:
        if len(set(s.params)) != len(s.params):
            raise SerqError(f"'{s.name}' has a repeated parameter", s.loc)
        for p in s.params:
            if p in self.info.consts or p in ("decoding", "now", "served"):
                raise SerqError(f"parameter '{p}' shadows a name in scope", s.loc)
        self.def_params = s.params
        self.def_reads_state = False
        self.def_reads_now = False
        t = self.expr(s.body, Ctx.DEF)
        if t == "string":  # pragma: no cover
            raise SerqError("a def cannot return a string", s.loc)
        self.declare(s.name, "function", s.loc)
        self.info.defs[s.name] = DefInfo(s, t, self.def_reads_state, self.def_reads_now)
        self.def_params = ()

    def engine_ref(self, name: str, loc: Loc) -> A.Engine:
        eng = self.info.engines.get(name)
        if eng is None:
            raise SerqError(f"unknown engine '{name}'", loc)
        return eng

    def engine(self, s: A.Engine) -> None:
        if s.device not in self.info.devices:
            raise SerqError(f"unknown device '{s.device}'", s.device_loc)
        seen: set[str] = set()
        for item in s.items:
            key = type(item).__name__
            if key in seen:
                what = {"TokensCap": "tokens cap", "Schedule": "schedule", "Execute": "execute"}
                raise SerqError(f"engine '{s.name}' has a second '{what[key]}'", item.loc)
            seen.add(key)
            if isinstance(item, A.TokensCap):
                self.expect(item.value, Ctx.ENGINE, "number", "tokens cap")
            elif isinstance(item, A.Execute):
                # a draw here is one sample per iteration (docs/serq.md, random costs)
                self.in_execute = True
                try:
                    self.expect(item.value, Ctx.ENGINE, "number", "execute")
                finally:
                    self.in_execute = False
            else:
                kinds: set[str] = set()
                for c in item.clauses:
                    want = "running" if c.kind == "advance" else "waiting"
                    if c.queue != want:
                        raise SerqError(
                            f"'{c.kind}' takes the '{want}' queue, not '{c.queue}'", c.queue_loc
                        )
                    if c.kind in kinds:
                        raise SerqError(f"a second '{c.kind}' clause", c.loc)
                    kinds.add(c.kind)
                    if c.only is not None:
                        self.expect(c.only, Ctx.ENGINE, "mode", "'only'")
                    if c.while_ is not None:
                        if c.kind == "advance":
                            raise SerqError("'while' belongs to 'admit', not 'advance'", c.loc)
                        self.expect(c.while_, Ctx.ENGINE, "bool", "'while'")
                    if c.each is not None:
                        self.expect(c.each, Ctx.ENGINE, "number", "'each at most'")
        if "Execute" not in seen:
            raise SerqError(f"engine '{s.name}' has no 'execute'", s.loc)
        self.declare(s.name, "engine", s.loc)
        self.info.engines[s.name] = s

    def workload(self, s: A.Workload) -> None:
        if self.info.workloads:
            raise SerqError("a second 'workload'", s.loc)
        arrives = 0
        for item in s.items:
            if isinstance(item, A.Arrive):
                arrives += 1
                if arrives > 1:
                    raise SerqError("a second 'arrive'", item.loc)
                if item.process != "poisson":
                    raise SerqError(
                        f"unknown arrival process '{item.process}' (known: poisson)", item.loc
                    )
                self.expect(item.rate, Ctx.CONST, "number", "the arrival rate")
            else:
                self.init_vars = dict(self.info.request_vars)
                for st in item.sets:
                    t = self.expr(st.value, Ctx.INIT)
                    if st.name in self.info.request_vars or st.name in self.init_vars:
                        raise SerqError(f"'{st.name}' is already set", st.loc)
                    self.declare(st.name, "request variable", st.loc)
                    self.init_vars[st.name] = t
                    self.info.request_vars[st.name] = t
                self.init_vars = None
        if arrives == 0:
            raise SerqError("a workload needs 'arrive poisson(rate);'", s.loc)
        self.info.workloads.append(s)

    def server(self, s: A.Server) -> None:
        if self.info.servers:
            raise SerqError("a second 'server'", s.loc)
        phases: list[str] = []
        for st in s.steps:
            if isinstance(st, A.Run):
                self.engine_ref(st.engine, st.engine_loc)
                if st.phase in phases:
                    raise SerqError(f"a second 'run {st.engine} {st.phase}'", st.loc)
                if st.phase == "prefill" and "decode" in phases:
                    raise SerqError("'prefill' must come before 'decode'", st.loc)
                phases.append(st.phase)
                amt = st.amount
                if isinstance(amt, A.Call) and amt.func == "cost":
                    self.arity("cost", 2, 2, amt.args, amt.loc)
                    eng, tokens = amt.args
                    if not isinstance(eng, A.Name):
                        raise SerqError("the first argument of cost must be an engine", eng.loc)
                    self.engine_ref(eng.name, eng.loc)
                    if eng.name != st.engine:
                        raise SerqError(
                            f"cost is for engine '{eng.name}' but the run is on '{st.engine}'",
                            eng.loc,
                        )
                    self.expect(tokens, Ctx.SERVER, "number", "a token count")
                else:
                    self.expect(amt, Ctx.SERVER, "number", "a run's amount")
            else:
                t = self.expr(st.value, Ctx.SERVER)
                if t != "number":
                    raise SerqError(f"an observation must be a number, got a {t}", st.value.loc)
        self.info.servers.append(s)

    def claim(self, s: A.Claim) -> None:
        if any(c.name == s.name for c in self.info.claims):
            raise SerqError(f"claim '{s.name}' is already defined", s.loc)
        if s.given is not None:
            self.expect(s.given, Ctx.GIVEN, "bool", "a 'given' condition")
        self.engine_ref(s.engine, s.engine_loc)
        self.expect(s.body, Ctx.CLAIM, "bool", "a claim")
        self.info.claims.append(s)


def _has_draw(e: A.Expr) -> bool:
    if isinstance(e, A.Draw):
        return True
    if isinstance(e, A.Unary):
        return _has_draw(e.operand)
    if isinstance(e, A.Binary):
        return _has_draw(e.left) or _has_draw(e.right)
    if isinstance(e, A.Cond):
        return _has_draw(e.cond) or _has_draw(e.then) or _has_draw(e.orelse)
    if isinstance(e, A.Call | A.MethodCall):
        return any(_has_draw(a) for a in e.args)
    return False


def check(program: A.Program, filename: str = "<input>", source: str | None = None) -> Info:
    """Resolve names and check types; return the program's symbols or raise SerqError."""
    try:
        return _Checker().program(program)
    except SerqError as err:
        if source is not None:
            err.attach(filename, source)
        raise
    except RecursionError:
        raise SerqError("program is nested too deeply").attach(filename, source or "") from None
