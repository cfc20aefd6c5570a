"""Paged key-value cache: a block pool with reference counts, per-request page tables, and
head-major storage in one arena.

Storage is one numpy array (the arena) of shape
``[layers, halves, num_blocks, kv_heads, block_size, head_dim]`` — index 0 of the second axis
holds keys, 1 values; a pool whose values are its keys (latent attention,
`plow.graph.mla.kv_halves`) has one half: each token's row is stored once and read as both.
Inside a block each key-value head owns a contiguous slot of
``block_size * head_dim`` elements (head-major), so attention for one head reads, per block, one
run of ``block_size * head_dim`` elements at offset ``head * block_size * head_dim`` in the block.

A request's `PageTable` lists its block ids; logical position ``p`` lives in block
``blocks[p // block_size]`` at slot ``p % block_size``. `PagedKVCache.write` stores new keys and
values straight at those destinations (no staging buffer, no copy pass) and `gather` returns
the ``[kv_heads, L, head_dim]`` view attention consumes.

`BlockPool` owns only ids and counts. A block is in exactly one of three states:
*referenced* (count > 0), *empty* (count 0, on the free list) or *idle cached* (count 0, holding
a prefix-cache entry, on an LRU list). Allocation takes empty blocks first and then evicts idle
cached blocks, least recently released first; a referenced block is never handed out. When
neither is left the pool raises `OutOfBlocks`, which the serving layer turns into backpressure.

fp8 (``dtype="fp8_e4m3"``) is opt-in and lossy: see `PagedKVCache` and `measure_fp8_error`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import ml_dtypes
import numpy as np

from plow.errors import PlowError

__all__ = [
    "BlockPool",
    "Fp8Error",
    "KVCacheError",
    "KVDtype",
    "OutOfBlocks",
    "PageTable",
    "PagedKVCache",
    "StridedRun",
    "measure_fp8_error",
]

KVDtype = Literal["float32", "bfloat16", "fp8_e4m3"]
_STORAGE: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
}
FP8_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def _pow2_scale(amax: np.ndarray) -> np.ndarray:
    """The smallest power of two s with amax / s <= 448 (1 where amax is 0)."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0)))
    return np.ldexp(np.float32(1.0), e.astype(np.int32)).astype(np.float32)


class KVCacheError(PlowError):
    """Misuse of the key-value cache (bad shape, position beyond the page table, ...)."""


class OutOfBlocks(KVCacheError):
    """The pool cannot supply `requested` blocks: only `available` are free or evictable."""

    exit_code = 1

    def __init__(self, requested: int, available: int) -> None:
        self.requested = requested
        self.available = available
        super().__init__(
            "kv block pool", f"out of blocks: need {requested}, {available} free or evictable"
        )


