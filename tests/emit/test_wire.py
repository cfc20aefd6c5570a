"""Wire format (plow.bundle.wire): byte-exact round trips and a decoder that rejects broken
records with the record, byte offset and field of the first violation."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plow.bundle.wire import (
    FIELD_OFFSETS,
    HEADER_SIZE,
    NO_COUNTER,
    PACKET_DTYPE,
    RECORD_SIZE,
    VALUE_FIELDS,
    Opcode,
    Packet,
    Phase,
    Scope,
    WireError,
    array_to_packets,
    decode,
    decode_packets,
    decode_plan,
    encode,
    encode_plan,
    packets_to_array,
    read_plan,
    write_plan,
)

U16, U32, U64 = 2**16 - 1, 2**32 - 1, 2**64 - 1


@st.composite
def packets(draw: st.DrawFn) -> Packet:
    u32 = st.integers(0, U32)
    return Packet(
        opcode=draw(st.sampled_from(list(Opcode))),
        flags=draw(st.integers(0, 31)),
        scope=draw(st.sampled_from(list(Scope))),
        worker=draw(st.integers(0, U16)),
        op_index=draw(u32),
        wait_counter=draw(st.one_of(st.just(NO_COUNTER), u32)),
        wait_threshold=draw(u32),
        signal_counter=draw(st.one_of(st.just(NO_COUNTER), u32)),
        row_start=draw(u32),
        col_start=draw(u32),
        rows=draw(u32),
        cols=draw(u32),
        in_offset=draw(st.integers(0, U64)),
        weight_offset=draw(st.integers(0, U64)),
        out_offset=draw(st.integers(0, U64)),
    )


packet_lists = st.lists(packets(), max_size=40)


def reference_record(p: Packet) -> bytes:
    """An independent encoder (struct) of docs/wire.md's table."""
    return struct.pack(
        "<BBBBHHIIIIIIIIQQQ",
        p.opcode,
        p.flags,
        p.scope,
        0,
        p.worker,
        0,
        p.op_index,
        p.wait_counter,
        p.wait_threshold,
        p.signal_counter,
        p.row_start,
        p.col_start,
        p.rows,
        p.cols,
        p.in_offset,
        p.weight_offset,
        p.out_offset,
    )


def test_layout_is_64_bytes_little_endian() -> None:
    assert PACKET_DTYPE.itemsize == RECORD_SIZE == 64
    # explicit little-endian (`str` spells the byte order, `|` for single bytes)
    assert all(PACKET_DTYPE[n].str[0] in "<|" for n in FIELD_OFFSETS)
    assert FIELD_OFFSETS["in_offset"] == 40 and FIELD_OFFSETS["out_offset"] == 56


@given(packet_lists)
@settings(max_examples=200, deadline=None)
def test_encode_decode_encode_is_byte_exact(ps: list[Packet]) -> None:
    data = encode(ps)
    assert data == b"".join(reference_record(p) for p in ps)
    arr = decode(data)
    assert array_to_packets(arr) == ps
    assert encode(arr) == data
    assert decode_packets(data) == ps


@given(packet_lists, st.sampled_from(list(Phase)), st.integers(0, U32), st.integers(0, U16))
@settings(max_examples=50, deadline=None)
def test_plan_file_round_trip(ps: list[Packet], phase: Phase, seq: int, workers: int) -> None:
    data = encode_plan(ps, phase=phase, batch=8, seq=seq, workers=workers)
    assert data[:8] == b"PLOWPLAN" and len(data) == HEADER_SIZE + RECORD_SIZE * len(ps)
    header, arr = decode_plan(data)
    assert (header.phase, header.batch, header.seq, header.workers) == (phase, 8, seq, workers)
    assert header.packet_count == len(ps)
    assert array_to_packets(arr) == ps


def test_plan_file_on_disk(tmp_path: Path) -> None:
    ps = [Packet(Opcode.EMBED, worker=1), Packet(Opcode.SAMPLE, worker=2)]
    path = tmp_path / "decode_b1_s1.bin"
    write_plan(path, ps, phase=Phase.DECODE, batch=1, seq=1, workers=4)
    assert array_to_packets(read_plan(path)[1]) == ps
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + RECORD_SIZE + 0] = 250  # second record's opcode
    path.write_bytes(bytes(data))
    with pytest.raises(WireError) as e:
        read_plan(path)
    assert str(path) in str(e.value) and "unknown opcode 250" in str(e.value)
    assert e.value.offset == HEADER_SIZE + RECORD_SIZE and e.value.record == 1


