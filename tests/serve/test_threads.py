"""`plow serve --threads N` (native executor): the engine's machine runs N host threads per
step and serves the same tokens as the default thread count; other executors refuse it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plow.errors import PlowError
from plow.runtime.executors import EXECUTORS
from plow.runtime.sampler import SamplingParams
from plow.serve.dispatcher import GenerationEvent, Request
from plow.serve.http import load_served_model
from plow.serve.prefill_cost import PrefillFit

FIT = PrefillFit(launch_s=1e-3, per_row_s=1e-5)


def tokens(bundle_dir: Path, threads: int | None) -> tuple[list[list[int]], int]:
    m = load_served_model(bundle_dir, name="t", max_num_seqs=4, executor="native",
                          threads=threads, prefill_fit=FIT)  # fmt: skip
    d = m.dispatcher
    machine = d.engine.model.machine  # type: ignore[attr-defined]
    rng = np.random.default_rng(5)
    events: list[list[GenerationEvent]] = [[] for _ in range(4)]
    for i in range(4):
        prompt = rng.integers(1, 250, size=int(rng.integers(3, 14))).tolist()
        d.submit(Request(f"r{i}", prompt, SamplingParams(), 8, events[i].append), check=False)
    while not d._idle():
        d._tick()
    return [[t for e in ev for t in e.token_ids] for ev in events], machine.threads_for(
        next(iter(machine._plans.values()))[0]
    )


def test_native_threads_option_sets_the_machine_and_keeps_the_tokens(tiny_bundle_dir: Path) -> None:
    why = EXECUTORS["native"].unavailable_reason()
    if why is not None:
        pytest.skip(why)
    one, used_one = tokens(tiny_bundle_dir, 1)
    default, used_default = tokens(tiny_bundle_dir, None)
    assert used_one == 1 and used_default >= 1
    assert all(len(t) == 8 for t in one) and one == default


def test_threads_on_another_executor_is_a_one_line_error(tiny_bundle_dir: Path) -> None:
    with pytest.raises(PlowError, match="--threads"):
        load_served_model(tiny_bundle_dir, executor="cpu", threads=1, prefill_fit=FIT)
