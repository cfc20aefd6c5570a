"""The engine protocol every executor implements for a slot-table caller (the serving
dispatcher, the harness's runners), and the reference engine that implements it.

It lives in the runtime because the runtime's executors implement it (`plow.runtime.cpu.engine`
is the cpu, native and cuda executors' engine) and the serving layer only drives it; data flows
one way: `plow.serve` imports this module, nothing here imports `plow.serve`.

An *engine* owns a fixed table of `max_batch` slots; each slot holds one request's key-value
state for at most `max_context` positions. One caller (the serving dispatcher,
`plow/serve/dispatcher.py`, or a harness runner) drives it from one thread, in this order for
a slot's life:

    add(slot, prompt_ids)                # bind the slot, reserve its pages
    prefill([PrefillChunk(slot, n), ...]) # one launch: the next n prompt tokens of each slot
    ...                                   # (repeated until the whole prompt is in the cache)
    decode([slot, ...], [token, ...])     # one launch: one token per slot, logits out
    ...
    free(slot)                            # pages back to the pool; the slot is reusable

A chunk never crosses the end of its slot's prompt, and a slot is decoded only after its whole
prompt was prefilled. `prefill` returns, per chunk, the logits of the chunk's last token
(only the chunk that completes a prompt needs them: its row samples the first token);
`decode` returns one logits row per slot. Sampling stays on the host (`plow.runtime.sampler`),
so an engine only computes logits; an executor that fuses greedy sampling can still implement
this protocol by returning logits rows.

`kv_usage()` reports the key-value pool in pages so the dispatcher and `/metrics` can show it
and a test can check that a freed slot returned its pages. Everything else (timings, cost
fits) is measured from outside through these calls.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from plow.checkpoint import Checkpoint, ModelSpec
from plow.graph import Bucket, OpGraph
from plow.runtime.kv_cache import BlockPool, PageTable
from plow.runtime.reference import ReferenceSession
from plow.runtime.sampler import SamplingParams

DEFAULT_PAGE_SIZE = 16


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """The next `length` prompt tokens of the request in `slot` (from its prefill cursor)."""

    slot: int
    length: int


@dataclass(frozen=True, slots=True)
class KVUsage:
    """Key-value pool occupancy in pages of `page_size` token positions."""

    pages_used: int
    pages_total: int
    page_size: int
    # recurrent-state slots (Mamba-2) held by requests / in the arena; 0 / 0 without state
    state_slots_used: int = 0
    state_slots_total: int = 0

    @property
    def fraction(self) -> float:
        return self.pages_used / self.pages_total if self.pages_total else 0.0


class EngineError(RuntimeError):
    """A protocol violation by the caller (bad slot, chunk past the prompt, context full)."""


@runtime_checkable
class Engine(Protocol):
    """What the dispatcher needs from an executor. See the module docstring for the call order."""

    @property
    def max_batch(self) -> int:
        """Number of slots (the largest compiled batch)."""
        ...

    @property
    def max_context(self) -> int:
        """Positions one slot holds: prompt + generated tokens."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def kind(self) -> str:
        """A short name for reports: "reference", "cpu", "cuda"."""
        ...

    def add(self, slot: int, prompt_ids: Sequence[int]) -> None:
        """Bind a free `slot` to a request whose prompt is `prompt_ids` (nothing runs yet)."""
        ...

    def prefill(self, chunks: Sequence[PrefillChunk]) -> np.ndarray:
        """One launch over several slots' next prompt chunks; logits[len(chunks), V] of each
        chunk's last token."""
        ...

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One launch: append `tokens[i]` to `slots[i]`; logits[len(slots), V]."""
        ...

    def free(self, slot: int) -> None:
        """Release the slot and return its pages to the pool (idempotent)."""
        ...

    def kv_usage(self) -> KVUsage: ...


@runtime_checkable
class SamplingEngine(Engine, Protocol):
    """An engine that can also sample on the device: `decode_sampled` is `decode` whose step
    epilogue samples each row with its own params and generator (greedy fused into the
    lm_head reduction) and returns token ids instead of logits rows. A caller uses it for a
    launch whose rows all need nothing but a token (no logprobs, penalties or grammar); the
    tokens equal sampling the logits on the host with the same generators."""

    def decode_sampled(
        self,
        slots: Sequence[int],
        tokens: Sequence[int],
        params: Sequence[SamplingParams],
        rngs: Sequence[np.random.Generator | None],
    ) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class Rung:
    """One launch shape a compiled engine runs: `phase` "prefill" (at most `rows` chunks of
    at most `tokens` tokens each) or "decode" (`rows` slots, one token each)."""

    phase: str
    rows: int
    tokens: int


@runtime_checkable
class RungEngine(Engine, Protocol):
    """An engine whose launches run precompiled rungs (`CpuEngine`: the native, cpu and cuda
    executors). `rungs()` lists every shape its `prefill` and `decode` launches can select, so
    a server can prepare each one (load, bind, one warm launch) before serving, and a
    scheduler can size a tick's prefill to one launch of the largest prefill rung."""

    def rungs(self) -> tuple[Rung, ...]: ...


