"""Turn detection: has the user finished their turn? Smart Turn v3 (ONNX, run by onnxruntime).

The model ships in Pipecat's wheel (``pipecat-ai`` 1.14.0, BSD-2-Clause:
``pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx``, 8.7 MB, int8), installed by hash
without its dependencies and never imported (importing pipecat pulls in loguru, soxr and more).
It is a Whisper-tiny encoder with a linear head: input ``input_features`` float32
``[batch, 80, 800]``, Whisper log-mel features of 8 s at 16 kHz; output ``logits`` ``[batch, 1]``,
already a probability (Pipecat's ``LocalSmartTurnAnalyzerV3`` reads it as one; the graph ends in
a sigmoid).

The preprocessing is Pipecat's (``local_smart_turn_v3._predict_endpoint`` and
``_whisper_features.compute_whisper_log_mel_features``), reproduced here:

1. keep the last 8 s of the turn, or left-pad it with zeros to 8 s (the end of the speech sits
   at the right edge, where the model looks for it);
2. normalize the whole 8 s buffer, padding included, to zero mean and unit variance;
3. Whisper's log-mel (n_fft 400, hop 160, 80 Slaney mels, the last frame dropped, floored at
   max - 8, then (x + 4) / 4), in float64 as Pipecat computes it. faster-whisper's
   ``FeatureExtractor`` computes the same in float32/complex64: within 7e-6, but the int8 graph
   quantizes its activations, so that much moved one clip's probability from 0.66 to 0.71. In
   float64 (its mel filters, our STFT) the features equal Pipecat's (tested).

Cost here (2-core AMD EPYC, one thread): the graph ~25 ms, the features a few ms; 60-100 ms in
all while the other core's work competes (docs/voice.md). Load 0.24 s, ~115 MiB once it has run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from voice.audio import SPEECH_RATE, Float32Array
from voice.errors import VoiceModelError
from voice.onnx_session import one_thread_session

WINDOW_S = 8  # the model sees the last 8 s of a turn
WINDOW_SAMPLES = WINDOW_S * SPEECH_RATE
N_MELS = 80
N_FFT = 400
HOP = 160  # 10 ms frames
FRAMES = WINDOW_SAMPLES // HOP  # 800


def find_smart_turn() -> Path:
    """The ONNX file inside the installed pipecat-ai package, found without importing it."""
    spec = importlib.util.find_spec("pipecat")
    if spec is None or not spec.submodule_search_locations:
        raise VoiceModelError("the Smart Turn model comes with the pipecat-ai package, which is not installed "
                              "(make install does it)")
    path = (Path(next(iter(spec.submodule_search_locations))) / "audio" / "turn" / "smart_turn" / "data"
            / "smart-turn-v3.2-cpu.onnx")
    if not path.is_file():
        raise VoiceModelError(f"the Smart Turn model is not at {path} (pipecat-ai's layout changed?)")
    return path


def last_window(samples_16k: Float32Array) -> Float32Array:
    """The last 8 s, or the samples left-padded with zeros to 8 s (Pipecat's
    ``truncate_audio_to_last_n_seconds``)."""
    x = np.asarray(samples_16k, np.float32)[-WINDOW_SAMPLES:]
    if len(x) < WINDOW_SAMPLES:
        x = np.concatenate([np.zeros(WINDOW_SAMPLES - len(x), np.float32), x])
    return x


class TurnModel:
    """Smart Turn v3, loaded once and shared by every session (``InferenceSession.run`` is
    thread-safe and the model keeps no state between calls)."""

    def __init__(self, path: str | Path = "auto") -> None:
        self.path = find_smart_turn() if path == "auto" else Path(path)
        # One thread, no spinning, as the VAD (voice/onnx_session.py): an inference is ~25 ms.
        self._session = one_thread_session(self.path, "Smart Turn v3", ["input_features"], sequential=True)
        # Slaney mel filters [80, 201], in float64 as Pipecat's: faster_whisper's feature_extractor
        # module is plain numpy (its package import, which loads CTranslate2, is lazy here too).
        from faster_whisper.feature_extractor import FeatureExtractor

        self._mel_filters = FeatureExtractor.get_mel_filters(SPEECH_RATE, N_FFT, n_mels=N_MELS)
        self._window = np.hanning(N_FFT + 1)[:-1]  # periodic Hann, as torch.hann_window

    def features(self, samples_16k: Float32Array) -> Float32Array:
        """The model's input for a turn: ``[80, 800]`` log-mel of its last 8 s, normalized."""
        x = last_window(samples_16k)
        x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)  # in float32, over the padding too, as Pipecat
        padded = np.pad(x.astype(np.float64), N_FFT // 2, mode="reflect")
        frames = sliding_window_view(padded, N_FFT)[::HOP]  # [801, 400]
        power = np.abs(np.fft.rfft(frames * self._window, axis=-1)) ** 2  # [801, 201]
        log_mel = np.log10(np.maximum(self._mel_filters @ power.T, 1e-10))[:, :-1]  # [80, 800]
        log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
        return ((log_mel + 4.0) / 4.0).astype(np.float32)

    def end_probability(self, samples_16k: Float32Array) -> float:
        """How likely the turn is over, given its audio so far (16 kHz float32, any length; only
        the last 8 s count). Blocking, ~25 ms."""
        (out,) = self._session.run(None, {"input_features": self.features(samples_16k)[None]})
        return float(np.asarray(out).reshape(-1)[0])
