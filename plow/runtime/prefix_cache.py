"""Prefix cache over full token blocks of the paged key-value cache.

A prompt's full blocks are named by a chain hash: block i's hash is
``sha256(hash(i-1) || tokens of block i as int64)``, with block -1's hash derived from a salt
(e.g. model and adapter identity), so a hash names the whole prefix up to and including its
block, not just the block's tokens. A new request looks up the longest run of leading block
hashes that are cached, takes a reference on those blocks and starts its page table with them:
their prefill work is skipped, and `acquire` returns how many tokens that is.

What a cached prefix is physically. The arena is head-major — ``[layers, 2, blocks, kv_heads,
block_size, head_dim]`` — so a prefix is not one contiguous range: for every layer and for K and
V, each of its blocks contributes one run per key-value head, at the same offset inside every
head's slot (rows ``0 .. block_size-1`` of that head), the heads ``block_size * head_dim``
elements apart. Sharing a prefix means sharing that set of strided runs; the page table just
names the blocks, and attention for head h reads the same offset in head h's slot of each block
whichever request it serves. `PagedKVCache.prefix_runs` lists the runs.

Lifetime. A cached block stays cached while any request references it and, after its last
reference is released, as an *idle cached* block until the pool needs room: the `BlockPool`
evicts idle cached blocks least-recently-released first, only when no empty block is left, and
never a referenced block. An evicted block's hash is forgotten here (the pool calls back).

Only full blocks are shared, and a lookup always leaves at least one prompt token to compute so
the request gets logits for its last position; shared blocks are read-only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plow.runtime.kv_cache import KVCacheError, PagedKVCache, PageTable

__all__ = ["PrefixCache", "PrefixCacheStats"]


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counts since the cache was created."""

    lookups: int
    prompt_tokens: int
    reused_tokens: int
    cached_blocks: int
    evictions: int


class PrefixCache:
    """Chain-hashed index from prompt prefixes to blocks of `cache`'s pool."""

    def __init__(self, cache: PagedKVCache, salt: bytes = b"") -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self._root = hashlib.sha256(b"plow-prefix-cache\0" + salt).digest()
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lookups = self._prompt_tokens = self._reused = self._evictions = 0
        cache.pool.set_evict_hook(self._evicted)

    # -- hashing -------------------------------------------------------------------------
    def block_hashes(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Chain hashes of the full blocks of `tokens` (a trailing partial block has none)."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        bs = self.block_size
        out: list[bytes] = []
        prev = self._root
        for i in range(toks.shape[0] // bs):
            prev = hashlib.sha256(prev + toks[i * bs:(i + 1) * bs].tobytes()).digest()
            out.append(prev)
        return out

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """Blocks of the longest cached chain of leading full blocks (no counts change)."""
        blocks: list[int] = []
        for h in self.block_hashes(tokens):
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    # -- request lifecycle ---------------------------------------------------------------
    def acquire(self, table: PageTable, prompt: Sequence[int] | np.ndarray) -> int:
        """Start an empty `table` with the cached blocks of `prompt`'s longest cached prefix,
        taking a reference on each. Returns the number of prompt tokens whose keys and values
        are already there (a multiple of block_size, always < len(prompt)); prefill starts at
        that position."""
        if table.blocks:
            raise KVCacheError("page table", "acquire wants an empty page table")
        n = len(prompt)
        if self.cache.free_state_slots is not None:  # recurrent state: see `register`
            self._lookups += 1
            self._prompt_tokens += n
            return 0
        blocks = self.lookup(prompt)[: max(n - 1, 0) // self.block_size]
        for b in blocks:
            self.cache.pool.incref(b)
        table.blocks.extend(blocks)
        reused = len(blocks) * self.block_size
        self._lookups += 1
        self._prompt_tokens += n
        self._reused += reused
        return reused

    def register(self, table: PageTable, tokens: Sequence[int] | np.ndarray) -> int:
        """Index the full blocks of `tokens` — the tokens whose keys and values `table` now
        holds, in order — so later requests can reuse them. A block whose prefix is already
        cached under another block stays private. Returns how many blocks became cached."""
        if self.cache.free_state_slots is not None:
            # a model with recurrent state (Mamba-2): a prefix is its state after the prefix,
            # which no block holds; prefix caching is off for it (no state snapshots yet)
            return 0
        hashes = self.block_hashes(tokens)
        if len(hashes) > len(table.blocks):
            raise KVCacheError(
                "tokens", f"{len(tokens)} tokens but the table holds {table.capacity}"
            )
        added = 0
        for h, b in zip(hashes, table.blocks, strict=False):
            known = self._block_of.get(h)
            if known is not None:
                continue  # already cached (this block, or a twin computed concurrently)
            if b in self._hash_of:
                raise KVCacheError("block", f"block {b} is cached under a different prefix")
            self._block_of[h] = b
            self._hash_of[b] = h
            self.cache.pool.mark_cached(b)
            added += 1
        return added

    def release(self, table: PageTable) -> None:
        """End of request: drop its references (cached blocks become idle, not free)."""
        self.cache.release(table)

    # -- internals -----------------------------------------------------------------------
    def _evicted(self, block: int) -> None:
        h = self._hash_of.pop(block)
        del self._block_of[h]
        self._evictions += 1

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self._lookups, self._prompt_tokens, self._reused, len(self._hash_of), self._evictions
        )

    def check_invariants(self) -> None:
        """The index and the pool agree; every block is in exactly one pool state."""
        pool = self.cache.pool
        pool.check_invariants()
        assert len(self._block_of) == len(self._hash_of)
        for h, b in self._block_of.items():
            assert self._hash_of[b] == h
            assert pool.is_cached(b), f"indexed block {b} not flagged cached in the pool"
        for b in range(pool.num_blocks):
            if pool.is_cached(b):
                assert b in self._hash_of, f"pool flags block {b} cached but it is not indexed"
