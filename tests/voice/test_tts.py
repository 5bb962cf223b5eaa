"""flite as the synthesizer: voices, the API's voice names, what it makes, its timing marks
(literals, then real output), and the child processes that speak (failures, timeouts, secrets)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import wave
from pathlib import Path

import numpy as np
import pytest

from voice.alignment import Alignment
from voice.errors import VoiceModelError
from voice.tts import OPENAI_VOICES, FliteSynthesizer, check_reply, marks_from_phones, merge_marks, word_marks


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


def test_blank_text_is_no_audio(synthesizer: FliteSynthesizer) -> None:
    assert len(synthesizer.synthesize("   \n").samples) == 0


def test_text_is_spoken_never_read_as_options(synthesizer: FliteSynthesizer) -> None:
    # An answer starting with a dash or holding control characters is spoken, not parsed.
    made = synthesizer.synthesize("-voice kal --help\x00 -o /tmp/x")
    assert made.seconds > 1.0 and made.sample_rate == 16_000


def test_an_over_long_text_is_a_callers_bug() -> None:
    with pytest.raises(ValueError):
        FliteSynthesizer().synthesize("word " * 1000)


def test_a_missing_library_is_a_clear_start_up_error(tmp_path: Path) -> None:
    with pytest.raises(VoiceModelError, match="no flite library"):
        FliteSynthesizer(str(tmp_path / "libflite.so.1"))
    not_flite = tmp_path / "libflite.so.1"
    not_flite.write_text("not a shared library")
    with pytest.raises(VoiceModelError, match="libflite could not be loaded"):  # the child says why
        FliteSynthesizer(str(not_flite))


@pytest.mark.skipif(shutil.which("flite") is None, reason="the flite program is not installed")
@pytest.mark.parametrize("voice", ["slt", "rms", "kal16"])
def test_a_phrase_sounds_as_the_flite_program_says_it(synthesizer: FliteSynthesizer, tmp_path: Path,
                                                      voice: str) -> None:
    # rms draws noise from libc's rand: the child seeds it per phrase, so a phrase spoken after
    # others is still the same audio, sample for sample.
    text = "The moon is about 384,400 kilometers away, isn't it?"
    synthesizer.synthesize("Something else first.", voice)
    made = synthesizer.synthesize(text, voice)
    subprocess.run(["flite", "-voice", voice, "-o", str(tmp_path / "x.wav"), "-t", text], check=True,
                   capture_output=True, timeout=60)
    with wave.open(str(tmp_path / "x.wav"), "rb") as w:
        expected = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        assert made.sample_rate == w.getframerate()
    assert np.array_equal(made.samples, expected)


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
    # a clause cut at " - ", a negative number: spoken as text, never read as an option
    assert synthesizer.phones("-5 degrees")[:6] == ["pau", "m", "ay", "n", "ax", "s"]
    text = "-5 degrees outside today."
    made = synthesizer.synthesize(text, "alloy")
    marked = dict(made.marks)
    assert all(m.end() in marked for m in re.finditer(r"\S+", text)), made.marks
    # A dash on its own is no word flite says: the words after it keep their own ends, in order.
    text = "- five degrees, Mr. Smith said."
    made = synthesizer.synthesize(text, "ash")
    marked = dict(made.marks)
    ends = [m.end() for m in re.finditer(r"\S+", text)][1:]
    assert all(end in marked for end in ends), made.marks
    assert [marked[end] for end in ends] == sorted(marked[end] for end in ends)
    assert marked[ends[0]] < made.samples.size / 3  # "five" ends early, not where the phrase does


def test_word_marks_need_phone_counts_that_add_up() -> None:
    phones = [("pau", 0.1), ("hh", 0.2), ("ay", 0.3), ("pau", 0.4), ("y", 0.5), ("uw", 0.6), ("pau", 0.7)]
    assert word_marks("Hi, you.", phones, [2, 2], 100, 100) == ((3, 30), (8, 60))
    assert word_marks("Hi, you.", phones, [2, 1], 100, 100) == ()  # flite spoke another phone
    assert word_marks("Hi, you.", phones, None, 100, 100) == ()  # no counts
    assert word_marks("- you.", phones[3:], [0, 2], 100, 100) == ((6, 60),)  # an unspoken token: no mark
    assert merge_marks(((0, 10), (8, 60)), ((3, 30), (8, 60))) == ((0, 10), (3, 30), (8, 60))


def test_the_flite_processes_never_see_the_servers_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine core's secret and the API keys sit in the gateway's environment; the processes
    that speak get none of it (issue 39, item 9)."""
    monkeypatch.setenv("ENGINE_CORE_SECRET", "s3cret-core-secret-value")
    monkeypatch.setenv("GATEWAY_API_KEYS", "sk-live-key")
    synthesizer = FliteSynthesizer(processes=2)
    try:
        pids = synthesizer.child_pids()
        assert len(pids) == 2
        for pid in pids:
            seen = Path(f"/proc/{pid}/environ").read_bytes()
            assert b"PATH=" in seen
            assert b"s3cret" not in seen and b"sk-live-key" not in seen
    finally:
        synthesizer.close()


