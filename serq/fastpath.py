"""The fast path of the generated loop: runs of identical iterations stepped in a tight loop.

:func:`fast_block` returns the code that :func:`serq.compile.build` places right after a batch
is formed (when the program allows it): it recognises a batch that the following iterations
repeat exactly until an event and steps them, checking every claim on every iteration, so that
iteration counts, times, claim results and statistics are the plain loop's (the tests compare
the two, and both against the reference interpreter :mod:`serq.interp`). Nothing here decides
what a program means; it only shortcuts the plain loop.
"""

from __future__ import annotations

import ast as pyast
import math
import re
from collections.abc import Callable


def indent(lines: list[str], n: int) -> list[str]:
    """``lines`` indented by ``n`` levels (empty lines stay empty)."""
    pad = "    " * n
    return [pad + ln if ln else ln for ln in lines]


_ind = indent


def fast_block(
    chk_run: list[str],
    chk_first: list[str],
    exec_code: str,
    exec_site: int,
    finish: Callable[[str], list[str]],
    first_token: Callable[[str, str], list[str]],
    admitted: tuple[str, str] | None,
    chain: list[str] | None,
) -> list[str]:
    """Code run after a batch is formed: step the run of identical iterations it starts.

    Only generated when no batch-formation expression and not ``execute`` reads ``now`` or
    ``served``, ``execute`` draws nothing (a drawn duration differs between two iterations
    of the same batch), and the cap and modes, computed before the batch is reset, do not read
    the previous batch: the batch an iteration forms is then a function of the request state
    alone (counts, queues, remaining prefill), and so is its duration. Two kinds of batch are
    repeated by the iterations that follow them until something changes that state:

    - decode run: every decoder takes one token and nothing else is in the batch
      (``adv == 1``, ``b_tok == n_dec``). Such an iteration changes only ``K``, so the next one
      forms the same batch, up to and including the iteration at which ``K`` reaches the next
      finishing step ``kh[0]`` (the least key of ``buckets``); its requests finish at its end.
    - prefill run: the batch is one chunk of ``b_tok == cap`` tokens of the oldest prefill,
      ``pa`` (taken by ``advance``), or of a request just admitted into an empty prefill queue
      when ``advance`` would take the same chunk of it next (``admitted``). Such an iteration
      changes only that request's remaining prefill, so the next one takes the same chunk
      while at least ``cap`` tokens remain; the prefill completes at the end of the iteration
      that takes its last chunk.

    A run also ends before the next arrival, backlog sample, the warm-up boundary and the
    horizon, where the general loop takes over again. Every iteration of a run is checked
    against every claim, with its own ``it``, ``now`` and ``served``: claims that read ``now``
    or ``served`` (``chk_run``) inside the loop, the others (``chk_first``), which read only
    state that is constant during the run, once for its first iteration. ``now`` advances by
    repeated addition as in the general loop, so times are bit-identical. The batch
    statistics of a run are recorded once, as ``(requests, tokens, count)``.

    When a run ends before the next event (arrival, sample, warm-up boundary, horizon) with the
    waiting and prefill queues empty, the general loop would do nothing but form the next
    batch from the decoders alone; ``chain`` forms it here (modes, cap, the decode bound) and
    starts the next decode run directly, or leaves it to the general loop when it would not
    be a decode run. Not used when tracing.
    """
    # the duration of a batch, remembered per token count when that is all `execute` reads
    dur_lines = [
        f"# @{exec_site}",
        f"dur = {exec_code}",
        "if not 0 <= dur < _INF:",
        f"    raise _Fault({exec_site}, 'duration', dur)",
        f"# @{exec_site}",
        "fdur = float(dur)  # what `now + dur` adds",
    ]
    # `fok`: the duration is a whole number of µs, at least 1 (a run may then take its closed
    # form, below)
    dur_lines += ["fok = fdur >= 1.0 and fdur == _floor(fdur)"]
    free = set(re.findall(r"\b[A-Za-z_]\w*\b", exec_code)) - {"b_tok", *PURE}
    # whether each claim, holding at a run's first iteration, holds at all of them: a function
    # of the duration and the batch alone, so remembered with the duration
    monos = _monotone(chk_run) if not free else None
    closed = _closed_form(chk_run, monos)
    if not free:
        names = ["fdur", "fok", *(f"_mo{j}" for j in range(len(monos or [])))]
        flags = [
            f"_mo{j} = fok and {m}" if m is not None else f"_mo{j} = False"
            for j, m in enumerate(monos or [])
        ]
        # a subscript in a `try` (free when it does not raise) costs less than `FDUR.get`
        dur_lines = [
            "try:",
            f"    {', '.join(names)} = FDUR[b_tok]",
            "except KeyError:",
            *_ind(dur_lines, 1),
            *_ind(flags, 1),
            f"    FDUR[b_tok] = ({', '.join(names)})",
        ]
    # `stop` and `rec` are set once before a chain of runs (see `warm` below)
    head = [*dur_lines]
    if chk_first:
        head += ["if now < stop:", *_ind(chk_first, 1)]
    step = [
        "for it in range(it, lim):",
        "    if now >= stop:",
        "        break",
        *_ind(chk_run, 1),
        "    served += b_tok; now += fdur",
        "else:",
        "    it = lim",
    ]
    fl_claims = _float_served(chk_run)
    stepped: list[str] = []
    if fl_claims is not None:
        # Claims that read `served` only as `served * K` (K an int constant) are checked on
        # float copies `_sk{j}` of `served * K{j}`, stepped by `_bk{j} = b_tok * K{j}`, so
        # the hot loop compares and adds floats instead of multiplying a growing int and
        # comparing it with a float. Exact: `served` and `b_tok` are ints >= 0 (a token
        # count and its sum), and the guard bounds every value `served * K` takes in the
        # run, `(served + (lim - it) * b_tok) * |K|`, below 2**53, so each `_sk`, `_bk` and
        # every sum of them is an integer that a float holds exactly and equals the int the
        # plain loop would compute (`served * K.0` converts `served` exactly, and the exact
        # product, below 2**53, needs no rounding). `_sk` is only compared (`_float_served`),
        # and an int/float comparison in Python is exact, so each claim has the same value.
        # Otherwise (a huge `served`) the plain int loop runs.
        lines, ks = fl_claims
        slim = 2**53 // max(1, *(abs(k) for k in ks))
        init = "; ".join(
            f"_sk{j} = served * {float(k)!r}; _bk{j} = b_tok * {float(k)!r}"
            for j, k in enumerate(ks)
        )
        incr = "; ".join(f"_sk{j} += _bk{j}" for j in range(len(ks)))
        stepped += [
            f"if served + (lim - it) * b_tok < {slim}:",
            f"    {init}",
            "    for it in range(it, lim):",
            "        if now >= stop:",
            "            break",
            *_ind(lines, 2),
            f"        {incr}; now += fdur",
            "    else:",
            "        it = lim",
            "    n = it - i0; served += n * b_tok",
            "else:",
            *_ind(step, 1),
            "    n = it - i0",
        ]
    else:
        stepped += [*step, "n = it - i0"]
    head += ["i0 = it"]
    if closed is not None:
        head += [*closed, "else:", *_ind(stepped, 1)]
    else:
        head += stepped
    head += ["if rec:"]
    # batch sizes of runs counted by token count alone (a decode run's batch has `b_tok`
    # requests, a prefill run's one), merged into `bc` after the loop
    decode = [
        "kmin = kh[0]",
        "lim = it + kmin - K",
        "if lim > MAXIT:",
        "    lim = MAXIT",
        *head,
        "    bcd[b_tok] += n",
        "K += n",
        "if K == kmin:",
        "    _heappop(kh)",
        "    fl = buckets.pop(K)",
        "    for rid in fl:",
        "        del dec[rid]",
        "    _n = len(fl); n_dec -= _n; n_res -= _n",
        "    fr += fl; ft += [now] * _n",
    ]
    prefill = [
        "p = prem[rid]",
        "lim = it + 1 + p // b_tok",
        "if lim > MAXIT:",
        "    lim = MAXIT",
        *head,
        "    bcp[b_tok] += n",
        "p -= (n - 1) * b_tok",
        "prem[rid] = p",
        "if p == 0:",
        "    pre.popleft()",
        *_ind(first_token("now", "dtot[rid]"), 1),
    ]
    out = [
        "if FAST:",
        "    run = 0",
        "    if adv == 1:",
        "        if b_tok == n_dec:",
        "            run = 1",
        "    elif adv == 0 and b_req == 1 and b_tok == cap and pdone is None:",
        "        if pa >= 0:",
        "            rid = pa; run = 2",
    ]
    if admitted is not None:
        mark, cond = admitted
        out += [
            f"        {mark}",
            f"        elif adone is None and len(pre) == 1 and {cond}:",
            "            rid = pre[0]; run = 2",
        ]
    body = [
        "if run == 1:",
        *_ind(decode, 1),
        "else:",
        *_ind(prefill, 1),
    ]
    # The warm-up boundary: a run stops at it (`stop`), and is counted in the batch
    # statistics (`rec`) only after it. Set once for a whole chain of runs: the chain goes on
    # only while `now < stop`, so a chain that starts before `W` stays before it (`stop` is
    # then at most `W`), and one that starts after it stays after it; `tstop` does not change
    # inside the chain (no arrivals or samples are processed there).
    warm = [
        "if now >= W:",
        "    stop = tstop; rec = True",
        "else:",
        "    stop = W if W < tstop else tstop; rec = False",
    ]
    if chain is not None:
        loop = [
            *warm,
            "while True:",
            *_ind(body, 1),
            "    if now >= stop or waiting or pre:",
            "        break",
            *_ind(chain, 1),
            "    run = 1",
        ]
    else:
        loop = [*warm, *body]
    out += [
        "    if run:",
        *_ind(loop, 2),
        "        continue",
    ]
    return out


