"""Prefill rungs of a serving bundle (issue 19, TTFT): a checkpoint served (or generated from)
is compiled with prefill rungs of 16 to 512 tokens, up to the context, the server's per-tick
token budget and the arena allowance, so a long prompt runs as one launch instead of several
64-token ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from plow.profile import SERVE_PREFILL_ARENA_BYTES, serve_prefill_seqs
from plow.runtime.cpu.bundle import cache_profile
from plow.serve.scheduler import SchedulerState, Waiting, schedule
from tests.serve.test_warm import EXECUTOR, run

OLD = ((1, 16), (1, 64))  # the rungs serving bundles had before
NEW = tuple((1, s) for s in serve_prefill_seqs(2048))


def test_serving_rungs_reach_512_tokens_within_context_budget_and_arena() -> None:
    assert serve_prefill_seqs(2048) == (16, 64, 128, 256, 512)
    assert serve_prefill_seqs(256) == (16, 64, 128, 256)  # the context bounds them
    assert serve_prefill_seqs(2048, max_tokens=200) == (16, 64, 128)  # the tick's token budget
    # the arena allowance drops the long rungs of a large vocabulary, never the short ones
    per_token = SERVE_PREFILL_ARENA_BYTES // 256
    assert serve_prefill_seqs(2048, token_bytes=per_token) == (16, 64, 128, 256)
    assert serve_prefill_seqs(2048, token_bytes=SERVE_PREFILL_ARENA_BYTES) == (16, 64)
    assert serve_prefill_seqs(10) == (10,) and serve_prefill_seqs(40) == (16,)
    with pytest.raises(ValueError):
        serve_prefill_seqs(0)
    prof = cache_profile(8192, 8)
    assert prof.prefill_seqs == (16, 64, 128, 256, 512) and prof.context == 2048
    assert cache_profile(8192, 8, max_prefill_tokens=64).prefill_seqs == (16, 64)


def test_a_long_prompt_is_one_launch_on_the_large_rungs() -> None:
    """A 250-token prompt alone, a launch priced at 15 rows: one launch of the 256-token rung on
    the serving rungs, four launches on the old 16/64 ladder (a 200-token prompt would still
    take four 64-token launches: 4 x 15 + 208 padded rows beat 15 + 256)."""

    def plan(rungs: tuple[tuple[int, int], ...]) -> tuple[int, bool]:
        st = SchedulerState(
            tick=0, now=0.0, running=(), waiting=(Waiting("a", 0.0, 250),), free_slots=(0,),
            max_num_batched_tokens=512, launch_rows=15.0, prefill_rungs=rungs,
        )  # fmt: skip
        p = schedule(st)
        return p.chunk, p.prefill[0].completes

    assert plan(NEW) == (256, True)
    assert plan(OLD) == (64, False)


def test_served_checkpoint_gets_rungs_up_to_the_token_budget(
    tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`plow serve CKPT --max-num-batched-tokens 128` compiles prefill rungs 16, 64 and 128 (the
    tiny model's 256-token context would allow 256: the budget stops it), and a 120-token
    prompt's prefill is one launch."""
    from plow.serve.http import load_served_model
    from plow.serve.prefill_cost import PrefillFit

    monkeypatch.setenv("PLOW_CACHE", str(tmp_path))  # a fresh bundle cache
    m = load_served_model(
        tiny_ckpt, name="t", max_num_seqs=2, max_num_batched_tokens=128, executor=EXECUTOR,
        prefill_fit=PrefillFit(launch_s=1e-3, per_row_s=1e-5),
    )  # fmt: skip
    from plow.graph import Phase

    bundle = m.engine.model.bundle  # type: ignore[attr-defined]
    assert {b.seq for b in bundle.ladder if b.phase is Phase.prefill} == {16, 64, 128}
    prefill = [r for r in m.engine.rungs() if r.phase == "prefill"]  # type: ignore[attr-defined]
    assert {(r.rows, r.tokens) for r in prefill} == {(1, 16), (1, 64), (1, 128)}
    d = m.dispatcher
    run(d, [[(7 * i) % 50 + 3 for i in range(120)]], n=2)
    rec = d.record("r0")
    assert rec is not None and rec.prefill_chunks == [120] and len(rec.prefill_ticks) == 1
