"""Streaming detokenisation: text deltas that never split a multi-byte character, and stop
strings that are cut out before they are ever sent.

`IncrementalDetokenizer` decodes the whole token sequence after every token and releases
the new suffix of the text, except while the decoded text ends in U+FFFD (the replacement
character a byte-level decoder produces for an incomplete UTF-8 sequence): then the tail is
held until the next token completes the character or the stream ends. The concatenation of
the deltas plus `flush()` is therefore exactly `decode(all ids)`.

`TextStream` adds stop strings on top: text is held back while a suffix of it could still
grow into a stop string, and the first complete stop string ends the stream with the text
before it (the stop string itself is not returned, as in the OpenAI API).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    decode: Callable[[list[int]], str]
    ids: list[int] = field(default_factory=list)
    emitted: str = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the newly releasable text (possibly empty)."""
        self.ids.append(int(token_id))
        text = self.decode(self.ids)
        if text.endswith(REPLACEMENT) or not text.startswith(self.emitted):
            # An incomplete character at the end (or a decoder that rewrote earlier text):
            # hold everything new until the text is stable again.
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta

    def flush(self) -> str:
        """The rest of the text at the end of the stream (a held incomplete tail included)."""
        text = self.decode(self.ids)
        if not text.startswith(self.emitted):  # pragma: no cover - not for prefix-stable decoders
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


@dataclass
class TextStream:
    """Detokenised deltas with stop strings applied; `stopped` once a stop string matched."""

    detok: IncrementalDetokenizer
    stops: tuple[str, ...] = ()
    buffer: str = ""
    stopped: bool = False

    @classmethod
    def create(cls, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> TextStream:
        return cls(IncrementalDetokenizer(decode), tuple(s for s in stops if s))

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.buffer[: min(hits)]
            self.buffer = ""
            self.stopped = True
            return out
        keep = 0 if final else _held_suffix(self.buffer, self.stops)
        out = self.buffer[: len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return out

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.buffer += self.detok.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self.buffer += self.detok.flush()
        return self._release(final=True)
