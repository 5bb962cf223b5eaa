"""Voice activity: Silero VAD (v6, ONNX, run by onnxruntime without torch) and a per-session
segmenter with the Realtime API's ``server_vad`` semantics.

The model file ships in the faster-whisper wheel (``faster_whisper/assets/silero_vad_v6.onnx``,
1.2 MB, MIT). Its graph, read with onnxruntime: input ``input`` float32 ``[n, 576]`` (n windows of
512 samples at 16 kHz, each preceded by the last 64 samples of the window before it, zeros for the
first), LSTM state ``h`` and ``c`` ``[1, 1, 128]``; outputs ``speech_probs`` ``[n]`` and the state
after the last window, ``hn`` and ``cn``. The LSTM runs along the n axis, so n windows in one call
give the same probabilities as n calls of one window with the state carried (checked: identical to
the last bit), and a segmenter batches whatever whole windows an append brings.

Cost here (2-core AMD EPYC, one intra-op thread): ~60 us per 32 ms window called one at a time,
less batched; ~0.2% of a core per live session. That is cheap enough to run on the event loop
inside the append handler; a thread hop would cost more than the work.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from voice.audio import SPEECH_RATE, Float32Array, Int16Array, to_float32
from voice.errors import VoiceModelError
from voice.onnx_session import one_thread_session

WINDOW = 512  # samples at 16 kHz: 32 ms, the only window size the v6 graph takes
CONTEXT = 64  # samples of the previous window the graph sees before each window
WINDOW_MS = WINDOW * 1000 // SPEECH_RATE


def find_silero_vad() -> Path:
    """The ONNX file inside the installed faster-whisper package, found without importing it
    (importing faster_whisper loads CTranslate2 and PyAV)."""
    spec = importlib.util.find_spec("faster_whisper")
    if spec is None or not spec.submodule_search_locations:
        raise VoiceModelError("the Silero VAD model comes with the faster-whisper package, which is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "assets" / "silero_vad_v6.onnx"
    if not path.is_file():
        raise VoiceModelError(f"the Silero VAD model is not at {path} (faster-whisper's assets changed?)")
    return path


@dataclass
class VadState:
    """One stream's model state: the LSTM's and the 64 samples the next window is preceded by."""

    h: np.ndarray = field(default_factory=lambda: np.zeros((1, 1, 128), np.float32))
    c: np.ndarray = field(default_factory=lambda: np.zeros((1, 1, 128), np.float32))
    context: Float32Array = field(default_factory=lambda: np.zeros(CONTEXT, np.float32))


class SileroVad:
    """The model, loaded once and shared by every session (``InferenceSession.run`` is
    thread-safe; the state lives in each caller's ``VadState``)."""

    def __init__(self, path: str | Path = "auto") -> None:
        self.path = find_silero_vad() if path == "auto" else Path(path)
        self._session = one_thread_session(self.path, "Silero VAD", ["input", "h", "c"])

    def probabilities(self, samples: Float32Array, state: VadState) -> Float32Array:
        """Speech probability of each whole 512-sample window in ``samples`` (its length a multiple
        of 512), updating ``state`` in place."""
        n = len(samples) // WINDOW
        assert n * WINDOW == len(samples), "whole windows only"
        if n == 0:
            return np.zeros(0, np.float32)
        windows = samples.reshape(n, WINDOW)
        batch = np.empty((n, CONTEXT + WINDOW), np.float32)
        batch[:, CONTEXT:] = windows
        batch[0, :CONTEXT] = state.context
        batch[1:, :CONTEXT] = windows[:-1, -CONTEXT:]
        probs, state.h, state.c = self._session.run(None, {"input": batch, "h": state.h, "c": state.c})
        state.context = windows[-1, -CONTEXT:].copy()
        return np.asarray(probs, np.float32).reshape(n)


@dataclass(frozen=True)
class VadParams:
    """``turn_detection`` of type ``server_vad``. Defaults are the Realtime API's."""

    threshold: float = 0.5  # speech once a window's probability reaches this
    prefix_padding_ms: int = 300  # audio kept before the detected start
    silence_duration_ms: int = 500  # silence that ends speech
    # Speech must last this long before it counts (a click or a cough of one window does not
    # cancel a response); the start reported is still the first window's. Not an API field.
    min_speech_ms: int = 64
    # A silence this long within speech is reported (``SpeechPaused``), before silence_duration_ms
    # ends the speech: the gateway starts transcribing then, so the transcript is ready (or nearly)
    # when the speech is over. 0: never. Not an API field.
    pause_ms: int = 160

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in 0..1, got {self.threshold}")
        for name in ("prefix_padding_ms", "silence_duration_ms", "min_speech_ms", "pause_ms"):
            value = getattr(self, name)
            if not 0 <= value <= 60_000:
                raise ValueError(f"{name} must be in 0..60000, got {value}")

    @property
    def neg_threshold(self) -> float:
        # Silero's hysteresis: speech ends only below threshold - 0.15, so a probability that
        # hovers around the threshold does not start and stop speech every window.
        return max(self.threshold - 0.15, 0.01)


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int  # as the API reports it: speech start minus prefix padding, floored
    speech_start_ms: int  # the first speech window's start


@dataclass(frozen=True)
class SpeechStopped:
    # As the API reports it: where the silence that ended speech reached silence_duration_ms,
    # i.e. the end of the audio committed, silence included.
    audio_end_ms: int
    speech_end_ms: int  # where that silence began


@dataclass(frozen=True)
class SpeechPaused:
    """Speech has been silent for ``pause_ms`` since ``speech_end_ms``: it may be over (a
    ``SpeechStopped`` with the same ``speech_end_ms`` follows if the silence lasts) or resume."""

    speech_end_ms: int


@dataclass(frozen=True)
class SpeechResumed:
    """Speech came back within the silence a ``SpeechPaused`` reported (begun at
    ``speech_end_ms``): the turn did not end there, and what was started for that end is moot."""

    speech_end_ms: int


VadEvent = SpeechStarted | SpeechPaused | SpeechResumed | SpeechStopped


class SpeechSegmenter:
    """One session's server VAD. ``feed`` takes 16 kHz float32 samples in chunks of any size and
    returns the events they complete; times are ms since the first sample fed. Chunking does not
    change the events: samples are windowed as one stream. Not thread-safe (one per session)."""

    def __init__(self, model: SileroVad, params: VadParams | None = None) -> None:
        self.model = model
        self.params = params or VadParams()
        self._state = VadState()
        self._pending = np.zeros(0, np.float32)  # samples short of a whole window
        self._windows = 0  # windows scored since the stream began
        self._candidate: int | None = None  # first window of speech not yet long enough to count
        self._speaking_since: int | None = None  # first window of the current speech
        self._silence_since: int | None = None  # first window of silence within speech
        self._floor_ms = 0  # a start's padding reaches back no further than the last stop
        self._paused_at: int | None = None  # the silence a SpeechPaused was reported for
        self.last_probability = 0.0

    @property
    def in_speech(self) -> bool:
        return self._speaking_since is not None

    @property
    def ms_fed(self) -> int:
        return (self._windows * WINDOW + len(self._pending)) * 1000 // SPEECH_RATE

    @property
    def silence_start_ms(self) -> int | None:
        """Where the silence within speech in progress began; None when there is none."""
        if self._speaking_since is None or self._silence_since is None:
            return None
        return self._silence_since * WINDOW_MS

    @property
    def windows_ms(self) -> int:
        """The end of the last whole window scored: where an end decided now would fall."""
        return self._windows * WINDOW_MS

    def end_speech(self, end_ms: int | None = None) -> SpeechStopped:
        """End the speech in progress, in a silence (a turn model judged it over before
        ``silence_duration_ms``): the stop reported as if the silence had reached it at ``end_ms``
        (default: now, the last window scored; earlier: within the silence, whose windows since
        were all below the threshold and so start nothing)."""
        silence_start_ms = self.silence_start_ms
        assert silence_start_ms is not None, "only speech in a silence can be ended early"
        end_ms = self.windows_ms if end_ms is None else end_ms
        assert silence_start_ms <= end_ms <= self.windows_ms, "the end must fall within the silence"
        self._speaking_since = self._silence_since = None
        self._floor_ms = end_ms
        return SpeechStopped(end_ms, silence_start_ms)

    def set_params(self, params: VadParams) -> None:
        """New thresholds from a ``session.update``; take effect from the next window."""
        self.params = params

    def feed(self, samples: Float32Array | Int16Array) -> list[VadEvent]:
        chunk = to_float32(samples) if samples.dtype == np.int16 else samples.astype(np.float32, copy=False)
        x = np.concatenate([self._pending, chunk])
        whole = len(x) // WINDOW * WINDOW
        self._pending = x[whole:].copy()
        if whole == 0:
            return []
        probs = self.model.probabilities(x[:whole], self._state)
        events: list[VadEvent] = []
        for p in probs.tolist():
            event = self._step(p, self._windows)
            self._windows += 1
            if event is not None:
                events.append(event)
        self.last_probability = float(probs[-1])
        return events

    def _step(self, p: float, w: int) -> VadEvent | None:
        """Window ``w`` with probability ``p``: the state machine, one window at a time."""
        params = self.params
        if self._speaking_since is None:
            if self._candidate is None:
                if p < params.threshold:
                    return None
                self._candidate = w
            elif p < params.neg_threshold:
                self._candidate = None  # too short to be speech
                return None
            if (w + 1 - self._candidate) * WINDOW_MS < params.min_speech_ms:
                return None
            start_ms = self._candidate * WINDOW_MS
            self._speaking_since, self._candidate, self._silence_since = self._candidate, None, None
            return SpeechStarted(max(start_ms - params.prefix_padding_ms, self._floor_ms), start_ms)
        if p >= params.threshold:
            paused = self._silence_since is not None and self._paused_at == self._silence_since
            silence_since, self._silence_since = self._silence_since, None
            if paused and silence_since is not None:
                return SpeechResumed(silence_since * WINDOW_MS)
        elif p < params.neg_threshold and self._silence_since is None:
            self._silence_since = w
        if self._silence_since is None:
            return None
        silence_start_ms = self._silence_since * WINDOW_MS
        silent_ms = (w + 1) * WINDOW_MS - silence_start_ms
        if silent_ms < params.silence_duration_ms:
            if 0 < params.pause_ms <= silent_ms and self._paused_at != self._silence_since:
                self._paused_at = self._silence_since
                return SpeechPaused(silence_start_ms)
            return None
        end_ms = silence_start_ms + params.silence_duration_ms
        self._speaking_since = self._silence_since = None
        self._floor_ms = end_ms
        return SpeechStopped(end_ms, silence_start_ms)
