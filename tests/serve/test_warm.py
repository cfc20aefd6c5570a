"""Time to first token (issue 19): every rung is prepared at server start (no plan loading or
binding on a request's path), and a tick's prefill is one launch of the engine — a short prompt
takes one launch of the smallest rung covering it, and a request packed with others gets its
first token without waiting for their chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plow.runtime.executors import EXECUTORS
from plow.runtime.sampler import SamplingParams
from plow.serve.dispatcher import Dispatcher, GenerationEvent, Request
from plow.serve.http import load_served_model
from plow.serve.prefill_cost import PrefillFit
from plow.serve.scheduler import Running, SchedulerState, Waiting, schedule

EXECUTOR = "native" if EXECUTORS["native"].unavailable_reason() is None else "cpu"
CHEAP = PrefillFit(launch_s=1e-3, per_row_s=1e-5)  # launch_rows 100: few launches win
DEAR_ROWS = PrefillFit(launch_s=0.0, per_row_s=1e-5)  # launch_rows 0: the least padding wins


@pytest.fixture(scope="module")
def two_rungs(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_ckpt` with prefill rungs of 8 and 32 tokens, decode 1, 2, 4, context 64."""
    from plow.emit.bundle import compile_bundle
    from plow.profile import CompileProfile
    from plow.target import load_target

    out = tmp_path_factory.mktemp("warm") / "tiny-two-rungs"
    profile = CompileProfile(
        name="warm-tests", decode_batches=(1, 2, 4), prefill_seqs=(8, 32), context=64
    )
    compile_bundle(tiny_ckpt, out, load_target("cpu"), profile, verify=True)
    return out


def run(d: Dispatcher, prompts: list[list[int]], n: int = 6) -> list[list[GenerationEvent]]:
    events: list[list[GenerationEvent]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        d.submit(Request(f"r{i}", p, SamplingParams(), n, events[i].append), check=False)
    for _ in range(500):
        if d._idle():
            return events
        d._tick()
    raise AssertionError("dispatcher did not drain")


def launches(engine: Any) -> list[str]:
    """Record the bucket of every launch the engine's model dispatches from now on."""
    m = engine.model
    seen: list[str] = []
    dispatch, quantum = m.dispatch, m.run_quantum

    def d(plan: Any, **kw: Any) -> Any:
        seen.append(f"{plan.bucket.phase.value}{plan.bucket.seq}")
        return dispatch(plan, **kw)

    def q(plan: Any, *a: Any, **kw: Any) -> Any:
        seen.append(f"{plan.bucket.phase.value}{plan.bucket.seq}")
        return quantum(plan, *a, **kw)

    m.dispatch, m.run_quantum = d, q
    return seen


def test_every_rung_is_prepared_before_the_first_request(
    two_rungs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = load_served_model(two_rungs, name="t", max_num_seqs=4, executor=EXECUTOR, prefill_fit=CHEAP)
    d, eng = m.dispatcher, m.engine
    rungs = eng.rungs()  # type: ignore[attr-defined]
    assert {(r.phase, r.rows, r.tokens) for r in rungs} == {
        ("prefill", 1, 8), ("prefill", 1, 32), ("decode", 1, 1), ("decode", 2, 1),
        ("decode", 4, 1),
    }  # fmt: skip
    assert [p.rung for p in d.prepared] == sorted(rungs, key=lambda r: r.phase != "prefill")
    assert all(p.seconds > 0 for p in d.prepared)

    # from here on, loading or binding any plan is a failure: requests of every prompt length
    # and batch must find their rungs ready
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a rung was prepared on a request's path")

    monkeypatch.setattr(eng.model.bundle, "plan", refuse)  # type: ignore[attr-defined]
    if EXECUTOR == "native":
        monkeypatch.setattr("plow.runtime.native.model.lower", refuse)
    rng = np.random.default_rng(3)
    for batch in (1, 2, 3, 4):
        prompts = [
            rng.integers(1, 250, size=int(rng.integers(1, 40))).tolist() for _ in range(batch)
        ]
        for ev in run(d, prompts):
            assert ev[-1].finish_reason == "length", ev[-1].error
            assert sum(len(e.token_ids) for e in ev) == 6


def test_a_short_prompt_takes_exactly_one_prefill_launch(two_rungs: Path) -> None:
    m = load_served_model(two_rungs, name="t", max_num_seqs=4, executor=EXECUTOR, prefill_fit=CHEAP)
    seen = launches(m.engine)
    run(m.dispatcher, [[5, 6, 7, 8, 9]], n=2)  # 5 tokens: the 8-token rung, once
    assert [b for b in seen if b.startswith("prefill")] == ["prefill8"]
    seen.clear()
    run(m.dispatcher, [list(range(3, 23))], n=2)  # 20 tokens, a dear launch: one 32-token launch
    assert [b for b in seen if b.startswith("prefill")] == ["prefill32"]
    rec = m.dispatcher.record("r0")
    assert rec is not None and rec.prefill_chunks == [20]


def test_a_tick_prefills_one_launch_and_the_first_request_does_not_wait_for_the_others(
    two_rungs: Path,
) -> None:
    m = load_served_model(two_rungs, name="t", max_num_seqs=4, executor=EXECUTOR, prefill_fit=CHEAP)
    d = m.dispatcher
    seen = launches(m.engine)
    per_tick: list[int] = []
    tick = d._tick

    def counted() -> None:
        n = len(seen)
        tick()
        per_tick.append(sum(1 for b in seen[n:] if b.startswith("prefill")))

    d._tick = counted  # type: ignore[method-assign]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 250, size=20).tolist() for _ in range(4)]
    for ev in run(d, prompts):
        assert ev[-1].finish_reason == "length"
    assert max(per_tick) == 1 and sum(per_tick) == 4  # 4 prompts, one 32-token launch each
    recs = [d.record(f"r{i}") for i in range(4)]
    first = [r.first_token_tick for r in recs if r is not None and r.first_token_tick is not None]
    assert first == sorted(first) and len(set(first)) == 4  # one after another, not all at the end


def test_schedule_sizes_a_prefill_to_one_rung_launch() -> None:
    waiting = tuple(Waiting(f"w{i}", 0.0, 100) for i in range(3))
    running = (Running("r", 3, 5, 5, 2, 42),)
    state = SchedulerState(1, 0.0, running, waiting, (0, 1, 2), 512, 10.0, None, ((1, 16), (1, 64)))
    plan = schedule(state)
    assert [(c.request_id, c.length, c.completes) for c in plan.prefill] == [("w0", 64, False)]
    assert plan.chunk == 64 and [s.request_id for s in plan.decode] == ["r"]
    # without rungs the old packing: one call over every pending prompt
    old = schedule(SchedulerState(1, 0.0, running, waiting, (0, 1, 2), 512, 10.0))
    assert len(old.prefill) == 3
    # a prompt's last, shorter chunk is priced at the rung that runs it (12 tokens: the
    # 16-token rung), so 76 tokens cost two launches and 80 rows with chunks of 64 (priced as
    # two 64s, 128 rows, five 16-token launches would win at 10 rows a launch)
    tail = SchedulerState(
        1, 0.0, (), (Waiting("t", 0.0, 76),), (0,), 512, 10.0, None, ((1, 16), (1, 64))
    )
    assert schedule(tail).prefill[0].length == 64
