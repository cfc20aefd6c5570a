"""``serq prove``: the RAD claims proved over every path in Rocq; a false claim is not proved
and the simulator finds its counterexample; what is outside the exported fragment says so."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from serq import interp
from serq.checker import check
from serq.parser import parse
from serq.prove import export, prove_file
from serq.sim import load, simulate

needs_rocq = pytest.mark.skipif(shutil.which("coqc") is None, reason="coqc is not installed")


RAD4 = Path(__file__).resolve().parents[2] / "examples" / "papers" / "bari_rad_assumption4.sq"


def test_assumption4_variant_is_the_rad_program_plus_one_claim(rad_text: str) -> None:
    text = RAD4.read_text()
    body = rad_text.rstrip()
    assert body.endswith("}")
    assert body[:-1].rstrip() in text
    assert text.count("claim ") == rad_text.count("claim ") + 1


def _spec(text: str) -> interp.Spec:
    return interp.prepare(check(parse(text), "<t>", text))


@needs_rocq
@pytest.mark.slow
def test_rad_claims_proved_every_path(rad_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "rad.v"
    results = prove_file(rad_path, keep=out)
    assert [(r.name, r.proved) for r in results] == [("token_rate", True), ("optimal_tiling", True)]
    text = out.read_text()
    assert "Theorem sq_token_rate : every_path E" in text
    assert "Admitted" not in text and "admit" not in text and "Axiom" not in text


@needs_rocq
@pytest.mark.slow
def test_false_claim_not_proved_and_simulated_counterexample(tmp_path: Path) -> None:
    """bari_rad_assumption4.sq at another tile size (64 tokens, 3000 µs a tile, 2 µs a token)
    is proved by the same theorems; `tokens == bcol` without the `decoders == residents`
    disjunct is false."""
    text = (
        RAD4.read_text()
        .replace("let bcol = 128;", "let bcol = 64;")
        .replace("let tlin = 4000;", "let tlin = 3000;")
        .replace("let tnl = 5;", "let tnl = 2;")
        .replace("(tokens == bcol || decoders == residents)", "(tokens == bcol)")
    )
    path = tmp_path / "false.sq"
    path.write_text(text)
    results = {r.name: r for r in prove_file(path)}
    assert results["token_rate"].proved and results["decoder_bound"].proved
    bad = results["optimal_tiling"]
    assert not bad.proved
    assert bad.result_text().startswith("not proved: tokens = bcol")
    run = simulate(load(path), 2e6, 0.0, 1)
    status = {c.name: c.status for c in run.claims}
    assert status == {"token_rate": "holds", "optimal_tiling": "fails", "decoder_bound": "holds"}


@needs_rocq
@pytest.mark.slow
def test_decoder_bound_needs_tiled_prompts(tmp_path: Path) -> None:
    """B3 without Assumption 3 is false: one Prefill Mode batch admits several short prompts
    that all start decoding. Not proved, and the simulator shows it."""
    text = """let bcol = 4;
