"""Source locations and the one error type every serQ stage raises."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Loc:
    """A 1-based line and column in a source file."""

    line: int
    col: int


NOWHERE = Loc(0, 0)

#: A diagnostic shows at most this many characters of the source line.
SHOWN = 100


class SerqError(Exception):
    """A diagnostic about a serQ program: file, line, column, message and the source line.

    ``str(err)`` is the full, multi-line diagnostic (``file:line:col: message``, the source
    line, and a caret under the column). ``err.message`` is the one-line message alone.
    """

    def __init__(
        self,
        message: str,
        loc: Loc | None = None,
        filename: str | None = None,
        source: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.loc = loc
        self.filename = filename
        self.source = source

    def attach(self, filename: str, source: str) -> SerqError:
        """Fill in the file name and source text if they are not known yet."""
        if self.filename is None:
            self.filename = filename
        if self.source is None:
            self.source = source
        return self

    def headline(self) -> str:
        name = self.filename or "<input>"
        if self.loc is None or self.loc.line <= 0:
            return f"{name}: {self.message}"
        return f"{name}:{self.loc.line}:{self.loc.col}: {self.message}"

    def render(self) -> str:
        head = self.headline()
        if self.loc is None or self.loc.line <= 0 or self.source is None:
            return head
        lines = self.source.splitlines()
        if not 1 <= self.loc.line <= len(lines):
            return head
        text = lines[self.loc.line - 1].replace("\t", " ")
        col = max(self.loc.col - 1, 0)
        if len(text) > SHOWN:
            # a window of the line around the column, so that one long line stays readable
            lo = max(0, min(col - SHOWN // 2, len(text) - SHOWN))
            text, col = text[lo : lo + SHOWN], col - lo
            if lo > 0:
                text, col = "..." + text[3:], col
            if lo + SHOWN < len(lines[self.loc.line - 1]):
                text = text[:-3] + "..."
        caret = " " * col + "^"
        return f"{head}\n  {text}\n  {caret}"

    def __str__(self) -> str:
        return self.render()
