"""Wire format version 1: packets as fixed-size little-endian records (docs/wire.md).

A packet is one tile of work for one worker of the persistent kernel. On the wire it is a
64-byte record; a plan file (`plan/<bucket>.bin`) is a 32-byte header followed by the records.
Encoding and decoding are vectorised over numpy structured arrays (`PACKET_DTYPE`); the
`Packet` dataclass is the convenient per-packet view. The decoder validates every record
(reserved bytes zero, known opcode, flags and scope in range) and raises `WireError` naming
the record, the byte offset and the field of the first violation, in byte order — the same
first violation the extracted Rocq decoder (Plow.Wire, checkpoint E) reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from plow.errors import PlowError

WIRE_VERSION = 1
RECORD_SIZE = 64
HEADER_SIZE = 32
MAGIC = b"PLOWPLAN"
NO_COUNTER = 0xFFFF_FFFF
"""`wait_counter` / `signal_counter` value meaning "none"."""


class Opcode(IntEnum):
    """What a packet does (u8 at offset 0). Codes 20..255 are unknown and rejected."""

    NOP = 0
    LOAD = 1
    EMBED = 2
    RMSNORM = 3
    LINEAR = 4
    ROPE = 5
    ATTENTION = 6
    ATTENTION_MERGE = 7
    MLP_GATE_UP = 8
    MLP_DOWN = 9
    RESIDUAL_ADD = 10
    LM_HEAD = 11
    SAMPLE = 12
    ROUTER = 13
    EXPERT_LINEAR = 14
    ALLREDUCE = 15
    SSM_CONV = 16  # Mamba-2 (docs/families.md)
    SSM_SCAN = 17
    SSM_NORM = 18
    KDA = 19  # Kimi-Linear's delta-rule recurrence (docs/families.md)


class Scope(IntEnum):
    """Scope of the signalled counter's atomic (u8 at offset 2)."""

    CTA = 0
    DEVICE = 1
    SYSTEM = 2


class Flag(IntFlag):
    """Flag bits (u8 at offset 1); bits 5..7 are reserved and must be zero."""

    MASKED = 1
    FUSED_RESIDUAL = 2
    FUSED_ROPE = 4
    FUSED_ARGMAX = 8
    ACCUMULATE = 16


FLAGS_LIMIT = 32
SCOPE_LIMIT = 3
KNOWN_OPCODES: frozenset[int] = frozenset(int(o) for o in Opcode)
_KNOWN_TABLE = np.zeros(256, dtype=bool)
_KNOWN_TABLE[sorted(KNOWN_OPCODES)] = True

# (name, numpy format), in record order. Reserved
# fields are named reserved*; they must hold zero and are not part of `Packet`.
_LAYOUT: tuple[tuple[str, str], ...] = (
    ("opcode", "u1"),
    ("flags", "u1"),
    ("scope", "u1"),
    ("reserved0", "u1"),
    ("worker", "<u2"),
    ("reserved1", "<u2"),
    ("op_index", "<u4"),
    ("wait_counter", "<u4"),
    ("wait_threshold", "<u4"),
    ("signal_counter", "<u4"),
    ("row_start", "<u4"),
    ("col_start", "<u4"),
    ("rows", "<u4"),
    ("cols", "<u4"),
    ("in_offset", "<u8"),
    ("weight_offset", "<u8"),
    ("out_offset", "<u8"),
)


def _offsets(layout: tuple[tuple[str, str], ...]) -> list[int]:
    out, off = [], 0
    for _, fmt in layout:
        out.append(off)
        off += np.dtype(fmt).itemsize
    return out


FIELD_OFFSETS: dict[str, int] = dict(zip((n for n, _ in _LAYOUT), _offsets(_LAYOUT), strict=True))
RESERVED_FIELDS: tuple[str, ...] = tuple(n for n, _ in _LAYOUT if n.startswith("reserved"))
VALUE_FIELDS: tuple[str, ...] = tuple(n for n, _ in _LAYOUT if not n.startswith("reserved"))

