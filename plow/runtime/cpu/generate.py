"""Engine-level batching on the CPU executor: requests of different lengths share a bucket,
join when a slot is free and leave when done, between steps.

Each request owns a slot (a batch row of the decode bucket) and a page table. A step of the
loop:

1. join: waiting requests take free slots; the prefix cache gives each the blocks of its
   longest cached prompt prefix (those tokens are not prefilled: `GenerationStats.
   prefix_tokens_skipped`); the joiners' remaining prompts run together in prefill launches
   (one row per joiner, rounded up by the ladder, chunked at the largest prefill rung), and
   the launch that ends a prompt samples the request's first token;
2. decode: one launch of the decode bucket covering the highest live slot, `multi_step`
   dispatches per host round trip; the sampled ids stay in the arena's ids slot between
   steps, the host only reads the token ring to stream them out;
3. leave: requests at their token budget or a stop id release their pages (prompt blocks stay
   in the prefix cache, idle, until the pool needs them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from plow.errors import PlowError
from plow.runtime.cpu.model import CpuModel, RowDevice, RowInput
from plow.runtime.kv_cache import PageTable
from plow.runtime.sampler import SamplingParams, make_generator


@dataclass(frozen=True, slots=True)
class Request:
    prompt: tuple[int, ...]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()


@dataclass
class GenerationStats:
    prefill_launches: int = 0
    decode_launches: int = 0  # host round trips of the decode loop
    decode_steps: int = 0  # dispatches of decode buckets
    prefill_tokens: int = 0  # prompt tokens computed
    prefix_tokens_skipped: int = 0  # prompt tokens whose keys/values came from the prefix cache
    buckets: set[str] = field(default_factory=set)


@dataclass
class _Live:
    index: int
    req: Request
    table: PageTable
    rng: np.random.Generator | None
    cursor: int  # prompt tokens already in the cache
    tokens: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def position(self) -> int:
        """Position of the last token fed (the next decode input)."""
        return len(self.req.prompt) + len(self.tokens) - 1


def generate(
    model: CpuModel,
    requests: Sequence[Request],
    *,
    multi_step: int = 1,
    prefix_cache: bool = True,
    max_batch: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    stats: GenerationStats | None = None,
) -> list[list[int]]:
    """New tokens of every request (in request order). `on_token(request, token)` streams."""
    st = stats if stats is not None else GenerationStats()
    slots = min(max_batch or model.max_batch, model.max_batch)
    for i, r in enumerate(requests):
        if not r.prompt:
            raise PlowError(f"request {i}", "empty prompt")
        if len(r.prompt) + r.max_new_tokens > model.context:
            raise PlowError(
                f"request {i}",
                f"prompt {len(r.prompt)} + {r.max_new_tokens} tokens exceed context "
                f"{model.context}",
            )
    waiting = deque(range(len(requests)))
    live: dict[int, _Live] = {}  # slot -> request state
    results: list[list[int]] = [[] for _ in requests]

    def emit(lv: _Live, tok: int) -> None:
        lv.tokens.append(tok)
        if on_token is not None:
            on_token(lv.index, tok)
        if len(lv.tokens) >= lv.req.max_new_tokens or tok in lv.req.stop_ids:
            lv.done = True

    while waiting or live:
        joiners: list[tuple[int, _Live]] = []
        while waiting and len(live) + len(joiners) < slots:
            slot = min(set(range(slots)) - set(live) - {s for s, _ in joiners})
            i = waiting.popleft()
            req = requests[i]
            table = model.kv.new_table()
            cursor = model.prefix.acquire(table, req.prompt) if prefix_cache else 0
            st.prefix_tokens_skipped += cursor
            rng = None if req.params.is_greedy else make_generator(req.params)
            joiners.append((slot, _Live(i, req, table, rng, cursor)))
        if joiners:
            _prefill(model, [lv for _, lv in joiners], st, emit)
            for slot, lv in joiners:
                if prefix_cache:
                    model.prefix.register(lv.table, lv.req.prompt)
                live[slot] = lv
        active = {s: lv for s, lv in live.items() if not lv.done}
        if active:
            _decode(model, active, multi_step, st, emit, fresh={s for s, _ in joiners})
        for s in [s for s, lv in live.items() if lv.done]:
            lv = live.pop(s)
            results[lv.index] = lv.tokens
            model.prefix.release(lv.table)
    return results


def _prefill(
    model: CpuModel,
    rows: list[_Live],
    st: GenerationStats,
    emit: Callable[[_Live, int], None],
) -> None:
    k = model.max_prefill_batch  # a bundle's prefill rungs may hold fewer rows
    for i in range(0, len(rows), k):
        _prefill_group(model, rows[i : i + k], st, emit)


def _prefill_group(
    model: CpuModel,
    rows: list[_Live],
    st: GenerationStats,
    emit: Callable[[_Live, int], None],
) -> None:
    chunk = model.max_prefill_tokens
    while True:
        todo = [lv for lv in rows if lv.cursor < len(lv.req.prompt)]
        if not todo:
            return
        longest = max(min(chunk, len(lv.req.prompt) - lv.cursor) for lv in todo)
        plan = model.plan(model.prefill_bucket(len(rows), longest))
        inputs: list[RowInput | None] = []
        dev: list[RowDevice | None] = []
        for lv in rows:
            n = min(chunk, len(lv.req.prompt) - lv.cursor)
            if n <= 0:
                inputs.append(None)
                dev.append(None)
                continue
            model.kv.reserve(lv.table, lv.cursor + n)
            inputs.append(
                RowInput(
                    lv.table,
                    tuple(range(lv.cursor, lv.cursor + n)),
                    tuple(lv.req.prompt[lv.cursor : lv.cursor + n]),
                )
            )
            last = lv.cursor + n == len(lv.req.prompt)
            dev.append(RowDevice(lv.req.params, lv.rng, 1) if last else None)
            st.prefill_tokens += n
        ring = model.run_quantum(plan, inputs, dev, 1)
        st.prefill_launches += 1
        st.buckets.add(plan.bucket.name)
        for b, lv in enumerate(rows):
            inp = inputs[b]
            if inp is None:
                continue
            lv.cursor += len(inp.positions)
            if dev[b] is not None:
                emit(lv, int(ring[0, b]))


def _decode(
    model: CpuModel,
    active: dict[int, _Live],
    multi_step: int,
    st: GenerationStats,
    emit: Callable[[_Live, int], None],
    fresh: set[int],
) -> None:
    plan = model.plan(model.decode_bucket(max(active) + 1))
    device_ids = model.last_plan is plan
    budget = {
        s: min(lv.req.max_new_tokens - len(lv.tokens), model.context - 1 - lv.position)
        for s, lv in active.items()
    }
    steps = max(1, min(multi_step, plan.ring, max(budget.values())))
    inputs: list[RowInput | None] = [None] * plan.batch
    dev: list[RowDevice | None] = [None] * plan.batch
    for s, lv in active.items():
        if budget[s] <= 0:
            lv.done = True
            continue
        model.kv.reserve(lv.table, min(model.context, lv.position + 1 + steps))
        keep = device_ids and s not in fresh
        inputs[s] = RowInput(lv.table, (lv.position,), None if keep else (lv.tokens[-1],))
        dev[s] = RowDevice(lv.req.params, lv.rng, min(budget[s], steps), lv.req.stop_ids)
    if all(x is None for x in inputs):
        return
    ring = model.run_quantum(plan, inputs, dev, steps)
    st.decode_launches += 1
    st.decode_steps += steps
    st.buckets.add(plan.bucket.name)
    for s, lv in active.items():
        if dev[s] is None:
            continue
        for i in range(steps):
            tok = int(ring[i, s])
            if tok < 0 or lv.done:
                break
            emit(lv, tok)
