"""Compile profiles with batched prefill rungs: a JSON round trip with `prefill_batches`, an
old-format file (no `prefill_batches`) loading to today's batch-1 ladder, one-line errors
naming the field, and the ladder's choice of the smallest covering prefill rung."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plow.bundle.ladder import LadderError, ladder_from_profile, round_up
from plow.errors import ConfigError
from plow.graph import Bucket
from plow.profile import CompileProfile, load_profile


def test_round_trip_with_prefill_batches(tmp_path: Path) -> None:
    prof = CompileProfile(
        name="p", decode_batches=(1, 4), prefill_seqs=(16, 64), prefill_batches=(1, 4), context=256
    )
    path = tmp_path / "p.json"
    path.write_text(prof.model_dump_json())
    back = load_profile(path)
    assert back == prof and back.prefill_batches == (1, 4)
    names = ladder_from_profile(back, 2048).names()
    assert names == [
        "decode_b1_s256", "decode_b4_s256", "prefill_b1_s16_c256", "prefill_b1_s64_c256",
        "prefill_b4_s16_c256", "prefill_b4_s64_c256",
    ]  # fmt: skip
    lad = ladder_from_profile(back, 2048)
    assert round_up(lad, "prefill", 3, 10) == Bucket.prefill(4, 16, 256)
    assert round_up(lad, "prefill", 1, 17) == Bucket.prefill(1, 64, 256)
    with pytest.raises(LadderError, match="no compiled bucket"):
        round_up(lad, "prefill", 5, 1)  # more rows than the widest rung: the caller splits


def test_old_format_file_keeps_its_ladder(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"name": "old", "decode_batches": [1, 2], "prefill_seqs": [8]}))
    prof = load_profile(path)
    assert prof.prefill_batches == (1,)
    assert [b.name for b in prof.buckets(32)] == [
        "decode_b1_s32",
        "decode_b2_s32",
        "prefill_b1_s8_c32",
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [({"prefill_batches": [0]}, "prefill_batches"), ({"prefill_batches": []}, "prefill_batches")],
)
def test_bad_prefill_batches_one_line(tmp_path: Path, body: dict[str, object], field: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError) as e:
        load_profile(path)
    msg = str(e.value)
    assert f"field '{field}'" in msg and "bad.json" in msg and "\n" not in msg
