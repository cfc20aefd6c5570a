"""Streaming detokenisation: deltas never split a character and add up to the full decode."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plow.checkpoint.tokenizer import Tokenizer
from plow.serve.detok import REPLACEMENT, IncrementalDetokenizer, TextStream
from plow.testing.fixtures import corpus_text


@pytest.fixture(scope="module")
def tok(tiny_ckpt: Path) -> Tokenizer:
    return Tokenizer.load(tiny_ckpt)


MULTIBYTE = sorted({c for c in corpus_text() if len(c.encode()) > 1})
ALPHABET = sorted(set(corpus_text()) - {"\n"})
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(tok.decode)
    deltas = [d.push(i) for i in ids]
    return deltas, d.flush()


def test_corpus_has_multibyte_characters(tok: Tokenizer) -> None:
    assert MULTIBYTE, "the fixture corpus should contain multi-byte characters"
    text = "".join(MULTIBYTE[:8])
    ids = tok.encode(text)
    # some token boundary falls inside a character: a prefix decodes to a replacement char
    assert any(tok.decode(ids[:k]).endswith(REPLACEMENT) for k in range(1, len(ids)))


@SETTINGS
@given(ids=st.lists(st.integers(min_value=0, max_value=316), min_size=0, max_size=40))
def test_random_ids_concatenate_to_full_decode(tok: Tokenizer, ids: list[int]) -> None:
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    shown = ""
    for k, delta in enumerate(deltas):
        shown += delta
        # what was shown so far is a prefix of every later decode, and never ends mid-character
        assert tok.decode(ids[: k + 1]).startswith(shown)
        assert not shown.endswith(REPLACEMENT)


@SETTINGS
@given(text=st.text(alphabet=st.sampled_from(MULTIBYTE + ALPHABET[:40]), max_size=30))
def test_valid_text_never_shows_a_replacement_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == text
    assert all(REPLACEMENT not in d for d in deltas)


@SETTINGS
@given(
    text=st.text(alphabet=st.sampled_from(ALPHABET[:30] + MULTIBYTE[:10]), max_size=30),
    stop=st.text(alphabet=st.sampled_from(ALPHABET[:30] + MULTIBYTE[:10]), min_size=1, max_size=3),
)
def test_stop_string_cuts_at_its_first_occurrence(tok: Tokenizer, text: str, stop: str) -> None:
    s = TextStream.create(tok.decode, [stop])
    out = "".join(s.push(i) for i in tok.encode(text)) + s.finish()
    i = text.find(stop)
    assert out == (text if i < 0 else text[:i])
    assert s.stopped == (i >= 0)


def test_first_completed_stop_string_wins(tok: Tokenizer) -> None:
    s = TextStream.create(tok.decode, ["world", "lo w"])
    out = "".join(s.push(i) for i in tok.encode("hello world again")) + s.finish()
    assert out == "hel" and s.stopped