def _claim_parts(chk_run: list[str]) -> list[tuple[str, str, pyast.expr]] | None:
    """``(flag, record, body)`` of each claim check in ``chk_run``, or None when one is not
    an affine comparison (:func:`_affine_claim`)."""
    checks: list[tuple[str, str, pyast.expr]] = []
    for i in range(0, len(chk_run), 3):
        m = re.fullmatch(r"if (c\d+) and not (.*):", chk_run[i + 1].strip())
        if m is None:
            return None
        body = pyast.parse(m.group(2), mode="eval").body
        if not _affine_claim(body):
            return None
        checks.append((m.group(1), "v" + m.group(1)[1:], body))
    return checks


def _monotone(chk_run: list[str]) -> list[str | None] | None:
    """For each claim, code deciding from ``fdur`` and ``b_tok`` that the claim cannot go from
    holding to failing within a run (None: not known, the run checks its last iteration).

    A claim ``L op R`` whose sides have constant coefficients ``a`` on ``now`` and ``s`` on
    ``served`` (:func:`_coefs`) changes ``L - R`` by ``a * fdur + s * b_tok`` per iteration
    (exactly: ``fdur`` is a whole number when the closed form runs, and the sum is taken in
    ints); for ``>=`` and ``>`` a change ``>= 0`` keeps it holding, for ``<=`` and ``<`` a
    change ``<= 0`` (a negated claim flips the comparison).
    """
    checks = _claim_parts(chk_run)
    if checks is None:
        return None
    out: list[str | None] = []
    for _, _, body in checks:
        neg = isinstance(body, pyast.UnaryOp)
        cmp = body.operand if isinstance(body, pyast.UnaryOp) else body
        assert isinstance(cmp, pyast.Compare)
        lc, rc = _coefs(cmp.left), _coefs(cmp.comparators[0])
        if lc is None or rc is None:
            out.append(None)
            continue
        a, s = lc[0] - rc[0], lc[1] - rc[1]
        up = isinstance(cmp.ops[0], pyast.Gt | pyast.GtE) != neg
        slope = f"({a} * _int(fdur) + {s} * b_tok)"
        out.append(f"{slope} >= 0" if up else f"{slope} <= 0")
    return out


