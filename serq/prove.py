"""``serq prove``: export a program's constants, engine and claims to Rocq and prove the claims
over every path.

The export states, for each claim, the theorem ``every_path E given (fun v => C v = true)``
of ``Plow/Serq/Step.v``: for every list of arrivals (any natural arrival times, any prefill
and decode amounts) whose requests all satisfy the claim's ``given``, every iteration of the
step semantics satisfies the claim.  ``E`` is the program's engine written as Gallina
functions of the engine state (``Step.view``), exactly as :mod:`serq.interp` evaluates its
expressions; constants become ``Definition``\\ s.  A claim is proved by the tactics of
``Plow/Serq/Tactics.v``, which instantiate the RAD family's theorems (``Radproof.v``) and
check that the program is in the family; ``coqc`` checks the result and ``Print Assumptions``
must show no axiom.

Only the natural-number fragment is exported: non-negative integer constants and literals,
``+``, ``*``, ``ceil(a / k)`` and ``floor(a / k)`` and ``a % k`` with ``k`` a positive
constant, ``min``, ``max``, comparisons, ``&&``, ``||``, ``!``, ``?:``, ``def`` calls (inlined,
as the interpreter does), the engine state and, in a ``given``, the set variables that are
the amounts of the ``run`` steps.  Anything else (``-``, real ``/``, fractional constants,
other request variables) leaves the claim *not proved*, naming what was not exported.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from serq import ast as A
from serq import pretty
from serq.checker import check
from serq.errors import Loc, SerqError
from serq.interp import Spec, Value, prepare
from serq.parser import parse_file

#: Where the compiled proof library is, unless SERQ_ROCQ_LIB says otherwise.
DEFAULT_LIB = Path(__file__).resolve().parents[1] / "_build" / "default" / "Plow"
COQC_TIMEOUT_S = 600
#: The largest number the export writes. Step.v counts in unary naturals (nat); Rocq writes
#: a literal above 5,000 as ``Nat.of_num_uint`` of its digits, and the tactics then build it in
#: unary: with a 100,000 µs constant the RAD claims took 50 s, with 4,000,000,000 more than
#: 5 minutes; up to 5,000 they take a second or two.
MAX_NAT = 5_000
HEADER = (
    "From Coq Require Import List Bool Arith Lia.\n"
    "From Plow Require Import Serq.Step Serq.Stepproof Serq.Rad Serq.Radproof Serq.Tactics."
)


class NotExported(Exception):
    """An expression outside the exported fragment: the claim cannot be stated in Rocq."""

    def __init__(self, what: str, loc: Loc | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.loc = loc

    def text(self) -> str:
        at = f" at {self.loc.line}:{self.loc.col}" if self.loc is not None and self.loc.line else ""
        return f"not exported to Rocq{at}: {self.what}"


# ----------------------------------------------------------------------------- expressions

Code = tuple[str, str]  # (Gallina text, "nat" | "bool")

_STATE = {
    ("running", "decoding"): "(v_decoding v)",
    ("running", "count"): "(v_count v)",
    ("running", "prefilling"): "(v_count v - v_decoding v)",  # decoding <= count always
    ("running", "preempted"): "0",
    ("waiting", "count"): "(v_waiting v)",
    ("batch", "tokens"): "(v_tokens v)",
    ("batch", "requests"): "(v_requests v)",
}
_CLAIM_WORDS = {"tokens": "(v_tokens v)", "decoders": "(v_decoding v)", "residents": "(v_count v)"}
_CMP = {"<": ("Nat.ltb", False), "<=": ("Nat.leb", False), ">": ("Nat.ltb", True),
        ">=": ("Nat.leb", True)}  # fmt: skip


def _ident(name: str) -> str:
    return "sq_" + name


class _Export:
    """Translates checked expressions to Gallina; records the constants they use."""

    def __init__(self, spec: Spec, amount_vars: Mapping[str, str]) -> None:
        self.spec = spec
        self.amount_vars = dict(amount_vars)  # set variable -> "(r_vp r)" / "(r_vd r)"
        self.used: dict[str, int] = {}
        # a drawing engine's execute (export_d): the iteration's sample, a natural, is the
        # Gallina variable `u`; one ~exp draw, read on every iteration, is `m * u`
        self.sample: str | None = None
        self.draws = 0
        self.lazy = 0  # > 0 inside a branch of ?: or an operand of && / || (read sometimes)

    def constant_value(self, e: A.Expr) -> int | None:
        """The value of ``e`` when it is a constant natural number (a literal or a ``let``)."""
        if isinstance(e, A.Num):
            return _natural(e.value)
        if isinstance(e, A.Name) and e.name in self.spec.consts:
            return _natural(self.spec.consts[e.name])
        return None

    def nat(self, e: A.Expr, ctx: str, env: Mapping[str, Code]) -> str:
        code, kind = self.tr(e, ctx, env)
        if kind != "nat":
            raise NotExported("a number was expected", e.loc)
        return code

    def boolean(self, e: A.Expr, ctx: str, env: Mapping[str, Code]) -> str:
        code, kind = self.tr(e, ctx, env)
        if kind != "bool":
            raise NotExported("a condition was expected", e.loc)
        return code

    def tr(self, e: A.Expr, ctx: str, env: Mapping[str, Code]) -> Code:
        if isinstance(e, A.Num):
            n = _natural(e.value)
            if n is None:
                raise NotExported(f"the literal {e.value!r} is not a natural number", e.loc)
            _small(n, f"the literal {n}", e.loc)
            return str(n), "nat"
        if isinstance(e, A.Name):
            return self.name(e, ctx, env)
        if isinstance(e, A.Attr):
            if (e.obj, e.attr) not in _STATE or ctx == "given":
                raise NotExported(f"'{e.obj}.{e.attr}'", e.loc)
            return _STATE[e.obj, e.attr], "nat"
        if isinstance(e, A.Unary):
            if e.op == "!":
                return f"(negb {self.boolean(e.operand, ctx, env)})", "bool"
            raise NotExported("negation of a number", e.loc)
        if isinstance(e, A.Binary):
            return self.binary(e, ctx, env)
        if isinstance(e, A.Draw):
            return self.draw(e, ctx, env)
        if isinstance(e, A.Cond):
            c = self.boolean(e.cond, ctx, env)
            self.lazy += 1
            try:
                (a, ka), (b, kb) = self.tr(e.then, ctx, env), self.tr(e.orelse, ctx, env)
            finally:
                self.lazy -= 1
            if ka != kb:
                raise NotExported("the branches of '?:' differ in type", e.loc)
            return f"(if {c} then {a} else {b})", ka
        if isinstance(e, A.Call):
            return self.call(e, ctx, env)
        raise NotExported(f"'{pretty.expr(e)}'", e.loc)

    def draw(self, e: A.Draw, ctx: str, env: Mapping[str, Code]) -> Code:
        """``~exp(m)`` in a drawing engine's ``execute``: ``m * u``, ``u`` the iteration's
        sample (Step.dengine: one sample per iteration, so exactly one draw, read on every
        iteration: the interpreter reads its stream once per iteration then too)."""
        if self.sample is None or ctx != "engine":
            raise NotExported(f"'{pretty.expr(e)}'", e.loc)
        if e.dist != "exp":
            raise NotExported(f"'{pretty.expr(e)}' (only ~exp(m) is m * the sample)", e.loc)
        if self.lazy:
            raise NotExported(f"'{pretty.expr(e)}' is not read on every iteration", e.loc)
        self.draws += 1
        if self.draws > 1:
            raise NotExported("a second draw (one sample per iteration)", e.loc)
        return f"({self.nat(e.args[0], ctx, env)} * {self.sample})", "nat"

    def name(self, e: A.Name, ctx: str, env: Mapping[str, Code]) -> Code:
        n = e.name
        if n in env:
            return env[n]
        if n == "decoding":
            return "true", "bool"
        if ctx == "claim" and n in _CLAIM_WORDS:
            return _CLAIM_WORDS[n], "nat"
        if ctx in ("engine", "claim") and n == "now":
            return "(v_now v)", "nat"
        if ctx in ("engine", "claim") and n == "served":
            return "(v_served v)", "nat"
        if ctx == "given" and n in self.amount_vars:
            return self.amount_vars[n], "nat"
        if n in self.spec.consts:
            v = self.spec.consts[n]
            if isinstance(v, bool):
                return ("true" if v else "false"), "bool"
            k = _natural(v)
            if k is None:
                raise NotExported(f"the constant '{n}' is {v!r}, not a natural number", e.loc)
            _small(k, f"the constant '{n}' ({k})", e.loc)
            self.used[n] = k
            return _ident(n), "nat"
        if ctx == "given":
            raise NotExported(f"the request variable '{n}' is not the amount of a run step", e.loc)
        raise NotExported(f"'{n}'", e.loc)

    def binary(self, e: A.Binary, ctx: str, env: Mapping[str, Code]) -> Code:
        op = e.op
        if op in ("&&", "||"):
            self.lazy += 1
            try:
                a, b = self.boolean(e.left, ctx, env), self.boolean(e.right, ctx, env)
            finally:
                self.lazy -= 1
            return f"({'andb' if op == '&&' else 'orb'} {a} {b})", "bool"
        if op == "/":
            raise NotExported("real division outside ceil(a / k) or floor(a / k)", e.loc)
        if op == "-":
            raise NotExported("subtraction (not a natural-number operation)", e.loc)
        (a, ka), (b, kb) = self.tr(e.left, ctx, env), self.tr(e.right, ctx, env)
        if op in ("==", "!="):
            if ka != kb:
                raise NotExported("'==' between a number and a condition", e.loc)
            eq = f"({'Nat.eqb' if ka == 'nat' else 'Bool.eqb'} {a} {b})"
            return (eq if op == "==" else f"(negb {eq})"), "bool"
        if ka != "nat" or kb != "nat":
            raise NotExported(f"'{op}' on a condition", e.loc)
        if op in _CMP:
            f, swap = _CMP[op]
            return (f"({f} {b} {a})" if swap else f"({f} {a} {b})"), "bool"
        if op == "%":
            self.divisor(e.right)
            return f"(Nat.modulo {a} {b})", "nat"
        return f"({a} {op} {b})", "nat"

    def divisor(self, e: A.Expr) -> None:
        k = self.constant_value(e)
        if k is None or k <= 0:
            raise NotExported("a divisor that is not a positive constant", e.loc)

    def call(self, e: A.Call, ctx: str, env: Mapping[str, Code]) -> Code:
        if e.func in ("ceil", "floor"):
            (x,) = e.args
            if isinstance(x, A.Binary) and x.op == "/":
                self.divisor(x.right)
                a, b = self.nat(x.left, ctx, env), self.nat(x.right, ctx, env)
                return (f"(ceil_div {a} {b})" if e.func == "ceil" else f"({a} / {b})"), "nat"
            return self.nat(x, ctx, env), "nat"
        if e.func in ("min", "max"):
            args = [self.nat(a, ctx, env) for a in e.args]
            f = "Nat.min" if e.func == "min" else "Nat.max"
            out = args[0]
            for a in args[1:]:
                out = f"({f} {out} {a})"
            return out, "nat"
        d = self.spec.defs.get(e.func)
        if d is None:
            raise NotExported(f"'{e.func}(...)'", e.loc)
        bound = {p: self.tr(a, ctx, env) for p, a in zip(d.params, e.args, strict=True)}
        return self.tr(d.body, ctx, {**env, **bound})


def _small(n: int, what: str, loc: Loc | None) -> None:
    """Rocq's naturals are unary: a proof step that computes with a large one never ends."""
    if n > MAX_NAT:
        raise NotExported(f"{what} is above {MAX_NAT:,}, the largest number exported", loc)


