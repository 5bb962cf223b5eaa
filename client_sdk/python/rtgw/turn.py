"""One turn as the application reads it: its text deltas and function calls as they stream (and,
for a spoken answer, its transcript and audio deltas and the user's transcript), and how it
ended. The client (``client.py``) fills it from the protocol core's events, online or from the
on-device model alike. ``TurnStarted`` reports a turn the server (or the device's VAD) began."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

from rtgw.errors import OfflineModelError
from rtgw.protocol import FunctionCall, TextDelta, TranscriptDelta, TurnResult
from rtgw.voice_events import AudioDelta, InputTranscript

MAX_BUFFERED_CHARS = 8 * 1024 * 1024  # undelivered text a turn holds before deltas are merged
# Undelivered audio a turn holds (10 minutes) before its oldest deltas are dropped: a reader that
# only iterates the text of a spoken answer never takes them.
MAX_BUFFERED_AUDIO_BYTES = 48_000 * 600

Pending = str | FunctionCall | TranscriptDelta | AudioDelta | InputTranscript


class Turn:
    """One turn's stream: iterate for ``TextDelta`` events (a spoken answer's transcript too), or
    ``events()`` for the text and the turn's ``FunctionCall`` events in order, and for a spoken
    answer its ``TranscriptDelta`` and ``AudioDelta`` events and the user's ``InputTranscript``;
    or await ``result()`` / ``text()``. One reader."""

    def __init__(self, offline: bool = False) -> None:
        self.offline = offline
        self.response_id: str | None = None
        self.calls: list[FunctionCall] = []  # the function calls so far (complete or cut short)
        self.user_transcript: str | None = None  # the user's speech this turn answers, once transcribed
        self.audio_bytes = 0  # of a spoken answer, received so far (PCM16 at 24 kHz: 48 a millisecond)
        self._pending: list[Pending] = []  # undelivered deltas and calls, in order
        self._pending_chars = 0
        self._pending_audio = 0
        self._result: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None  # the offline generation, when offline
        self._response: dict[str, Any] = {}  # its response.create options, to start it again on a new session
        self._error: OfflineModelError | None = None  # the on-device model could not answer: raised, not empty
        self._cancel_reason = "client_cancelled"  # an offline turn's, when cancelled (barge-in: turn_detected)
        self._stop_speech: Callable[[], None] | None = None  # an offline spoken answer's: stops its audio at once
        self._cancelling = False  # an offline turn asked to stop, its task not ended yet

    @property
    def done(self) -> bool:
        return self._result.done()

    def _push(self, text: str) -> None:
        if not text:
            return
        pending = self._pending
        if self._pending_chars + len(text) > MAX_BUFFERED_CHARS and pending and isinstance(pending[-1], str):
            pending[-1] += text  # a reader that does not iterate: one growing delta
        else:
            pending.append(text)
        self._pending_chars += len(text)
        self._wakeup.set()

    def _call(self, call: FunctionCall) -> None:
        self.calls.append(call)
        self._pending.append(call)
        self._wakeup.set()

    def _voice(self, event: TranscriptDelta | AudioDelta | InputTranscript) -> None:
        if isinstance(event, AudioDelta):
            self.audio_bytes += len(event.pcm)
            self._pending_audio += len(event.pcm)
            while self._pending_audio > MAX_BUFFERED_AUDIO_BYTES:
                oldest = next(i for i, p in enumerate(self._pending) if isinstance(p, AudioDelta))
                self._pending_audio -= len(self._pending.pop(oldest).pcm)  # type: ignore[union-attr]
        elif isinstance(event, InputTranscript):
            self.user_transcript = event.transcript
        elif not event.text:
            return
        self._pending.append(event)
        self._wakeup.set()

    def _cancel_offline(self, reason: str = "client_cancelled") -> None:
        """Stop the on-device answer now: its speech first (nothing more is sent), then its task."""
        self._cancel_reason = reason
        self._cancelling = True
        if self._stop_speech is not None:
            self._stop_speech()
        if self._task is not None:
            self._task.cancel()

    def _finish(self, result: TurnResult) -> None:
        if not self._result.done():
            self._result.set_result(result)
        self._wakeup.set()

    def __aiter__(self) -> AsyncIterator[TextDelta]:  # the text, or a spoken answer's transcript
        return cast(AsyncIterator[TextDelta], self._stream(calls=False))

    def events(self) -> AsyncIterator[TextDelta | FunctionCall | AudioDelta | InputTranscript]:
        """The turn's text deltas and function calls, in the order they came; for a spoken answer
        its ``TranscriptDelta`` (a ``TextDelta``) and ``AudioDelta`` events, and the user's
        ``InputTranscript`` when it comes during the turn."""
        return self._stream(calls=True)

    async def _stream(self, *, calls: bool) -> AsyncIterator[TextDelta | FunctionCall | AudioDelta | InputTranscript]:
        while True:
            pending = self._pending
            if pending:
                first = pending[0]
                if not isinstance(first, str):
                    del pending[0]
                    if isinstance(first, AudioDelta):
                        self._pending_audio -= len(first.pcm)
                    if isinstance(first, TranscriptDelta):
                        yield first if calls else TextDelta(first.response_id, first.text)
                    elif calls:
                        yield first
                    continue
                n = next((i for i, p in enumerate(pending) if not isinstance(p, str)), len(pending))
                text = "".join(p for p in pending[:n] if isinstance(p, str))
                del pending[:n]
                self._pending_chars -= len(text)
                yield TextDelta(self.response_id or "", text)
                continue
            if self._result.done():
                if self._error is not None:
                    raise self._error
                return
            self._wakeup.clear()
            await self._wakeup.wait()

    async def result(self) -> TurnResult:
        """How the turn ended (``calls``: the functions it called). An offline turn whose
        on-device model could not answer raises ``OfflineModelError`` (its cause and the fix)
        instead of ending with nothing."""
        result = await asyncio.shield(self._result)
        if self._error is not None:
            raise self._error
        return result

    async def text(self) -> str:
        return (await self.result()).text


@dataclass(frozen=True)
class TurnStarted:
    """A response the server began on its own (server VAD with ``create_response``): a voice event."""

    turn: Turn
