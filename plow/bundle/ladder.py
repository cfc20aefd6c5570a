"""The bucket ladder: the rungs (phase, batch, seq) a bundle is compiled for, and the
runtime's rounding rule — a live shape runs on the smallest rung that covers it.

The policy that picks the rungs is the compile profile's (`CompileProfile.buckets`: decode
batches x the context, prefill batches x prefill chunk lengths). A rung covers a live shape of
the same phase when its batch is at least the live batch and its `seq` at least the live
`seq` (decode: the key-value length the step attends over; prefill: the tokens per row of
the chunk). A prefill longer than the longest rung is chunked at it, and more rows than the
widest rung are split (the callers: `plow.runtime.cpu.engine`, `plow.runtime.cpu.generate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plow.errors import PlowError
from plow.graph import Bucket, Phase
from plow.profile import CompileProfile


class LadderError(PlowError):
    """No rung of the ladder covers a live shape."""


@dataclass(frozen=True, slots=True)
class Ladder:
    rungs: tuple[Bucket, ...]

    def names(self) -> list[str]:
        return [b.name for b in self.rungs]


def ladder_from_profile(profile: CompileProfile, max_position: int) -> Ladder:
    """The rungs the profile's policy asks for (in the profile's order, duplicates dropped)."""
    seen: dict[str, Bucket] = {}
    for b in profile.buckets(max_position):
        seen.setdefault(b.name, b)
    return Ladder(tuple(seen.values()))


def _covers(rung: Bucket, phase: Phase, batch: int, seq: int) -> bool:
    if rung.phase is not phase or rung.batch < batch:
        return False
    return rung.seq >= seq if phase is Phase.prefill else rung.context >= seq


def round_up(ladder: Ladder | Sequence[Bucket], phase: Phase | str, batch: int, seq: int) -> Bucket:
    """The smallest rung covering (phase, batch, seq): least padded work `batch * seq`
    (decode: `batch * context`), then least batch, then least seq. `LadderError` when no
    rung covers it (or the shape is not positive)."""
    rungs = ladder.rungs if isinstance(ladder, Ladder) else tuple(ladder)
    ph = Phase(phase)
    if batch < 1 or seq < 1:
        raise LadderError(f"{ph.value} batch {batch} seq {seq}", "batch and seq must be >= 1")
    cands = [r for r in rungs if _covers(r, ph, batch, seq)]
    if not cands:
        have = ", ".join(r.name for r in rungs if r.phase is ph) or "none"
        raise LadderError(
            f"{ph.value} batch {batch} seq {seq}",
            f"no compiled bucket covers it (rungs of this phase: {have})",
        )

    def extent(r: Bucket) -> int:
        return r.seq if ph is Phase.prefill else r.context

    return min(cands, key=lambda r: (r.batch * extent(r), r.batch, extent(r)))
