"""The engine protocol and the dispatcher's tick semantics, driven tick by tick (no threads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plow.checkpoint import Checkpoint, load_checkpoint
from plow.runtime.reference import forward_logits, generate_greedy
from plow.runtime.sampler import SamplingParams
from plow.serve.admission import AdmissionController, QueueModel, StepTimes
from plow.serve.dispatcher import Dispatcher, GenerationEvent, Request
from plow.serve.engine import Engine, EngineError, PrefillChunk, ReferenceEngine
from plow.serve.prefill_cost import PrefillFit


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt: Path) -> Checkpoint:
    return load_checkpoint(tiny_ckpt)


def make(ckpt: Checkpoint, slots: int = 3, budget: int = 64, launch_s: float = 0.0) -> Dispatcher:
    eng = ReferenceEngine.from_checkpoint(ckpt, max_batch=slots, max_context=128)
    fit = PrefillFit(launch_s=launch_s, per_row_s=1e-5)
    return Dispatcher("t", eng, ckpt.tokenizer.decode, eos_token_ids=(), prefill_fit=fit,
                      max_num_batched_tokens=budget)  # fmt: skip


def submit(d: Dispatcher, rid: str, ids: list[int], n: int, **kw: object) -> list[GenerationEvent]:
    events: list[GenerationEvent] = []
    params = SamplingParams(**kw)  # type: ignore[arg-type]
    d.submit(Request(rid, ids, params, n, events.append))
    return events


def run_until_idle(d: Dispatcher, limit: int = 500) -> None:
    for _ in range(limit):
        if d._idle():
            return
        d._tick()
    raise AssertionError("dispatcher did not drain")


def test_reference_engine_implements_the_protocol(ckpt: Checkpoint) -> None:
    eng = ReferenceEngine.from_checkpoint(ckpt, max_batch=2, max_context=64)
    assert isinstance(eng, Engine)
    prompt = [5, 17, 42, 99, 7, 8, 250, 31, 12]
    eng.add(0, prompt)
    eng.add(1, prompt[:4])
    # chunked prefill of slot 0 (4 + 5) alongside slot 1's whole prompt in one launch
    first = eng.prefill([PrefillChunk(0, 4), PrefillChunk(1, 4)])
    last = eng.prefill([PrefillChunk(0, 5)])
    whole = forward_logits(ckpt, prompt)
    np.testing.assert_allclose(last[0], whole[-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(first[1], forward_logits(ckpt, prompt[:4])[-1], rtol=1e-4, atol=1e-4)
    assert eng.kv_usage().pages_used == 2  # 9 and 4 positions, 16 per page
    with pytest.raises(EngineError):
        eng.prefill([PrefillChunk(0, 1)])  # past the end of the prompt
    with pytest.raises(EngineError):
        eng.add(1, prompt)  # slot in use
    eng.free(0)
    eng.free(1)
    eng.free(1)  # idempotent
    assert eng.kv_usage().pages_used == 0
    eng.pool.check_invariants()


def test_greedy_tokens_match_the_reference_generator(ckpt: Checkpoint) -> None:
    d = make(ckpt)
    prompt = ckpt.tokenizer.encode("The quick brown fox")
    ev = submit(d, "a", prompt, 12)
    run_until_idle(d)
    got = [t for e in ev for t in e.token_ids]
    assert got == generate_greedy(ckpt, prompt, 12)
    assert ev[-1].finish_reason == "length" and ev[-1].completion_tokens == 12
    assert "".join(e.text for e in ev) == ckpt.tokenizer.decode(got)


def test_tokens_do_not_depend_on_batch_neighbours(ckpt: Checkpoint) -> None:
    kw = dict(temperature=0.9, top_p=0.95, seed=11)
    alone = make(ckpt)
    ev_alone = submit(alone, "x", [3, 4, 5, 6], 10, **kw)
    run_until_idle(alone)
    busy = make(ckpt)
    submit(busy, "n1", [7, 8, 9], 20, temperature=1.0, seed=1)
    busy._tick()
    ev_busy = submit(busy, "x", [3, 4, 5, 6], 10, **kw)
    submit(busy, "n2", list(range(10, 60)), 5, temperature=1.0, seed=2)
    run_until_idle(busy)
    toks = [[t for e in ev for t in e.token_ids] for ev in (ev_alone, ev_busy)]
    assert toks[0] == toks[1] and len(toks[0]) == 10


def test_arrival_mid_generation_gets_its_first_token_next_tick(ckpt: Checkpoint) -> None:
    d = make(ckpt, slots=3)
    a = submit(d, "a", [3, 4, 5], 30)
    b = submit(d, "b", [6, 7, 8, 9], 30)
    for _ in range(5):
        d._tick()
    arrival_tick = d.tick
    c = submit(d, "c", [10, 11, 12], 4)
    d._tick()
    rec = d.record("c")
    assert rec is not None and rec.first_token_tick == arrival_tick + 1
    assert c and c[0].tick == arrival_tick + 1
    assert a[-1].finish_reason is None and b[-1].finish_reason is None  # still decoding
    run_until_idle(d)
    ra, rc = d.record("a"), d.record("c")
    assert ra is not None and rc is not None
    assert rc.finish_tick is not None and ra.finish_tick is not None
    assert rc.finish_tick < ra.finish_tick  # c finished while a still ran


def test_long_prompt_is_chunked_and_decoding_continues_between_chunks(ckpt: Checkpoint) -> None:
    d = make(ckpt, slots=2, budget=20)
    a = submit(d, "a", [3, 4, 5], 40)
    d._tick()
    long_prompt = [int(x) for x in np.random.default_rng(0).integers(3, 300, size=90)]
    submit(d, "long", long_prompt, 3)
    before = len(a)
    d._tick()
    d._tick()
    rec = d.record("long")
    assert rec is not None
    assert rec.prefill_chunks and max(rec.prefill_chunks) <= 20 - 1  # budget minus a's decode
    assert len(a) == before + 2  # a got a token on each tick of the long prefill
    run_until_idle(d)
    assert sum(rec.prefill_chunks) == 90 and len(rec.prefill_ticks) >= 90 // 19
    assert rec.prefill_ticks == sorted(set(rec.prefill_ticks))  # one chunk per launch


def test_abort_frees_the_slot_and_pages_on_the_next_tick(ckpt: Checkpoint) -> None:
    d = make(ckpt, slots=2)
    ev = submit(d, "a", list(range(3, 40)), 50)
    for _ in range(3):
        d._tick()
    assert d.stats().slots_in_use == 1 and d.stats().kv.pages_used > 0
    d.abort("a")
    d._tick()
    st = d.stats()
    assert st.slots_in_use == 0 and st.kv.pages_used == 0
    assert ev[-1].finish_reason == "abort"
    rec = d.record("a")
    assert rec is not None and rec.freed_tick == d.tick


def test_finished_request_frees_its_slot_on_the_next_tick(ckpt: Checkpoint) -> None:
    d = make(ckpt, slots=1)
    ev1 = submit(d, "a", [3, 4], 2)
    ev2 = submit(d, "b", [5, 6], 2)
    run_until_idle(d)
    r1, r2 = d.record("a"), d.record("b")
    assert r1 is not None and r2 is not None
    assert r1.finish_tick is not None and r1.freed_tick == r1.finish_tick + 1
    assert r2.admitted_tick == r1.freed_tick  # the one slot is reused in the tick that frees it
    assert ev1[-1].finish_reason == ev2[-1].finish_reason == "length"


def test_stop_token_and_stop_string(ckpt: Checkpoint) -> None:
    d = make(ckpt)
    prompt = [3, 4, 5]
    greedy = generate_greedy(ckpt, prompt, 8)
    events: list[GenerationEvent] = []
    d.submit(Request("s", prompt, SamplingParams(), 8, events.append,
                     stop_token_ids=frozenset({greedy[3]})))  # fmt: skip
    run_until_idle(d)
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == 4
    text = ckpt.tokenizer.decode(greedy)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    events = []
    d.submit(Request("t", prompt, SamplingParams(), 8, events.append, stop=(stop,)))
    run_until_idle(d)
    out = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop" and out == text[: text.find(stop)]


def test_a_request_waiting_past_the_bound_is_refused_instead_of_admitted(
    ckpt: Checkpoint,
) -> None:
    eng = ReferenceEngine.from_checkpoint(ckpt, max_batch=1, max_context=128)
    fit = PrefillFit(launch_s=0.0, per_row_s=1e-5)
    step = StepTimes(d0_s=0.001, d1_s=0.0, max_batch=1)
    adm = AdmissionController(QueueModel(step, fit, 1), max_wait_s=5.0)
    d = Dispatcher("t", eng, ckpt.tokenizer.decode, prefill_fit=fit, admission=adm,
                   max_num_batched_tokens=64)  # fmt: skip
    a = submit(d, "a", [3, 4, 5], 30)
    d._tick()
    b = submit(d, "b", [6, 7], 2)  # predicted about 30 ticks of 1 ms: queued
    c = submit(d, "c", [8, 9], 2)
    rec_b, rec_c = d.record("b"), d.record("c")
    assert rec_b is not None and rec_c is not None and rec_b.predicted_wait_s < 5.0
    rec_b.arrival_t -= 10.0  # b has waited 10 s already (the prediction was wrong)
    d._tick()
    assert b[-1].finish_reason == "refused" and (b[-1].retry_after_s or 0) >= 1
    assert rec_b.admitted_tick is None and rec_b.finish_reason == "refused"
    assert not c and d.stats().waiting == 1  # c, within the bound, still waits its turn
    run_until_idle(d)
    assert c[-1].finish_reason == "length" and a[-1].finish_reason == "length"
    assert rec_c.admitted_t is not None and rec_c.admitted_t - rec_c.arrival_t <= 5.0
