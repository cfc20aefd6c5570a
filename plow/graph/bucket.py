"""Buckets: one rung of the ladder, (phase, batch, seq), with every dim concrete."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from plow.errors import GraphError


class Phase(str, Enum):
    prefill = "prefill"
    decode = "decode"


@dataclass(frozen=True, slots=True)
class Bucket:
    """`seq` is the tokens per row a step processes in prefill, and the key-value length
    (context) a step attends over in decode. `context` is the key-value capacity per row;
    it defaults to `seq` and must be at least the tokens a prefill row writes."""

    phase: Phase
    batch: int
    seq: int
    context: int = 0

    def __post_init__(self) -> None:
        if self.batch < 1 or self.seq < 1:
            raise GraphError(self.name, "batch and seq must be at least 1")
        if self.context == 0:
            object.__setattr__(self, "context", self.seq)
        if self.context < self.seq:
            raise GraphError(self.name, f"context {self.context} is below seq {self.seq}")

    @property
    def tokens_per_row(self) -> int:
        return self.seq if self.phase is Phase.prefill else 1

    @property
    def name(self) -> str:
        base = f"{self.phase.value}_b{self.batch}_s{self.seq}"
        return base if self.context in (0, self.seq) else f"{base}_c{self.context}"

    @classmethod
    def decode(cls, batch: int, context: int) -> Bucket:
        return cls(Phase.decode, batch, context)

    @classmethod
    def prefill(cls, batch: int, seq: int, context: int = 0) -> Bucket:
        return cls(Phase.prefill, batch, seq, context)
