"""The phrase splitter with literals, and its invariants over any text and any chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from voice.phrases import PhraseBounds, PhraseSplitter


def split(text: str, step: int | None = None, bounds: PhraseBounds | None = None) -> list[str]:
    splitter = PhraseSplitter(bounds)
    out: list[str] = []
    size = step or max(len(text), 1)
    for at in range(0, len(text), size):
        out += splitter.feed(text[at:at + size])
    return out + splitter.flush()


def test_sentences_become_phrases_once_the_space_after_them_arrives() -> None:
    splitter = PhraseSplitter()
    assert splitter.feed("Hello.") == []  # "Hello.com" or "Hello.5" may follow
    assert splitter.feed(" How are") == ["Hello."]
    assert splitter.feed(" you? Fine") == [" How are you?"]
    assert splitter.flush() == [" Fine"]
    assert splitter.flush() == []


def test_clause_marks_end_a_phrase_only_once_it_is_long_enough() -> None:
    text = "Sure, here is the plan: first we go to the office, then we meet the whole team for lunch, and then we rest."
    assert split(text) == [
        "Sure, here is the plan:",  # "Sure," alone is under the first phrase's 16 characters
        " first we go to the office, then we meet the whole team for lunch,",  # 40 characters for later ones
        " and then we rest.",
    ]


def test_no_false_sentence_ends() -> None:
    text = "Mr. Smith paid 3.50 dollars at example.com in the U.S. yesterday. Then e.g. J. Doe came."
    assert split(text, bounds=PhraseBounds(first_max_chars=100)) == ["Mr. Smith paid 3.50 dollars at example.com in the U.S. yesterday.",
                           " Then e.g. J. Doe came."]


def test_other_ends_dashes_and_line_breaks() -> None:
    assert split("Wait... Really?! Yes.") == ["Wait...", " Really?!", " Yes."]
    assert split("She said \"go.\" He went.") == ["She said \"go.\"", " He went."]
    assert split("First line\nsecond line") == ["First line", "\nsecond line"]
    assert split("We could try that approach - if you like - later on.") == [
        "We could try that approach", " - if you like - later on."]


def test_a_long_run_without_marks_is_cut_at_a_space_within_the_bound() -> None:
    text = "word " * 50
    phrases = split(text.strip())
    assert phrases[0] == "word " * 11 + "word"  # 59 characters: the first phrase's bound is 60
    assert all(len(p) <= 160 for p in phrases[1:])
    assert "".join(phrases) == text.strip()


def test_a_word_longer_than_the_bound_is_cut_inside() -> None:
    assert split("x" * 70 + " y") == ["x" * 60, "x" * 10 + " y"]


def test_trailing_whitespace_is_dropped_and_blank_text_gives_nothing() -> None:
    assert split("Hi.   ") == ["Hi."]
    assert split("   ") == []
    assert split("") == []


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        PhraseBounds(first_clause_chars=80, first_max_chars=60)
    with pytest.raises(ValueError):
        PhraseBounds(clause_chars=0)


_PIECE = st.sampled_from([*"ab .,;:!?-\n\"'", "Mr.", "3.5", "U.S.", "word ", "–", "…"])
_TEXT = st.lists(_PIECE, max_size=80).map("".join)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_TEXT, max_size=20))
def test_phrases_rebuild_the_text_within_bounds_whatever_the_chunking(parts: list[str]) -> None:
    text = "".join(parts)
    splitter = PhraseSplitter()
    streamed: list[str] = []
    for part in parts:
        streamed += splitter.feed(part)
    streamed += splitter.flush()
    assert "".join(streamed) == text.rstrip()
    assert streamed == split(text)  # chunking does not move a cut
    assert all(p.strip() for p in streamed)
    assert all(len(p) <= (60 if i == 0 else 160) for i, p in enumerate(streamed))
