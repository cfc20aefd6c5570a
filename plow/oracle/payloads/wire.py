"""Checkpoint E payload: a packet stream as bytes and as structured packets.

The oracle (Plow.Wire.check_wire) decodes `bytes` with the extracted decoder and accepts when
the bytes decode to exactly `packets` — hence (theorem Plow.Wireproof.checkpoint_e_sound)
`packets` encode to exactly `bytes` and every packet is well formed. `bytes` holds the records
only (a plan file without its header), as lowercase hex. Integers only; u64 fields may exceed
2^63 (JSON carries them exactly).

With `ops` (`plow verify`: the packets are the plan file's decoded records, `ops` the op
table's operands at their arena-map offsets, `emit_ops`), the oracle then checks the packets
against the emitter's field rules (Plow.Emitcheck.check_emit; theorem
Plow.Emitcheckproof.checkpoint_e_emit_sound): nops zero; loads in = out = 0; weight = the
op's second input; merges in = the partial (or first input), out = the output; compute
in = the first input, out = the partial (or output); col_start = cols = 0; no FUSED_* flag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from plow.bundle.wire import (
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


Buf = tuple[str, int] | None  # (buffer name, arena offset), or none


class OpOffsets(BaseModel):
    """One op's operands for the emitter rules: its first input, second input, first output
    and partial, each (buffer name, arena offset) or None."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    in_: Buf = Field(alias="in")
    weight: Buf
    out: Buf
    partial: Buf


class WirePayload(BaseModel):
    """`bytes`: the records as hex; `packets`: what they say; `ops`: the op table's offsets
    (None: the round trip alone)."""

    model_config = ConfigDict(frozen=True)

    version: int = WIRE_VERSION
    record_size: int = RECORD_SIZE
    bytes: str = Field(pattern=r"^([0-9a-fA-F]{2})*$")
    packets: list[WirePacket]
    ops: list[OpOffsets] | None = None


class OpOperands(Protocol):
    """What `emit_ops` reads of an op-table row (`plow.bundle.files.OpRow`)."""

    @property
    def name(self) -> str: ...
    @property
    def inputs(self) -> Sequence[str]: ...
    @property
    def outputs(self) -> Sequence[str]: ...
    @property
    def partial(self) -> str | None: ...
    @property
    def argmax(self) -> str | None: ...


def emit_ops(ops: Sequence[OpOperands], offsets: Mapping[str, int]) -> list[dict[str, object]]:
    """The payload's `ops` (JSON-ready): per op its name and its first input, second input,
    first output and partial as [name, offset] or None (and the fused argmax buffer's name
    or None), offsets from `offsets` (the arena
    map). Raises KeyError naming a buffer the map lacks."""

    def buf(name: str | None) -> list[object] | None:
        if name is None:
            return None
        return [name, offsets[name]]

    return [
        {
            "name": o.name,
            "in": buf(o.inputs[0] if o.inputs else None),
            "weight": buf(o.inputs[1] if len(o.inputs) > 1 else None),
            "out": buf(o.outputs[0] if o.outputs else None),
            "partial": buf(o.partial or None),
            "argmax": o.argmax,  # greedy fused into lm_head: FUSED_ARGMAX on its packets
        }
        for o in ops
    ]


def wire_payload(packets: PacketArray | Sequence[Packet], data: bytes | None = None) -> WirePayload:
    """Payload for structured `packets` and their bytes.

    `data`: the record bytes to check (e.g. read back from a plan file, header stripped);
    default: the packets encoded by `plow.bundle.wire` (no validation, so broken packets
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
