"""Prefix cache: reuse of shared prompt blocks, reference counts, LRU eviction of unreferenced
blocks only, and a state-machine test that no block is ever both free and referenced."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from plow.runtime.kv_cache import KVCacheError, OutOfBlocks, PagedKVCache, PageTable
from plow.runtime.prefix_cache import PrefixCache

HEADS, D, BS = 2, 4, 4


def kv_of(tokens: list[int], start: int) -> np.ndarray:
    """Deterministic stand-in for the keys of tokens[start:] (a function of the whole prefix,
    as real keys are)."""
    out = np.empty((HEADS, len(tokens) - start, D), np.float32)
    for i in range(start, len(tokens)):
        seed = hash(tuple(tokens[: i + 1])) & 0xFFFFFFFF
        out[:, i - start] = np.random.default_rng(seed).normal(size=(HEADS, D))
    return out


def prefill(cache: PagedKVCache, pc: PrefixCache, prompt: list[int]) -> tuple[PageTable, int]:
    """What the executor will do: reuse the cached prefix, compute the rest, index it."""
    t = cache.new_table()
    reused = pc.acquire(t, prompt)
    try:
        cache.reserve(t, len(prompt))
    except OutOfBlocks:
        pc.release(t)
        raise
    kv = kv_of(prompt, reused)
    cache.write(0, t, range(reused, len(prompt)), kv, -kv)
    pc.register(t, prompt)
    return t, reused


def make(num_blocks: int = 32) -> tuple[PagedKVCache, PrefixCache]:
    cache = PagedKVCache(1, HEADS, D, BS, num_blocks)
    return cache, PrefixCache(cache)


def test_chain_hash_names_the_whole_prefix() -> None:
    _, pc = make()
    a = pc.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = pc.block_hashes([9, 9, 9, 9, 5, 6, 7, 8])
    assert len(a) == 2 and len(b) == 2  # the partial block has no hash
    assert a[1] != b[1]  # same block tokens, different prefix
    assert a == pc.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0, 0])[:2]
    assert PrefixCache(PagedKVCache(1, 1, 1, BS, 1), salt=b"m2").block_hashes([1, 2, 3, 4]) != a[:1]


def test_second_request_reuses_shared_blocks() -> None:
    cache, pc = make()
    shared = list(range(100, 100 + 3 * BS))  # three full shared blocks
    p1 = shared + [1, 2, 3, 4, 5, 6]
    p2 = shared + [7, 8]
    t1, r1 = prefill(cache, pc, p1)
    assert r1 == 0
    t2, r2 = prefill(cache, pc, p2)
    assert r2 == 3 * BS  # reused tokens == shared full blocks x block_size
    assert t2.blocks[:3] == t1.blocks[:3] and t2.blocks[3] != t1.blocks[3]
    assert [cache.pool.refcount(b) for b in t1.blocks[:3]] == [2, 2, 2]
    # Request 2 sees request 1's keys and values for the shared prefix, and its own after.
    k2, v2 = cache.gather(0, t2, len(p2))
    np.testing.assert_array_equal(k2, kv_of(p2, 0))
    np.testing.assert_array_equal(v2, -kv_of(p2, 0))
    assert pc.stats().reused_tokens == 3 * BS
    # Shared blocks are read-only.
    with pytest.raises(KVCacheError):
        cache.write(0, t2, [0], np.zeros((HEADS, 1, D), np.float32),
                    np.zeros((HEADS, 1, D), np.float32))
    blocks = set(t1.blocks) | set(t2.blocks)
    pc.release(t1)
    pc.release(t2)
    assert all(cache.pool.refcount(b) == 0 for b in blocks)
    # Cached blocks stay cached (idle) after both end: a third request still hits.
    assert cache.pool.num_evictable == pc.stats().cached_blocks == 4  # p1 has 4 full blocks
    t3, r3 = prefill(cache, pc, shared + [1, 2, 3, 4, 0])
    assert r3 == 4 * BS
    pc.release(t3)
    pc.check_invariants()


def test_fully_cached_prompt_leaves_one_token_to_compute() -> None:
    cache, pc = make()
    prompt = list(range(4 * BS))
    t1, _ = prefill(cache, pc, prompt)
    t2 = cache.new_table()
    assert pc.acquire(t2, prompt) == 3 * BS  # the last block is recomputed, for its logits
    assert pc.acquire(cache.new_table(), prompt[:1]) == 0
    pc.release(t2)
    pc.release(t1)
    pc.check_invariants()


def test_eviction_takes_only_unreferenced_blocks_lru() -> None:
    cache, pc = make(num_blocks=8)
    a = [1] * (3 * BS) + [2]  # 4 blocks, 3 cached
    b = [3] * (3 * BS) + [4]
    ta, _ = prefill(cache, pc, a)
    tb, _ = prefill(cache, pc, b)
    assert cache.pool.num_empty == 0
    pc.release(tb)  # b's 3 cached blocks become idle; its partial block is empty
    assert (cache.pool.num_empty, cache.pool.num_evictable) == (1, 3)
    idle = tb_cached = pc.lookup(b)
    assert len(idle) == 3
    got = cache.pool.allocate(2)  # the empty block first, then the LRU idle one: b's tail
    assert got[1] == tb_cached[2] and got[0] not in tb_cached
    assert len(pc.lookup(b)) == 2 and pc.stats().evictions == 1
    cache.pool.allocate(2)  # the rest of b's idle blocks
    assert pc.lookup(b) == [] and len(pc.lookup(a)) == 3
    with pytest.raises(OutOfBlocks):
        cache.pool.allocate(1)  # a's referenced (cached) blocks are never taken
    assert all(cache.pool.refcount(x) == 1 for x in ta.blocks)
    pc.check_invariants()


def test_idle_block_revived_by_a_hit_is_not_evicted() -> None:
    cache, pc = make(num_blocks=4)
    p = [5] * (2 * BS) + [6]
    t1, _ = prefill(cache, pc, p)
    pc.release(t1)
    t2, r = prefill(cache, pc, p)  # hit on two idle blocks: they become referenced again
    assert r == 2 * BS and cache.pool.num_evictable == 0
    cache.pool.allocate(cache.pool.num_free)
    assert pc.lookup(p) == t2.blocks[:2]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions (prompts over a tiny vocabulary, so prefixes collide), decode steps
    and completions against a small pool, checking the accounting after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.cache, self.pc = make(num_blocks=10)
        self.live: dict[int, tuple[PageTable, list[int]]] = {}
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, prompt: list[int]) -> None:
        free_before = self.cache.pool.num_free
        try:
            t, reused = prefill(self.cache, self.pc, prompt)
        except OutOfBlocks:
            assert self.cache.pool.num_free == free_before  # a refused request takes nothing
            return
        assert reused % BS == 0 and reused < len(prompt)
        np.testing.assert_array_equal(self.cache.gather(0, t, len(prompt))[0], kv_of(prompt, 0))
        self.live[self.next_id] = (t, prompt)
        self.next_id += 1

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        t, toks = self.live[rid]
        toks = toks + [token]
        try:
            self.cache.reserve(t, len(toks))
        except OutOfBlocks:
            return
        kv = kv_of(toks, len(toks) - 1)
        self.cache.write(0, t, [len(toks) - 1], kv, -kv)
        self.pc.register(t, toks)
        self.live[rid] = (t, toks)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        t, toks = self.live.pop(rid)
        np.testing.assert_array_equal(self.cache.gather(0, t, len(toks))[1], -kv_of(toks, 0))
        self.pc.release(t)

    @invariant()
    def accounting(self) -> None:
        self.pc.check_invariants()  # includes: no block both free and referenced
        pool = self.cache.pool
        owners: dict[int, int] = {}
        for t, _ in self.live.values():
            for b in t.blocks:
                owners[b] = owners.get(b, 0) + 1
        for b in range(pool.num_blocks):
            assert pool.refcount(b) == owners.get(b, 0)
            free = b not in owners
            assert free == (pool.refcount(b) == 0)
        assert pool.num_free == pool.num_blocks - len(owners)

    def teardown(self) -> None:
        for t, _ in self.live.values():
            self.pc.release(t)
        pool = self.cache.pool
        assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks))
        assert pool.num_free == pool.num_blocks
        self.pc.check_invariants()


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
