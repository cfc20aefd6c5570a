"""The Rocq step semantics (``Plow/Serq/Step.v``) against the reference interpreter.

Random programs of the exported fragment (caps, both clauses with modes, guards and bounds
reading the engine state, ``now`` and ``served``, costs) and random traces (integer arrival
gaps, prefill and decode amounts, including empty ones) go through ``serq.interp.run`` and
through Rocq's own evaluation of ``Step.step`` (``vm_compute`` on the exported engine, in one
``coqc`` run; numbers are printed as binary ``N``, faster to print): after every iteration,
the clock, the tokens served, the batch, the counts the claims read, the waiting queue, every
request's prefill and decode progress and the number of ended requests must be equal. Time
stays integral because gaps and costs are integers.

Drawing engines (an ``execute`` with one ``~exp(m)`` read on every iteration): the program is
exported as a ``Step.dengine`` (``serq.prove.export_d``: the draw is ``m * u``, ``u`` the
iteration's sample) and run by ``Step.stepd`` on a draw stream ``fun i => nth i [...] 0``,
while the interpreter reads the same numbers, in order, as execute's exponential stream (the
amounts come from ``~uniform``, so that stream is execute's alone): the same traces. Reading
sample ``i + 1`` at iteration ``i`` on the Rocq side makes them differ.
"""

from __future__ import annotations

import ast
import math
import random
import re
import shutil
from typing import Any

import pytest

from serq import interp
from serq.checker import check
from serq.parser import parse
from serq.prove import HEADER, coqc, export, export_d, library

TRACE_FN = """
From Coq Require Import NArith.
Definition n := N.of_nat.
Definition pairs (l : list (nat * nat)) : list (N * N) := map (fun '(a, b) => (n a, n b)) l.
Fixpoint trace (E : engine) (fuel : nat) (st : state)
    : list (N * N * N * N * N * N * N * list N * list (N * N) * list (N * N) * N) :=
  match fuel with
  | 0 => []
  | S f =>
      match step E st with
      | Iterated st1 b st' =>
          let v := claim_view st1 b in
          (n (s_now st'), n (s_served st'), n (b_tokens b), n (b_requests b),
           n (v_decoding v), n (v_count v), n (v_waiting v),
           map (fun j => n (j_id j)) (s_waiting st'),
           pairs (map (fun j => (j_id j, j_pre j)) (s_prefilling st')),
           pairs (map (fun j => (j_id j, j_dec j)) (s_decoding st')), n (length (s_ended st')))
          :: trace E f st'
      | Idle st' => trace E f st'
      | Halted _ => []
      end
  end.
"""

MODES = [
    None,
    "decoding",
    "!decoding",
    "running.decoding >= {k} || running.decoding == running.count ? decoding : !decoding",
    "waiting.count > {k} ? !decoding : decoding",
]
GUARDS = [
    None,
    "running.preempted == 0",
    "waiting.count > {k}",
    "batch.tokens < {k}",
    "batch.requests <= {k}",
    "running.count <= {k} + 2",
    "served % 3 != 1",
]
BOUNDS = [None, "{k}", "1 + now % {k}", "max({k}, running.prefilling)", "min({k}, 2 + served % 4)"]


def _pick(rng: random.Random, options: list[str | None]) -> str | None:
    o = rng.choice(options)
    return None if o is None else o.format(k=rng.randint(1, 5))


