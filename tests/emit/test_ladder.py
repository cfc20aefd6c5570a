"""The runtime's rounding rule: a live shape runs on the smallest covering rung."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plow.bundle.ladder import Ladder, LadderError, ladder_from_profile, round_up
from plow.graph import Bucket, Phase
from plow.profile import CompileProfile

PROFILE = CompileProfile(decode_batches=(1, 2, 4, 8), prefill_seqs=(16, 64, 256), context=1024)
LADDER = ladder_from_profile(PROFILE, max_position=4096)


def test_ladder_follows_the_profile_policy() -> None:
    assert LADDER.names() == [
        "decode_b1_s1024",
        "decode_b2_s1024",
        "decode_b4_s1024",
        "decode_b8_s1024",
        "prefill_b1_s16_c1024",
        "prefill_b1_s64_c1024",
        "prefill_b1_s256_c1024",
    ]


@pytest.mark.parametrize(
    ("phase", "batch", "seq", "want"),
    [
        ("decode", 1, 1, "decode_b1_s1024"),
        ("decode", 3, 700, "decode_b4_s1024"),
        ("decode", 8, 1024, "decode_b8_s1024"),
        ("prefill", 1, 17, "prefill_b1_s64_c1024"),
        ("prefill", 1, 256, "prefill_b1_s256_c1024"),
    ],
)
def test_round_up(phase: str, batch: int, seq: int, want: str) -> None:
    assert round_up(LADDER, phase, batch, seq).name == want


@pytest.mark.parametrize(
    ("phase", "batch", "seq", "match"),
    [
        ("decode", 9, 10, "no compiled bucket covers it"),
        ("decode", 1, 1025, "no compiled bucket covers it"),
        ("prefill", 2, 16, "rungs of this phase: prefill_b1_s16_c1024"),
        ("decode", 0, 5, "must be >= 1"),
    ],
)
def test_round_up_errors(phase: str, batch: int, seq: int, match: str) -> None:
    with pytest.raises(LadderError, match=match):
        round_up(LADDER, phase, batch, seq)


rungs = st.lists(
    st.builds(lambda b, s: Bucket.decode(b, s), st.integers(1, 16), st.integers(1, 64)),
    min_size=1,
    max_size=8,
)


@given(rungs, st.integers(1, 16), st.integers(1, 64))
def test_round_up_is_the_smallest_cover(rs: list[Bucket], batch: int, seq: int) -> None:
    covering = [r for r in rs if r.batch >= batch and r.context >= seq]
    if not covering:
        with pytest.raises(LadderError):
            round_up(Ladder(tuple(rs)), Phase.decode, batch, seq)
        return
    got = round_up(Ladder(tuple(rs)), Phase.decode, batch, seq)
    assert got.batch >= batch and got.context >= seq
    assert all(got.batch * got.context <= r.batch * r.context for r in covering)