PACKET_DTYPE = np.dtype(
    {
        "names": [n for n, _ in _LAYOUT],
        "formats": [f for _, f in _LAYOUT],
        "offsets": list(FIELD_OFFSETS.values()),
        "itemsize": RECORD_SIZE,
    }
)
assert sum(np.dtype(f).itemsize for _, f in _LAYOUT) == RECORD_SIZE

_HEADER_LAYOUT: tuple[tuple[str, str], ...] = (
    ("magic", "S8"),
    ("version", "<u2"),
    ("packet_size", "<u2"),
    ("packet_count", "<u4"),
    ("phase", "u1"),
    ("reserved0", "u1"),
    ("workers", "<u2"),
    ("batch", "<u4"),
    ("seq", "<u4"),
    ("reserved1", "<u4"),
)
HEADER_OFFSETS: dict[str, int] = dict(
    zip((n for n, _ in _HEADER_LAYOUT), _offsets(_HEADER_LAYOUT), strict=True)
)
HEADER_DTYPE = np.dtype(
    {
        "names": [n for n, _ in _HEADER_LAYOUT],
        "formats": [f for _, f in _HEADER_LAYOUT],
        "offsets": list(HEADER_OFFSETS.values()),
        "itemsize": HEADER_SIZE,
    }
)
assert sum(np.dtype(f).itemsize for _, f in _HEADER_LAYOUT) == HEADER_SIZE


class WireError(PlowError):
    """Bytes (or packets) that are not a valid packet stream.

    `offset` is the absolute byte offset of the violation (the field's first byte),
    `record` the record index when one is concerned, `field` the field name.
    """

    def __init__(
        self, offset: int, problem: str, *, record: int | None = None, field: str | None = None
    ) -> None:
        self.offset = offset
        self.record = record
        self.field = field
        where = (
            f"byte offset {offset}" if record is None else f"record {record} (byte offset {offset})"
        )
        if field is not None:
            where += f" field {field}"
        super().__init__(where, problem)


class Phase(IntEnum):
    PREFILL = 0
    DECODE = 1


@dataclass(frozen=True, slots=True)
class Packet:
    """One tile of work (the structured view of one record; reserved fields omitted).

    `wait_counter`: the counter this packet waits on (`NO_COUNTER`: none) until it reaches
    `wait_threshold`; `signal_counter`: the counter incremented when it completes, with an
    atomic of `scope`. The tile is rows `[row_start, row_start + rows)` x cols
    `[col_start, col_start + cols)` of op `op_index`'s output; `in_offset`, `weight_offset`,
    `out_offset` are byte offsets into the arena.
    """

    opcode: Opcode
    flags: int = 0
    scope: Scope = Scope.CTA
    worker: int = 0
    op_index: int = 0
    wait_counter: int = NO_COUNTER
    wait_threshold: int = 0
    signal_counter: int = NO_COUNTER
    row_start: int = 0
    col_start: int = 0
    rows: int = 0
    cols: int = 0
    in_offset: int = 0
    weight_offset: int = 0
    out_offset: int = 0


assert tuple(f.name for f in dataclasses.fields(Packet)) == VALUE_FIELDS

PacketArray = npt.NDArray[Any]
"""A structured array of dtype `PACKET_DTYPE`."""


# ---------------------------------------------------------------- conversions