def _natural(v: Value) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, float):
        if not math.isfinite(v) or not v.is_integer():
            return None
        v = int(v)
    return v if v >= 0 else None


# ----------------------------------------------------------------------------- the file


@dataclass(frozen=True, slots=True)
class ClaimExport:
    name: str
    given: str | None  # the claim's given, as written
    statement: str | None  # the Rocq statement, or None when not exported
    reason: str | None  # why not exported


@dataclass(frozen=True, slots=True)
class Export:
    prelude: str  # imports, then defs
    defs: str  # the constants, the unfolding tactic, the engine E
    bcol: str | None  # the tokens cap, the tile size the RAD theorems are instantiated at
    claims: tuple[ClaimExport, ...]
    reason: str | None  # why the engine itself was not exported


def _clause(x: _Export, cl: A.Clause | None) -> str:
    if cl is None:
        return "None"

    def opt(e: A.Expr | None, kind: str) -> str:
        if e is None:
            return "None"
        code = x.boolean(e, "engine", {}) if kind == "bool" else x.nat(e, "engine", {})
        return f"(Some (fun v : view => {code}))"

    only, while_, each = opt(cl.only, "bool"), opt(cl.while_, "bool"), opt(cl.each, "nat")
    return f"(Some (mk_clause {only} {while_} {each}))"


