"""Text to audio alignment with literals (1,000 samples a second: a sample is a millisecond)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from voice.alignment import Alignment, scale_marks


def two_phrases() -> Alignment:
    a = Alignment(1000)
    a.add("Hello there.", 1200)  # no marks: "Hello" ends at 5/12 of the audio (500), "there." at 1200
    # Marks: speech from sample 100 (char 1) to 700 (char 9), then trailing silence to 800.
    a.add(" Bye now.", 800, [(1, 100), (9, 700)])
    return a


@pytest.mark.parametrize(("ms", "spoken"), [
    (-5, ""),
    (0, ""),
    (499, ""),  # "Hello" not finished
    (500, "Hello"),
    (1199.9, "Hello"),
    (1200, "Hello there."),  # the first phrase played to its end
    (1524, "Hello there."),  # " Bye" ends at 1200 + 100 + (700 - 100) * 3/8 = 1525
    (1525, "Hello there. Bye"),
    (1899, "Hello there. Bye"),
    (1900, "Hello there. Bye now."),  # the speech ended (mark at 700); the rest is flite's silence
    (2000, "Hello there. Bye now."),
    (10_000, "Hello there. Bye now."),
])
def test_a_cut_keeps_whole_phrases_then_whole_words(ms: float, spoken: str) -> None:
    assert two_phrases().spoken_text(ms) == spoken


def test_totals() -> None:
    a = two_phrases()
    assert a.text == "Hello there. Bye now."
    assert a.total_samples == 2000 and a.total_ms == 2000.0
    assert [p.start_char for p in a.phrases] == [0, 12]
    assert [p.start_sample for p in a.phrases] == [0, 1200]
    assert a.phrases[1].word_ends == ((4, 325), (9, 700))


def test_an_output_rate_of_24_khz() -> None:
    a = Alignment(24_000)
    a.add("One two.", 24_000)  # one second; "One" ends at 3/8 of it
    assert a.spoken_text(374) == ""
    assert a.spoken_text(375) == "One"
    assert a.spoken_chars(1000) == 8


def test_a_phrase_without_audio_between_two_others() -> None:
    a = Alignment(1000)
    a.add("Yes.", 400)
    a.add(" ", 0)
    a.add(" No.", 400)
    assert a.spoken_text(399) == ""
    assert a.spoken_text(400) == "Yes."  # a cut where phrases meet keeps those before it
    assert a.spoken_text(800) == "Yes.  No."


def test_an_empty_alignment() -> None:
    a = Alignment(1000)
    assert a.spoken_text(100) == "" and a.total_ms == 0.0


def test_marks_out_of_order_or_past_the_audio_are_ignored() -> None:
    a = Alignment(1000)
    a.add("aa bb cc", 800, [(3, 500), (2, 100), (6, 900), (8, 600)])  # (2, 100) goes back, (6, 900) past the end
    # Kept: (3, 500) and (8, 600). "aa" ends at char 2: 500 * 2/3 = 333; "bb" at char 5: 500 + 100 * 2/5 = 540.
    assert a.phrases[0].word_ends == ((2, 333), (5, 540), (8, 600))


def test_scale_marks() -> None:
    assert scale_marks([(0, 160), (5, 16_000)], 16_000, 24_000) == ((0, 240), (5, 24_000))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Alignment(0)
    with pytest.raises(ValueError):
        Alignment(1000).add("x", -1)


_PHRASE = st.tuples(st.text(alphabet="ab ,.", max_size=30), st.integers(0, 500))


@given(phrases=st.lists(_PHRASE, max_size=8), cuts=st.lists(st.floats(-10, 5000), min_size=2, max_size=2))
def test_the_spoken_text_is_a_prefix_that_grows_with_the_cut(phrases: list[tuple[str, int]], cuts: list[float]) -> None:
    a = Alignment(1000)
    for text, n in phrases:
        a.add(text, n)
    early, late = sorted(cuts)
    assert a.text.startswith(a.spoken_text(late))
    assert a.spoken_text(late).startswith(a.spoken_text(early))
    assert a.spoken_text(a.total_ms) == a.text
