"""The real models, loaded once per test session (speech clips: voice_clips.py).

No test here skips when a model or flite is missing: ``make test`` installs them, and a voice
test that quietly skipped would hide a broken install.
"""

from __future__ import annotations

import pytest

from voice.asr import WhisperRecognizer
from voice.tts import FliteSynthesizer
from voice.vad import SileroVad


@pytest.fixture(scope="session")
def vad_model() -> SileroVad:
    return SileroVad()


@pytest.fixture(scope="session")
def recognizer() -> WhisperRecognizer:
    return WhisperRecognizer(threads=1, workers=1)


@pytest.fixture(scope="session")
def synthesizer() -> FliteSynthesizer:
    return FliteSynthesizer()