def export(spec: Spec, source: str) -> Export:
    """The Rocq text of a prepared program: its engine and one statement per claim."""
    amount_vars = {}
    for e, field in ((spec.prefill, "(r_vp r)"), (spec.decode, "(r_vd r)")):
        if isinstance(e, A.Name) and e.name in spec.number_vars:
            amount_vars[e.name] = field
    x = _Export(spec, amount_vars)
    engine: str | None = None
    reason = None
    bcol = None
    try:
        cap = "None"
        if spec.cap is not None:
            bcol = x.nat(spec.cap, "engine", {})
            cap = f"(Some (fun v : view => {bcol}))"
        adv, adm = _clause(x, spec.advance), _clause(x, spec.admit)
        exe = x.nat(spec.execute, "engine", {})
        engine = (f"Definition E : engine := mk_engine\n  {cap}\n  {adv}\n  {adm}\n"
                  f"  (fun v : view => {exe}).")  # fmt: skip
    except NotExported as err:
        reason = "the engine is " + err.text()
    claims = []
    for c in spec.claims:
        given_text = pretty.expr(c.given) if c.given is not None else None
        if engine is None:
            claims.append(ClaimExport(c.name, given_text, None, reason))
            continue
        try:
            g = x.boolean(c.given, "given", {}) if c.given is not None else "true"
            body = x.boolean(c.body, "claim", {})
        except NotExported as err:
            claims.append(ClaimExport(c.name, given_text, None, err.text()))
            continue
        stmt = f"every_path E (fun r : req => {g}) (fun v : view => {body} = true)"
        claims.append(ClaimExport(c.name, given_text, stmt, None))
    consts = "\n".join(f"Definition {_ident(n)} : nat := {v}." for n, v in x.used.items())
    unfold = ", ".join(_ident(n) for n in x.used)
    defs = "\n".join([
        consts,
        f"Ltac sq_unfold := {'unfold ' + unfold + ' in *' if unfold else 'idtac'}.",
        engine or f"(* {reason} *)",
    ])  # fmt: skip
    prelude = "\n".join([
        f"(* {source} exported by serq prove: constants, engine, claims (Plow/Serq/Step.v). *)",
        HEADER,
        defs,
    ])  # fmt: skip
    return Export(prelude, defs, bcol, tuple(claims), reason)


