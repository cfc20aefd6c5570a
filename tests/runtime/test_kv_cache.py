"""Paged key-value cache: write/gather against a contiguous cache, block accounting, errors,
head-major strided runs, and the measured fp8 error."""

from __future__ import annotations

import numpy as np
import pytest

from plow.runtime.kv_cache import (
    BlockPool,
    KVCacheError,
    OutOfBlocks,
    PagedKVCache,
    PageTable,
    measure_fp8_error,
)

LAYERS, HEADS, D, BS = 3, 4, 8, 4


def test_position_maps_to_block_and_slot() -> None:
    t = PageTable(4, [7, 2, 9])
    assert [t.locate(p) for p in (0, 3, 4, 6, 11)] == [(7, 0), (7, 3), (2, 0), (2, 2), (9, 3)]
    with pytest.raises(KVCacheError):
        t.locate(12)


def test_write_then_gather_equals_contiguous_cache() -> None:
    rng = np.random.default_rng(0)
    cache = PagedKVCache(LAYERS, HEADS, D, BS, num_blocks=64)
    lengths = [13, 1, 32, 7, 20]
    tables = [cache.new_table() for _ in lengths]
    ref = {(r, layer): (np.zeros((HEADS, n, D), np.float32), np.zeros((HEADS, n, D), np.float32))
           for r, n in enumerate(lengths) for layer in range(LAYERS)}
    written = [0] * len(lengths)
    # Requests advance in random interleaved chunks (prefill-like, then decode-like), so their
    # blocks interleave in the pool; each chunk's positions are written in a random order.
    while any(w < n for w, n in zip(written, lengths, strict=True)):
        r = int(rng.choice([i for i, n in enumerate(lengths) if written[i] < n]))
        n = min(int(rng.integers(1, 6)), lengths[r] - written[r])
        pos = rng.permutation(np.arange(written[r], written[r] + n))
        cache.reserve(tables[r], written[r] + n)
        for layer in range(LAYERS):
            k = rng.normal(size=(HEADS, n, D)).astype(np.float32)
            v = rng.normal(size=(HEADS, n, D)).astype(np.float32)
            cache.write(layer, tables[r], pos, k, v)
            ref[r, layer][0][:, pos] = k
            ref[r, layer][1][:, pos] = v
        written[r] += n
    owned = [b for t in tables for b in t.blocks]
    assert len(owned) == len(set(owned)) == sum(-(-n // BS) for n in lengths)
    for r, n in enumerate(lengths):
        for layer in range(LAYERS):
            k, v = cache.gather(layer, tables[r], n)
            assert k.shape == v.shape == (HEADS, n, D)
            np.testing.assert_array_equal(k, ref[r, layer][0])
            np.testing.assert_array_equal(v, ref[r, layer][1])
            part = max(n - 3, 0)  # a prefix gather
            np.testing.assert_array_equal(cache.gather(layer, tables[r], part)[0],
                                          ref[r, layer][0][:, :part])
    # Release frees every block.
    assert cache.pool.num_free == 64 - len(owned)
    for t in tables:
        cache.release(t)
        assert t.blocks == []
    assert cache.pool.num_free == cache.pool.num_empty == 64
    assert all(cache.pool.refcount(b) == 0 for b in range(64))
    cache.pool.check_invariants()


def test_write_lands_head_major_in_the_arena() -> None:
    cache = PagedKVCache(1, HEADS, D, BS, num_blocks=8)
    t = cache.new_table()
    cache.reserve(t, 6)
    k = np.arange(HEADS * 6 * D, dtype=np.float32).reshape(HEADS, 6, D)
    cache.write(0, t, range(6), k, -k)
    b0, b1 = t.blocks
    for h in range(HEADS):
        np.testing.assert_array_equal(cache.arena[0, 0, b0, h], k[h, :4])
        np.testing.assert_array_equal(cache.arena[0, 0, b1, h, :2], k[h, 4:6])
        np.testing.assert_array_equal(cache.arena[0, 1, b1, h, :2], -k[h, 4:6])
    # prefix_runs names those elements in the flat arena: per block, one run per head at the
    # same offset in every head's slot, heads block_size * head_dim apart.
    flat = cache.arena.reshape(-1)
    runs = cache.prefix_runs(0, 0, t.blocks, 6)
    assert [(r.length, r.stride, r.count) for r in runs] == [(BS * D, BS * D, HEADS),
                                                             (2 * D, BS * D, HEADS)]
    got = [np.concatenate([flat[r.offset + h * r.stride: r.offset + h * r.stride + r.length]
                           for r in runs]) for h in range(HEADS)]
    np.testing.assert_array_equal(np.stack(got), k.reshape(HEADS, -1))


def test_out_of_blocks_is_typed_and_all_or_nothing() -> None:
    cache = PagedKVCache(1, HEADS, D, BS, num_blocks=5)
    a, b = cache.new_table(), cache.new_table()
    cache.reserve(a, 3 * BS)
    with pytest.raises(OutOfBlocks) as e:
        cache.reserve(b, 3 * BS)
    assert (e.value.requested, e.value.available) == (3, 2)
    assert b.blocks == [] and cache.pool.num_free == 2  # nothing taken on failure
    cache.release(a)
    cache.reserve(b, 3 * BS)
    assert len(b.blocks) == 3


def test_misuse_is_rejected() -> None:
    cache = PagedKVCache(2, HEADS, D, BS, num_blocks=4)
    t = cache.new_table()
    cache.reserve(t, 5)
    z = np.zeros((HEADS, 1, D), np.float32)
    with pytest.raises(KVCacheError, match="outside"):
        cache.write(0, t, [8], z, z)  # capacity is 2 blocks = 8 positions
    with pytest.raises(KVCacheError, match="shape"):
        cache.write(0, t, [0], np.zeros((1, HEADS, D), np.float32), z)
    with pytest.raises(KVCacheError, match="repeat"):
        cache.write(0, t, [1, 1], np.zeros((HEADS, 2, D), np.float32),
                    np.zeros((HEADS, 2, D), np.float32))
    with pytest.raises(KVCacheError, match="layer"):
        cache.write(2, t, [0], z, z)
    with pytest.raises(KVCacheError, match="length"):
        cache.gather(0, t, 9)
    cache.pool.incref(t.blocks[0])  # a second owner: the block becomes read-only
    with pytest.raises(KVCacheError, match="shared"):
        cache.write(0, t, [0], z, z)
    with pytest.raises(KVCacheError, match="dtype"):
        PagedKVCache(1, 1, 1, 1, 1, dtype="int8")  # type: ignore[arg-type]


def test_pool_refcounts() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate()
    pool.incref(b)
    pool.decref(b)
    assert pool.refcount(b) == 1 and pool.num_free == 2
    pool.decref(b)
    assert pool.refcount(b) == 0 and pool.num_free == 3
    with pytest.raises(KVCacheError):
        pool.decref(b)
    with pytest.raises(KVCacheError):
        pool.incref(b)  # a free (uncached) block cannot gain an owner
    pool.check_invariants()


def test_bfloat16_storage() -> None:
    rng = np.random.default_rng(3)
    cache = PagedKVCache(1, HEADS, D, BS, num_blocks=8, dtype="bfloat16")
    t = cache.new_table()
    cache.reserve(t, 10)
    k = rng.normal(size=(HEADS, 10, D)).astype(np.float32)
    cache.write(0, t, range(10), k, k)
    got, _ = cache.gather(0, t, 10)
    assert got.dtype == np.float32
    rel = np.abs(got - k) / np.abs(k)
    assert rel.max() <= 2.0**-8  # 8 significand bits, round to nearest
    assert rel.max() > 0  # and it is lossy
    assert cache.bytes_per_token() == 2 * HEADS * D * 2


# -- fp8 ----------------------------------------------------------------------------------
def _kv_like(seed: int, heads: int = 8, length: int = 200, d: int = 64) -> np.ndarray:
    """Normal data with a few outlier channels, as real keys have."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(heads, length, d)).astype(np.float32)
    x[:, :, rng.choice(d, 3, replace=False)] *= 8.0
    return x


# e4m3 keeps 3 mantissa bits: rounding a normal value errs by at most 2**-4 of it. Scales are
# powers of two with amax / scale in (224, 448], so every value >= 1e-2 * amax is normal, and
# rescaling a group when its amax grows is exact for normals: the bound holds for incremental
# (decode) writes too.
REL_BOUND = 2.0**-4


def test_fp8_error_single_write_within_bound() -> None:
    k, v = _kv_like(1), _kv_like(2)
    err = measure_fp8_error(k, v, block_size=16)
    assert 0 < err.max_rel <= REL_BOUND
    assert err.max_rel_amax <= REL_BOUND
    assert err.rms_rel < 0.03
    assert err.max_abs <= REL_BOUND * float(max(np.abs(k).max(), np.abs(v).max()))


def test_fp8_error_prefill_then_decode_within_bound() -> None:
    k, v = _kv_like(3), _kv_like(4)
    k[:, 150:] *= 3.0  # later tokens raise their groups' amax, forcing requantisation
    err = measure_fp8_error(k, v, block_size=16, chunks=[37] + [1] * 163)
    assert 0 < err.max_rel <= REL_BOUND
    assert err.max_rel_amax <= REL_BOUND
    assert err.rms_rel < 0.03


def test_fp8_cache_storage_and_fresh_scales() -> None:
    cache = PagedKVCache(1, 2, D, BS, num_blocks=2, dtype="fp8_e4m3")
    assert cache.arena.itemsize == 1 and cache.bytes_per_token() == 2 * 2 * D
    t = cache.new_table()
    cache.reserve(t, BS)
    big = np.full((2, BS, D), 300.0, np.float32)
    cache.write(0, t, range(BS), big, big)
    cache.release(t)
    t2 = cache.new_table()
    cache.reserve(t2, 2 * BS)  # reuses the block that held 300s: its scale starts afresh
    small = np.full((2, 2 * BS, D), 0.01, np.float32)
    cache.write(0, t2, range(2 * BS), small, small)
    got, _ = cache.gather(0, t2, 2 * BS)
    np.testing.assert_allclose(got, small, rtol=REL_BOUND)
