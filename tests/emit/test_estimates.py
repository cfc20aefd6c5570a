"""`plow.compile.bucket_estimates_ns`: the cost model's estimates come from the driver (the
pipeline through its bounds stage), so a caller without a latency target (the harness) sizes
its budgets from the graph the compiler compiles, and plans nothing itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from plow.compile import Timer, bucket_estimates_ns, compile_plan, transf_program
from plow.profile import CompileProfile
from plow.target import load_target

PROFILE = CompileProfile(decode_batches=(1, 2), prefill_seqs=(8,), context=32)


def test_estimates_are_the_compiles_bounds(tiny_llama: Path) -> None:
    target = load_target("cpu")
    stages: list[str] = []
    est = bucket_estimates_ns(
        tiny_llama, target, PROFILE, on_stage=lambda s, b, p: stages.append(s)
    )
    assert "schedule" not in stages and "bounds" in stages  # stops at the bounds
    plan = compile_plan(tiny_llama, target, PROFILE)
    assert {b.name: v for b, v in est.items()} == {
        bp.bucket.name: float(bp.bounds.estimated_ns) for bp in plan.buckets
    }


def test_estimates_ignore_the_profiles_budget(tiny_llama: Path) -> None:
    """A budget no plan fits (1 ns) rejects the compile, not the estimate."""
    tight = PROFILE.model_copy(update={"decode_budget_ns": 1, "prefill_budget_ns_per_token": 1})
    est = bucket_estimates_ns(tiny_llama, load_target("cpu"), tight)
    assert len(est) == 3 and all(v > 1 for v in est.values())


def test_until_is_bounds_only(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="until"):
        transf_program(tiny_llama, load_target("cpu"), PROFILE, until="schedule", timer=Timer())
    with pytest.raises(ValueError, match="until"):
        transf_program(
            tiny_llama, load_target("cpu"), PROFILE, until="bounds", emit=True, timer=Timer()
        )