def export_d(spec: Spec) -> str:
    """A program whose ``execute`` draws, as a ``Step.dengine`` named ``D``: the constants it
    uses, then ``D``, its execute reading the iteration's sample ``u`` (``~exp(m)`` is ``m *
    u``). :class:`NotExported` when the engine is outside that fragment (more than one draw,
    a draw not read on every iteration, ``~uniform``, or anything ``export`` refuses)."""
    x = _Export(spec, {})
    cap = "None"
    if spec.cap is not None:
        cap = f"(Some (fun v : view => {x.nat(spec.cap, 'engine', {})}))"
    adv, adm = _clause(x, spec.advance), _clause(x, spec.admit)
    x.sample = "u"
    exe = x.nat(spec.execute, "engine", {})
    x.sample = None
    consts = "\n".join(f"Definition {_ident(n)} : nat := {v}." for n, v in x.used.items())
    return (f"{consts}\nDefinition D : dengine := mk_dengine\n  {cap}\n  {adv}\n  {adm}\n"
            f"  (fun (v : view) (u : nat) => {exe}).")  # fmt: skip


def _tactic(ex: Export) -> str:
    return f"serq_claim ({ex.bcol}) ltac:(sq_unfold)"


def attempt_file(ex: Export) -> str:
    """Pass 1: try each claim, printing a marker and what is left of the goal."""
    out = [ex.prelude]
    for i, c in enumerate(ex.claims):
        if c.statement is None:
            continue
        out += [
            f"Goal {c.statement}.",
            "Proof.",
            f'tryif ({_tactic(ex)}) then idtac "@@serq proved {i}" '
            f'else (idtac "@@serq open {i}"; serq_residual ({ex.bcol}) ltac:(sq_unfold)).',
            "Show.",
            "Abort.",
        ]
    return "\n".join(out) + "\n"


def proof_file(ex: Export, proved: set[int]) -> str:
    """Pass 2: the proved claims as theorems, checked by the kernel, and their assumptions."""
    out = [ex.prelude]
    for i, c in enumerate(ex.claims):
        if c.statement is None:
            out.append(f"(* {c.name}: {c.reason} *)")
        elif i in proved:
            out += [f"Theorem {_ident(c.name)} : {c.statement}.",
                    f"Proof. {_tactic(ex)}. Qed.",
                    f"Print Assumptions {_ident(c.name)}."]  # fmt: skip
        else:
            out.append(f"(* not proved: {c.name} : {c.statement} *)")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- checking


