"""The CPU executor behind the `Engine` protocol (`plow.runtime.engine`) and the
harness's `Runner` (`harness.executors`), plus the `plow generate --executor cpu` entry.

`CpuEngine` maps each dispatcher slot to one batch row (row = slot, so a slot keeps its arena
ids slot across steps) and one page table. `add` takes the prompt's longest cached prefix from
the prefix cache (those tokens are never prefilled; `prefix_tokens_skipped` counts them); a
`prefill` call is one launch of the smallest covering prefill rung over every chunk (chunks
longer than the largest rung take several launches); `decode` is one launch of the decode
rung covering the highest slot; both return logits rows (the dispatcher samples on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from plow.checkpoint import Checkpoint
from plow.errors import PlowError
from plow.runtime.cpu.generate import GenerationStats, Request, generate
from plow.runtime.cpu.model import CpuModel, RowDevice, RowInput
from plow.runtime.engine import EngineError, KVUsage, PrefillChunk, Rung, check_new_slot
from plow.runtime.kv_cache import KVDtype, PageTable
from plow.runtime.sampler import SamplingParams

if TYPE_CHECKING:
    from plow.graph import Bucket
    from plow.runtime.cpu.bundle import Bundle


@dataclass
class _Slot:
    prompt: list[int]
    table: PageTable
    cursor: int = 0  # the dispatcher's prefill cursor
    length: int = 0  # positions whose keys/values are in the cache
    registered: bool = False


class CpuEngine:
    """`plow.runtime.engine.Engine` on the CPU executor (see the module docstring)."""

    def __init__(self, model: CpuModel, *, prefix_cache: bool = True) -> None:
        self.model = model
        self.use_prefix = prefix_cache
        self._slots: dict[int, _Slot] = {}
        self.prefix_tokens_skipped = 0

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Checkpoint,
        *,
        max_batch: int = 8,
        max_context: int | None = None,
        prefix_cache: bool = True,
        **model_kw: Any,
    ) -> CpuEngine:
        context = ckpt.spec.max_position if max_context is None else max_context
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not 1 <= context <= ckpt.spec.max_position:
            raise ValueError(f"max_context must be in 1..{ckpt.spec.max_position}, got {context}")
        model = CpuModel(
            ckpt.spec, ckpt.weights, max_batch=max_batch, max_context=context, **model_kw
        )
        return cls(model, prefix_cache=prefix_cache)

    @classmethod
    def from_bundle(
        cls,
        bundle: Bundle | Path | str,
        *,
        max_batch: int | None = None,
        max_context: int | None = None,
        prefix_cache: bool = True,
        verify: bool = True,
        **model_kw: Any,
    ) -> CpuEngine:
        """An engine running a bundle's packet streams (`CpuModel.from_bundle`)."""
        model = CpuModel.from_bundle(
            bundle, max_batch=max_batch, max_context=max_context, verify=verify, **model_kw
        )
        return cls(model, prefix_cache=prefix_cache)

    @property
    def max_batch(self) -> int:
        return self.model.max_batch

    @property
    def max_context(self) -> int:
        return self.model.context

    @property
    def vocab_size(self) -> int:
        return self.model.spec.vocab_size

    @property
    def kind(self) -> str:
        return self.model.executor_name

    def rungs(self) -> tuple[Rung, ...]:
        """`plow.runtime.engine.RungEngine.rungs`: every bucket `prefill` and `decode` can
        select for this engine's slots and context (rows capped at what a launch may hold)."""
        m = self.model
        out: dict[Bucket, Rung] = {}
        for rows in range(1, m.max_prefill_batch + 1):
            for seq in m.prefill_seqs:
                b = m.prefill_bucket(rows, min(seq, m.max_prefill_tokens))
                if b.tokens_per_row < self.max_context:
                    n = min(b.batch, m.max_prefill_batch)
                    out.setdefault(b, Rung("prefill", n, b.tokens_per_row))
        for rows in range(1, self.max_batch + 1):
            b = m.decode_bucket(rows)
            out.setdefault(b, Rung("decode", min(b.batch, self.max_batch), 1))
        return tuple(out.values())

    def _slot(self, slot: int) -> _Slot:
        s = self._slots.get(slot)
        if s is None:
            raise EngineError(f"slot {slot} is not in use")
        return s

    def _decode_row(self, slot: int, tok: int) -> RowInput:
        """The next decode input of `slot` (its prompt prefilled, room for one more token)."""
        s = self._slot(slot)
        if s.length < len(s.prompt):
            raise EngineError(f"slot {slot}: decode before its prompt is prefilled")
        if s.length >= self.max_context:
            raise EngineError(f"slot {slot}: context {self.max_context} is full")
        self.model.kv.reserve(s.table, s.length + 1)
        return RowInput(s.table, (s.length,), (int(tok),))

    def add(self, slot: int, prompt_ids: Sequence[int], *, reuse_prefix: bool = True) -> None:
        """`Engine.add`; `reuse_prefix=False` prefills every prompt position (a request that
        wants the logits of its whole prompt, `prefill_all`)."""
        check_new_slot(slot, prompt_ids, self.max_batch, self.max_context, self._slots)
        table = self.model.kv.new_table()
        reuse = self.use_prefix and reuse_prefix
        reused = self.model.prefix.acquire(table, list(prompt_ids)) if reuse else 0
        self.prefix_tokens_skipped += reused
        self._slots[slot] = _Slot(list(prompt_ids), table, 0, reused)

    def prefill(self, chunks: Sequence[PrefillChunk]) -> np.ndarray:
        return self.prefill_all(chunks, ())[0]

    def prefill_all(
        self, chunks: Sequence[PrefillChunk], every_row: Sequence[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """`prefill`, and for each chunk index in `every_row` the logits of every position the
        chunk covers ([length, V], row j the logits after the chunk's j-th token): the rows the
        prefill rung's lm_head computes anyway. Positions the prefix cache held are not
        computed (their rows stay NaN): add such a slot with `reuse_prefix=False`."""
        m = self.model
        out = np.zeros((len(chunks), self.vocab_size), dtype=np.float32)
        keep = set(every_row)
        rows_out: dict[int, np.ndarray] = {
            i: np.full((chunks[i].length, self.vocab_size), np.nan, np.float32) for i in keep
        }
        first: dict[int, int] = {}  # chunk index -> its first position
        work: list[tuple[int, _Slot, int, int]] = []  # (chunk index, slot, start, stop)
        for i, c in enumerate(chunks):
            s = self._slot(c.slot)
            if c.length < 1 or s.cursor + c.length > len(s.prompt):
                raise EngineError(
                    f"slot {c.slot}: chunk of {c.length} at {s.cursor} crosses the prompt end "
                    f"({len(s.prompt)})"
                )
            stop = s.cursor + c.length
            first[i] = s.cursor
            start = max(s.cursor, s.length)  # positions the prefix cache holds are skipped
            s.cursor = stop
            if start < stop:
                work.append((i, s, start, stop))
        while work:
            head, rest = work[: m.max_prefill_batch], work[m.max_prefill_batch :]
            step = [(i, s, a, min(b, a + m.max_prefill_tokens)) for i, s, a, b in head]
            plan = m.plan(m.prefill_bucket(len(step), max(b - a for _, _, a, b in step)))
            rows: list[RowInput | None] = []
            for _, s, a, b in step:
                m.kv.reserve(s.table, b)
                rows.append(RowInput(s.table, tuple(range(a, b)), tuple(s.prompt[a:b])))
            m.write_inputs(plan, rows)
            m.dispatch(plan)
            logits = m.logits(plan)
            every = m.arena.view("lm_head") if keep else None
            nxt = []
            for r, ((i, s, a, b), (_, _, _, stop)) in enumerate(zip(step, head, strict=True)):
                if every is not None and i in keep:
                    rows_out[i][a - first[i] : b - first[i]] = every[r, : b - a]
                s.length = b
                if b == stop:
                    out[i] = logits[r]
                else:
                    nxt.append((i, s, b, stop))
            work = nxt + rest
        for c in chunks:
            s = self._slots[c.slot]
            if self.use_prefix and not s.registered and s.length == len(s.prompt):
                m.prefix.register(s.table, s.prompt)
                s.registered = True
        return out, rows_out

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        if len(slots) != len(tokens):
            raise EngineError("decode needs one token per slot")
        if not slots:
            return np.zeros((0, self.vocab_size), np.float32)
        m = self.model
        plan = m.plan(m.decode_bucket(max(slots) + 1))
        rows: list[RowInput | None] = [None] * plan.batch
        for slot, tok in zip(slots, tokens, strict=True):
            rows[slot] = self._decode_row(slot, tok)
        m.write_inputs(plan, rows)
        m.dispatch(plan)
        logits = m.logits(plan)
        for slot in slots:
            self._slots[slot].length += 1
        return np.stack([logits[s] for s in slots])

    def decode_sampled(
        self,
        slots: Sequence[int],
        tokens: Sequence[int],
        params: Sequence[SamplingParams],
        rngs: Sequence[np.random.Generator | None],
    ) -> np.ndarray:
        """`decode`, sampling on the device: one launch whose step epilogue samples each row
        (greedy fused into the lm_head reduction; a stochastic row draws one number from its
        own generator, as `plow.runtime.sampler.sample_row` on the host would); token ids
        [len(slots)] out, no logits row read back (`plow.runtime.engine.SamplingEngine`)."""
        if not len(slots) == len(tokens) == len(params) == len(rngs):
            raise EngineError("decode_sampled needs one token, params and rng per slot")
        if not slots:
            return np.zeros(0, np.int64)
        m = self.model
        plan = m.plan(m.decode_bucket(max(slots) + 1))
        rows: list[RowInput | None] = [None] * plan.batch
        dev: list[RowDevice | None] = [None] * plan.batch
        for slot, tok, p, g in zip(slots, tokens, params, rngs, strict=True):
            rows[slot] = self._decode_row(slot, tok)
            dev[slot] = RowDevice(p, g, 1)
        ring = m.run_quantum(plan, rows, dev, 1)
        for slot in slots:
            self._slots[slot].length += 1
        return np.array([int(ring[0, s]) for s in slots], dtype=np.int64)

    def free(self, slot: int) -> None:
        s = self._slots.pop(slot, None)
        if s is not None:
            self.model.prefix.release(s.table)

    def kv_usage(self) -> KVUsage:
        pool = self.model.kv.pool
        used = pool.num_blocks - pool.num_empty - pool.num_evictable
        free, total = self.model.kv.free_state_slots, self.model.arena.state_shape.slots
        held = total - len(free) if free is not None else 0
        return KVUsage(used, pool.num_blocks, self.model.block_size, held, total if free else 0)

    def positions(self, slot: int) -> int:
        return self._slot(slot).length


@dataclass
class CpuRunner:
    """The harness's `Runner` on the CPU executor: rows are slots 0..n-1 of a `CpuEngine`."""

    engine: CpuEngine
    rows: int = 0

    @classmethod
    def from_bundle(
        cls, bundle: Bundle | Path | str, *, max_batch: int | None = None, **kw: Any
    ) -> CpuRunner:
        return cls(CpuEngine.from_bundle(bundle, max_batch=max_batch, **kw))

    @property
    def executor(self) -> str:
        return self.engine.model.executor_name

    @property
    def max_batch(self) -> int:
        return self.engine.max_batch

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def prefill(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        if not 1 <= len(rows) <= self.max_batch:
            raise ValueError(f"batch of {len(rows)} rows outside 1..{self.max_batch}")
        for s in range(self.rows):
            self.engine.free(s)
        for s, r in enumerate(rows):
            self.engine.add(s, [int(t) for t in r])
        self.rows = len(rows)
        return self.engine.prefill([PrefillChunk(s, len(r)) for s, r in enumerate(rows)])

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        if len(tokens) != self.rows:
            raise ValueError(f"{len(tokens)} tokens for a batch of {self.rows} rows")
        return self.engine.decode(list(range(self.rows)), [int(t) for t in tokens])

    def last_step_ns(self) -> int | None:
        return None


def generate_bundle(
    bundle: Bundle | Path | str,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    params: SamplingParams | None = None,
    stop_ids: tuple[int, ...] = (),
    multi_step: int = 1,
    verify: bool = True,
    kv_dtype: KVDtype = "float32",
) -> tuple[list[int], GenerationStats]:
    """One request through a bundle's packet streams (what `plow generate BUNDLE --executor
    cpu` runs, and a checkpoint after `compile_cached`). `kv_dtype` other than float32 is
    lossy (see `CpuModel`)."""
    if not prompt_ids:
        raise PlowError("prompt", "empty prompt")
    model = CpuModel.from_bundle(bundle, max_batch=1, verify=verify, kv_dtype=kv_dtype)
    return generate_request(model, prompt_ids, max_new_tokens, params, stop_ids, multi_step)


def generate_request(
    model: CpuModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams | None,
    stop_ids: tuple[int, ...],
    multi_step: int,
) -> tuple[list[int], GenerationStats]:
    """One request on a bundle model of any executor (cpu, native, cuda share the host side)."""
    if len(prompt_ids) + max_new_tokens > model.context:
        raise PlowError(
            "--max-new-tokens",
            f"prompt {len(prompt_ids)} + {max_new_tokens} new tokens exceed the bundle's "
            f"context {model.context}",
        )
    stats = GenerationStats()
    req = Request(
        tuple(int(t) for t in prompt_ids), max_new_tokens, params or SamplingParams(), stop_ids
    )
    out = generate(model, [req], multi_step=multi_step, stats=stats)
    return out[0], stats