def test_a_child_that_dies_is_replaced(synthesizer: FliteSynthesizer) -> None:
    alone = FliteSynthesizer()
    try:
        (pid,) = alone.child_pids()
        os.kill(pid, 9)
        with pytest.raises(RuntimeError, match="flite did not speak"):
            alone.synthesize("Are you there?")
        (fresh,) = alone.child_pids()
        assert fresh != pid
        assert alone.synthesize("Are you there?").seconds > 0.5
    finally:
        alone.close()


def _fake_python(tmp_path: Path, behaviour: str) -> str:
    """A "python" that runs a child which says hello with one voice, then ``behaviour``."""
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, struct, sys, time\n"
        "def send(b):\n    os.write(1, struct.pack('>I', len(b)) + b)\n"
        "send(json.dumps({'voices': ['slt']}).encode())\n"
        "os.read(0, 65536)\n" + behaviour + "\n")
    program = tmp_path / "python"
    program.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    program.chmod(0o755)
    return str(program)


@pytest.mark.parametrize(("behaviour", "said"), [
    ("time.sleep(60)", "did not answer in time"),
    ("os.write(1, struct.pack('>I', 1 << 30)); time.sleep(60)", "frame of 1073741824 bytes"),
    ("send(b'[1, 2]'); send(b''); time.sleep(60)", "not an object"),
    ("send(json.dumps({'rate': 16000, 'phones': 'x', 'words': []}).encode()); send(b''); time.sleep(60)",
     "out of shape"),
    ("sys.exit(3)", "exited with 3"),
])
def test_a_stuck_or_lying_child_is_killed_with_a_reason(tmp_path: Path, behaviour: str, said: str) -> None:
    synthesizer = FliteSynthesizer(python=_fake_python(tmp_path, behaviour), timeout_s=1.0)
    try:
        (pid,) = synthesizer.child_pids()
        with pytest.raises(RuntimeError, match=said):
            synthesizer.synthesize("Hello.")
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        assert synthesizer.child_pids() != [pid]  # a fresh one waits for the next phrase
    finally:
        synthesizer.close()


def test_replies_are_checked_before_they_are_trusted() -> None:
    good = {"rate": 16000, "phones": [["pau", 0.1], ["hh", 0.2]], "words": [1]}
    assert check_reply(good, b"\0\0") == (16000, [("pau", 0.1), ("hh", 0.2)], [1])
    for bad, samples in [({**good, "rate": 1}, b""), (good, b"\0"), ({**good, "words": [-1]}, b""),
                         ({**good, "phones": [["a"]]}, b""), ({"error": "no voice 'x'"}, b"")]:
        with pytest.raises(RuntimeError):
            check_reply(bad, samples)


def test_two_callers_speak_at_once_each_their_own_phrase() -> None:
    synthesizer = FliteSynthesizer(processes=2)
    texts = ["The first caller's phrase.", "And the second one, a little longer than the first."]
    made: dict[str, int] = {}
    try:
        expected = {text: len(synthesizer.synthesize(text).samples) for text in texts}
        threads = [threading.Thread(target=lambda t=text: made.__setitem__(t, len(synthesizer.synthesize(t).samples)))
                   for text in texts for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert made == expected
    finally:
        synthesizer.close()
