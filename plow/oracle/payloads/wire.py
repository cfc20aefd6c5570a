"""Checkpoint E payload: a packet stream as bytes and as structured packets.

The oracle (Plow.Wire.check_wire) decodes `bytes` with the extracted decoder and accepts when
the bytes decode to exactly `packets` — hence (theorem Plow.Wireproof.checkpoint_e_sound)
`packets` encode to exactly `bytes` and every packet is well formed. `bytes` holds the records
only (a plan file without its header), as lowercase hex. Integers only; u64 fields may exceed
2^63 (JSON carries them exactly).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from plow.emit.wire import (
    RECORD_SIZE,
    VALUE_FIELDS,
    WIRE_VERSION,
    Packet,
    PacketArray,
    as_packet_array,
)


class WirePacket(BaseModel):
    """One packet, field for field as in docs/wire.md (reserved fields omitted)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    opcode: int = Field(ge=0)
    flags: int = Field(ge=0)
    scope: int = Field(ge=0)
    worker: int = Field(ge=0)
    op_index: int = Field(ge=0)
    wait_counter: int = Field(ge=0)
    wait_threshold: int = Field(ge=0)
    signal_counter: int = Field(ge=0)
    row_start: int = Field(ge=0)
    col_start: int = Field(ge=0)
    rows: int = Field(ge=0)
    cols: int = Field(ge=0)
    in_offset: int = Field(ge=0)
    weight_offset: int = Field(ge=0)
    out_offset: int = Field(ge=0)


assert tuple(WirePacket.model_fields) == VALUE_FIELDS


class WirePayload(BaseModel):
    """`bytes`: the records as hex; `packets`: what the compiler meant them to say."""

    model_config = ConfigDict(frozen=True)

    version: int = WIRE_VERSION
    record_size: int = RECORD_SIZE
    bytes: str = Field(pattern=r"^([0-9a-fA-F]{2})*$")
    packets: list[WirePacket]


def wire_payload(packets: PacketArray | Sequence[Packet], data: bytes | None = None) -> WirePayload:
    """Payload for structured `packets` and their bytes.

    `data`: the record bytes to check (e.g. read back from a plan file, header stripped);
    default: the packets encoded by `plow.emit.wire` (no validation, so broken packets
    reach the oracle as they are).
    """
    arr = as_packet_array(packets)
    body = arr.tobytes() if data is None else data
    cols = [arr[name].tolist() for name in VALUE_FIELDS]
    return WirePayload(
        bytes=body.hex(),
        packets=[
            WirePacket.model_validate(dict(zip(VALUE_FIELDS, row, strict=True)))
            for row in zip(*cols, strict=True)
        ],
    )
