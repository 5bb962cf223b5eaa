"""Speech clips for the voice tests: flite's speech through the wire rate, silences and noise,
with the bounds of the sound in them measured from the samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from voice.audio import SPEECH_RATE, Float32Array, resample
from voice.semantic import SemanticEvent, SemanticSegmenter
from voice.tts import FliteSynthesizer


@dataclass(frozen=True)
class Clip:
    samples: Float32Array  # 16 kHz
    speech_start_ms: float  # first and last sample louder than -40 dBFS: where the voice really is
    speech_end_ms: float


def loud_bounds_ms(samples: Float32Array, level: float = 0.01) -> tuple[float, float]:
    loud = np.flatnonzero(np.abs(samples) > level)
    assert loud.size, "no sound in the clip"
    return loud[0] * 1000 / SPEECH_RATE, (loud[-1] + 1) * 1000 / SPEECH_RATE


def speech(synthesizer: FliteSynthesizer, text: str, voice: str = "alloy") -> Float32Array:
    """flite's speech for ``text`` at 16 kHz float32, resampled through the 24 kHz wire rate as a
    client's audio would be."""
    made = synthesizer.synthesize(text, voice)
    at_24k = resample(made.samples, made.sample_rate, 24_000)
    return resample(at_24k, 24_000, SPEECH_RATE)


def silence(ms: int) -> Float32Array:
    return np.zeros(ms * SPEECH_RATE // 1000, np.float32)


def fed(segmenter: SemanticSegmenter, samples: Float32Array, chunk_ms: int = 100) -> list[SemanticEvent]:
    """The events of ``samples`` fed to ``segmenter`` in chunks of ``chunk_ms``, as a client streams."""
    step = chunk_ms * SPEECH_RATE // 1000
    return [e for i in range(0, len(samples), step) for e in segmenter.feed(samples[i:i + step])]


def spoken_upto(synthesizer: FliteSynthesizer, text: str, upto: str,
                voice: str = "alloy") -> tuple[Float32Array, Float32Array]:
    """``text`` spoken whole, cut where the word ``upto`` ends (flite's word marks): the speech
    before the cut and after it, one utterance's prosody (not "Please turn on the" said alone,
    which flite ends like a sentence)."""
    made = synthesizer.synthesize(text, voice)
    samples = speech(synthesizer, text, voice)
    char_end = text.index(f" {upto} ") + len(upto) + 1
    cut = round(dict(made.marks)[char_end] * SPEECH_RATE / made.sample_rate)
    return samples[:cut], samples[cut:]


def clip(*parts: Float32Array | float) -> Clip:
    """Audio and silences (a float: seconds of zeros) in order, with the bounds of the sound in it."""
    pieces = [np.zeros(round(p * SPEECH_RATE), np.float32) if isinstance(p, float) else p for p in parts]
    samples = np.concatenate(pieces).astype(np.float32)
    start, end = loud_bounds_ms(samples)
    return Clip(samples, start, end)


def noise(seconds: float, level: float, seed: int = 0) -> Float32Array:
    return (np.random.default_rng(seed).standard_normal(round(seconds * SPEECH_RATE)) * level).astype(np.float32)

