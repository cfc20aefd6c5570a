"""The dispatcher's policy as a pure function: `schedule(SchedulerState) -> TickPlan`.

This is the part of a tick that serQ models (the RAD program's admit / prefill / decode
choices): given a snapshot of the slot table and the queue, decide what the next launch does.
It reads nothing else and changes nothing; the dispatcher applies the plan to its own state,
hands it to the engine (`execute`, `plow/serve/step.py`) and samples from the results
(`update`, in the dispatcher). vLLM v1 splits `EngineCore.step` the same way: the scheduler
returns a `SchedulerOutput` value, the executor runs it, the update consumes the outputs.

The policy, in order:

1. slots whose request finished or was aborted are freed; aborted waiting requests leave the
   queue;
2. waiting requests older than the admission bound (`max_wait_s`) are refused instead of
   admitted (their arrival prediction was low: the bound must hold for every admitted
   request); the queue is in arrival order, so they are a prefix of it;
3. the remaining waiting requests take free slots, oldest first, lowest slot first;
4. at most one prefill launch: the chunk size minimises the priced cost of the prompts still
   to prefill (`prefill_cost.choose_chunk_size`) under the token budget
   (`max_num_batched_tokens` less one token per decoding request), and the chunks of as many
   requests as the budget holds are packed into it, in admission order. When the engine runs
   compiled rungs (`prefill_rungs`: (rows, tokens) of each prefill rung) the plan is one
   launch of the engine, not just one call: the chunk sizes are the rungs' token counts, each
   chunk priced at the rung that runs it, and the launch packs no more chunks than a rung of
   that size has rows. Otherwise a chunk longer than the largest rung, or more chunks than
   its rows, would run as several launches back to back inside one tick: every request packed
   in it would wait for all of them before its first token, and the running requests'
   decode would wait too;
5. one decode launch over every request that had already sampled a token when the tick began
   (a request whose prompt completes in this tick's prefill samples its first token there and
   decodes from the next tick on).
"""

from __future__ import annotations

from dataclasses import dataclass

from plow.serve.prefill_cost import choose_chunk_size, rows_for


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued request as the scheduler sees it."""

    request_id: str
    arrival_t: float
    prompt_tokens: int
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class Running:
    """A request holding a slot: how far its prompt is prefilled and what it last sampled."""

    request_id: str
    slot: int
    prompt_tokens: int
    prefilled: int
    generated: int
    last_token: int | None
    finished: bool = False
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.finished or self.cancelled


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """Everything `schedule` reads: the slot table (`running`, in admission order), the queue
    (`waiting`, in arrival order; a caller may leave out requests that cannot change the plan:
    past the late prefix and the first as many as there can be free slots, all but the
    cancelled ones), the free slots, the clock and the budgets."""

    tick: int
    now: float
    running: tuple[Running, ...]
    waiting: tuple[Waiting, ...]
    free_slots: tuple[int, ...]
    max_num_batched_tokens: int
    launch_rows: float  # the prefill fit's launch cost in row equivalents
    max_wait_s: float | None = None  # None: no admission bound
    # (rows, tokens) of each prefill rung the engine can launch; () : no compiled rungs
    prefill_rungs: tuple[tuple[int, int], ...] = ()
    # the decode launch that follows each prefill launch while requests decode, in prefill
    # row equivalents: one more prefill launch delays the prompt's first token by it too
    decode_rows: float = 0.0


@dataclass(frozen=True, slots=True)
class Admit:
    request_id: str
    slot: int


@dataclass(frozen=True, slots=True)
class Release:
    """A slot freed this tick; `aborted` when its request had not finished (client gone)."""

    request_id: str
    slot: int
    aborted: bool


@dataclass(frozen=True, slots=True)
class Chunk:
    """The next `length` prompt tokens of the request in `slot`; `completes` when they end
    its prompt (that row samples the request's first token)."""

    request_id: str
    slot: int
    length: int
    completes: bool


@dataclass(frozen=True, slots=True)
class Step:
    """One decode row: feed `token` to the request in `slot`."""

    request_id: str
    slot: int
    token: int


@dataclass(frozen=True, slots=True)
class TickPlan:
    """What one tick does, in this order: release, drop (aborted while waiting), refuse
    (waited past the bound), admit, one prefill launch over `prefill`, one decode launch over
    `decode`. `chunk` is the prefill chunk size chosen (0 without a prefill)."""

    tick: int
    release: tuple[Release, ...] = ()
    drop: tuple[str, ...] = ()
    refuse: tuple[str, ...] = ()
    admit: tuple[Admit, ...] = ()
    prefill: tuple[Chunk, ...] = ()
    decode: tuple[Step, ...] = ()
    chunk: int = 0

    @property
    def launches(self) -> bool:
        return bool(self.prefill or self.decode)


def schedule(state: SchedulerState) -> TickPlan:
    """The tick's plan (module docstring); a pure function of `state`."""
    release = tuple(Release(r.request_id, r.slot, not r.finished) for r in state.running if r.done)
    kept = [r for r in state.running if not r.done]
    free = sorted({*state.free_slots, *(r.slot for r in release)})
    drop = tuple(w.request_id for w in state.waiting if w.cancelled)
    queue = [w for w in state.waiting if not w.cancelled]
    refuse: list[str] = []
    if state.max_wait_s is not None:
        while queue and state.now - queue[0].arrival_t > state.max_wait_s:
            refuse.append(queue.pop(0).request_id)
    admit = tuple(Admit(w.request_id, s) for w, s in zip(queue, free, strict=False))
    fresh = [
        Running(w.request_id, a.slot, w.prompt_tokens, 0, 0, None)
        for w, a in zip(queue, admit, strict=False)
    ]
    table = kept + fresh
    pending = [r for r in table if r.prefilled < r.prompt_tokens]
    decoding = [r for r in kept if r.generated > 0 and r.last_token is not None]
    prefill: tuple[Chunk, ...] = ()
    chunk = 0
    if pending:
        budget = max(1, state.max_num_batched_tokens - len(decoding))
        remaining = [r.prompt_tokens - r.prefilled for r in pending]
        rungs = state.prefill_rungs
        sizes = sorted({t for _, t in rungs}) if rungs else None
        per = state.launch_rows + (state.decode_rows if decoding else 0.0)
        chunk = choose_chunk_size(remaining, budget, per, sizes, rungs).chunk
        per_launch = max(1, budget // chunk)
        if rungs:
            per_launch = min(per_launch, max(rows_for(rungs, chunk), 1))
        prefill = tuple(
            Chunk(r.request_id, r.slot, min(chunk, n), min(chunk, n) == n)
            for r, n in zip(pending[:per_launch], remaining, strict=False)
        )
    decode = tuple(
        Step(r.request_id, r.slot, r.last_token) for r in decoding if r.last_token is not None
    )
    return TickPlan(
        state.tick, release, drop, tuple(refuse), admit, prefill, decode, chunk
    )
