"""``semantic_vad``: the VAD proposes an end of turn after a short pause, the turn models decide.

Pipecat's scheme (``SmartTurnParams``: a VAD stop of 0.2 s, then Smart Turn on the turn so far),
with the words as a second opinion:

- Silero VAD segments speech as for ``server_vad`` (``voice.vad.SpeechSegmenter``), but reports
  a pause (``SpeechPaused``) after ``TRANSCRIBE_MS`` of silence: the session starts transcribing
  then, so that the words are ready when they are needed (a pause that ends in more speech costs
  a recognition: the session's budget counts it, ``voice.pool``);
- at ``PAUSE_MS`` (``CONFIRMED_PAUSE_MS`` with ``confirm``) the turn model (``voice.turn``) scores the turn's audio so far (from its
  reported start, the last 8 s): at ``END_THRESHOLD`` or above, the turn ends at once
  (``SpeechStopped``, its ``audio_end_ms`` where the decision was made, its ``speech_end_ms`` where
  the silence began);
- below, the segmenter waits and asks again every ``RECHECK_MS`` of further silence, and ends the
  turn anyway once the silence reaches ``max_wait_ms`` (the eagerness's bound);
- speech that resumes cancels the pending end (the inner segmenter simply goes on);
- with ``confirm`` (a text turn model runs: ``voice.text_turn``), the model's end is a proposal
  (``SpeechEndProposed``): the caller reads the transcript started at the pause and ends the turn
  with ``confirm_end`` when the words are finished too, or leaves it open (more speech, or the
  eagerness's bound, ends it). The audio model is not asked again in that silence: its answer
  would be the same, and so would the words.

Measured (bench/voice_sessions.py at one session, docs/benchmarks.md): transcribing at 96 ms and
judging at 160 with the words to confirm, instead of both at Pipecat's 200, took the first answer
audio from 510-545 to 395-430 ms after the end of speech in short runs; the end then waits for
the words (~130 ms of recognition and judgement), not for the audio model.

The model runs inline, on the caller's thread (~25 ms here: docs/voice.md). Audio is fed to the
inner segmenter one 32 ms window at a time, so the decisions fall on the same windows whatever
the size of the appends (a 6 s recording in one append is judged as if it had been streamed).
Not thread-safe (one per session).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from voice.audio import SPEECH_RATE, Float32Array, Int16Array, to_float32
from voice.turn import WINDOW_SAMPLES, TurnModel
from voice.vad import (
    WINDOW,
    SileroVad,
    SpeechPaused,
    SpeechSegmenter,
    SpeechStarted,
    SpeechStopped,
    VadEvent,
    VadParams,
)

PAUSE_MS = 200  # the turn model's first judgement, this far into a silence: Pipecat's stop_secs
# ... or with the words to confirm it, sooner: at 160 ms Smart Turn ends more turns early (flite's
# "Please turn on the" with a pause after it: 0.04 at 224 ms, over 0.5 at 160), which the words hold.
CONFIRMED_PAUSE_MS = 160
TRANSCRIBE_MS = 96  # the pause reported (the transcription starts) this far into a silence
RECHECK_MS = 300  # ask the model again after this much more silence
END_THRESHOLD = 0.5  # Smart Turn's own: "complete" above it


@dataclass(frozen=True)
class SpeechEndProposed:
    """The turn model judged the turn over in the silence that began at ``speech_end_ms`` (the
    ``SpeechPaused`` of that silence came first), at ``audio_end_ms``: ``confirm_end(speech_end_ms)``
    ends it there."""

    speech_end_ms: int
    audio_end_ms: int


SemanticEvent = VadEvent | SpeechEndProposed


class SemanticSegmenter:
    """One session's ``semantic_vad``: ``feed`` as ``SpeechSegmenter.feed`` (16 kHz samples in,
    events out, ms since the first sample). ``max_wait_ms``: the silence after which a turn ends
    whatever the model says. ``judgements`` records each judgement (silence ms, probability)
    of the current or last turn, for tests and logs. ``confirm``: the model's end is proposed, not
    made (``SpeechEndProposed``, ``confirm_end``)."""

    def __init__(self, vad: SileroVad, turn: TurnModel, params: VadParams, max_wait_ms: int, *,
                 confirm: bool = False) -> None:
        assert max_wait_ms > PAUSE_MS
        self.turn = turn
        self.confirm = confirm
        self._segmenter = SpeechSegmenter(vad, VadParams(
            threshold=params.threshold, prefix_padding_ms=params.prefix_padding_ms,
            silence_duration_ms=max_wait_ms, min_speech_ms=params.min_speech_ms, pause_ms=TRANSCRIBE_MS))
        # The last samples fed, as the chunks they came in (up to 8 s and one feed's worth): joined
        # only when the model judges, at a pause, not copied on every feed.
        self._recent: deque[Float32Array] = deque()
        self._recent_len = 0
        self._recent_start = 0  # sample index of the first sample in _recent since the first sample fed
        self._fed = 0  # samples fed to the inner segmenter
        self._turn_start = 0  # sample index the current turn's audio begins at (its reported start)
        self._next_check_ms: int | None = None  # silence length at which to ask the model next
        self._proposed: SpeechEndProposed | None = None  # the end awaiting confirm_end
        self.judgements: list[tuple[int, float]] = []

    @property
    def in_speech(self) -> bool:
        return self._segmenter.in_speech

    def feed(self, samples: Float32Array | Int16Array) -> list[SemanticEvent]:
        chunk = to_float32(samples) if samples.dtype == np.int16 else samples.astype(np.float32, copy=False)
        self._remember(chunk)
        events: list[SemanticEvent] = []
        # Window by window, so that a decision falls where the silence reached its length.
        pos = 0
        while pos < len(chunk):
            end = min(pos + WINDOW - self._fed % WINDOW, len(chunk))
            for event in self._segmenter.feed(chunk[pos:end]):
                events.append(event)
                if isinstance(event, SpeechStarted):
                    self._turn_start = event.audio_start_ms * SPEECH_RATE // 1000
                    self.judgements = []
                elif isinstance(event, SpeechPaused):
                    self._next_check_ms = CONFIRMED_PAUSE_MS if self.confirm else PAUSE_MS
            self._fed += end - pos
            pos = end
            stopped = self._judge()
            if stopped is not None:
                events.append(stopped)
        return events

    def confirm_end(self, speech_end_ms: int) -> SpeechStopped | None:
        """End the turn proposed at ``speech_end_ms`` where the turn model judged it over (the audio
        since, silent, comes before the next turn); None when that silence is over (the user went
        on, or the eagerness's bound ended the turn)."""
        proposed, self._proposed = self._proposed, None
        if (proposed is None or proposed.speech_end_ms != speech_end_ms
                or self._segmenter.silence_start_ms != speech_end_ms):
            return None
        return self._segmenter.end_speech(proposed.audio_end_ms)

    def _judge(self) -> SemanticEvent | None:
        silence_start = self._segmenter.silence_start_ms
        if silence_start is None or self._next_check_ms is None:
            if silence_start is None:
                self._next_check_ms = None  # speech resumed (or ended): nothing pending
            return None
        silent_ms = self._segmenter.windows_ms - silence_start
        if silent_ms < self._next_check_ms:
            return None
        p = self.turn.end_probability(self._turn_audio())
        self.judgements.append((silent_ms, p))
        if p >= END_THRESHOLD:
            self._next_check_ms = None
            if not self.confirm:
                return self._segmenter.end_speech()
            self._proposed = SpeechEndProposed(silence_start, self._segmenter.windows_ms)
            return self._proposed
        self._next_check_ms = silent_ms + RECHECK_MS
        return None

    def _remember(self, chunk: Float32Array) -> None:
        keep = WINDOW_SAMPLES + WINDOW + len(chunk)  # the model's 8 s, the window not yet scored, this feed
        self._recent.append(chunk)
        self._recent_len += len(chunk)
        while self._recent_len - len(self._recent[0]) >= keep:  # whole chunks no judgement can reach
            dropped = self._recent.popleft()
            self._recent_len -= len(dropped)
            self._recent_start += len(dropped)

    def _turn_audio(self) -> Float32Array:
        """The turn so far, up to the last sample scored (at most the last 8 s of it)."""
        end = self._segmenter.windows_ms * SPEECH_RATE // 1000
        start = max(self._turn_start, end - WINDOW_SAMPLES, self._recent_start)
        recent = np.concatenate(self._recent) if self._recent else np.zeros(0, np.float32)
        return recent[start - self._recent_start:end - self._recent_start]
