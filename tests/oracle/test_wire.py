"""Checkpoint E (wire round trip): the extracted Rocq decoder against the Python decoder on
the same bytes, and located rejections of truncated and corrupted record streams."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.bundle.wire import (
    FIELD_OFFSETS,
    PACKET_DTYPE,
    RECORD_SIZE,
    Opcode,
    Packet,
    WireError,
    array_to_packets,
    decode,
    encode,
)
from plow.oracle import Certificate, run_checkpoint
from plow.oracle.payloads.wire import WirePayload, wire_payload

SOUND = "Plow.Wireproof.checkpoint_e_sound"
U64 = 2**64 - 1

# field name -> (offset, width) for every field of a record, reserved included
WIDTHS = {n: PACKET_DTYPE[n].itemsize for n in FIELD_OFFSETS}


@st.composite
def packets(draw: st.DrawFn) -> Packet:
    u32 = st.integers(0, 2**32 - 1)
    return Packet(
        opcode=draw(st.sampled_from(list(Opcode))),
        flags=draw(st.integers(0, 31)),
        scope=draw(st.integers(0, 2)),  # type: ignore[arg-type]
        worker=draw(st.integers(0, 2**16 - 1)),
        op_index=draw(u32),
        wait_counter=draw(u32),
        wait_threshold=draw(u32),
        signal_counter=draw(u32),
        row_start=draw(u32),
        col_start=draw(u32),
        rows=draw(u32),
        cols=draw(u32),
        in_offset=draw(st.integers(0, U64)),
        weight_offset=draw(st.integers(0, U64)),
        out_offset=draw(st.integers(0, U64)),
    )


def stream(n: int) -> list[Packet]:
    return [
        Packet(
            Opcode.LINEAR,
            worker=i % 7,
            op_index=i,
            wait_counter=i,
            wait_threshold=i + 1,
            signal_counter=i + 1,
            rows=16,
            cols=64,
            in_offset=64 * i,
            out_offset=2**40 + i,
        )
        for i in range(n)
    ]


def run(payload: WirePayload) -> Certificate:
    return run_checkpoint("E", payload)


def located(field: str, record: int) -> str:
    offset = record * RECORD_SIZE + FIELD_OFFSETS[field]
    return f"record {record} (byte offset {offset}) field {field}: "


def test_accepts_a_correct_stream() -> None:
    ps = stream(20) + [Packet(Opcode.SAMPLE, in_offset=U64, weight_offset=U64, out_offset=U64)]
    cert = run(wire_payload(ps))
    assert cert.accepted, cert.reason
    assert SOUND in cert.theorems


def test_accepts_the_empty_stream() -> None:
    assert run(wire_payload([])).accepted


@given(st.lists(packets(), max_size=12))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_accepts_random_streams(ps: list[Packet]) -> None:
    cert = run(wire_payload(ps))
    assert cert.accepted, cert.reason


@given(st.lists(packets(), min_size=1, max_size=8), st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_extracted_decoder_agrees_with_python(ps: list[Packet], data: st.DataObject) -> None:
    """Corrupt one byte; both decoders must agree on what the bytes say (or where they fail)."""
    b = bytearray(encode(ps))
    pos = data.draw(st.integers(0, len(b) - 1))
    b[pos] = data.draw(st.integers(0, 255))
    raw = bytes(b)
    try:
        arr = decode(raw)
    except WireError as e:
        cert = run(wire_payload(ps, raw))
        assert not cert.accepted
        assert e.record is not None and e.field is not None
        assert cert.reason is not None and cert.reason.startswith(located(e.field, e.record))
        assert cert.reason == str(e)  # same record, offset, field and wording
        return
    # Python accepts: the oracle accepts the Python-decoded packets on these bytes (so the
    # extracted decoder decodes them to the same packets, by checkpoint_e_sound) ...
    cert = run(wire_payload(arr, raw))
    assert cert.accepted, cert.reason
    # ... and, when the byte changed a value, rejects the original packets at that field.
    decoded = array_to_packets(arr)
    if decoded != ps:
        r = pos // RECORD_SIZE
        field = next(
            n
            for n in FIELD_OFFSETS
            if FIELD_OFFSETS[n] <= pos % RECORD_SIZE < FIELD_OFFSETS[n] + WIDTHS[n]
        )
        cert = run(wire_payload(ps, raw))
        assert not cert.accepted
        assert cert.reason == (
            located(field, r) + f"bytes decode to {getattr(decoded[r], field)} "
            f"but packet says {getattr(ps[r], field)}"
        )


def test_rejects_truncated_stream() -> None:
    raw = encode(stream(3))[:130]
    cert = run(wire_payload(stream(3), raw))
    assert not cert.accepted and cert.theorems == []
    assert cert.reason == "truncated: 130 bytes is not a multiple of 64"


def test_rejects_nonzero_padding_with_record_and_offset() -> None:
    b = bytearray(encode(stream(20)))
    b[17 * RECORD_SIZE + 3] = 5  # record 17, reserved0
    cert = run(wire_payload(stream(20), bytes(b)))
    assert not cert.accepted
    assert cert.reason == (
        "record 17 (byte offset 1091) field reserved0: reserved bytes not zero (field value 5)"
    )
    b = bytearray(encode(stream(20)))
    b[4 * RECORD_SIZE + 7] = 1  # record 4, high byte of reserved1
    cert = run(wire_payload(stream(20), bytes(b)))
    assert cert.reason == (
        "record 4 (byte offset 262) field reserved1: reserved bytes not zero (field value 256)"
    )


def test_rejects_unknown_opcode() -> None:
    b = bytearray(encode(stream(5)))
    b[3 * RECORD_SIZE] = 250
    cert = run(wire_payload(stream(5), bytes(b)))
    assert not cert.accepted
    assert cert.reason == "record 3 (byte offset 192) field opcode: unknown opcode 250"


def test_rejects_flags_and_scope_out_of_range() -> None:
    b = bytearray(encode(stream(5)))
    b[2 * RECORD_SIZE + 2] = 3
    cert = run(wire_payload(stream(5), bytes(b)))
    assert (
        cert.reason
        == "record 2 (byte offset 130) field scope: value 3 out of range (must be below 3)"
    )
    b[RECORD_SIZE + 1] = 0x80
    cert = run(wire_payload(stream(5), bytes(b)))
    assert (
        cert.reason
        == "record 1 (byte offset 65) field flags: value 128 out of range (must be below 32)"
    )


def test_rejects_a_flipped_field() -> None:
    ps = stream(12)
    raw = encode(ps)
    wrong = list(ps)
    wrong[9] = Packet(**{**{f: getattr(ps[9], f) for f in Packet.__slots__}, "wait_threshold": 4})
    assert ps[9].wait_threshold == 10
    cert = run(wire_payload(wrong, raw))
    assert not cert.accepted
    assert (
        cert.reason
        == "record 9 (byte offset 592) field wait_threshold: bytes decode to 10 but packet says 4"
    )
    wrong[9] = Packet(**{**{f: getattr(ps[9], f) for f in Packet.__slots__}, "out_offset": U64})
    cert = run(wire_payload(wrong, raw))
    assert cert.reason == (
        f"record 9 (byte offset 632) field out_offset: bytes decode to {2**40 + 9} "
        f"but packet says {U64}"
    )


def test_rejects_missing_or_extra_packets() -> None:
    raw = encode(stream(4))
    cert = run(wire_payload(stream(3), raw))
    assert cert.reason == "the bytes hold 4 records but the payload lists 3 packets"
    cert = run(wire_payload(stream(5), raw))
    assert cert.reason == "the bytes hold 4 records but the payload lists 5 packets"


def test_rejects_other_record_size_or_version() -> None:
    p = wire_payload(stream(2))
    cert = run(p.model_copy(update={"record_size": 32}))
    assert cert.reason is not None and "record size 32" in cert.reason
    cert = run(p.model_copy(update={"version": 2}))
    assert cert.reason is not None and "wire version 2" in cert.reason


def test_ten_thousand_packets() -> None:
    n = 10_000
    rng = np.random.default_rng(1)
    arr = np.zeros(n, dtype=PACKET_DTYPE)
    arr["opcode"] = rng.integers(0, 16, n)
    arr["worker"] = rng.integers(0, 132, n)
    arr["wait_threshold"] = rng.integers(0, 2**32, n, dtype=np.uint64)
    arr["weight_offset"] = rng.integers(0, 2**63, n, dtype=np.uint64) * 2
    cert = run(wire_payload(arr))
    assert cert.accepted, cert.reason
    b = bytearray(arr.tobytes())
    b[9_999 * RECORD_SIZE + 6] = 9
    cert = run(wire_payload(arr, bytes(b)))
    assert cert.reason == (
        "record 9999 (byte offset 639942) field reserved1: reserved bytes not zero (field value 9)"
    )