def program(rng: random.Random) -> str:
    """A random program of the exported fragment; amounts are read from the draw streams."""
    clauses = []
    for kind, queue in (("advance", "running"), ("admit", "waiting")):
        if rng.random() < 0.1:
            continue
        cl = f"{kind} {queue}"
        if (m := _pick(rng, MODES)) is not None:
            cl += f" only ({m})"
        if kind == "admit" and (g := _pick(rng, GUARDS)) is not None:
            cl += f" while ({g})"
        if (b := _pick(rng, BOUNDS)) is not None:
            cl += f" each at most ({b})"
        clauses.append(cl + ";")
    cap = f"tokens cap {rng.randint(1, 8)};" if rng.random() < 0.8 else ""
    a, b, c, k = rng.randint(0, 9), rng.randint(0, 3), rng.randint(0, 2), rng.randint(1, 6)
    return (
        f"let k = {k};\nfn main() {{\n  device gpu {{ }}\n  engine E on gpu {{\n    {cap}\n"
        f"    schedule {{ {' '.join(clauses)} }}\n"
        f"    execute ({a} * ceil(batch.tokens / k) + {b} * batch.tokens + {c});\n  }}\n"
        "  workload { arrive poisson(1); init { set vp = ~uniform(0, 1); set vd = ~exp(1); } }\n"
        "  server { run E prefill (cost(E, vp)); run E decode (cost(E, vd)); }\n}\n"
    )


def trace_input(rng: random.Random) -> list[tuple[int, int, int]]:
    """Arrivals: (gap since the previous one, prefill amount, decode amount)."""
    return [
        (rng.choice([0, 0, 1, 3, 10, 40]), rng.choice([0, 1, 2, 3, 5, 8, 12]), rng.randint(0, 6))
        for _ in range(rng.randint(1, 9))
    ]


def interp_trace(spec: interp.Spec, reqs: list[tuple[int, int, int]]) -> list[tuple[Any, ...]]:
    gaps = iter([float(g) for g, _, _ in reqs] + [1e30] * 4)
    vps = iter([float(p) for _, p, _ in reqs])
    vds = iter([float(d) for _, _, d in reqs])
    steps: list[tuple[Any, ...]] = []
    interp.run(spec, 1e15, 0.0, gaps.__next__, vps.__next__, vds.__next__, [math.inf],
               steps=steps)  # fmt: skip
    out = []
    for row, now, served, waiting, prefilling, decoding, ended, _active in steps:
        _i, _t0, _s0, tokens, requests, decoders, residents, left, _mode = row
        assert float(now).is_integer()
        out.append((int(now), served, tokens, requests, decoders, residents, left,
                    list(waiting), list(prefilling), list(decoding), ended))  # fmt: skip
    return out


def rocq_arrivals(reqs: list[tuple[int, int, int]]) -> str:
    t, out = 0, []
    for g, p, d in reqs:
        t += g
        out.append(f"mk_req {t} {p} {d}")
    return "[" + "; ".join(out) + "]"


def rocq_traces(cases: list[tuple[interp.Spec, list[list[tuple[int, int, int]]]]]) -> list[Any]:
    """Evaluate ``trace`` in Rocq for every (program, arrival lists); one coqc run."""
    parts = [HEADER, "Import ListNotations.", TRACE_FN]
    for i, (spec, traces) in enumerate(cases):
        ex = export(spec, f"program {i}")
        assert ex.reason is None, ex.reason
        parts.append(f"Module P{i}.\n{ex.defs}")
        for j, reqs in enumerate(traces):
            fuel = 4 * sum(p + d + 2 for _, p, d in reqs) + 10
            parts.append(f"Definition t{j} := trace E {fuel} (init {rocq_arrivals(reqs)}).")
        _end_module(parts, i, len(traces))
    return _evaluate(parts, "SerqStepTrace")


def _end_module(parts: list[str], i: int, n_traces: int) -> None:
    parts.append(f"Definition all := [{'; '.join(f't{j}' for j in range(n_traces))}].")
    parts.append(f"End P{i}.")
    parts.append(f"Eval vm_compute in P{i}.all.")  # one evaluation per program


def _evaluate(parts: list[str], name: str) -> list[Any]:
    """Run the Rocq text in one coqc call and read back every evaluated list of traces."""
    rc, out, err = coqc("\n".join(parts) + "\n", library(), name)
    assert rc == 0, (out + err)[-3000:]
    results = []
    for m in re.finditer(r"=\s*(\[.*?\])\s*:\s*list", out, re.S):
        text = " ".join(m.group(1).split()).replace(";", ",").replace("%N", "")
        results += ast.literal_eval(text)
    return results


