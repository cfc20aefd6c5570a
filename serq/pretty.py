"""A canonical pretty-printer for serQ: ``parse(pretty(p)) == p`` for every program ``p``."""

from __future__ import annotations

from serq import ast as A

_BIN_LEVEL: dict[str, int] = {
    "||": 1,
    "&&": 2,
    "==": 3,
    "!=": 3,
    "<": 3,
    "<=": 3,
    ">": 3,
    ">=": 3,
    "+": 4,
    "-": 4,
    "*": 5,
    "/": 5,
    "%": 5,
}
_ATOM = 7
_UNARY = 6


def _level(e: A.Expr) -> int:
    if isinstance(e, A.Cond):
        return 0
    if isinstance(e, A.Binary):
        return _BIN_LEVEL[e.op]
    if isinstance(e, A.Unary):
        return _UNARY
    return _ATOM


def _num(v: int | float) -> str:
    if isinstance(v, bool):  # pragma: no cover - the AST never holds bools
        raise ValueError("boolean literal")
    return repr(v) if isinstance(v, float) else str(v)


def expr(e: A.Expr, min_level: int = 0) -> str:
    """Print an expression, parenthesised where the grammar's precedence needs it."""
    text = _expr(e)
    return f"({text})" if _level(e) < min_level else text


def _args(args: tuple[A.Expr, ...]) -> str:
    return ", ".join(expr(a) for a in args)


def _expr(e: A.Expr) -> str:
    if isinstance(e, A.Num):
        return _num(e.value)
    if isinstance(e, A.Str):
        return f'"{e.value}"'
    if isinstance(e, A.Name):
        return e.name
    if isinstance(e, A.Attr):
        return f"{e.obj}.{e.attr}"
    if isinstance(e, A.Unary):
        return f"{e.op}{expr(e.operand, _UNARY)}"
    if isinstance(e, A.Binary):
        lvl = _BIN_LEVEL[e.op]
        if lvl == 3:  # comparisons do not associate
            return f"{expr(e.left, 4)} {e.op} {expr(e.right, 4)}"
        return f"{expr(e.left, lvl)} {e.op} {expr(e.right, lvl + 1)}"
    if isinstance(e, A.Cond):
        return f"{expr(e.cond, 1)} ? {expr(e.then, 0)} : {expr(e.orelse, 0)}"
    if isinstance(e, A.Call):
        return f"{e.func}({_args(e.args)})"
    if isinstance(e, A.MethodCall):
        return f"{e.obj}.{e.method}({_args(e.args)})"
    return f"~{e.dist}({_args(e.args)})"


def _clause(c: A.Clause) -> str:
    parts = [c.kind, c.queue]
    if c.only is not None:
        parts.append(f"only ({expr(c.only)})")
    if c.while_ is not None:
        parts.append(f"while ({expr(c.while_)})")
    if c.each is not None:
        parts.append(f"each at most ({expr(c.each)})")
    return " ".join(parts) + ";"


def _stmt(s: A.MainStmt | A.TopItem, ind: str) -> list[str]:
    if isinstance(s, A.Use):
        return [f'{ind}use "{s.path}";']
    if isinstance(s, A.Let):
        return [f"{ind}let {s.name} = {expr(s.value)};"]
    if isinstance(s, A.Fn):
        out = [f"{ind}fn {s.name}() {{"]
        for st in s.body:
            out += _stmt(st, ind + "  ")
        return out + [f"{ind}}}"]
    if isinstance(s, A.Device):
        return [f"{ind}device {s.name} {{ }}"]
    if isinstance(s, A.Def):
        return [f"{ind}def {s.name}({', '.join(s.params)}) {{ {expr(s.body)} }}"]
    if isinstance(s, A.Engine):
        out = [f"{ind}engine {s.name} on {s.device} {{"]
        i2 = ind + "  "
        for item in s.items:
            if isinstance(item, A.TokensCap):
                out.append(f"{i2}tokens cap {expr(item.value)};")
            elif isinstance(item, A.Execute):
                out.append(f"{i2}execute ({expr(item.value)});")
            else:
                out.append(f"{i2}schedule {{")
                out += [f"{i2}  {_clause(c)}" for c in item.clauses]
                out.append(f"{i2}}}")
        return out + [f"{ind}}}"]
    if isinstance(s, A.Workload):
        out = [f"{ind}workload {{"]
        i2 = ind + "  "
        for w in s.items:
            if isinstance(w, A.Arrive):
                out.append(f"{i2}arrive {w.process}({expr(w.rate)});")
            else:
                out.append(f"{i2}init {{")
                out += [f"{i2}  set {v.name} = {expr(v.value)};" for v in w.sets]
                out.append(f"{i2}}}")
        return out + [f"{ind}}}"]
    if isinstance(s, A.Server):
        out = [f"{ind}server {{"]
        for step in s.steps:
            if isinstance(step, A.Run):
                out.append(f"{ind}  run {step.engine} {step.phase} ({expr(step.amount)});")
            else:
                out.append(f"{ind}  observe {step.name} = {expr(step.value)};")
        return out + [f"{ind}}}"]
    given = f" given ({expr(s.given)})" if s.given is not None else ""
    return [f"{ind}claim {s.name}{given}: every iteration of {s.engine} ({expr(s.body)});"]


def pretty(p: A.Program) -> str:
    """Print a whole program in canonical layout (two-space indentation, no comments)."""
    lines: list[str] = []
    for item in p.items:
        lines += _stmt(item, "")
    return "\n".join(lines) + "\n"
