"""`CpuModel`: one model on the CPU executor — fp32 weights, the ladder of compiled buckets, the
arena with the paged key-value pool, the prefix cache, and one launch per step.

The host's part of a step is small and explicit (`Launch`): it writes the inputs that change
between steps (positions, page tables, sampled-row indices, and token ids only where the
device does not already hold them), dispatches the bucket's packet stream, and reads what it
streams out. The device-side epilogue of a step (`_epilogue`) samples stochastic rows from the
logits in the arena, appends each row's token to the token ring, and advances positions, so a
multi-step quantum runs several steps with no host work in between.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from plow.checkpoint import ModelSpec
from plow.errors import PlowError
from plow.graph import Bucket, Phase, TensorRole, build_graph
from plow.graph.mla import kv_halves
from plow.graph.shard import pool_kv_heads
from plow.runtime.cpu.arena import Arena, KVShape, StateShape
from plow.runtime.cpu.machine import DispatchStats, Machine, Mode
from plow.runtime.cpu.plan import (
    PAGE_TABLE,
    REMAINING,
    RING,
    STATE_SLOT,
    Plan,
    fuse_argmax,
    plan_from_parts,
)
from plow.runtime.kv_cache import KVDtype, PagedKVCache, PageTable
from plow.runtime.prefix_cache import PrefixCache
from plow.runtime.sampler import SamplingParams, sample_row
from plow.schedule import ScheduleOptions, build_schedule
from plow.target import Target, load_target
from plow.tiles import TilingOptions, tile_graph

if TYPE_CHECKING:
    from plow.runtime.cpu.bundle import ArenaMode, Bundle

F32 = np.float32


def round_up(value: int, rungs: Sequence[int]) -> int:
    """The smallest rung >= value (the ladder's rule); `PlowError` when none covers it."""
    for r in sorted(rungs):
        if r >= value:
            return r
    raise PlowError("ladder", f"{value} exceeds the largest rung {max(rungs)}")


def _pow2_rungs(top: int, start: int = 1) -> tuple[int, ...]:
    out, r = [], start
    while r < top:
        out.append(r)
        r *= 2
    out.append(top)
    return tuple(sorted(set(out)))


def state_shape(spec: ModelSpec, slots: int) -> StateShape:
    """The arena's recurrent-state region of `spec` (empty without recurrent layers): the
    graph's state tensors (`TensorRole.state`, [B, ...] per batch row there) in graph order,
    each one block per slot (Mamba-2: `L<n>.conv_state`, `L<n>.ssm_state`; Kimi-Linear's KDA
    layers: `L<n>.conv_state`, `L<n>.kda_state`)."""
    graph = build_graph(spec, Bucket.decode(1, 1))
    tensors = tuple(
        (name, t.shape[1:]) for name, t in graph.tensors.items() if t.role is TensorRole.state
    )
    return StateShape(slots, tensors) if tensors else StateShape()


@dataclass(frozen=True, slots=True)
class RowInput:
    """One batch row of a launch: the request's page table, the positions this step feeds
    (contiguous), and their token ids (None: the device already holds the id in the ids
    slot — a decode row continuing from the previous step)."""

    table: PageTable
    positions: tuple[int, ...]
    ids: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class RowDevice:
    """What the device epilogue needs per row in a quantum: sampling and stopping."""

    params: SamplingParams
    rng: np.random.Generator | None
    remaining: int  # tokens the row may still produce
    stop_ids: tuple[int, ...] = ()


class CpuModel:
    """See the module docstring. `target` plans the buckets (default: the `cpu` target);
    `mode`/`seed`/`check` configure the machine (interleaving, checking mode); `kv_dtype`
    the key-value pool's storage (float32 default; bfloat16 / fp8_e4m3 are opt-in and
    lossy); `fuse_argmax` fuses greedy sampling into the lm_head tasks of the plans compiled
    here in memory (`plan.fuse_argmax`; the same tokens, bit for bit, without the sample op's
    scan of the logits). A bundle's plans run as the compiler fused them (its op table's
    `argmax` and packets' FUSED_ARGMAX, plow/bundle/argmax.py); `fuse_argmax` does not apply."""

    executor_name = "cpu"  # the executor this model is (engines and runners report it)

    def __init__(
        self,
        spec: ModelSpec,
        weights: Mapping[str, np.ndarray],
        *,
        target: str | Target = "cpu",
        max_batch: int = 8,
        max_context: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        ring: int = 8,
        mode: Mode = "round_robin",
        seed: int = 0,
        check: bool = False,
        schedule_options: ScheduleOptions | None = None,
        kv_dtype: KVDtype = "float32",
        fuse_argmax: bool = True,
        tp: int = 1,
    ) -> None:
        self.spec = spec
        self.fuse_argmax = fuse_argmax
        self.target = load_target(target) if isinstance(target, str) else target
        self.max_batch = max_batch
        self.context = min(spec.max_position, max_context or spec.max_position)
        self.block_size = block_size
        self.ring = ring
        self.schedule_options = schedule_options
        self.decode_batches = _pow2_rungs(max_batch)
        self.prefill_seqs = _pow2_rungs(self.context, 8)
        per_row = -(-self.context // block_size)
        blocks = num_blocks or 2 * max_batch * per_row
        names = {n for n in weights}
        self.weights: dict[str, np.ndarray] = {}
        self._raw = weights
        self._names = names
        self.kv_dtype: KVDtype = kv_dtype
        # tensor parallel (plow/graph/shard.py): device d's heads of layer n are pool layer
        # n * tp + d, its part of the key-value heads (the largest part sizes the pool)
        layers, kv_heads = spec.num_layers * tp, pool_kv_heads(spec.num_kv_heads, tp)
        halves = kv_halves(spec)  # 1: latent attention's values are its keys, stored once
        kv = KVShape(layers, blocks, kv_heads, block_size, spec.head_dim, kv_dtype, halves)
        state = state_shape(spec, max_batch)
        self.arena = Arena(kv, state=state)
        self.kv = PagedKVCache(
            layers, kv_heads, spec.head_dim, block_size, blocks, kv_dtype, halves
        )
        if state.tensors:
            self.kv.use_state_slots(state.slots)  # one per request a launch may hold
        self.kv.arena = self.arena.kv  # the pool's storage is the arena's key-value region
        # fp8: the executor's scales are per row, in the arena (`Arena.kv_scale`, written by
        # the attention kernel); the cache's own per-(block, head) scales are not used
        self.kv.scales = self.kv._amax = None
        self.prefix = PrefixCache(self.kv, salt=f"{spec.family}:{id(weights)}".encode())
        self.machine = Machine(self.arena, self.weights, mode=mode, seed=seed, check=check)
        self.plans: dict[Bucket, Plan] = {}
        self.last_plan: Plan | None = None
        self.steps = 0
        self.tasks_run = 0
        self.bundle: Bundle | None = None
        self.bundle_arena: ArenaMode = "bundle"

    @classmethod
    def from_bundle(
        cls,
        bundle: Bundle | Path | str,
        *,
        max_batch: int | None = None,
        max_context: int | None = None,
        verify: bool = True,
        arena: ArenaMode = "bundle",
        **kw: object,
    ) -> CpuModel:
        """A model whose plans are the bundle's rungs, loaded from its files (the ladder, the
        packet streams, the arena offsets, the memory-mapped weights; see
        `plow.runtime.cpu.bundle`). `verify=False` skips the hash and certificate checks;
        `arena="private"` gives every tensor its own words (diagnosis; default: the bundle's
        offsets)."""
        from plow.bundle.ladder import round_up as rung_for
        from plow.runtime.cpu.bundle import Bundle as _Bundle

        b = bundle if isinstance(bundle, _Bundle) else _Bundle.open(bundle, verify=verify)
        decode = [r for r in b.ladder if r.phase is Phase.decode]
        if not decode:
            raise PlowError(b.path, "the bundle has no decode bucket: the executor needs one")
        top = max(r.batch for r in decode)
        ctx = max(r.context for r in decode)
        batch = min(max_batch or top, top)
        rung_for(b.ladder, Phase.decode, batch, 1)  # some rung covers the batch
        m = cls(
            b.spec,
            b.weights,
            max_batch=batch,
            max_context=min(max_context or ctx, ctx),
            tp=b.tp,
            **kw,  # type: ignore[arg-type]
        )
        m.bundle = b
        m.bundle_arena = arena
        m.decode_batches = tuple(sorted({r.batch for r in decode}))
        prefill = [r for r in b.ladder if r.phase is Phase.prefill]
        m.prefill_seqs = tuple(sorted({r.seq for r in prefill})) or (1,)
        return m

    # -- plans ---------------------------------------------------------------------------
    def _weight(self, name: str) -> None:
        if name not in self.weights:
            self.weights[name] = np.ascontiguousarray(np.asarray(self._raw[name], dtype=F32))

    def plan(self, bucket: Bucket) -> Plan:
        """The plan of `bucket`: loaded from the bundle's files (a bundle model), else
        compiled on first use, in memory."""
        p = self.plans.get(bucket)
        if p is None and self.bundle is not None:
            # greedy fused into lm_head as the compiler decided it (the bundle's op table and
            # FUSED_ARGMAX flags, certified by E / D / F): run as loaded, no transform
            p = self.bundle.plan(
                bucket, kv=self.arena.kv_shape, ring=self.ring, arena=self.bundle_arena
            )
            self.add_plan(p)
        elif p is None:
            graph = build_graph(self.spec, bucket)
            tg = tile_graph(graph, self.target, TilingOptions())
            sched = build_schedule(tg, graph, self.target, self.schedule_options)
            p = plan_from_parts(bucket, graph, tg, sched, self.arena.kv_shape, self.ring)
            if self.fuse_argmax:
                p = fuse_argmax(p)
            self.add_plan(p)
        return p

    def add_plan(self, p: Plan) -> None:
        """Install a plan (compiled here, or loaded from a bundle / mutated by a test)."""
        for name, t in p.graph.tensors.items():
            if t.role.value == "weight":
                self._weight(name)
        if self.arena.grow(p.layout.words):
            self.kv.arena = self.arena.kv
        self.plans[p.bucket] = p

    def decode_bucket(self, rows: int) -> Bucket:
        if self.bundle is not None:
            from plow.bundle.ladder import round_up as rung_for

            return rung_for(self.bundle.ladder, Phase.decode, rows, self.context)
        return Bucket.decode(round_up(rows, self.decode_batches), self.context)

    def prefill_bucket(self, rows: int, tokens: int) -> Bucket:
        """The bucket of a prefill launch of `rows` rows (at most `max_prefill_batch`) of up
        to `tokens` tokens (at most `max_prefill_tokens`). A bundle without prefill rungs
        prefills through its decode rungs, one token per row and launch."""
        if self.bundle is not None:
            from plow.bundle.ladder import round_up as rung_for

            if not self._bundle_prefill:
                return self.decode_bucket(rows)
            return rung_for(self.bundle.ladder, Phase.prefill, rows, tokens)
        return Bucket.prefill(
            round_up(rows, self.decode_batches), round_up(tokens, self.prefill_seqs), self.context
        )

    @property
    def _bundle_prefill(self) -> list[Bucket]:
        assert self.bundle is not None
        return [r for r in self.bundle.ladder if r.phase is Phase.prefill]

    @property
    def max_prefill_tokens(self) -> int:
        return max(self.prefill_seqs)

    @property
    def max_prefill_batch(self) -> int:
        """Rows one prefill launch can hold (a bundle's prefill rungs may be narrower than
        its decode rungs: callers split their rows)."""
        if self.bundle is not None and self._bundle_prefill:
            return min(self.max_batch, max(r.batch for r in self._bundle_prefill))
        return self.max_batch

    # -- one launch ----------------------------------------------------------------------
    def write_inputs(self, plan: Plan, rows: Sequence[RowInput | None]) -> None:
        """Host → arena: ids (where given), positions, sample index, page tables."""
        if len(rows) > plan.batch:
            raise PlowError(plan.bucket.name, f"{len(rows)} rows exceed batch {plan.batch}")
        if self.arena.layout is not plan.layout:
            self.arena.use(plan.layout)
            self.kv.arena = self.arena.kv
            self.last_plan = None  # another bucket ran: the ids slot holds no device tokens
        B, T = plan.batch, plan.tokens
        ids = self.arena.view("ids")
        pos = self.arena.view("positions")
        sidx = self.arena.view("sample_index")
        table = self.arena.view(PAGE_TABLE)
        slots = self.arena.view(STATE_SLOT) if STATE_SLOT in plan.layout.slots else None
        pos[:] = -1
        sidx[:] = 0
        table[:] = 0
        if slots is not None:
            slots[:] = 0
        for b in range(B):
            r = rows[b] if b < len(rows) else None
            if r is None:
                ids[b, :] = 0  # a padded row still embeds: give it a valid id
                continue
            n = len(r.positions)
            if not 1 <= n <= T:
                raise PlowError(plan.bucket.name, f"row {b}: {n} tokens, bucket holds {T}")
            if r.positions[-1] >= self.context:
                raise PlowError(plan.bucket.name, f"row {b}: position beyond {self.context}")
            if r.table.capacity <= r.positions[-1]:
                raise PlowError(plan.bucket.name, f"row {b}: page table too short")
            pos[b, :n] = r.positions
            sidx[b] = n - 1
            nb = min(len(r.table.blocks), table.shape[1])  # no attention: a 1-wide table
            table[b, :nb] = r.table.blocks[:nb]
            if slots is not None:
                if r.table.state_slot < 0:
                    raise PlowError(plan.bucket.name, f"row {b}: no recurrent-state slot")
                slots[b] = r.table.state_slot
            if r.ids is not None:
                ids[b, :n] = r.ids
                ids[b, n:] = 0
            elif self.last_plan is not plan:
                raise PlowError(plan.bucket.name, f"row {b}: no ids given and none on device")

    def dispatch(self, plan: Plan, **kw: object) -> DispatchStats:
        st = self.machine.dispatch(plan, **kw)  # type: ignore[arg-type]
        self.last_plan = plan
        self.steps += 1
        self.tasks_run += st.tasks
        return st

    def logits(self, plan: Plan) -> np.ndarray:
        """logits[B, V] of each row's sampled position (a copy)."""
        lg = self.arena.view("lm_head")
        sidx = self.arena.view("sample_index")
        return np.array(lg[np.arange(plan.batch), sidx])

    def sampled(self, plan: Plan) -> np.ndarray:
        return np.array(self.arena.view("sample").reshape(-1)[: plan.batch])

    def _epilogue(self, plan: Plan, i: int, dev: Sequence[RowDevice | None]) -> None:
        """Device-side end of step `i` of a quantum: stochastic rows sample from the logits in
        the arena, each row's token goes to the ring, positions advance, rows out of budget or
        at a stop id turn into padding."""
        out = self.arena.view("sample").reshape(-1)
        pos = self.arena.view("positions")
        ring = self.arena.view(RING)
        rem = self.arena.view(REMAINING)
        lg = self.arena.view("lm_head")
        sidx = self.arena.view("sample_index")
        for b in range(plan.batch):
            d = dev[b] if b < len(dev) else None
            if d is None or pos[b, 0] < 0 or rem[b] <= 0:
                ring[i, b] = -1
                if plan.tokens == 1:
                    pos[b, 0] = -1
                continue
            if not d.params.is_greedy:
                out[b] = sample_row(lg[b, sidx[b]], d.params, d.rng)
            tok = int(out[b])
            ring[i, b] = tok
            rem[b] -= 1
            if plan.tokens == 1:
                p = int(pos[b, 0]) + 1
                pos[b, 0] = -1 if rem[b] == 0 or tok in d.stop_ids or p >= self.context else p

    def run_quantum(
        self,
        plan: Plan,
        rows: Sequence[RowInput | None],
        dev: Sequence[RowDevice | None],
        steps: int,
        **kw: object,
    ) -> np.ndarray:
        """Write the inputs once, run `steps` dispatches back to back (decode) or one
        (prefill), and read the token ring: tokens[steps, B] (-1: no token)."""
        if not 1 <= steps <= plan.ring:
            raise PlowError("multi-step", f"quantum {steps} outside 1..{plan.ring}")
        if plan.tokens > 1 and steps != 1:
            raise PlowError("multi-step", "a prefill launch is one step")
        self.write_inputs(plan, rows)
        rem = self.arena.view(REMAINING)
        rem[:] = 0
        for b, d in enumerate(dev):
            if d is not None:
                rem[b] = d.remaining
        for i in range(steps):
            self.dispatch(plan, **kw)
            self._epilogue(plan, i, dev)
        return np.array(self.arena.view(RING)[:steps, : plan.batch])

    def context_full(self, position: int) -> bool:
        return position >= self.context

    @property
    def lossy(self) -> bool:
        """True when the key-value pool rounds what attention stores (not float32)."""
        return self.kv_dtype != "float32"

    @property
    def weight_bytes(self) -> int:
        """fp32 bytes of the weights a step reads (each tensor once)."""
        return sum(int(math.prod(self._raw[n].shape)) * 4 for n in self._names)