@dataclass
class _Slot:
    session: ReferenceSession
    prompt: list[int]
    table: PageTable
    cursor: int = 0  # prompt tokens already in the cache


def check_new_slot(
    slot: int, prompt_ids: Sequence[int], max_batch: int, max_context: int, in_use: Container[int]
) -> None:
    """What every engine's `add` refuses: a slot out of range or taken, an empty prompt, a
    prompt longer than the context."""
    if not 0 <= slot < max_batch:
        raise EngineError(f"slot {slot} outside 0..{max_batch - 1}")
    if slot in in_use:
        raise EngineError(f"slot {slot} is already in use")
    if not prompt_ids:
        raise EngineError("empty prompt")
    if len(prompt_ids) > max_context:
        raise EngineError(f"prompt of {len(prompt_ids)} tokens exceeds context {max_context}")


@dataclass
class ReferenceEngine:
    """`Engine` over the numpy reference executor: one `ReferenceSession` per slot.

    A prefill or decode over several slots runs the sessions one after another; to the
    dispatcher it is one launch (one logical tick). Pages are accounted in a
    `plow.runtime.kv_cache.BlockPool` sized for every slot at full context: a slot holding n
    positions owns ceil(n / page_size) blocks of it (the session's own cache stays
    contiguous), and `free` hands them back.
    """

    spec: ModelSpec
    weights: Mapping[str, np.ndarray]
    batch: int
    context: int
    page_size: int = DEFAULT_PAGE_SIZE
    _slots: dict[int, _Slot] = field(default_factory=dict)
    _graphs: dict[Bucket, OpGraph] = field(default_factory=dict)  # shared by all sessions
    _pool: BlockPool | None = None

    def __post_init__(self) -> None:
        self._pool = BlockPool(self.batch * -(-self.context // self.page_size))

    @property
    def pool(self) -> BlockPool:
        assert self._pool is not None
        return self._pool

    def _grow(self, s: _Slot) -> None:
        need = s.table.blocks_for(s.session.length) - len(s.table.blocks)
        if need > 0:
            s.table.blocks.extend(self.pool.allocate(need))

    @classmethod
    def from_checkpoint(
        cls, ckpt: Checkpoint, *, max_batch: int = 8, max_context: int | None = None
    ) -> ReferenceEngine:
        context = ckpt.spec.max_position if max_context is None else max_context
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not 1 <= context <= ckpt.spec.max_position:
            raise ValueError(f"max_context must be in 1..{ckpt.spec.max_position}, got {context}")
        return cls(ckpt.spec, ckpt.weights, max_batch, context)

    @property
    def max_batch(self) -> int:
        return self.batch

    @property
    def max_context(self) -> int:
        return self.context

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def kind(self) -> str:
        return "reference"

    def _slot(self, slot: int) -> _Slot:
        s = self._slots.get(slot)
        if s is None:
            raise EngineError(f"slot {slot} is not in use")
        return s

    def add(self, slot: int, prompt_ids: Sequence[int]) -> None:
        check_new_slot(slot, prompt_ids, self.batch, self.context, self._slots)
        session = ReferenceSession(self.spec, self.weights, self.context, _graphs=self._graphs)
        self._slots[slot] = _Slot(session, list(prompt_ids), PageTable(self.page_size))

    def prefill(self, chunks: Sequence[PrefillChunk]) -> np.ndarray:
        rows = []
        for c in chunks:
            s = self._slot(c.slot)
            if c.length < 1 or s.cursor + c.length > len(s.prompt):
                raise EngineError(
                    f"slot {c.slot}: chunk of {c.length} at {s.cursor} crosses the prompt end "
                    f"({len(s.prompt)})"
                )
            logits = s.session.step(s.prompt[s.cursor : s.cursor + c.length])
            s.cursor += c.length
            self._grow(s)
            rows.append(logits[-1])
        return np.stack(rows) if rows else np.zeros((0, self.vocab_size), np.float32)

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        if len(slots) != len(tokens):
            raise EngineError("decode needs one token per slot")
        rows = []
        for slot, tok in zip(slots, tokens, strict=True):
            s = self._slot(slot)
            if s.cursor < len(s.prompt):
                raise EngineError(f"slot {slot}: decode before its prompt is prefilled")
            if s.session.length >= self.context:
                raise EngineError(f"slot {slot}: context {self.context} is full")
            rows.append(s.session.step([int(tok)])[-1])
            self._grow(s)
        return np.stack(rows) if rows else np.zeros((0, self.vocab_size), np.float32)

    def free(self, slot: int) -> None:
        s = self._slots.pop(slot, None)
        if s is not None:
            for b in s.table.blocks:
                self.pool.decref(b)
            s.table.blocks.clear()

    def kv_usage(self) -> KVUsage:
        pool = self.pool
        return KVUsage(pool.num_blocks - pool.num_free, pool.num_blocks, self.page_size)

    def positions(self, slot: int) -> int:
        """Positions the slot's cache holds (for tests and reports)."""
        return self._slot(slot).session.length
