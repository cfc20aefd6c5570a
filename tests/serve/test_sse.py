"""An SSE event stays one `data:` line for a client that reads the stream line by line
(httpx's `iter_lines` uses str.splitlines, which also breaks on U+0085, U+2028 and U+2029 —
characters a sampled token can hold)."""

import json

import httpx

from plow.serve.http import _sse


def test_event_with_unicode_line_breaks_is_one_data_line() -> None:
    text = "a\u2028b\x85c\u2029d \u00e9\n\ttab"
    event = _sse({"choices": [{"text": text}]})
    lines = [ln for ln in httpx.Response(200, content=event.encode()).iter_lines() if ln]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == {"choices": [{"text": text}]}
    assert "\u00e9" in event  # non-ASCII text is still sent as itself, not escaped
