"""Checkpoint F payload: the arena address map with live ranges.

Every tensor of a plan lives at an offset in one arena. A buffer holds bytes
`[offset, offset + size)` and is live on program steps `[live_start, live_end)`. The oracle
(Plow.Alloc.check_alloc) accepts when every buffer is in bounds and aligned and two buffers
live at a common step share no byte (theorems Plow.Allocproof.check_alloc_sound and
alloc_safe_exclusive). Integers only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Region = Literal["weights", "activations", "kv", "scratch", "io"]


class BufferPlacement(BaseModel):
    """One buffer of the address map."""

    model_config = ConfigDict(frozen=True)

    name: str
    offset: int = Field(ge=0)
    size: int = Field(ge=0)
    align: int = Field(ge=0)
    live_start: int = Field(ge=0)
    live_end: int = Field(ge=0)
    region: Region


class AllocPayload(BaseModel):
    """`arena_bytes` is the arena size; `buffers` every placed buffer (any order)."""

    model_config = ConfigDict(frozen=True)

    arena_bytes: int = Field(ge=0)
    buffers: list[BufferPlacement]