def _coefs(e: pyast.expr) -> tuple[int, int] | None:
    """The constant coefficients ``(on now, on served)`` of a side that :func:`_affine`
    accepts, or None when one depends on the run's counts (``served * n_dec``)."""
    if isinstance(e, pyast.Constant):
        return (0, 0)
    if isinstance(e, pyast.Name):
        return (1, 0) if e.id == "now" else (0, 1) if e.id == "served" else (0, 0)
    if isinstance(e, pyast.UnaryOp) and isinstance(e.op, pyast.USub | pyast.UAdd):
        c = _coefs(e.operand)
        return None if c is None else (-c[0], -c[1]) if isinstance(e.op, pyast.USub) else c
    if isinstance(e, pyast.BinOp):
        a, b = _coefs(e.left), _coefs(e.right)
        if a is None or b is None:
            return None
        if isinstance(e.op, pyast.Add):
            return (a[0] + b[0], a[1] + b[1])
        if isinstance(e.op, pyast.Sub):
            return (a[0] - b[0], a[1] - b[1])
        if isinstance(e.op, pyast.Mult):
            for x, cx, y in ((e.left, a, e.right), (e.right, b, e.left)):
                if cx == (0, 0):
                    k = _const_value(x)
                    if k is not None:
                        cy = _coefs(y)
                        return None if cy is None else (k * cy[0], k * cy[1])
            return (0, 0) if a == (0, 0) and b == (0, 0) else None
    return None