@dataclass(frozen=True, slots=True)
class ClaimProof:
    name: str
    given: str | None
    proved: bool
    detail: str  # why not, or the theorem's name

    def result_text(self) -> str:
        return "proved (every path)" if self.proved else f"not proved: {self.detail}"


def library() -> Path:
    lib = Path(os.environ.get("SERQ_ROCQ_LIB", DEFAULT_LIB))
    if not (lib / "Serq" / "Tactics.vo").is_file():
        raise SerqError(f"the Rocq library is not built at {lib} (run make proofs)")
    return lib


def coqc(text: str, lib: Path, name: str = "SerqExport") -> tuple[int, str, str]:
    """Check ``text`` as a file of its own; the exit status, what it printed, its errors."""
    exe = shutil.which("coqc")
    if exe is None:
        raise SerqError("coqc is not on PATH (serq prove needs Rocq/Coq 8.16)")
    with tempfile.TemporaryDirectory(prefix="serq-prove-") as tmp:
        path = Path(tmp) / f"{name}.v"
        path.write_text(text, encoding="utf-8")
        try:
            r = subprocess.run(
                [exe, "-q", "-Q", str(lib), "Plow", str(path)],
                capture_output=True, text=True, timeout=COQC_TIMEOUT_S, cwd=tmp,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise SerqError(f"coqc ran more than {COQC_TIMEOUT_S} s") from None
    return r.returncode, r.stdout, r.stderr


_WORDS = [("v_tokens v", "tokens"), ("v_decoding v", "decoders"), ("v_count v", "residents"),
          ("v_served v", "served"), ("v_now v", "now"), ("v_waiting v", "waiting.count"),
          ("v_requests v", "batch.requests"), ("r_vp r", "vp"), ("r_vd r", "vd")]  # fmt: skip


def _readable(goal: str) -> str:
    text = " ".join(goal.split())
    for a, b in _WORDS:
        text = text.replace(a, b)
    return re.sub(r"\bsq_(\w+)", r"\1", text)


def residual(block: str) -> str:
    """The goal ``Show`` printed after the attempt: its conclusion, with the facts the family
    theorems gave (hypotheses ``H...``), in the program's words."""
    lines = block.splitlines()
    try:
        bar = next(i for i, ln in enumerate(lines) if ln.strip().startswith("===="))
    except StopIteration:
        return _readable(block.strip() or "the statement")
    concl: list[str] = []
    for ln in lines[bar + 1 :]:
        if not ln.strip() or ln.strip().startswith("goal "):
            break
        concl.append(ln)
    facts: list[str] = []
    cur: list[str] | None = None
    for ln in lines[:bar]:
        m = re.match(r"\s{2}(H\w*) : (.*)", ln)
        if m:
            cur = [m.group(2)]
            facts.append("")
        elif cur is not None and ln.startswith("     "):
            cur.append(ln)
        else:
            cur = None
        if cur is not None:
            facts[-1] = " ".join(cur)
    out = _readable(" ".join(concl))
    if facts:
        out += " (knowing " + "; ".join(_readable(f) for f in facts) + ")"
    return out


def prove_spec(spec: Spec, source: str, keep: Path | None = None) -> list[ClaimProof]:
    """Export ``spec``, try every claim in Rocq, check the proved ones with the kernel."""
    ex = export(spec, source)
    results: dict[int, ClaimProof] = {}
    for i, c in enumerate(ex.claims):
        if c.statement is None:
            results[i] = ClaimProof(c.name, c.given, False, c.reason or "not exported")
        elif ex.bcol is None:
            results[i] = ClaimProof(
                c.name, c.given, False, "the engine has no tokens cap (the RAD theorems need one)"
            )
    todo = [i for i in range(len(ex.claims)) if i not in results]
    proved: set[int] = set()
    if todo:
        lib = library()
        rc, out, err = coqc(attempt_file(ex), lib)
        if rc != 0:
            raise SerqError("coqc rejected the exported program: " + _first_error(out + err))
        blocks = re.split(r"@@serq (proved|open) (\d+)\n", out)
        for k in range(1, len(blocks) - 2, 3):
            status, i, rest = blocks[k], int(blocks[k + 1]), blocks[k + 2]
            c = ex.claims[i]
            if status == "proved":
                proved.add(i)
            else:
                results[i] = ClaimProof(c.name, c.given, False, residual(rest))
    final = proof_file(ex, proved)
    if keep is not None:
        keep.write_text(final, encoding="utf-8")
    if proved:
        rc, out, err = coqc(final, library())
        if rc != 0:
            raise SerqError("coqc rejected the proofs it had found: " + _first_error(out + err))
        closed = out.count("Closed under the global context")
        if closed != len(proved):
            raise SerqError("a proved claim depends on an axiom:\n" + out.strip())
        for i in proved:
            c = ex.claims[i]
            results[i] = ClaimProof(c.name, c.given, True, _ident(c.name))
    for i, c in enumerate(ex.claims):
        if i not in results:  # pragma: no cover - every claim got an answer above
            results[i] = ClaimProof(c.name, c.given, False, "no answer from coqc")
    return [results[i] for i in range(len(ex.claims))]


#: the stability theorems of ``Plow/Serq/Theorem2proof.v`` instantiated at the program's engine
STABILITY = "theorem2 (B4, B5, B6)"


def stability_file(ex: Export) -> str:
    """Theorem 2 (B4, B5 per node and joint, B6) for the program's engine ``E``: it is one
    of the engines the library proves them for (``rad128``: RAD's schedule with 128-token
    tiles, any cost, an admission ``while`` that always holds), shown by computation."""
    return "\n".join([
        ex.prelude,
        "From Coq Require Import QArith.",
        "From Plow Require Import Serq.Theorem2 Serq.Theorem2proof.",
        "Theorem theorem2 :",
        "  theorem2_one_node_for E /\\ theorem2_nodes_per_node_for E",
        "  /\\ theorem2_nodes_joint_for E /\\ theorem2_compound_for E.",
        "Proof.",
        "  apply theorem2_all_rad128. split.",
        "  - serq_schedule ltac:(sq_unfold).",
        "  - intros c Hc v. unfold E in Hc. cbn in Hc.",
        "    first [discriminate Hc | injection Hc as <-; cbn; sq_unfold; cbn; reflexivity].",
        "Qed.",
        "Print Assumptions theorem2.",
    ]) + "\n"  # fmt: skip


def prove_stability(spec: Spec, source: str) -> ClaimProof:
    """Whether Theorem 2 holds of the program's engine, checked by the kernel: every
    reachable job-list state of one node positive recurrent under any finite slot law with
    fewer than 128 expected tokens a slot (B4), the same per node under uniform routing to
    ``g`` nodes and fewer than ``128 g``, and the nodes' joint return to all empty when an
    empty slot has positive probability (B5), a bounded expected return to the empty engine
    under a countable (compound Poisson) law (B6). The slotted model is Theorem 2's, not the
    program's ``workload``; the theorem is proved once in the library, for ``rad128`` engines."""
    ex = export(spec, source)
    if ex.reason is not None:
        return ClaimProof(STABILITY, None, False, ex.reason)
    rc, out, err = coqc(stability_file(ex), library(), "SerqStability")
    if rc != 0:
        return ClaimProof(
            STABILITY,
            None,
            False,
            "the engine is not shown to be RAD with 128-token tiles and an admission 'while'"
            " that always holds (Theorem 2 is proved for those): " + _first_error(out + err),
        )
    if "Closed under the global context" not in out:
        raise SerqError("Theorem 2 depends on an axiom:\n" + out.strip())
    return ClaimProof(STABILITY, None, True, "theorem2")


def _first_error(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    for k, ln in enumerate(lines):
        if ln.startswith("Error"):
            return " ".join([ln, *lines[k + 1 : k + 3]])
    return lines[-1] if lines else "(no output)"


def _spec_of_file(path: str | Path, overrides: Mapping[str, Value] | None) -> Spec:
    """The checked, prepared program in ``path`` (errors located in its text)."""
    program, text = parse_file(path)
    info = check(program, str(path), text)
    try:
        return prepare(info, overrides)
    except SerqError as err:
        raise err.attach(str(path), text) from None


def prove_file(
    path: str | Path, overrides: Mapping[str, Value] | None = None, keep: Path | None = None
) -> list[ClaimProof]:
    return prove_spec(_spec_of_file(path, overrides), str(path), keep)


def prove_file_stability(
    path: str | Path, overrides: Mapping[str, Value] | None = None
) -> ClaimProof:
    """:func:`prove_stability` of the program in ``path``."""
    return prove_stability(_spec_of_file(path, overrides), str(path))
