"""flite as the synthesizer: voices, the API's voice names, what it makes, and its timing marks
(parsed with literals, then checked on real output)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from voice.alignment import Alignment
from voice.errors import VoiceModelError
from voice.tts import OPENAI_VOICES, FliteSynthesizer, marks_from_phones, merge_marks, parse_phone_ends, word_marks


def test_the_built_in_voices_the_mapping_needs_exist(synthesizer: FliteSynthesizer) -> None:
    assert set(OPENAI_VOICES.values()) <= set(synthesizer.voices)


def test_every_api_voice_maps_to_a_fixed_flite_voice(synthesizer: FliteSynthesizer) -> None:
    assert {name: synthesizer.resolve_voice(name) for name in OPENAI_VOICES} == OPENAI_VOICES
    assert synthesizer.resolve_voice("ALLOY") == "slt"
    assert synthesizer.resolve_voice("rms") == "rms"  # a flite name passes through
    assert synthesizer.resolve_voice("no-such-voice") == synthesizer.default_voice == "slt"
    assert synthesizer.resolve_voice("awb_time") == "slt"  # speaks only times of day: never chosen
    assert synthesizer.resolve_voice(None) == "slt"


def test_voices_sound_different(synthesizer: FliteSynthesizer) -> None:
    female = synthesizer.synthesize("Hello there.", "alloy")
    male = synthesizer.synthesize("Hello there.", "ash")
    assert female.sample_rate == male.sample_rate == 16_000
    assert len(female.samples) != len(male.samples) or not np.array_equal(female.samples, male.samples)


def test_speech_is_pcm16_with_increasing_marks(synthesizer: FliteSynthesizer) -> None:
    text = "Well, I think so. And you?"
    made = synthesizer.synthesize(text, "alloy")
    assert made.samples.dtype == np.int16 and made.sample_rate == 16_000
    assert 1.0 < made.seconds < 5.0
    assert np.abs(made.samples.astype(np.int32)).max() > 3000  # audible, not silence
    assert made.seconds_taken > 0 and made.real_time_factor < 1
    chars = [c for c, _ in made.marks]
    samples = [s for _, s in made.marks]
    assert chars == sorted(set(chars)) and samples == sorted(samples)
    assert made.marks[0][0] == 0 and made.marks[-1][0] == len(text)
    # flite's leading pause: speech starts after silence; the two inside pauses were tied to the
    # two punctuation breaks (each pause's end: the next word's start), and every word has its end.
    assert made.marks[0][1] > 0.05 * 16_000
    word_ends = {m.end() for m in re.finditer(r"\S+", text)}
    assert set(chars) == {0, 6, 18} | word_ends


def test_blank_text_is_no_audio_and_no_process(synthesizer: FliteSynthesizer) -> None:
    assert len(synthesizer.synthesize("   \n").samples) == 0


def test_text_is_spoken_never_read_as_options(synthesizer: FliteSynthesizer) -> None:
    # An answer starting with a dash or holding control characters is spoken, not parsed.
    made = synthesizer.synthesize("-voice kal --help\x00 -o /tmp/x")
    assert made.seconds > 1.0 and made.sample_rate == 16_000


def test_an_over_long_text_is_a_callers_bug() -> None:
    with pytest.raises(ValueError):
        FliteSynthesizer().synthesize("word " * 1000)


def test_a_missing_binary_is_a_clear_start_up_error(tmp_path: Path) -> None:
    with pytest.raises(VoiceModelError, match="not installed"):
        FliteSynthesizer(str(tmp_path / "no-flite"))


def test_phone_timings_parse() -> None:
    assert parse_phone_ends("pau:0.220 hh:0.295 ax:0.342 junk pau:x l:1\n") == [
        ("pau", 0.22), ("hh", 0.295), ("ax", 0.342), ("l", 1.0)]


def test_marks_from_phones_tie_pauses_to_punctuation() -> None:
    # "Hi, you." at 100 Hz: leading pause to 0.2 s, "hi" to 0.4, a pause to 0.5, "you" to 0.8,
    # trailing pause to 1.0.
    phones = [("pau", 0.2), ("hh", 0.3), ("ay", 0.4), ("pau", 0.5), ("y", 0.6), ("uw", 0.8), ("pau", 1.0)]
    assert marks_from_phones("Hi, you.", phones, 100, 100) == ((0, 20), (3, 40), (4, 50), (8, 80))
    # Leading whitespace in the phrase: speech starts at its first character.
    assert marks_from_phones(" Hi, you.", phones, 100, 100) == ((1, 20), (4, 40), (5, 50), (9, 80))


def test_marks_skip_pauses_that_do_not_match_the_punctuation() -> None:
    # Two inside pauses but one break in the text: only where speech starts and ends is used.
    phones = [("pau", 0.1), ("a", 0.2), ("pau", 0.3), ("b", 0.4), ("pau", 0.5), ("c", 0.6), ("pau", 0.7)]
    assert marks_from_phones("a b, c", phones, 100, 70) == ((0, 10), (6, 60))


def test_marks_need_phones_and_audio() -> None:
    assert marks_from_phones("hi", [], 100, 10) == ()
    assert marks_from_phones("hi", [("pau", 0.1)], 100, 10) == ()
    assert marks_from_phones("", [("a", 0.1)], 100, 10) == ()
    assert marks_from_phones("hi", [("hh", 0.1), ("ay", 5.0)], 100, 10) == ((0, 0), (2, 10))  # clamped to the audio


def test_every_word_of_a_plain_sentence_gets_its_end_from_flite(synthesizer: FliteSynthesizer) -> None:
    text = "I am going to set a timer for ten minutes."
    made = synthesizer.synthesize(text, "alloy")
    word_ends = [m.end() for m in re.finditer(r"\S+", text)]
    marked = dict(made.marks)
    assert all(end in marked for end in word_ends), (made.marks, word_ends)
    alignment = Alignment(made.sample_rate)
    alignment.add(text, len(made.samples), made.marks)
    for n, end in enumerate(word_ends):  # at a word's end that word is heard, the next one not yet
        ms = marked[end] * 1000 / made.sample_rate
        assert alignment.spoken_text(ms + 1) == text[:end]
        if n:
            assert alignment.spoken_text(ms - 1) == text[:word_ends[n - 1]]


def test_a_phrase_starting_with_a_dash_keeps_its_word_timing(synthesizer: FliteSynthesizer) -> None:
    # a clause cut at " - ", a negative number: t2p must read it as text, not as an option
    assert synthesizer.phones("-5 degrees")[:6] == ["pau", "m", "ay1", "n", "ax", "s"]
    text = "-5 degrees outside today."
    made = synthesizer.synthesize(text, "alloy")
    marked = dict(made.marks)
    assert all(m.end() in marked for m in re.finditer(r"\S+", text)), made.marks


def test_word_marks_need_phone_counts_that_add_up() -> None:
    phones = [("pau", 0.1), ("hh", 0.2), ("ay", 0.3), ("pau", 0.4), ("y", 0.5), ("uw", 0.6), ("pau", 0.7)]
    assert word_marks("Hi, you.", phones, [2, 2], 100, 100) == ((3, 30), (8, 60))
    assert word_marks("Hi, you.", phones, [2, 1], 100, 100) == ()  # flite spoke another phone
    assert word_marks("Hi, you.", phones, None, 100, 100) == ()  # t2p could not count them
    assert merge_marks(((0, 10), (8, 60)), ((3, 30), (8, 60))) == ((0, 10), (3, 30), (8, 60))


def test_flite_and_t2p_never_see_the_servers_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine core's secret and the API keys sit in the gateway's environment; the programs
    that speak get none of it (issue 39, item 9)."""
    monkeypatch.setenv("ENGINE_CORE_SECRET", "s3cret-core-secret-value")
    monkeypatch.setenv("GATEWAY_API_KEYS", "sk-live-key")
    dump = tmp_path / "env.txt"
    for name in ("flite", "t2p"):  # each writes its environment down, then lists voices or fails
        program = tmp_path / name
        program.write_text(f"#!/bin/sh\nenv >> {dump}\necho 'Voices available: slt rms'\nexit 0\n")
        program.chmod(0o755)
    synthesizer = FliteSynthesizer(str(tmp_path / "flite"))
    assert synthesizer.t2p == str(tmp_path / "t2p")
    synthesizer.phones("hello")
    with pytest.raises(RuntimeError, match="no usable WAV"):
        synthesizer.synthesize("Hello.")  # the fake writes no WAV
    seen = dump.read_text()
    assert "PATH=" in seen and seen.count("PATH=") >= 3  # all three runs were recorded
    assert "s3cret" not in seen and "sk-live-key" not in seen