def _const_value(e: pyast.expr) -> int | None:
    """An int constant, or a float literal that is a whole number (a power of two here)."""
    v = _int_const(e)
    if v is not None:
        return v
    if isinstance(e, pyast.Constant) and type(e.value) is float and e.value.is_integer():
        return int(e.value)
    return None


def _closed_form(chk_run: list[str], monos: list[str | None] | None) -> list[str] | None:
    """A run taken in one step instead of iteration by iteration, when that is exact.

    Guarded at run time by the *exact regime*: the duration ``fdur`` is a whole number of µs
    (at least 1; ``fok``) and ``now + L * fdur`` stays below ``btop``, the least power of two
    above ``now`` (at most 2**53; ``_binade``), for the ``L = lim - it`` iterations the run
    can take. There every ``now`` the plain loop reaches by repeated addition is
    ``now + k * fdur`` exactly: each lies in ``[btop / 2, btop)``, where the floats are the
    multiples of ``ulp = btop * 2**-53 <= 1``, ``now`` is one (a float of that binade) and so
    is the whole ``fdur``, so no addition rounds (``now = 0`` too: its sums are integers).
    The iterations run while ``now < stop``: ``n`` is the least ``k`` with
    ``now + k * fdur >= stop`` (at most ``L``), found from the quotient and corrected by those
    exact comparisons.

    Each claim in ``chk_run`` must be a comparison (``<``, ``<=``, ``>``, ``>=``, possibly
    negated) of two sides that are affine in ``now`` and ``served`` and evaluated exactly
    (:func:`_affine`): at the run's ``k``-th iteration each side is then an affine function
    of ``k``, so the iterations where the claim holds are an interval that reaches one end of
    the run. Checking the first and the last iteration decides whether it holds on all of
    them (the first alone when the claim's slope keeps it holding: :func:`_monotone`); when
    it holds on the first and fails on the last, a bisection finds the first that fails,
    which the plain loop would have recorded (``it``, its exact ``now``; the trace is empty
    when not tracing, and the fast path does not run when tracing). Claims that cannot
    raise (no division, no call) are the only ones taken. Returns None when a claim is not of
    this form (the run is then stepped).
    """
    checks = _claim_parts(chk_run)
    if checks is None:
        return None

    def at(e: pyast.expr, k: str | None) -> str:
        if k is None:
            return pyast.unparse(e)
        sub = {"now": f"(now + {k} * fdur)", "served": f"(served + {k} * b_tok)"}

        class Sub(pyast.NodeTransformer):
            def visit_Name(self, node: pyast.Name) -> pyast.expr:
                if node.id in sub:
                    return pyast.parse(sub[node.id], mode="eval").body
                return node

        return pyast.unparse(Sub().visit(pyast.parse(pyast.unparse(e), mode="eval").body))

    # `rend = now + L * fdur` rounded is below `btop` exactly when the exact sum is (in the
    # binade the exact sum is a float; at or above `btop` rounding keeps it there, `btop`
    # being a float), and then `rend - fdur` is exact too
    out = [
        "if now >= btop:",
        "    btop = _binade(now)",
        "L = lim - it",
        "rend = now + L * fdur",
        "if fok and rend < btop:",
        "    if rend - fdur < stop:",
        "        n = L",
        "    else:",
        "        n = _ceil((stop - now) / fdur)",
        "        if n < 0:",
        "            n = 0",
        "        elif n > L:",
        "            n = L",
        "        while n and now + (n - 1) * fdur >= stop:",
        "            n -= 1",
        "        while n < L and now + n * fdur < stop:",
        "            n += 1",
        "        rend = now + n * fdur",
    ]
    if checks:
        out += ["    if n:"]
        for j, (c, v, body) in enumerate(checks):
            cached = monos is not None and monos[j] is not None
            out += [
                f"        if {c}:",
                f"            if not ({at(body, None)}):",
                f"                {c} = False; {v} = (it, now, list(trace))",
                f"            elif not _mo{j}:" if cached else "            else:",
                "                _k = n - 1",
                f"                if _k and not ({at(body, '_k')}):",
                "                    _lo = 0",
                "                    while _k - _lo > 1:",
                "                        _md = (_lo + _k) // 2",
                f"                        if {at(body, '_md')}:",
                "                            _lo = _md",
                "                        else:",
                "                            _k = _md",
                f"                    {c} = False; {v} = (it + _k, now + _k * fdur, list(trace))",
            ]
    out += ["    it += n; now = rend; served += n * b_tok"]
    return out