@given(packet_lists.filter(bool), st.integers(1, RECORD_SIZE - 1))
@settings(max_examples=50, deadline=None)
def test_rejects_truncated_stream(ps: list[Packet], cut: int) -> None:
    data = encode(ps)[:-cut]
    with pytest.raises(WireError) as e:
        decode(data)
    assert f"truncated: {len(data)} bytes is not a multiple of 64" in str(e.value)
    assert e.value.offset == (len(ps) - 1) * RECORD_SIZE


@given(
    packet_lists.filter(bool),
    st.data(),
    st.sampled_from([("reserved0", 3, 1), ("reserved1", 6, 2)]),
    st.integers(1, 255),
)
@settings(max_examples=100, deadline=None)
def test_rejects_nonzero_padding(
    ps: list[Packet], data: st.DataObject, where: tuple[str, int, int], value: int
) -> None:
    name, off, width = where
    r = data.draw(st.integers(0, len(ps) - 1))
    k = data.draw(st.integers(0, width - 1))
    b = bytearray(encode(ps))
    b[r * RECORD_SIZE + off + k] = value
    with pytest.raises(WireError) as e:
        decode(bytes(b))
    assert (e.value.record, e.value.field, e.value.offset) == (r, name, r * RECORD_SIZE + off)
    assert "reserved bytes not zero" in str(e.value)
    assert f"record {r} (byte offset {r * RECORD_SIZE + off}) field {name}" in str(e.value)


@given(packet_lists.filter(bool), st.data(), st.integers(20, 255))
@settings(max_examples=100, deadline=None)
def test_rejects_unknown_opcode(ps: list[Packet], data: st.DataObject, code: int) -> None:
    r = data.draw(st.integers(0, len(ps) - 1))
    b = bytearray(encode(ps))
    b[r * RECORD_SIZE] = code
    with pytest.raises(WireError) as e:
        decode(bytes(b))
    assert (e.value.record, e.value.field, e.value.offset) == (r, "opcode", r * RECORD_SIZE)
    assert f"unknown opcode {code}" in str(e.value)


def test_rejects_flags_and_scope_out_of_range_first_in_byte_order() -> None:
    b = bytearray(encode([Packet(Opcode.NOP)] * 3))
    b[2 * RECORD_SIZE + 2] = 7  # record 2 scope
    b[1 * RECORD_SIZE + 6] = 1  # record 1 reserved1
    b[1 * RECORD_SIZE + 1] = 32  # record 1 flags: first violation in byte order
    with pytest.raises(WireError) as e:
        decode(bytes(b))
    assert str(e.value) == (
        "record 1 (byte offset 65) field flags: value 32 out of range (must be below 32)"
    )


def test_encoder_refuses_values_outside_their_width() -> None:
    with pytest.raises(WireError) as e:
        encode([Packet(Opcode.NOP), Packet(Opcode.NOP, worker=U16 + 1)])
    assert (e.value.record, e.value.field, e.value.offset) == (1, "worker", 68)
    with pytest.raises(WireError):
        encode([Packet(Opcode.NOP, out_offset=-1)])
    with pytest.raises(WireError):
        encode([Packet(Opcode.NOP, in_offset=U64 + 1)])
    with pytest.raises(WireError):
        encode([Packet(Opcode.NOP, flags=32)])


def test_plan_header_validation() -> None:
    good = encode_plan([Packet(Opcode.NOP)], phase=Phase.PREFILL, batch=1, seq=128, workers=8)
    cases = [
        (0, b"PLOWPLAX", "magic"),
        (8, b"\x02\x00", "version"),
        (10, b"\x20\x00", "packet_size"),
        (12, b"\x02\x00\x00\x00", "packet_count"),
        (17, b"\x01", "reserved0"),
    ]
    for off, patch, field in cases:
        b = bytearray(good)
        b[off : off + len(patch)] = patch
        with pytest.raises(WireError) as e:
            decode_plan(bytes(b))
        assert e.value.field == field, (field, str(e.value))
    with pytest.raises(WireError, match="truncated"):
        decode_plan(good[:20])


def test_ten_thousand_packets_vectorised() -> None:
    rng = np.random.default_rng(0)
    n = 10_000
    arr = np.zeros(n, dtype=PACKET_DTYPE)
    arr["opcode"] = rng.integers(0, 16, n)
    arr["worker"] = rng.integers(0, 132, n)
    arr["in_offset"] = rng.integers(0, 2**62, n, dtype=np.uint64)
    data = encode(arr)
    assert len(data) == n * RECORD_SIZE
    back = decode(data)
    assert np.array_equal(back, arr)
    assert packets_to_array(array_to_packets(back)).tobytes() == data
    assert VALUE_FIELDS[0] == "opcode"
