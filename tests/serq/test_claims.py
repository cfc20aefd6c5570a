"""Claims: counterexamples for false claims, `given` scoping, and exact small-run semantics."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from serq.cli import app
from serq.sim import load, simulate

DISJUNCT = "every iteration of E (tokens == bcol || decoders == residents);"


def test_false_claim_has_counterexample(rad_text: str, tmp_path: Path) -> None:
    assert DISJUNCT in rad_text
    src = rad_text.replace(DISJUNCT, "every iteration of E (tokens == bcol);")
    r = simulate(load(text=src, filename="false.sq"), 10_000_000, 0, 1)
    tiling = r.claims[1]
    assert tiling.status == "fails"
    ce = tiling.counterexample
    assert ce is not None
    last = ce["trace"][-1]
    assert last["iteration"] == ce["iteration"] and last["now"] == ce["time_us"]
    assert last["tokens"] != 128 and last["decoders"] == last["residents"]
    assert 1 <= len(ce["trace"]) <= 5
    assert [s["iteration"] for s in ce["trace"]] == list(
        range(ce["iteration"] - len(ce["trace"]) + 1, ce["iteration"] + 1)
    )
    assert r.claims[0].status == "holds"

    f = tmp_path / "false.sq"
    f.write_text(src, encoding="utf-8")
    res = CliRunner().invoke(app, ["run", str(f), "--horizon", "10000000", "--seed", "1"])
    assert res.exit_code == 1
    assert f"violated at iteration {ce['iteration']}" in res.output
    assert "State 1:" in res.output


def test_given_restricts_claim(rad_text: str) -> None:
    # prompts no longer whole tiles: the tiling claim is out of scope, not violated
    src = rad_text.replace(
        "set vp = bcol * floor(~uniform(1, vpmax + 1));",
        "set vp = 100 + bcol * floor(~uniform(1, vpmax + 1));",
    )
    assert src != rad_text
    r = simulate(load(text=src), 10_000_000, 0, 1)
    assert r.claims[1].status == "not applicable"
    assert r.claims[1].given_failure is not None
    assert r.claims[0].status == "holds"
    # without the given, the same claim is false on these runs
    src2 = src.replace("given (vp == bcol * floor(vp / bcol))", "")
    r2 = simulate(load(text=src2), 10_000_000, 0, 1)
    assert r2.claims[1].status == "fails"


SMALL = """
use "std/args";
let bcol = 128;
fn main() {
  let rate = args.number("rate", 0.0000001);
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
    execute (4000 * ceil(batch.tokens / bcol) + 5 * batch.tokens);
  }
  workload { arrive poisson(rate); init { set t0 = now; set vp = 256; set vd = 3; } }
  server {
    run E prefill (cost(E, vp));
    observe ttft = now - t0;
    run E decode (cost(E, vd));
    observe response = now - t0;
  }
  claim lone: every iteration of E (residents <= 1);
  claim pace: every iteration of E (served * 4640 <= 128 * now);
}
"""


def test_isolated_requests_exact_timing() -> None:
    # arrivals ~10 s apart, each request alone: 2 prefill chunks then 3 decode steps
    r = simulate(load(text=SMALL), 200_000_000, 0, 5)
    s = r.stats
    n = s["completions"]
    assert n >= 5
    assert [c.status for c in r.claims] == ["holds", "holds"]
    assert s["iterations"] == 5 * n
    prefill = 2 * (4000 + 5 * 128)
    assert s["ttft_us"]["max"] == s["ttft_us"]["p50"] == prefill
    assert s["observe"]["ttft"]["p50"] == prefill
    assert s["response_us"]["max"] == prefill + 3 * 4005
    assert s["tbt_us"]["p50"] == 4005
    assert s["batch"]["tokens"]["max"] == 128


def test_set_override_changes_load() -> None:
    lo = simulate(load(text=SMALL), 100_000_000, 0, 1)
    hi = simulate(load(text=SMALL, overrides={"rate": 0.000002}), 100_000_000, 0, 1)
    assert hi.stats["arrivals"] > 5 * lo.stats["arrivals"]
    assert hi.params == {"rate": 0.000002}