fn main() {
  device gpu { }
  def in_mode() {
    running.decoding >= bcol || running.decoding == running.count ? decoding : !decoding
  }
  engine E on gpu {
    tokens cap bcol;
    schedule {
      advance running only (in_mode()) each at most (bcol);
      admit waiting only (in_mode()) while (running.preempted == 0) each at most (bcol);
    }
    execute (10 * ceil(batch.tokens / bcol) + 1 * batch.tokens);
  }
  workload { arrive poisson(0.05); init { set vp = floor(~uniform(1, 3)); set vd = 1000; } }
  server { run E prefill (cost(E, vp)); run E decode (cost(E, vd)); }
  claim decoder_bound: every iteration of E (decoders <= bcol);
}
"""
    path = tmp_path / "b3.sq"
    path.write_text(text)
    (r,) = prove_file(path)
    assert not r.proved and r.detail.startswith("decoders <= bcol (knowing")
    run = simulate(load(path), 1e5, 0.0, 0)
    assert [c.status for c in run.claims] == ["fails"]


def test_export_translates_the_rad_engine(rad_text: str) -> None:
    ex = export(_spec(rad_text), "rad")
    assert ex.bcol == "sq_bcol"
    assert "Definition sq_bcol : nat := 128." in ex.defs
    assert "(fun v : view => ((sq_tlin * (ceil_div (v_tokens v) sq_bcol)) + " in ex.defs
    assert "(Nat.leb sq_bcol (v_decoding v))" in ex.defs  # running.decoding >= bcol
    by_name = {c.name: c for c in ex.claims}
    assert by_name["optimal_tiling"].statement == (
        "every_path E (fun r : req => (Nat.eqb (r_vp r) (sq_bcol * ((r_vp r) / sq_bcol)))) "
        "(fun v : view => (orb (Nat.eqb (v_tokens v) sq_bcol) "
        "(Nat.eqb (v_decoding v) (v_count v))) = true)"
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (("(tokens == bcol || decoders == residents)", "(tokens - 1 < bcol)"),
         "not exported to Rocq at 63:27: subtraction"),
        (("given (vp == bcol * floor(vp / bcol))", "given (t0 >= 0)"),
         "not exported to Rocq at 62:31: the request variable 't0' is not the amount"),
        (("(tokens == bcol || decoders == residents)", "(tokens / bcol <= 1)"),
         "not exported to Rocq at 63:27: real division"),
    ],
)  # fmt: skip
def test_outside_the_fragment_is_named(rad_text: str, change: tuple[str, str], reason: str) -> None:
    ex = export(_spec(rad_text.replace(*change)), "rad")
    (c,) = [c for c in ex.claims if c.name == "optimal_tiling"]
    assert c.statement is None and c.reason is not None
    assert c.reason.startswith(reason), c.reason


def test_engine_outside_the_fragment(rad_text: str) -> None:
    ex = export(_spec(rad_text.replace("let tnl = 5;", "let tnl = 5.5;")), "rad")
    assert ex.reason is not None and "the constant 'tnl' is 5.5" in ex.reason
    assert all(c.statement is None for c in ex.claims)


def test_large_constants_are_not_exported(rad_text: str) -> None:
    """Rocq's naturals are unary: a 4,000,000,000 µs tile made coqc run for minutes."""
    ex = export(_spec(rad_text.replace("let tlin = 4000;", "let tlin = 4000000000;")), "rad")
    assert ex.reason is not None
    assert "the constant 'tlin' (4000000000) is above 5,000, the largest number exported" in (
        ex.reason
    )


@needs_rocq
def test_theorem2_proved_without_axioms() -> None:
    # B4, B5 (per node and joint) and B6: the library's theorems have exactly the stated
    # types and rest on nothing assumed
    from serq.prove import coqc, library

    names = ["one_node", "nodes_per_node", "nodes_joint", "compound"]
    text = "From Plow Require Import Serq.Theorem2 Serq.Theorem2proof.\n"
    text += "".join(f"Check (theorem2_{n}_holds : theorem2_{n}).\n" for n in names)
    text += "".join(f"Print Assumptions theorem2_{n}_holds.\n" for n in names)
    rc, out, err = coqc(text, library())
    assert rc == 0, out + err
    assert out.count("Closed under the global context") == len(names)


@needs_rocq
def test_theorem2_for_the_programs_engine(rad_text: str) -> None:
    """`serq prove` instantiates Theorem 2 (B4, B5, B6) at the program's engine when
    it is RAD with 128-token tiles and an admission `while` that always holds; a node with
    64-token tiles, or one whose admission can stop, is not shown to be one of them."""
    from serq.prove import prove_stability

    r = prove_stability(_spec(rad_text), "rad")
    assert r.proved and r.detail == "theorem2"
    other_costs = rad_text.replace("let tlin = 4000;", "let tlin = 3000;")
    assert prove_stability(_spec(other_costs), "rad").proved  # durations do not enter
    for change in (
        ("let bcol = 128;", "let bcol = 64;"),
        ("while (running.preempted == 0)", "while (waiting.count < 3)"),
    ):
        bad = prove_stability(_spec(rad_text.replace(*change)), "rad")
        assert not bad.proved, change
        assert bad.detail.startswith("the engine is not shown to be RAD with 128-token tiles")


def test_theorem2_bound_is_not_met_with_64_token_tiles(rad_text: str) -> None:
    """The witness for the 64-token variant (with the same prompts, whole 128-token tiles):
    at 30 requests/s, 4640 µs slots bring 4640 * 3e-5 * E[vp + vd] = about 107 < 128 tokens,
    Theorem 2's condition for 128-token tiles; the 128-token node keeps up, and the 64-token
    one (at most 64 tokens per 4320 µs) falls behind, its backlog growing with the horizon."""

    def backlog(text: str, horizon: float) -> int:
        stats = simulate(load(text=text, overrides={"rate": 0.00003}), horizon, 0.0, 1).stats
        return int(stats["in_system_at_end"])

    small = rad_text.replace("let bcol = 128;", "let bcol = 64;")
    small = small.replace("set vp = bcol * floor(", "set vp = 128 * floor(")
    assert small.count("set vp = 128 * floor(") == 1
    assert backlog(rad_text, 4e7) < 150
    b1, b2 = backlog(small, 2e7), backlog(small, 4e7)
    assert b1 > 200 and b2 > 1.5 * b1