def _column(name: str, values: list[int], fmt: str) -> npt.NDArray[Any]:
    """One field over all packets as an unsigned array; out-of-width values raise."""
    dt = np.dtype(fmt)
    limit = 1 << (8 * dt.itemsize)
    try:
        col = np.array(values, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        col = None
    if col is not None and dt.itemsize < 8:
        bad = np.flatnonzero(col >= limit)
        if bad.size == 0:
            return col.astype(dt)
        i = int(bad[0])
    elif col is not None:
        return col.astype(dt)
    else:
        i = next(k for k, v in enumerate(values) if not (isinstance(v, int) and 0 <= v < limit))
    raise WireError(
        i * RECORD_SIZE + FIELD_OFFSETS[name],
        f"value {values[i]!r} does not fit {8 * dt.itemsize} unsigned bits",
        record=i,
        field=name,
    )


def packets_to_array(packets: Sequence[Packet]) -> PacketArray:
    """Structured array of the packets (reserved bytes zero). Values must fit their widths."""
    arr = np.zeros(len(packets), dtype=PACKET_DTYPE)
    if not packets:
        return arr
    formats = dict(_LAYOUT)
    for name in VALUE_FIELDS:
        arr[name] = _column(name, [int(getattr(p, name)) for p in packets], formats[name])
    return arr


def array_to_packets(arr: PacketArray) -> list[Packet]:
    """The `Packet` view of a (validated) structured array."""
    cols = [arr[name].tolist() for name in VALUE_FIELDS]
    return [
        Packet(Opcode(row[0]), row[1], Scope(row[2]), *row[3:]) for row in zip(*cols, strict=True)
    ]


def as_packet_array(packets: PacketArray | Sequence[Packet]) -> PacketArray:
    """A structured array of dtype `PACKET_DTYPE` (arrays pass through, packets convert)."""
    if isinstance(packets, np.ndarray):
        if packets.dtype != PACKET_DTYPE:
            raise WireError(0, f"array dtype {packets.dtype} is not PACKET_DTYPE")
        return packets
    return packets_to_array(packets)


# ---------------------------------------------------------------- validation


def validate(arr: PacketArray, *, base_offset: int = 0) -> None:
    """Raise `WireError` for the first invalid field, in byte order (record, then field).

    Checks what the extracted Rocq decoder checks: opcode known, flags < 32, scope < 3,
    reserved fields zero (every other field is a plain unsigned number of its width).
    """
    if arr.size == 0:
        return
    checks: list[tuple[str, npt.NDArray[np.bool_]]] = [
        ("opcode", ~_KNOWN_TABLE[arr["opcode"]]),
        ("flags", arr["flags"] >= FLAGS_LIMIT),
        ("scope", arr["scope"] >= SCOPE_LIMIT),
        ("reserved0", arr["reserved0"] != 0),
        ("reserved1", arr["reserved1"] != 0),
    ]
    bad = np.zeros(arr.size, dtype=bool)
    for _, mask in checks:
        bad |= mask
    hits = np.flatnonzero(bad)
    if hits.size == 0:
        return
    r = int(hits[0])
    for name, mask in checks:  # already in layout (byte) order
        if mask[r]:
            v = int(arr[name][r])
            if name == "opcode":
                problem = f"unknown opcode {v}"
            elif name.startswith("reserved"):
                problem = f"reserved bytes not zero (field value {v})"
            else:
                bound = FLAGS_LIMIT if name == "flags" else SCOPE_LIMIT
                problem = f"value {v} out of range (must be below {bound})"
            raise WireError(
                base_offset + r * RECORD_SIZE + FIELD_OFFSETS[name], problem, record=r, field=name
            )


# ---------------------------------------------------------------- records


def encode(packets: PacketArray | Sequence[Packet]) -> bytes:
    """The records of `packets`, concatenated (no header). Validates first."""
    arr = as_packet_array(packets)
    validate(arr)
    return arr.tobytes()


def decode(data: bytes | bytearray | memoryview, *, base_offset: int = 0) -> PacketArray:
    """Decode and validate concatenated records (no header) into a structured array.

    `base_offset` is added to the byte offsets in errors (e.g. the header size).
    """
    n = len(data)
    if n % RECORD_SIZE:
        raise WireError(
            base_offset + n - n % RECORD_SIZE,
            f"truncated: {n} bytes is not a multiple of {RECORD_SIZE}",
        )
    arr = np.frombuffer(data, dtype=PACKET_DTYPE).copy()
    validate(arr, base_offset=base_offset)
    return arr


def decode_packets(data: bytes | bytearray | memoryview) -> list[Packet]:
    """`decode` as a list of `Packet`."""
    return array_to_packets(decode(data))


# ---------------------------------------------------------------- plan files


@dataclass(frozen=True, slots=True)
class PlanHeader:
    """The 32-byte header of a plan file: the bucket, the worker count and the record count."""

    phase: Phase
    batch: int
    seq: int
    workers: int
    packet_count: int
    version: int = WIRE_VERSION
    packet_size: int = RECORD_SIZE


def encode_plan(
    packets: PacketArray | Sequence[Packet], *, phase: Phase, batch: int, seq: int, workers: int
) -> bytes:
    """A plan file's bytes: header, then the records."""
    body = encode(packets)
    count = len(body) // RECORD_SIZE
    for name, v, bits in (("batch", batch, 32), ("seq", seq, 32), ("workers", workers, 16)):
        if not 0 <= v < (1 << bits):
            raise WireError(HEADER_OFFSETS[name], f"value {v} does not fit {bits} bits", field=name)
    if count >= 1 << 32:
        raise WireError(HEADER_OFFSETS["packet_count"], f"{count} packets", field="packet_count")
    h = np.zeros(1, dtype=HEADER_DTYPE)
    h["magic"] = MAGIC
    h["version"] = WIRE_VERSION
    h["packet_size"] = RECORD_SIZE
    h["packet_count"] = count
    h["phase"] = int(Phase(phase))
    h["workers"] = workers
    h["batch"] = batch
    h["seq"] = seq
    return h.tobytes() + body


def decode_plan(data: bytes | bytearray | memoryview) -> tuple[PlanHeader, PacketArray]:
    """Validate a plan file's header and decode its records."""
    if len(data) < HEADER_SIZE:
        raise WireError(
            len(data), f"truncated: {len(data)} bytes, the header alone is {HEADER_SIZE}"
        )
    h = np.frombuffer(data, dtype=HEADER_DTYPE, count=1)[0]

    def fail(name: str, problem: str) -> WireError:
        return WireError(HEADER_OFFSETS[name], problem, field=name)

    if bytes(data[:8]) != MAGIC:
        raise fail("magic", f"magic {bytes(data[:8])!r} is not {MAGIC!r}")
    if int(h["version"]) != WIRE_VERSION:
        raise fail("version", f"wire version {int(h['version'])}, this build reads {WIRE_VERSION}")
    if int(h["packet_size"]) != RECORD_SIZE:
        raise fail("packet_size", f"packet size {int(h['packet_size'])} is not {RECORD_SIZE}")
    if int(h["phase"]) not in (Phase.PREFILL, Phase.DECODE):
        raise fail("phase", f"unknown phase {int(h['phase'])}")
    for name in ("reserved0", "reserved1"):
        if int(h[name]) != 0:
            raise fail(name, f"reserved bytes not zero (field value {int(h[name])})")
    count = int(h["packet_count"])
    body = memoryview(data)[HEADER_SIZE:]
    if len(body) != count * RECORD_SIZE:
        raise WireError(
            HEADER_SIZE,
            f"header says {count} packets ({count * RECORD_SIZE} bytes) "
            f"but {len(body)} bytes follow",
            field="packet_count",
        )
    arr = decode(body, base_offset=HEADER_SIZE)
    header = PlanHeader(
        phase=Phase(int(h["phase"])),
        batch=int(h["batch"]),
        seq=int(h["seq"]),
        workers=int(h["workers"]),
        packet_count=count,
    )
    return header, arr


def write_plan(
    path: str | Path,
    packets: PacketArray | Sequence[Packet],
    *,
    phase: Phase,
    batch: int,
    seq: int,
    workers: int,
) -> None:
    """Write a plan file atomically (temporary file, then rename)."""
    path = Path(path)
    data = encode_plan(packets, phase=phase, batch=batch, seq=seq, workers=workers)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def read_plan(path: str | Path) -> tuple[PlanHeader, PacketArray]:
    """Read and validate a plan file; errors name the file."""
    path = Path(path)
    try:
        return decode_plan(path.read_bytes())
    except WireError as e:
        e.where = f"{path}: {e.where}"
        e.args = (f"{e.where}: {e.problem}",)
        raise