def _compare(n_programs: int, n_traces: int, seed: int) -> int:
    rng = random.Random(seed)
    cases = []
    for _ in range(n_programs):
        text = program(rng)
        spec = interp.prepare(check(parse(text), "<gen>", text))
        cases.append((spec, [trace_input(rng) for _ in range(n_traces)]))
    got = rocq_traces(cases)
    assert len(got) == n_programs * n_traces
    it = iter(got)
    iterations = 0
    for spec, traces in cases:
        for reqs in traces:
            want = interp_trace(spec, reqs)
            rocq = [tuple(r) for r in next(it)]
            assert rocq == want, (reqs, rocq, want)
            iterations += len(want)
    return iterations


needs_rocq = pytest.mark.skipif(shutil.which("coqc") is None, reason="coqc is not installed")


@needs_rocq
def test_rocq_step_matches_interpreter_quick() -> None:
    assert _compare(4, 5, seed=1) > 40


@needs_rocq
@pytest.mark.slow
def test_rocq_step_matches_interpreter() -> None:
    """1,000 traces over 50 generated programs."""
    assert _compare(50, 20, seed=2) > 4000


# ----------------------------------------------------------------------------- drawing engines

TRACE_D_FN = TRACE_FN.replace(
    "Fixpoint trace (E : engine)", "Fixpoint traced (D : dengine) (draws : nat -> nat)"
)
TRACE_D_FN = TRACE_D_FN.replace("match step E st with", "match stepd D draws st with")
TRACE_D_FN = TRACE_D_FN.replace(":: trace E f st'", ":: traced D draws f st'")
TRACE_D_FN = TRACE_D_FN.replace("| Idle st' => trace E f st'", "| Idle st' => traced D draws f st'")

# execute's one draw, read on every iteration (Step.dengine: the iteration's sample)
DRAW_COSTS = [
    "{a} * batch.tokens + ~exp({m}) + {c}",
    "~exp({m}) * batch.requests + {c}",
    "max({c}, ~exp(batch.requests) + {a} * ceil(batch.tokens / k))",
    "(running.decoding > {k} ? {a} : {c}) + ~exp({m})",
]


def program_d(rng: random.Random) -> str:
    """A random program of the exported fragment whose ``execute`` draws once an iteration;
    the amounts come from ``~uniform`` (the exponential stream is execute's alone)."""
    text = program(rng)
    cost = rng.choice(DRAW_COSTS).format(a=rng.randint(0, 4), c=rng.randint(0, 3),
                                         m=rng.randint(1, 3), k=rng.randint(0, 3))  # fmt: skip
    text = re.sub(r"execute \(.*\);", f"execute ({cost});", text)
    return text.replace("set vd = ~exp(1);", "set vd = ~uniform(0, 1);")


def interp_trace_d(spec: interp.Spec, reqs: list[tuple[int, int, int]],
                   draws: list[int]) -> list[tuple[Any, ...]]:  # fmt: skip
    gaps = iter([float(g) for g, _, _ in reqs] + [1e30] * 4)
    amounts = iter([float(x) for _, p, d in reqs for x in (p, d)])
    stream = iter([float(u) for u in draws])
    steps: list[tuple[Any, ...]] = []
    interp.run(spec, 1e15, 0.0, gaps.__next__, amounts.__next__, stream.__next__, [math.inf],
               steps=steps)  # fmt: skip
    return [(int(now), served, row[3], row[4], row[5], row[6], row[7], list(waiting),
             list(prefilling), list(decoding), ended)
            for row, now, served, waiting, prefilling, decoding, ended, _ in steps]  # fmt: skip