class BlockPool:
    """Block ids ``0 .. num_blocks-1`` with reference counts, a free list and an LRU of idle
    cached blocks (see the module docstring for the three states)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise KVCacheError("num_blocks", f"must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._empty: deque[int] = deque(range(num_blocks))
        self._idle: OrderedDict[int, None] = OrderedDict()  # idle cached, LRU first
        self._cached: set[int] = set()
        self._on_evict: Callable[[int], None] | None = None

    # -- queries -------------------------------------------------------------------------
    @property
    def num_empty(self) -> int:
        return len(self._empty)

    @property
    def num_evictable(self) -> int:
        return len(self._idle)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can obtain: empty plus idle cached."""
        return len(self._empty) + len(self._idle)

    def refcount(self, block: int) -> int:
        return self._ref[self._check(block)]

    def is_cached(self, block: int) -> bool:
        return self._check(block) in self._cached

    def is_idle_cached(self, block: int) -> bool:
        return block in self._idle

    def _check(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise KVCacheError("block", f"id {block} out of range [0, {self.num_blocks})")
        return block

    # -- allocation ----------------------------------------------------------------------
    def set_evict_hook(self, hook: Callable[[int], None] | None) -> None:
        """`hook(block)` runs when an idle cached block is reclaimed for a new owner."""
        self._on_evict = hook

    def allocate(self, n: int = 1) -> list[int]:
        """n blocks, each with count 1; all or nothing. Evicts idle cached blocks (LRU) only
        once no empty block is left."""
        if n < 0:
            raise KVCacheError("n", f"must be >= 0, got {n}")
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        out: list[int] = []
        for _ in range(n):
            if self._empty:
                b = self._empty.popleft()
            else:
                b, _ = self._idle.popitem(last=False)
                self._cached.discard(b)
                if self._on_evict is not None:
                    self._on_evict(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def incref(self, block: int) -> None:
        """One more owner. An idle cached block is revived (leaves the LRU)."""
        b = self._check(block)
        if self._ref[b] == 0:
            if b not in self._idle:
                raise KVCacheError("block", f"incref of free block {b}")
            del self._idle[b]
        self._ref[b] += 1

    def decref(self, block: int) -> None:
        """One owner fewer. At zero a cached block becomes idle (most recently used end of the
        LRU); an uncached one goes back to the free list."""
        b = self._check(block)
        if self._ref[b] <= 0:
            raise KVCacheError("block", f"decref of unreferenced block {b}")
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if b in self._cached:
                self._idle[b] = None
            else:
                self._empty.append(b)

    def mark_cached(self, block: int) -> None:
        """Flag a referenced block as holding a prefix-cache entry."""
        b = self._check(block)
        if self._ref[b] == 0:
            raise KVCacheError("block", f"only a referenced block can be cached; {b} is free")
        self._cached.add(b)

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is in exactly one state."""
        empty = set(self._empty)
        idle = set(self._idle)
        assert len(empty) == len(self._empty), "duplicate on the free list"
        assert not (empty & idle), f"blocks both empty and idle cached: {sorted(empty & idle)}"
        assert idle <= self._cached, "idle block not flagged cached"
        assert not (empty & self._cached), "empty block flagged cached"
        for b, r in enumerate(self._ref):
            assert r >= 0, f"negative count on block {b}"
            free = b in empty or b in idle
            assert (r > 0) != free, f"block {b}: count {r}, free={free}"


@dataclass(slots=True)
class PageTable:
    """One request's blocks, in logical order. Position p -> (blocks[p // bs], p % bs)."""

    block_size: int
    blocks: list[int] = field(default_factory=list)
    # the request's recurrent-state slot (models with state: Mamba-2), -1: none
    state_slot: int = -1

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def locate(self, position: int) -> tuple[int, int]:
        if not 0 <= position < self.capacity:
            raise KVCacheError(
                "position", f"{position} outside the page table [0, {self.capacity})"
            )
        return self.blocks[position // self.block_size], position % self.block_size

    def blocks_for(self, length: int) -> int:
        """How many blocks hold `length` tokens."""
        return -(-length // self.block_size)


@dataclass(frozen=True, slots=True)
class StridedRun:
    """`count` runs of `length` elements starting at `offset` in the flat arena, `stride`
    elements apart (one run per key-value head)."""

    offset: int
    length: int
    stride: int
    count: int


@dataclass(frozen=True, slots=True)
class Fp8Error:
    """fp8 round-trip error against fp32 over the data measured.

    max_abs: largest |x - dequant(quant(x))|.
    max_rel_amax: largest error divided by the amax of its (block, head) scale group.
    max_rel: largest error divided by |x| over elements with |x| >= 1e-2 * amax of the group.
    rms_rel: root-mean-square error divided by root-mean-square of x.
    """

    max_abs: float
    max_rel_amax: float
    max_rel: float
    rms_rel: float


class PagedKVCache:
    """The arena of key and value blocks for every layer, plus its `BlockPool`.

    dtype: "float32" (default, exact), "bfloat16", or "fp8_e4m3".

    fp8_e4m3 is LOSSY and opt-in. Each (layer, K/V, block, head) group has its own fp32 scale
    in `scales`: the smallest power of two ``s`` with ``amax / s <= 448``, where ``amax`` is the
    largest magnitude written to the group so far. Values are stored as ``x / s`` rounded to
    nearest e4m3 (3 mantissa bits: a value in e4m3's normal range, i.e. any value above
    ``amax * 2**-14``, errs by at most ``2**-4`` of itself). When a later write raises a group's
    amax past its scale, the group's stored values are rescaled by the power-of-two ratio, which
    is exact for normals — so incremental decode writes do not round a value twice, except for
    values that fall below the normal range. `measure_fp8_error` reports the error on given
    data; quote it alongside any memory saving.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: KVDtype = "float32",
        halves: int = 2,
    ) -> None:
        if halves not in (1, 2):
            raise KVCacheError("halves", f"must be 1 (values are keys) or 2, got {halves}")
        for name, val in (("num_layers", num_layers), ("kv_heads", kv_heads),
                          ("head_dim", head_dim), ("block_size", block_size)):
            if val <= 0:
                raise KVCacheError(name, f"must be > 0, got {val}")
        if dtype not in _STORAGE:
            raise KVCacheError("dtype", f"must be one of {sorted(_STORAGE)}, got {dtype!r}")
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype: KVDtype = dtype
        self.halves = halves
        self.pool = BlockPool(num_blocks)
        # recurrent-state slots not held by a table (None: the model has no state)
        self.free_state_slots: set[int] | None = None
        shape = (num_layers, halves, num_blocks, kv_heads, block_size, head_dim)
        self.arena = np.zeros(shape, dtype=_STORAGE[dtype])
        self.scales: np.ndarray | None = (
            np.ones((num_layers, halves, num_blocks, kv_heads), dtype=np.float32)
            if dtype == "fp8_e4m3" else None
        )
        self._amax: np.ndarray | None = (
            np.zeros((num_layers, halves, num_blocks, kv_heads), dtype=np.float32)
            if dtype == "fp8_e4m3" else None
        )

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def bytes_per_token(self) -> int:
        """Storage bytes one token takes across all layers (keys + values, without scales; one
        row per head and layer when the values are the keys)."""
        return self.num_layers * self.halves * self.kv_heads * self.head_dim * self.arena.itemsize

    # -- page tables ---------------------------------------------------------------------
    def new_table(self) -> PageTable:
        """A request's empty table; with recurrent state (`state_slots`), it also takes the
        lowest free state slot (`OutOfBlocks` when every slot is held)."""
        free = self.free_state_slots
        if free is None:
            return PageTable(self.block_size)
        if not free:
            raise OutOfBlocks(1, 0)
        slot = min(free)
        free.remove(slot)
        return PageTable(self.block_size, state_slot=slot)

    def use_state_slots(self, slots: int) -> None:
        """Give every new table one of `slots` recurrent-state slots; `release` frees it."""
        self.free_state_slots = set(range(slots))

    def reserve(self, table: PageTable, length: int) -> None:
        """Grow `table` so it holds `length` tokens; all or nothing (raises `OutOfBlocks`)."""
        need = table.blocks_for(length) - len(table.blocks)
        if need > 0:
            new = self.pool.allocate(need)
            if self._amax is not None and self.scales is not None:
                self._amax[:, :, new] = 0.0  # a reused block starts a fresh scale group
                self.scales[:, :, new] = 1.0
            table.blocks.extend(new)

    def release(self, table: PageTable) -> None:
        """Drop the request's reference on each block, last block first (so under LRU the tail
        of a cached prefix is evicted before its head), and empty the table."""
        for b in reversed(table.blocks):
            self.pool.decref(b)
        table.blocks.clear()
        free = self.free_state_slots
        if free is not None and table.state_slot >= 0:
            free.add(table.state_slot)  # a finished or dropped request frees its state
            table.state_slot = -1

    # -- data ----------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise KVCacheError("layer", f"{layer} outside [0, {self.num_layers})")

    def write(
        self,
        layer: int,
        table: PageTable,
        positions: Sequence[int] | np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
    ) -> None:
        """Store k, v of shape [kv_heads, T, head_dim] at logical `positions` [T] of `table`.

        Positions must be distinct, inside the table's capacity, and in blocks this request
        owns alone; a block held by the prefix cache is read-only. A one-half pool (values
        are keys) stores k only and refuses a v that differs from it.
        """
        self._check_layer(layer)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        t = pos.shape[0]
        want = (self.kv_heads, t, self.head_dim)
        if k.shape != want or v.shape != want:
            raise KVCacheError("k/v", f"want shape {want}, got {k.shape} and {v.shape}")
        if self.halves == 1 and not np.array_equal(k, v):
            raise KVCacheError("v", "this pool's values are its keys: v must equal k")
        if t == 0:
            return
        if pos.min() < 0 or pos.max() >= table.capacity:
            raise KVCacheError(
                "positions", f"range [{pos.min()}, {pos.max()}] outside [0, {table.capacity})"
            )
        if np.unique(pos).shape[0] != t:
            raise KVCacheError("positions", "positions repeat within one write")
        blocks = np.asarray(table.blocks, dtype=np.int64)[pos // self.block_size]
        slots = pos % self.block_size
        for b in np.unique(blocks):
            if self.pool.refcount(int(b)) != 1:
                raise KVCacheError(
                    "block", f"write into block {b} shared by {self.pool.refcount(int(b))} owners"
                )
            if self.pool.is_cached(int(b)):
                raise KVCacheError("block", f"write into block {b}, which the prefix cache holds")
        for kind, x in ((0, k), (1, v))[: self.halves]:
            rows = np.ascontiguousarray(np.asarray(x, dtype=np.float32).transpose(1, 0, 2))
            if self.dtype == "fp8_e4m3":
                self._write_fp8(layer, kind, blocks, slots, rows)
            else:
                # Advanced indices split by a slice: the indexed view is [T, kv_heads, head_dim].
                self.arena[layer, kind, blocks, :, slots, :] = rows.astype(self.arena.dtype)

    def _write_fp8(
        self, layer: int, kind: int, blocks: np.ndarray, slots: np.ndarray, rows: np.ndarray
    ) -> None:
        assert self.scales is not None and self._amax is not None
        store = self.arena[layer, kind]  # [NB, H, BS, D]
        for b in np.unique(blocks):
            sel = blocks == b
            group_amax = np.abs(rows[sel]).max(axis=(0, 2))  # [H]
            new_amax = np.maximum(self._amax[layer, kind, b], group_amax)
            old_scale = self.scales[layer, kind, b].copy()
            new_scale = _pow2_scale(new_amax)
            for h in np.flatnonzero((new_scale > old_scale) & (self._amax[layer, kind, b] > 0)):
                # Rescale what the group holds by a power of two: exact for e4m3 normals.
                ratio = np.float32(old_scale[h] / new_scale[h])
                store[b, h] = (store[b, h].astype(np.float32) * ratio).astype(store.dtype)
            new_scale = np.maximum(new_scale, old_scale)  # a scale never shrinks in place
            self._amax[layer, kind, b] = new_amax
            self.scales[layer, kind, b] = new_scale
            q = rows[sel] / new_scale[None, :, None]  # [t, H, D]
            store[b, :, slots[sel], :] = q.astype(store.dtype)

    def gather(self, layer: int, table: PageTable, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of positions [0, length): two fp32 arrays [kv_heads, length, d] (the
        same rows twice from a one-half pool)."""
        self._check_layer(layer)
        if not 0 <= length <= table.capacity:
            raise KVCacheError("length", f"{length} outside [0, {table.capacity}]")
        nb = table.blocks_for(length)
        ids = np.asarray(table.blocks[:nb], dtype=np.int64)
        out: list[np.ndarray] = []
        for kind in range(self.halves):
            blk = self.arena[layer, kind, ids].astype(np.float32)  # [nb, H, BS, D]
            if self.scales is not None:
                blk *= self.scales[layer, kind, ids][:, :, None, None]
            x = blk.transpose(1, 0, 2, 3).reshape(
                self.kv_heads, nb * self.block_size, self.head_dim
            )
            out.append(np.ascontiguousarray(x[:, :length]))
        return out[0], out[-1].copy() if self.halves == 1 else out[1]

    def prefix_runs(
        self, layer: int, kind: int, blocks: Sequence[int], tokens: int
    ) -> list[StridedRun]:
        """Where the first `tokens` tokens held in `blocks` live in the flat arena, for one
        layer and K (kind 0) or V (kind 1): one `StridedRun` per block, each made of one run per
        head at the same offset within every head's slot, heads `block_size * head_dim`
        elements apart. A full block's runs abut; a partial block's runs have gaps. A
        one-half pool's values are its keys: kind 1 names the key rows."""
        bs, d, h = self.block_size, self.head_dim, self.kv_heads
        block_elems = h * bs * d
        kind = min(kind, self.halves - 1)
        base = (layer * self.halves + kind) * self.num_blocks * block_elems
        runs: list[StridedRun] = []
        left = tokens
        for b in blocks:
            if left <= 0:
                break
            n = min(left, bs)
            runs.append(StridedRun(base + b * block_elems, n * d, bs * d, h))
            left -= n
        return runs


def measure_fp8_error(
    k: np.ndarray, v: np.ndarray, block_size: int = 16, chunks: Sequence[int] = ()
) -> Fp8Error:
    """fp8_e4m3 key-value error against fp32 on given data.

    k, v: [kv_heads, L, head_dim]. The data are written into a one-layer fp8 cache — in one
    write, or in successive writes of the sizes in `chunks` (e.g. a prefill then single-token
    decode steps, which exercises requantisation) — gathered back, and compared with the
    fp32 input.
    """
    kv_heads, length, head_dim = k.shape
    cache = PagedKVCache(1, kv_heads, head_dim, block_size, -(-length // block_size), "fp8_e4m3")
    table = cache.new_table()
    cache.reserve(table, length)
    sizes = list(chunks) if chunks else [length]
    if sum(sizes) != length:
        raise KVCacheError("chunks", f"sizes sum to {sum(sizes)}, data has {length} positions")
    start = 0
    for n in sizes:
        sl = slice(start, start + n)
        cache.write(0, table, np.arange(start, start + n), k[:, sl], v[:, sl])
        start += n
    gk, gv = cache.gather(0, table, length)
    max_abs = max_rel_amax = max_rel = 0.0
    se = ss = 0.0
    for ref, got in ((k, gk), (v, gv)):
        ref64 = ref.astype(np.float64)
        err = np.abs(got.astype(np.float64) - ref64)
        pad = (-length) % block_size
        amax_tok = np.abs(np.pad(ref64, ((0, 0), (0, pad), (0, 0))))
        amax_grp = amax_tok.reshape(kv_heads, -1, block_size * head_dim).max(axis=2)  # [H, nb]
        amax = np.repeat(amax_grp, block_size, axis=1)[:, :length, None]
        max_abs = max(max_abs, float(err.max()))
        with np.errstate(divide="ignore", invalid="ignore"):
            max_rel_amax = max(max_rel_amax, float(np.nanmax(np.where(amax > 0, err / amax, 0.0))))
            big = np.abs(ref64) >= 1e-2 * amax
            if big.any():
                max_rel = max(max_rel, float((err[big] / np.abs(ref64[big])).max()))
        se += float((err * err).sum())
        ss += float((ref64 * ref64).sum())
    return Fp8Error(max_abs, max_rel_amax, max_rel, float(np.sqrt(se / ss)) if ss > 0 else 0.0)
