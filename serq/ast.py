"""The typed abstract syntax of serQ.

Every node is a frozen dataclass with slots. Source locations are carried in ``loc`` fields
that take no part in equality, so two programs that differ only in layout compare equal
(this is what the pretty-printer round-trip relies on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from serq.errors import NOWHERE, Loc

# ---------------------------------------------------------------------------- expressions


@dataclass(frozen=True, slots=True)
class Num:
    value: int | float
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Str:
    value: str
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Name:
    name: str
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Attr:
    """``obj.attr``: engine state such as ``running.decoding`` or ``batch.tokens``."""

    obj: str
    attr: str
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


UnaryOp = Literal["!", "-"]
BinaryOp = Literal["||", "&&", "==", "!=", "<", "<=", ">", ">=", "+", "-", "*", "/", "%"]


@dataclass(frozen=True, slots=True)
class Unary:
    op: UnaryOp
    operand: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Binary:
    op: BinaryOp
    left: Expr
    right: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Cond:
    """``cond ? then : orelse``."""

    cond: Expr
    then: Expr
    orelse: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Call:
    """A call of a builtin (``ceil``, ``floor``, ``min``, ``max``, ``cost``) or a ``def``."""

    func: str
    args: tuple[Expr, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class MethodCall:
    """``obj.method(args)``: a module function such as ``args.number("rate", 0.1)``."""

    obj: str
    method: str
    args: tuple[Expr, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Draw:
    """A random draw ``~dist(args)``: ``~uniform(a, b)`` or ``~exp(mean)``."""

    dist: str
    args: tuple[Expr, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


Expr = Num | Str | Name | Attr | Unary | Binary | Cond | Call | MethodCall | Draw

# ---------------------------------------------------------------------------- statements


@dataclass(frozen=True, slots=True)
class Use:
    path: str
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Let:
    name: str
    value: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Def:
    name: str
    params: tuple[str, ...]
    body: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


ClauseKind = Literal["advance", "admit"]


@dataclass(frozen=True, slots=True)
class Clause:
    """``advance|admit QUEUE [only (P)] [while (C)] [each at most (E)];``"""

    kind: ClauseKind
    queue: str
    only: Expr | None = None
    while_: Expr | None = None
    each: Expr | None = None
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    queue_loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class TokensCap:
    value: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Schedule:
    clauses: tuple[Clause, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Execute:
    value: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


EngineItem = TokensCap | Schedule | Execute


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    device: str
    items: tuple[EngineItem, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    device_loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Arrive:
    """``arrive poisson(rate);`` with the rate in requests per µs."""

    process: str
    rate: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class SetVar:
    name: str
    value: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Init:
    sets: tuple[SetVar, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


WorkloadItem = Arrive | Init


@dataclass(frozen=True, slots=True)
class Workload:
    items: tuple[WorkloadItem, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


Phase = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class Run:
    """``run ENGINE prefill|decode (amount);`` — the amount is in tokens."""

    engine: str
    phase: Phase
    amount: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    engine_loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Observe:
    name: str
    value: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


ServerStep = Run | Observe


@dataclass(frozen=True, slots=True)
class Server:
    steps: tuple[ServerStep, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Claim:
    """``claim NAME [given (G)]: every iteration of ENGINE (BODY);``"""

    name: str
    given: Expr | None
    engine: str
    body: Expr
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    engine_loc: Loc = field(default=NOWHERE, compare=False, repr=False)


MainStmt = Let | Device | Def | Engine | Workload | Server | Claim


@dataclass(frozen=True, slots=True)
class Fn:
    name: str
    body: tuple[MainStmt, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


TopItem = Use | Let | Fn


@dataclass(frozen=True, slots=True)
class Program:
    items: tuple[TopItem, ...]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)


Node = Expr | MainStmt | TopItem | EngineItem | WorkloadItem | ServerStep | Clause | SetVar