def rocq_traces_d(cases: list[tuple[interp.Spec, list[tuple[list[Any], list[int]]]]],
                  shift: int = 0) -> list[Any]:  # fmt: skip
    """``stepd`` in Rocq on every (program, arrivals, draw stream), one coqc run; iteration
    ``i`` reads ``draws (i + shift)`` (``shift`` 1: a wrong stream, for the mutation test)."""
    parts = [HEADER, "Import ListNotations.", TRACE_D_FN]
    for i, (spec, traces) in enumerate(cases):
        parts.append(f"Module P{i}.\n{export_d(spec)}")
        for j, (reqs, draws) in enumerate(traces):
            fuel = 4 * sum(p + d + 2 for _, p, d in reqs) + 10
            stream = "[" + "; ".join(map(str, draws)) + "]"
            parts.append(f"Definition t{j} := traced D (fun i => nth (i + {shift}) {stream} 0) "
                         f"{fuel} (init {rocq_arrivals(reqs)}).")  # fmt: skip
        _end_module(parts, i, len(traces))
    return _evaluate(parts, "SerqStepdTrace")


def _compare_d(n_programs: int, n_traces: int, seed: int, shift: int = 0) -> tuple[int, int]:
    """(iterations compared, traces that differ)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n_programs):
        text = program_d(rng)
        spec = interp.prepare(check(parse(text), "<gen>", text))
        traces = []
        for _ in range(n_traces):
            reqs = trace_input(rng)
            # one sample per iteration; more than the iterations a run can have
            n = 4 * sum(p + d + 2 for _, p, d in reqs) + 10
            traces.append((reqs, [rng.choice([0, 0, 1, 2, 5, 9]) for _ in range(n + 1)]))
        cases.append((spec, traces))
    got = rocq_traces_d(cases, shift)
    assert len(got) == n_programs * n_traces
    it = iter(got)
    iterations = differ = 0
    for spec, traces in cases:
        for reqs, draws in traces:
            want = interp_trace_d(spec, reqs, draws)
            rocq = [tuple(r) for r in next(it)]
            differ += rocq != want
            if shift == 0:
                assert rocq == want, (reqs, draws, rocq, want)
            iterations += len(want)
    return iterations, differ


@needs_rocq
def test_rocq_stepd_matches_interpreter_on_the_same_draws() -> None:
    """A drawing engine: Rocq's ``stepd`` with the stream ``draws`` and the interpreter reading
    the same numbers as execute's ``~exp`` draws give the same trace, iteration by iteration."""
    iterations, _ = _compare_d(6, 5, seed=3)
    assert iterations > 60


@needs_rocq
@pytest.mark.slow
def test_rocq_stepd_matches_interpreter() -> None:
    """500 traces over 50 generated drawing programs."""
    iterations, _ = _compare_d(50, 10, seed=4)
    assert iterations > 2000


@needs_rocq
def test_rocq_stepd_shifted_stream_differs() -> None:
    """The comparison sees the stream: Rocq reading iteration i + 1's sample breaks it."""
    _, differ = _compare_d(6, 5, seed=3, shift=1)
    assert differ >= 5


def test_export_d_refuses_what_one_sample_cannot_model() -> None:
    from serq.prove import NotExported

    base = ("fn main() {{ device gpu {{ }} engine E on gpu {{ tokens cap 4; schedule {{ advance "
            "running; admit waiting; }} execute ({cost}); }} workload {{ arrive poisson(1); "
            "init {{ set vp = ~uniform(0, 1); }} }} server {{ run E prefill (cost(E, vp)); }} "
            "}}\n")  # fmt: skip
    for cost, why in [("~exp(1) + ~exp(2)", "a second draw"),
                      ("batch.tokens > 2 ? ~exp(1) : 1", "not read on every iteration"),
                      ("~uniform(1, 3)", "only ~exp(m)")]:  # fmt: skip
        text = base.format(cost=cost)
        spec = interp.prepare(check(parse(text), "<gen>", text))
        with pytest.raises(NotExported, match=re.escape(why)):
            export_d(spec)
