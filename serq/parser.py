"""The serQ grammar (lark, LALR) and the transformation of its parse tree into the typed AST."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import (
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    UnexpectedToken,
    VisitError,
)

from serq import ast as A
from serq.errors import Loc, SerqError

#: The largest integer a literal or a constant may hold (a literal beyond it is an error; write
#: a float such as ``1e30`` instead). Keeps every constant printable and convertible to a float.
MAX_INT = 2**63 - 1

GRAMMAR = r"""
start: top*

?top: use | let | fn

use: "use" STRING ";"
let: "let" NAME "=" expr ";"
fn: "fn" NAME "(" ")" "{" main_stmt* "}"

?main_stmt: let | device | def | engine | workload | server | claim

device: "device" NAME "{" "}"
def: "def" NAME "(" [params] ")" "{" expr "}"
params: NAME ("," NAME)*

engine: "engine" NAME "on" NAME "{" engine_item* "}"
?engine_item: tokens_cap | schedule | execute
tokens_cap: "tokens" "cap" expr ";"
schedule: "schedule" "{" clause* "}"
clause: clause_kind NAME [only_part] [while_part] [each_part] ";"
!clause_kind: "advance" | "admit"
only_part: "only" "(" expr ")"
while_part: "while" "(" expr ")"
each_part: "each" "at" "most" "(" expr ")"
execute: "execute" "(" expr ")" ";"

workload: "workload" "{" workload_item* "}"
?workload_item: arrive | init
arrive: "arrive" NAME "(" expr ")" ";"
init: "init" "{" set_stmt* "}"
set_stmt: "set" NAME "=" expr ";"

server: "server" "{" server_step* "}"
?server_step: run | observe
run: "run" NAME phase "(" expr ")" ";"
!phase: "prefill" | "decode"
observe: "observe" NAME "=" expr ";"

claim: "claim" NAME [given_part] ":" "every" "iteration" "of" NAME "(" expr ")" ";"
given_part: "given" "(" expr ")"

?expr: or_expr "?" expr ":" expr -> cond
     | or_expr
?or_expr: or_expr "||" and_expr -> or_
        | and_expr
?and_expr: and_expr "&&" cmp_expr -> and_
         | cmp_expr
?cmp_expr: sum "==" sum -> eq
         | sum "!=" sum -> ne
         | sum "<" sum -> lt
         | sum "<=" sum -> le
         | sum ">" sum -> gt
         | sum ">=" sum -> ge
         | sum
?sum: sum "+" term -> add
    | sum "-" term -> sub
    | term
?term: term "*" unary -> mul
     | term "/" unary -> div
     | term "%" unary -> mod
     | unary
?unary: "!" unary -> not_
      | "-" unary -> neg
      | atom
?atom: NUMBER -> number
     | STRING -> string
     | NAME -> name
     | NAME "." NAME -> attr
     | NAME "(" [args] ")" -> call
     | NAME "." NAME "(" [args] ")" -> method
     | "~" NAME "(" [args] ")" -> draw
     | "(" expr ")"
args: expr ("," expr)*