#: ints that a run does not change (the batch, the counts of requests and the queue)
_RUN_INTS = {"b_tok", "b_req", "n_dec", "n_res"}
#: comparisons whose truth over an affine function is an interval reaching an end
_ORDER = (pyast.Lt, pyast.LtE, pyast.Gt, pyast.GtE)


def _affine_claim(e: pyast.expr) -> bool:
    """A comparison (or its negation) of two sides that :func:`_affine` accepts."""
    if isinstance(e, pyast.UnaryOp) and isinstance(e.op, pyast.Not):
        e = e.operand
    if not (isinstance(e, pyast.Compare) and len(e.ops) == 1 and isinstance(e.ops[0], _ORDER)):
        return False
    return _affine(e.left) is not None and _affine(e.comparators[0]) is not None


def _pow2(e: pyast.expr) -> int | None:
    """``j`` when ``e`` is an int or float literal ``2**j`` with ``0 <= j <= 64`` (multiplying a
    float below 2**53 by it is exact), else None."""
    if not isinstance(e, pyast.Constant):
        return None
    v = e.value
    if not (type(v) in (int, float) and isinstance(v, int | float)) or not 1 <= v <= 2**64:
        return None
    m, j = math.frexp(v)
    return j - 1 if m == 0.5 else None


def _clock_scale(e: pyast.expr) -> int | None:
    """``j`` when ``e`` is ``now`` (or its negation) times powers of two ``2**j`` in all."""
    if isinstance(e, pyast.UnaryOp) and isinstance(e.op, pyast.USub | pyast.UAdd):
        return _clock_scale(e.operand)
    if isinstance(e, pyast.Name):
        return 0 if e.id == "now" else None
    if isinstance(e, pyast.BinOp) and isinstance(e.op, pyast.Mult):
        for a, b in ((e.left, e.right), (e.right, e.left)):
            j = _pow2(b)
            if j is not None:
                k = _clock_scale(a)
                return None if k is None else j + k
    return None


