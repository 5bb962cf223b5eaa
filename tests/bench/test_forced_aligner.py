"""The voice benchmark's forced aligner (its clock for ``truncate_exact``): word ends from speech,
and no answer, rather than a crash, for audio its text does not fit."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

pytest.importorskip("pocketsphinx")
if shutil.which("flite") is None:
    pytest.skip("flite is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("voice_sessions"), importlib.import_module("_voice_client")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def aligner(bench_modules):
    return bench_modules[0].ForcedAligner()


def test_word_ends_of_speech_rise_within_the_audio(bench_modules, aligner) -> None:
    text = "Book a table for four people."
    audio = bench_modules[1].speech_clips([text])[text]
    ends = aligner.word_ends_ms(text, audio)
    assert ends is not None and len(ends) == 6
    assert ends == sorted(ends) and len(set(ends)) == 6
    assert ends[-1] <= len(audio) / 48.0 + 10  # 24 kHz PCM16: 48 bytes a millisecond


def test_audio_the_text_does_not_fit_aligns_to_nothing(aligner) -> None:
    assert aligner.word_ends_ms("book a table", bytes(48 * 200)) is None  # 200 ms of silence