NUMBER: /(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?/
STRING: /"[^"\\\n]*"/
NAME: /[A-Za-z_][A-Za-z0-9_]*/
COMMENT: /\/\/[^\n]*/
%import common.WS
%ignore WS
%ignore COMMENT
"""

#: Words the grammar uses as keywords. Programs may not use them as names.
KEYWORDS = frozenset(
    [
        "use",
        "let",
        "fn",
        "device",
        "def",
        "engine",
        "on",
        "tokens",
        "cap",
        "schedule",
        "advance",
        "admit",
        "only",
        "while",
        "each",
        "at",
        "most",
        "execute",
        "workload",
        "arrive",
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
    ]
)


def _loc(meta: Any) -> Loc:
    if getattr(meta, "empty", True):
        return Loc(0, 0)
    return Loc(int(meta.line), int(meta.column))


def _tloc(tok: Token) -> Loc:
    return Loc(int(tok.line or 0), int(tok.column or 0))


def _args(node: Any) -> tuple[A.Expr, ...]:
    if node is None:
        return ()
    return tuple(node)


_BINOPS: dict[str, A.BinaryOp] = {
    "or_": "||",
    "and_": "&&",
    "eq": "==",
    "ne": "!=",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
    "add": "+",
    "sub": "-",
    "mul": "*",
    "div": "/",
    "mod": "%",
}


@v_args(meta=True, inline=True)
class _ToAst(Transformer[Token, A.Program]):
    # ------------------------------------------------------------------ expressions
    def number(self, meta: Any, tok: Token) -> A.Num:
        text = str(tok)
        value: int | float
        if any(c in text for c in ".eE"):
            value = float(text)
            if not math.isfinite(value):
                raise SerqError(f"number literal {text} is out of range", _tloc(tok))
        else:
            digits = text.lstrip("0")
            if len(digits) > 19 or int(digits or "0") > MAX_INT:
                shown = (
                    text if len(text) <= 24 else f"{text[:10]}...{text[-6:]} ({len(text)} digits)"
                )
                raise SerqError(
                    f"integer literal {shown} is too large (at most 2**63 - 1; "
                    "write a float such as 1e30)",
                    _tloc(tok),
                )
            value = int(text)
        return A.Num(value, _tloc(tok))

    def string(self, meta: Any, tok: Token) -> A.Str:
        return A.Str(str(tok)[1:-1], _tloc(tok))

    def name(self, meta: Any, tok: Token) -> A.Name:
        return A.Name(str(tok), _tloc(tok))

    def attr(self, meta: Any, obj: Token, attr: Token) -> A.Attr:
        return A.Attr(str(obj), str(attr), _tloc(obj))

    def call(self, meta: Any, func: Token, args: Any) -> A.Call:
        return A.Call(str(func), _args(args), _tloc(func))

    def method(self, meta: Any, obj: Token, meth: Token, args: Any) -> A.MethodCall:
        return A.MethodCall(str(obj), str(meth), _args(args), _tloc(obj))

    def draw(self, meta: Any, dist: Token, args: Any) -> A.Draw:
        return A.Draw(str(dist), _args(args), _loc(meta))

    def args(self, meta: Any, *exprs: A.Expr) -> tuple[A.Expr, ...]:
        return tuple(exprs)

    def cond(self, meta: Any, c: A.Expr, a: A.Expr, b: A.Expr) -> A.Cond:
        return A.Cond(c, a, b, _loc(meta))

    def not_(self, meta: Any, e: A.Expr) -> A.Unary:
        return A.Unary("!", e, _loc(meta))

    def neg(self, meta: Any, e: A.Expr) -> A.Unary:
        return A.Unary("-", e, _loc(meta))

    def __default__(self, data: Any, children: Any, meta: Any) -> Any:
        op = _BINOPS.get(str(data))
        if op is not None:
            left, right = children
            return A.Binary(op, left, right, _loc(meta))
        raise SerqError(f"internal: no rule for {data}", _loc(meta))  # pragma: no cover

    # ------------------------------------------------------------------ statements
    def use(self, meta: Any, path: Token) -> A.Use:
        return A.Use(str(path)[1:-1], _loc(meta))

    def let(self, meta: Any, name: Token, value: A.Expr) -> A.Let:
        return A.Let(str(name), value, _loc(meta))

    def fn(self, meta: Any, name: Token, *body: A.MainStmt) -> A.Fn:
        return A.Fn(str(name), tuple(body), _loc(meta))

    def device(self, meta: Any, name: Token) -> A.Device:
        return A.Device(str(name), _loc(meta))

    def params(self, meta: Any, *names: Token) -> tuple[str, ...]:
        return tuple(str(n) for n in names)

    def def_(self, meta: Any, name: Token, params: Any, body: A.Expr) -> A.Def:
        return A.Def(str(name), tuple(params or ()), body, _loc(meta))

    def engine(self, meta: Any, name: Token, device: Token, *items: A.EngineItem) -> A.Engine:
        return A.Engine(str(name), str(device), tuple(items), _loc(meta), _tloc(device))

    def tokens_cap(self, meta: Any, value: A.Expr) -> A.TokensCap:
        return A.TokensCap(value, _loc(meta))

    def schedule(self, meta: Any, *clauses: A.Clause) -> A.Schedule:
        return A.Schedule(tuple(clauses), _loc(meta))

    def clause_kind(self, meta: Any, tok: Token) -> str:
        return str(tok)

    def only_part(self, meta: Any, e: A.Expr) -> A.Expr:
        return e

    def while_part(self, meta: Any, e: A.Expr) -> A.Expr:
        return e

    def each_part(self, meta: Any, e: A.Expr) -> A.Expr:
        return e

    def given_part(self, meta: Any, e: A.Expr) -> A.Expr:
        return e

    def clause(
        self,
        meta: Any,
        kind: str,
        queue: Token,
        only: A.Expr | None,
        while_: A.Expr | None,
        each: A.Expr | None,
    ) -> A.Clause:
        k: A.ClauseKind = "advance" if kind == "advance" else "admit"
        return A.Clause(k, str(queue), only, while_, each, _loc(meta), _tloc(queue))

    def execute(self, meta: Any, value: A.Expr) -> A.Execute:
        return A.Execute(value, _loc(meta))

    def workload(self, meta: Any, *items: A.WorkloadItem) -> A.Workload:
        return A.Workload(tuple(items), _loc(meta))

    def arrive(self, meta: Any, process: Token, rate: A.Expr) -> A.Arrive:
        return A.Arrive(str(process), rate, _loc(meta))

    def init(self, meta: Any, *sets: A.SetVar) -> A.Init:
        return A.Init(tuple(sets), _loc(meta))

    def set_stmt(self, meta: Any, name: Token, value: A.Expr) -> A.SetVar:
        return A.SetVar(str(name), value, _loc(meta))

    def server(self, meta: Any, *steps: A.ServerStep) -> A.Server:
        return A.Server(tuple(steps), _loc(meta))

    def phase(self, meta: Any, tok: Token) -> str:
        return str(tok)

    def run(self, meta: Any, engine: Token, phase: str, amount: A.Expr) -> A.Run:
        ph: A.Phase = "prefill" if phase == "prefill" else "decode"
        return A.Run(str(engine), ph, amount, _loc(meta), _tloc(engine))

    def observe(self, meta: Any, name: Token, value: A.Expr) -> A.Observe:
        return A.Observe(str(name), value, _loc(meta))

    def claim(
        self, meta: Any, name: Token, given: A.Expr | None, engine: Token, body: A.Expr
    ) -> A.Claim:
        return A.Claim(str(name), given, str(engine), body, _loc(meta), _tloc(engine))

    def start(self, meta: Any, *items: A.TopItem) -> A.Program:
        return A.Program(tuple(items), _loc(meta))


# ``def`` is a Python keyword, so the rule's callback is registered under another name.
setattr(_ToAst, "def", _ToAst.def_)  # noqa: B010


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(
        GRAMMAR,
        parser="lalr",
        lexer="contextual",
        propagate_positions=True,
        maybe_placeholders=True,
    )


_PUNCT_NAMES = {
    "SEMICOLON": "';'",
    "LPAR": "'('",
    "RPAR": "')'",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "COMMA": "','",
    "COLON": "':'",
    "EQUAL": "'='",
    "DOT": "'.'",
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": "a string",
    "$END": "end of file",
}


def _describe_terminal(name: str) -> str:
    if name in _PUNCT_NAMES:
        return _PUNCT_NAMES[name]
    try:
        term = _parser().get_terminal(name)
    except KeyError:
        return name
    pattern = term.pattern
    if pattern.type == "str":
        return f"'{pattern.value}'"
    return name.lower()


def _expected(names: Iterable[Any] | None) -> str:
    if not names:
        return ""
    described = sorted({_describe_terminal(str(n)) for n in names})
    if len(described) > 6:
        described = described[:6] + ["..."]
    return "; expected " + ", ".join(described)


def _syntax_error(err: UnexpectedInput, text: str) -> SerqError:
    if isinstance(err, UnexpectedCharacters):
        pos = err.pos_in_stream
        ch = text[pos] if pos is not None and 0 <= pos < len(text) else "?"
        return SerqError(f"syntax error: unexpected character {ch!r}", Loc(err.line, err.column))
    if isinstance(err, UnexpectedEOF):
        lines = text.splitlines() or [""]
        loc = Loc(len(lines), len(lines[-1]) + 1)
        return SerqError("syntax error: unexpected end of file" + _expected(err.expected), loc)
    if isinstance(err, UnexpectedToken):
        tok = err.token
        if tok.type == "$END":
            lines = text.splitlines() or [""]
            loc = Loc(len(lines), len(lines[-1]) + 1)
            return SerqError("syntax error: unexpected end of file" + _expected(err.expected), loc)
        what = f"keyword '{tok}'" if str(tok) in KEYWORDS else repr(str(tok))
        return SerqError(
            f"syntax error: unexpected {what}" + _expected(err.expected),
            Loc(int(tok.line or 0), int(tok.column or 0)),
        )
    return SerqError(f"syntax error: {err}", Loc(err.line, err.column))  # pragma: no cover


def parse(text: str, filename: str = "<input>") -> A.Program:
    """Parse serQ source text into a :class:`serq.ast.Program`; raise :class:`SerqError`."""
    try:
        tree = _parser().parse(text)
        program = _ToAst().transform(tree)
    except UnexpectedInput as err:
        raise _syntax_error(err, text).attach(filename, text) from None
    except VisitError as err:
        orig = err.orig_exc
        if isinstance(orig, SerqError):
            raise orig.attach(filename, text) from None
        if isinstance(orig, RecursionError):
            raise SerqError("program is nested too deeply").attach(filename, text) from None
        raise
    except RecursionError:
        raise SerqError("program is nested too deeply").attach(filename, text) from None
    assert isinstance(program, A.Program)
    return program


def parse_file(path: str | Path) -> tuple[A.Program, str]:
    """Read and parse a file; return the program and its source text."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise SerqError("no such file", filename=str(path)) from None
    except OSError as err:
        raise SerqError(f"cannot read file: {err.strerror or err}", filename=str(path)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        located = _encoding_error(data, err)
        raise located.attach(str(path), data.decode("utf-8", "replace")) from None
    return parse(text, str(path)), text


def _encoding_error(data: bytes, err: UnicodeDecodeError) -> SerqError:
    """The first byte that is not UTF-8, located by line and column (in characters)."""
    start = err.start
    line_start = data.rfind(b"\n", 0, start) + 1
    line = data.count(b"\n", 0, start) + 1
    col = len(data[line_start:start].decode("utf-8", "replace")) + 1
    return SerqError(
        f"the file is not UTF-8: byte 0x{data[start]:02x} {err.reason}", Loc(line, col)
    )