def _affine(e: pyast.expr) -> tuple[str, int] | None:
    """``(type, degree)`` of an expression that is affine in ``now`` and ``served`` during a
    run and evaluated without rounding or raising, else None.

    Ints (literals, ``served``, the counts the run keeps) under ``+``, ``-`` and ``*`` of
    degree at most 1 are exact; the one float is the clock ``now``, exact in the regime of
    :func:`_closed_form` (below 2**53), alone, negated, or times a power of two.
    """
    if isinstance(e, pyast.Constant):
        if type(e.value) is int:
            return ("i", 0)
        if type(e.value) is float and math.isfinite(e.value):
            return ("f", 0)
        return None
    if isinstance(e, pyast.Name):
        if e.id == "now":
            return ("f", 1)
        if e.id == "served":
            return ("i", 1)
        return ("i", 0) if e.id in _RUN_INTS else None
    if isinstance(e, pyast.UnaryOp) and isinstance(e.op, pyast.USub | pyast.UAdd):
        return _affine(e.operand)
    if isinstance(e, pyast.BinOp):
        a, b = _affine(e.left), _affine(e.right)
        if a is None or b is None:
            return None
        if a[0] == "i" and b[0] == "i" and isinstance(e.op, pyast.Add | pyast.Sub):
            return ("i", max(a[1], b[1]))
        if isinstance(e.op, pyast.Mult):
            if a[0] == "i" and b[0] == "i" and a[1] + b[1] <= 1:
                return ("i", a[1] + b[1])
            # the clock scaled by powers of two, 2**64 at most in all (no overflow)
            j = _clock_scale(e)
            if j is not None and j <= 64:
                return ("f", 1)
    return None


def _int_const(e: pyast.expr) -> int | None:
    """The value of an expression of int literals, ``+``, ``-`` and ``*``; else None."""
    if isinstance(e, pyast.Constant) and type(e.value) is int:
        return e.value
    if isinstance(e, pyast.UnaryOp) and isinstance(e.op, pyast.USub | pyast.UAdd):
        v = _int_const(e.operand)
        return None if v is None else (-v if isinstance(e.op, pyast.USub) else v)
    if isinstance(e, pyast.BinOp) and isinstance(e.op, pyast.Add | pyast.Sub | pyast.Mult):
        a, b = _int_const(e.left), _int_const(e.right)
        if a is None or b is None:
            return None
        if isinstance(e.op, pyast.Add):
            return a + b
        return a - b if isinstance(e.op, pyast.Sub) else a * b
    return None


def _float_served(chk_run: list[str]) -> tuple[list[str], list[int]] | None:
    """Claim checks with each ``served * K`` (K an int constant) replaced by ``_sk{j}``.

    Only an operand of a comparison is replaced (a bare ``served`` is ``served * 1``): a
    comparison of equal values, int or float, has the same result, while arithmetic on the
    product would round differently as a float. Returns the rewritten lines and the constants
    ``K{j}``, or None when no check reads ``served`` or one reads it in any other way.
    """
    ks: list[int] = []

    def factor(e: pyast.expr) -> int | None:
        if isinstance(e, pyast.Name) and e.id == "served":
            return 1
        if isinstance(e, pyast.BinOp) and isinstance(e.op, pyast.Mult):
            for a, b in ((e.left, e.right), (e.right, e.left)):
                if isinstance(a, pyast.Name) and a.id == "served":
                    return _int_const(b)
        return None

    class Sub(pyast.NodeTransformer):
        bad = False

        def visit_Compare(self, node: pyast.Compare) -> pyast.expr:
            ops = [node.left, *node.comparators]
            for i, e in enumerate(ops):
                k = factor(e)
                if k is not None:
                    if k not in ks:
                        ks.append(k)
                    ops[i] = pyast.Name(id=f"_sk{ks.index(k)}", ctx=pyast.Load())
            node.left, node.comparators = ops[0], ops[1:]
            self.generic_visit(node)
            return node

        def visit_Name(self, node: pyast.Name) -> pyast.expr:
            if node.id == "served":
                self.bad = True
            return node

    out: list[str] = []
    for ln in chk_run:
        m = re.fullmatch(r"(\s*)if (.*):", ln)
        if m is None or not re.search(r"\bserved\b", ln):
            out.append(ln)
            continue
        sub = Sub()
        tree = sub.visit(pyast.parse(m.group(2), mode="eval"))
        if sub.bad:
            return None
        out.append(f"{m.group(1)}if {pyast.unparse(tree)}:")
    return (out, ks) if ks else None


#: names in generated expressions that are functions or constants, not state
PURE = {"_ceil", "_floor", "_min", "_max", "_INF", "True", "False"}
PURE |= {"and", "or", "not", "if", "else"}
