"""A session's input audio: the buffer the client appends to, its rate bound, and turn detection.

Pure state, no I/O: the session hands each appended chunk here and gets back what the voice
activity detector saw (speech started / stopped, in ms from the first audio of the session),
then takes the committed speech out of the buffer. The detector itself is injected
(``SegmenterFactory``): the gateway's wraps the Silero model of ``voice``; tests use a scripted
one. Audio is PCM16 mono at 24 kHz throughout (``audio_events.PCM_RATE``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.ws.audio_events import PCM_BYTES_PER_MS, ServerVad
from gateway.ws.events import SessionLimits
from gateway.ws.fields import ProtocolError
from llm_shared.token_bucket import TokenBucket

MIN_COMMIT_MS = 100  # the API refuses to commit less audio than this


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int  # where the speech begins, prefix padding included, from the session's first audio


@dataclass(frozen=True)
class SpeechPaused:
    speech_end_ms: int  # the user has been silent since: the speech may be over (or resume)


@dataclass(frozen=True)
class SpeechResumed:
    speech_end_ms: int  # the paused silence that speech came back in: the turn did not end there


@dataclass(frozen=True)
class SpeechEndProposed:
    """semantic_vad: the audio says the turn ended, at ``audio_end_ms``, in the silence begun at
    ``speech_end_ms``; the words confirm it (``InputAudio.confirm_end``)."""

    speech_end_ms: int
    audio_end_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int  # where the speech ends, the silence that ended it included
    speech_end_ms: int  # where that silence began


SpeechEvent = SpeechStarted | SpeechPaused | SpeechResumed | SpeechEndProposed | SpeechStopped


class Segmenter(Protocol):
    """Server VAD over one stream of PCM16 at 24 kHz: ms counted from its first sample."""

    def feed(self, pcm: bytes) -> list[SpeechEvent]: ...

    def confirm_end(self, speech_end_ms: int) -> SpeechStopped | None:
        """End the turn a ``SpeechEndProposed`` proposed, now; None if that silence is over
        (a segmenter that never proposes: always None)."""
        ...


SegmenterFactory = Callable[[ServerVad], Segmenter]


class InputAudio:
    """The input audio buffer: audio appended since the last commit or clear, starting at
    ``start_ms`` of the session's audio; with server VAD, the segmenter's view of it."""

    def __init__(self, limits: SessionLimits, segmenters: SegmenterFactory | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limits = limits
        self._segmenters = segmenters
        self._clock = clock
        self._buffer = bytearray()
        self.start_ms = 0  # session audio position of the buffer's first byte
        self.total_ms = 0  # every ms of audio appended in this session
        self._segmenter: Segmenter | None = None
        self._segmenter_origin = 0  # session ms of the current segmenter's first sample
        self._vad: ServerVad | None = None
        self.speech_start_ms: int | None = None  # speech in progress (server VAD), from its start
        self._rate = TokenBucket(limits.max_audio_bytes_per_s, limits.audio_burst_bytes, clock())

    @property
    def buffered_ms(self) -> int:
        return len(self._buffer) // PCM_BYTES_PER_MS

    def configure(self, vad: ServerVad | None) -> None:
        """Turn detection changed: a fresh detector from the current position (or none)."""
        if vad == self._vad:
            return
        self._vad = vad
        self.speech_start_ms = None
        self._segmenter = self._segmenters(vad) if vad is not None and self._segmenters is not None else None
        self._segmenter_origin = self.total_ms

    def append(self, pcm: bytes) -> list[SpeechEvent]:
        """Add audio; what the detector saw in it, in session ms. Refused (the buffer unchanged)
        when it comes faster than the rate bound or would overfill the buffer."""
        if len(self._buffer) + len(pcm) > self._limits.max_audio_buffer_ms * PCM_BYTES_PER_MS:
            raise ProtocolError("input_audio_buffer_full", f"the input audio buffer holds at most "
                                f"{self._limits.max_audio_buffer_ms} ms; commit or clear it", "audio")
        if not self._rate.take(len(pcm), self._clock()):
            speed = self._limits.max_audio_bytes_per_s / (PCM_BYTES_PER_MS * 1000)
            raise ProtocolError("audio_rate_exceeded", f"audio is arriving faster than {speed:g}x real time; this "
                                "chunk was dropped: send audio as it is captured", "audio")
        if self.speech_start_ms is None and self._vad is not None:
            # Between turns only the prefix padding can still become part of one: keep no more.
            self._drop_before(self.total_ms - self._vad.prefix_padding_ms)
        self._buffer += pcm
        self.total_ms = self.start_ms + self.buffered_ms
        if self._segmenter is None:
            return []
        events = [self._absolute(e) for e in self._segmenter.feed(pcm)]
        for event in events:
            if isinstance(event, SpeechStarted):
                self.speech_start_ms = event.audio_start_ms
            elif isinstance(event, SpeechStopped):
                self.speech_start_ms = None
        return events

    def confirm_end(self, speech_end_ms: int) -> SpeechStopped | None:
        """The turn proposed to end in the silence begun at ``speech_end_ms`` (session ms) ends
        where it was proposed to; None if the user went on, or it ended already."""
        if self._segmenter is None or self.speech_start_ms is None:
            return None
        stopped = self._segmenter.confirm_end(speech_end_ms - self._segmenter_origin)
        if stopped is None:
            return None
        self.speech_start_ms = None
        return SpeechStopped(stopped.audio_end_ms + self._segmenter_origin, stopped.speech_end_ms + self._segmenter_origin)

    def peek(self, start_ms: int, end_ms: int) -> bytes:
        """A copy of the audio of [start_ms, end_ms) (clamped to the buffer), left in it."""
        lo = max(start_ms - self.start_ms, 0) * PCM_BYTES_PER_MS
        hi = min(max(end_ms - self.start_ms, 0) * PCM_BYTES_PER_MS, len(self._buffer))
        return bytes(self._buffer[lo:hi]) if hi > lo else b""

    def take(self, start_ms: int, end_ms: int) -> bytes:
        """The audio of [start_ms, end_ms) (clamped to the buffer), removed with all before it."""
        audio = self.peek(start_ms, end_ms)
        self._drop_before(end_ms)
        return audio

    def commit(self) -> bytes:
        """The whole buffer (the client's commit), emptied; speech in progress is ended by it."""
        if self.buffered_ms < MIN_COMMIT_MS:
            raise ProtocolError("input_audio_buffer_commit_empty", f"buffer too small: expected at least "
                                f"{MIN_COMMIT_MS} ms of audio, have {self.buffered_ms} ms")
        self.speech_start_ms = None
        return self.take(self.start_ms, self.total_ms)

    def clear(self) -> None:
        self.speech_start_ms = None
        self._drop_before(self.total_ms)

    def _drop_before(self, ms: int) -> None:
        cut = min(max(ms - self.start_ms, 0), self.buffered_ms)
        if cut:
            del self._buffer[:cut * PCM_BYTES_PER_MS]
            self.start_ms += cut

    def _absolute(self, event: SpeechEvent) -> SpeechEvent:
        origin = self._segmenter_origin
        if isinstance(event, SpeechStarted):
            return SpeechStarted(event.audio_start_ms + origin)
        if isinstance(event, SpeechPaused):
            return SpeechPaused(event.speech_end_ms + origin)
        if isinstance(event, SpeechResumed):
            return SpeechResumed(event.speech_end_ms + origin)
        if isinstance(event, SpeechEndProposed):
            return SpeechEndProposed(event.speech_end_ms + origin, event.audio_end_ms + origin)
        return SpeechStopped(event.audio_end_ms + origin, event.speech_end_ms + origin)
