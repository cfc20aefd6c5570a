"""Emitted packet streams: wire round trip, the nop convention, and the parse back to tasks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from plow.bundle.files import OpTable, ScheduleFile
from plow.bundle.stream import group_tasks
from plow.bundle.wire import NO_COUNTER, PACKET_DTYPE, decode, encode, read_plan
from plow.emit.emit import emit_packets
from plow.emit.verify import counter_graph_from_packets
from tests.emit.bundle_edit import first_rung


def _files(bundle: Path) -> tuple[OpTable, ScheduleFile, np.ndarray]:
    rung = first_rung(bundle)
    ot = OpTable.model_validate_json((bundle / rung["ops"]).read_text())
    sf = ScheduleFile.model_validate_json((bundle / rung["schedule"]).read_text())
    _, arr = read_plan(bundle / rung["plan"])
    return ot, sf, arr


def test_reemission_matches_the_plan_file(tiny_bundles: dict[str, Path]) -> None:
    for b in tiny_bundles.values():
        ot, sf, arr = _files(b)
        assert emit_packets(sf, ot).tobytes() == arr.tobytes()


def test_nops_carry_the_extra_waits_and_signals(tiny_bundles: dict[str, Path]) -> None:
    ot, sf, arr = _files(tiny_bundles["gemma3"])
    t = sf.tasks
    extra = sum(
        max(0, len(w) - 1) + max(0, len(s) - 1) for w, s in zip(t.waits, t.signals, strict=True)
    )
    assert extra > 0  # attention waits on q, k and v: the convention is exercised
    assert int((arr["opcode"] == 0).sum()) == extra
    g = group_tasks(arr)
    assert not isinstance(g, str) and len(g.tasks) == len(t.name)
    for k, pk in enumerate(g.tasks):
        waits = [int(arr["wait_counter"][i]) for i in pk if arr["wait_counter"][i] != NO_COUNTER]
        sigs = [int(arr["signal_counter"][i]) for i in pk if arr["signal_counter"][i] != NO_COUNTER]
        assert waits == t.waits[k] and sigs == t.signals[k]
        assert {int(arr["worker"][i]) for i in pk} == {t.worker[k]}


def test_queue_order_is_file_order(tiny_bundles: dict[str, Path]) -> None:
    _, sf, arr = _files(tiny_bundles["llama"])
    w = arr["worker"].astype(int)
    assert (np.diff(w) >= 0).all()  # each worker's queue is one contiguous run
    g = counter_graph_from_packets(arr, sf)
    assert not isinstance(g, str)
    assert sorted(t for q in g.queues for t in q) == list(range(len(sf.tasks.name)))


def test_op_table_interprets_every_packet(tiny_bundles: dict[str, Path]) -> None:
    ot, _, arr = _files(tiny_bundles["qwen3"])
    doc = json.loads(ot.model_dump_json())
    spans = [(t["offset"], t["offset"] + t["size"]) for t in doc["tensors"].values()]
    for i in np.flatnonzero(arr["opcode"] != 0):
        op = ot.ops[int(arr["op_index"][i])]
        assert arr["opcode"][i] in (op.opcode, 7, 15, 1)  # own, attention_merge, allreduce, load
        tiles = int(np.prod([a.steps for a in op.axes]))
        assert arr["row_start"][i] + arr["rows"][i] <= max(tiles, 1) or arr["flags"][i] & 16
        for f in ("in_offset", "out_offset"):
            assert any(a == int(arr[f][i]) for a, _ in spans)


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    arr = np.frombuffer(base, dtype=PACKET_DTYPE).copy()
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, arr.size - 1))
        name = draw(
            st.sampled_from(
                [
                    "worker",
                    "op_index",
                    "wait_counter",
                    "wait_threshold",
                    "signal_counter",
                    "row_start",
                    "rows",
                    "in_offset",
                    "weight_offset",
                    "out_offset",
                    "flags",
                    "scope",
                    "opcode",
                ]
            )
        )
        dt = PACKET_DTYPE[name]
        hi = {"flags": 31, "scope": 2, "opcode": 15}.get(name, (1 << (8 * dt.itemsize)) - 1)
        arr[name][i] = draw(st.integers(0, hi))
    return arr.tobytes()


def test_emitted_streams_round_trip(tiny_bundles: dict[str, Path]) -> None:
    _, _, arr = _files(tiny_bundles["llama"])
    base = arr.tobytes()

    @settings(max_examples=60, deadline=None)
    @given(mutated(base))
    def prop(data: bytes) -> None:
        once = encode(decode(data))
        assert once == data
        assert encode(decode(once)) == once

    prop()
