"""Checkpoint F (allocation safety): the extracted checker against hand-made address maps,
address maps packed by a first-fit allocator, and mutations of them."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.oracle import run_checkpoint
from plow.oracle.payloads.alloc import AllocPayload, BufferPlacement

SOUND = "Plow.Allocproof.check_alloc_sound"


def buf(
    name: str, offset: int, size: int, live: tuple[int, int], align: int = 256,
    region: str = "activations",
) -> BufferPlacement:
    return BufferPlacement(
        name=name, offset=offset, size=size, align=align,
        live_start=live[0], live_end=live[1], region=region,  # type: ignore[arg-type]
    )


def check(arena: int, *bufs: BufferPlacement):  # type: ignore[no-untyped-def]
    return run_checkpoint("F", AllocPayload(arena_bytes=arena, buffers=list(bufs)))


def test_accepts_a_correct_map_with_reuse() -> None:
    cert = check(
        16384,
        buf("embed.w", 0, 8192, (0, 100), region="weights"),
        buf("L3.h", 8192, 4096, (5, 8)),
        buf("L4.h", 8192, 4096, (8, 12)),  # same bytes, live ranges touch but do not meet
        buf("L4.tmp", 12288, 4096, (8, 9), region="scratch"),
        buf("empty", 8448, 0, (0, 100), region="io"),  # holds no byte
        buf("dead", 0, 4096, (3, 3), region="kv"),  # never live
    )
    assert cert.accepted, cert.reason
    assert SOUND in cert.theorems


def test_rejects_overlapping_live_buffers() -> None:
    cert = check(
        8192,
        buf("L3.h", 0, 4096, (5, 10)),
        buf("L4.h", 2048, 4096, (7, 12)),
    )
    assert not cert.accepted
    assert cert.theorems == []
    assert cert.reason == (
        'buffers "L3.h" (activations) [0, 4096) and "L4.h" (activations) [2048, 6144) '
        "overlap while both live (steps 7..9)"
    )


def test_rejects_buffer_past_arena_end() -> None:
    cert = check(8192, buf("L0.w", 0, 4096, (0, 1)), buf("L1.w", 4096, 4352, (0, 1)))
    assert not cert.accepted
    assert cert.reason is not None
    assert '"L1.w"' in cert.reason and "ends at byte 8448" in cert.reason
    assert "past the arena end 8192" in cert.reason


def test_rejects_misaligned_offset() -> None:
    cert = check(8192, buf("L2.kv", 100, 256, (0, 4), align=64, region="kv"))
    assert not cert.accepted
    assert cert.reason is not None
    assert '"L2.kv"' in cert.reason and "misaligned" in cert.reason
    assert "offset 100" in cert.reason and "alignment 64" in cert.reason


def test_rejects_zero_alignment() -> None:
    cert = check(8192, buf("io.tokens", 0, 256, (0, 4), align=0, region="io"))
    assert not cert.accepted
    assert cert.reason is not None
    assert '"io.tokens"' in cert.reason and "alignment 0" in cert.reason


def test_large_weight_map_is_accepted() -> None:
    # Thousands of buffers, all live at once: the sort-and-sweep check stays fast.
    n = 3000
    bufs = [buf(f"w{i}", i * 4096, 4096, (0, 1000), region="weights") for i in range(n)]
    assert check(n * 4096, *bufs).accepted


# ---- random address maps --------------------------------------------------------------

Spec = tuple[int, int, int, int]  # size_in_aligns, align, live_start, live_len


def live_meet(a: BufferPlacement, b: BufferPlacement) -> bool:
    return max(a.live_start, b.live_start) < min(a.live_end, b.live_end)


def bytes_meet(a: BufferPlacement, b: BufferPlacement) -> bool:
    return max(a.offset, b.offset) < min(a.offset + a.size, b.offset + b.size)


def first_fit(specs: list[Spec]) -> list[BufferPlacement]:
    """Place buffers in order of first live step, each at the lowest aligned offset that
    does not meet an already placed buffer whose live range meets its own."""
    order = sorted(range(len(specs)), key=lambda i: specs[i][2])
    placed: dict[int, BufferPlacement] = {}
    for i in order:
        k, align, start, length = specs[i]
        size = k * align
        probe = buf(f"t{i}", 0, size, (start, start + length), align=align)
        rivals = [p for p in placed.values() if live_meet(p, probe)]
        candidates = sorted({0} | {p.offset + p.size for p in rivals})
        for c in candidates:
            off = -(-c // align) * align
            cand = probe.model_copy(update={"offset": off})
            if not any(bytes_meet(cand, p) for p in rivals):
                placed[i] = cand
                break
    return [placed[i] for i in range(len(specs))]


specs_st = st.lists(
    st.tuples(
        st.integers(1, 4),
        st.sampled_from([1, 16, 64, 256]),
        st.integers(0, 20),
        st.integers(1, 8),
    ),
    min_size=1,
    max_size=25,
)


def arena_of(bufs: list[BufferPlacement]) -> int:
    return max(b.offset + b.size for b in bufs)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_st)
def test_first_fit_allocation_is_accepted(specs: list[Spec]) -> None:
    bufs = first_fit(specs)
    cert = check(arena_of(bufs), *bufs)
    assert cert.accepted, cert.reason


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_st, data=st.data())
def test_mutation_making_live_buffers_overlap_is_rejected(
    specs: list[Spec], data: st.DataObject
) -> None:
    bufs = first_fit(specs)
    pairs = [
        (a, b) for a in range(len(bufs)) for b in range(len(bufs))
        if a != b and live_meet(bufs[a], bufs[b])
    ]
    if not pairs:
        specs = specs + [specs[0]]  # a twin of buffer 0: same live range
        bufs = first_fit(specs)
        pairs = [(0, len(bufs) - 1)]
    a, b = data.draw(st.sampled_from(pairs))
    # move b onto a's first byte, rounded down to b's alignment (sizes are multiples of
    # the alignment, so b still covers that byte)
    target = bufs[a].offset - bufs[a].offset % bufs[b].align
    bufs[b] = bufs[b].model_copy(update={"offset": target})
    cert = check(arena_of(bufs), *bufs)
    assert not cert.accepted
    assert cert.reason is not None
    m = re.match(
        r'buffers "t(\d+)" \(\w+\) \[(\d+), (\d+)\) and "t(\d+)" \(\w+\) \[(\d+), (\d+)\) '
        r"overlap while both live \(steps (\d+)\.\.(\d+)\)$",
        cert.reason,
    )
    assert m, cert.reason
    i, lo1, hi1, j, lo2, hi2, s1, s2 = (int(g) for g in m.groups())
    x, y = bufs[i], bufs[j]
    assert i < j and b in (i, j)  # only pairs involving the moved buffer can conflict
    assert (lo1, hi1, lo2, hi2) == (x.offset, x.offset + x.size, y.offset, y.offset + y.size)
    assert live_meet(x, y) and bytes_meet(x, y)
    assert (s1, s2 + 1) == (
        max(x.live_start, y.live_start), min(x.live_end, y.live_end)
    )
