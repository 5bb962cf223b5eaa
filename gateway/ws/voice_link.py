"""The voice commands of one Realtime connection, run off the event loop and reported back.

``Transcribe`` and ``Synthesize`` become tasks awaiting the gateway's ``VoiceService`` (which runs
recognition and synthesis on its own bounded workers); each reports to the session when done and
asks the connection to pump. ``CancelSpeech`` cancels a response's phrases still queued, so a
barge-in frees the synthesis workers within the phrase being made. Nothing here outlives the
connection: ``close`` cancels and awaits every task.

Each job is charged to the session's key first (``spend``: the key's audio seconds a minute,
``LimitsStore.spend_audio``): an utterance by its length, a phrase by the length its text will
take to say. A refusal fails that transcription or that spoken answer with the limit's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.metrics import GatewayMetrics
from gateway.ws.commands import CancelSpeech, CancelTranscription, Synthesize, Transcribe
from gateway.ws.server_events import AudioDelta, OtherEvent, ServerEvent
from gateway.ws.session import RealtimeSession
from gateway.ws.speech_out import PhraseSplitter
from gateway.ws.voice_input import VoiceHooks
from llm_shared.errors import EngineError
from voice.alignment import Mark

log = logging.getLogger(__name__)

WIRE_BYTES_PER_S = 48_000  # PCM16 mono at 24 kHz
SPOKEN_CHARS_PER_S = 15.0  # a phrase is charged before it is made, at about flite's pace


@dataclass(frozen=True)
class Heard:
    """A transcript (its pieces reached ``on_piece`` as they were decoded)."""

    text: str
    seconds: float  # of audio
    finished: bool | None = None  # asked for (judge_end): the words are a finished turn; None: not judged


@dataclass(frozen=True)
class _SpokenAhead:
    """The first phrase of an answer started ahead of its turn's end, being spoken before its
    response asks for it."""

    response_id: str
    text: str
    voice: str
    job: asyncio.Task[tuple[bytes, tuple[Mark, ...]]]


class VoiceService(Protocol):
    """Speech in and out for every session of a gateway process."""

    hooks: VoiceHooks

    async def transcribe(self, audio: bytes, owner: Hashable = None,
                         on_piece: Callable[[str], None] | None = None, speculative: bool = False,
                         judge_end: bool = False, prompt: str | None = None) -> Heard:
        """PCM16 mono at 24 kHz -> what was said, in ``owner``'s (the session's) turn of the
        shared workers; ``on_piece`` hears each piece as it is decoded (on this event loop);
        ``speculative``: a job started at a pause, which may be skipped to save the session's
        recognition budget for the turn's end; ``judge_end``: also whether the words are a finished
        turn (``Heard.finished``, semantic_vad's confirmation); ``prompt``: the session's
        transcription prompt ("" for none; None: the server's). Raises ``EngineError`` (busy, rate-limited, timed
        out: its message and code are for the client)."""
        ...

    async def synthesize(self, text: str, voice: str, owner: Hashable = None) -> tuple[bytes, tuple[Mark, ...]]:
        """Speech for ``text`` as PCM16 mono at 24 kHz, with timing marks (character offset, sample
        offset at 24 kHz; may be empty). Raises ``EngineError`` as ``transcribe``."""
        ...


class VoiceLink:
    def __init__(self, service: VoiceService, session: RealtimeSession, pump: Callable[[], None],
                 metrics: GatewayMetrics, spend: Callable[[float], Awaitable[None]]) -> None:
        self._service = service
        self._spend = spend
        self._session = session
        self._pump = pump
        self._metrics = metrics
        self._speech_stopped_at: float | None = None  # the user's speech ended: its answer's first audio is timed from it
        self._tasks: set[asyncio.Task[None]] = set()
        self._speech: dict[str, set[asyncio.Task[None]]] = {}  # response id -> its phrases being made
        self._transcripts: dict[str, asyncio.Task[None]] = {}  # item id -> its latest transcription
        self._ahead: _SpokenAhead | None = None
        self._closed = False  # the connection is over: pieces still coming from a worker are dropped

    def run(self, command: Transcribe | CancelTranscription | Synthesize | CancelSpeech) -> None:
        if isinstance(command, CancelTranscription):
            job = self._transcripts.pop(command.item_id, None)
            if job is not None:
                job.cancel()  # a queued job leaves the pool's queue at once
        elif isinstance(command, Transcribe):
            older = self._transcripts.get(command.item_id)
            if older is not None:
                older.cancel()  # the user went on speaking: that cut of the speech is moot
            task = self._spawn(self._transcribe(command), f"transcribe-{command.item_id}")
            self._transcripts[command.item_id] = task
            task.add_done_callback(lambda t, item=command.item_id: self._transcripts.pop(item, None)
                                   if self._transcripts.get(item) is t else None)
        elif isinstance(command, Synthesize):
            task = self._spawn(self._synthesize(command), f"speak-{command.response_id}-{command.index}")
            phrases = self._speech.setdefault(command.response_id, set())
            phrases.add(task)
            task.add_done_callback(phrases.discard)
        else:
            for task in self._speech.pop(command.response_id, set()):
                task.cancel()

    def phrases(self) -> PhraseSplitter:
        """A splitter that cuts an answer into the phrases a response asks to speak."""
        return self._service.hooks.phrases()

    def speak_ahead(self, response_id: str, text: str, voice: str) -> None:
        """Start speaking ``text``, the first phrase of the answer started ahead as ``response_id``
        (``gateway.ws.foresight``), so that its audio is ready when the response asks for it."""
        self.drop_ahead()
        self._ahead = _SpokenAhead(response_id, text, voice,
                                   self._spawn(self._speak(text, voice), f"speak-ahead-{response_id}"))

    def drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.job.cancel()

    def observe(self, event: ServerEvent) -> bool:
        """Count a voice event on its way out (VAD decisions, speech-to-first-audio); True if it was one."""
        if isinstance(event, AudioDelta):
            if self._speech_stopped_at is not None:  # the first audio of the answer to the user's speech
                self._metrics.voice_first_audio.observe(time.monotonic() - self._speech_stopped_at)
                self._speech_stopped_at = None
            return True
        if isinstance(event, OtherEvent) and event.type.startswith("input_audio_buffer.speech_"):
            self._metrics.voice_vad.labels(event.type.removeprefix("input_audio_buffer.")).inc()
            self._speech_stopped_at = time.monotonic() if event.type.endswith("stopped") else None
            return True
        return False

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._speech.clear()

    def _spawn(self, work: object, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(work, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _piece(self, command: Transcribe, text: str) -> None:
        # (A piece of a job a later one replaced is dropped by the session: its cut is not awaited.)
        if not self._closed:
            self._session.transcription_piece(command.item_id, command.tag, text)
            self._pump()

    async def _transcribe(self, command: Transcribe) -> None:
        try:
            await self._spend(len(command.audio) / WIRE_BYTES_PER_S)
            heard = await self._service.transcribe(command.audio, owner=self, on_piece=lambda text: self._piece(
                command, text), speculative=command.at_pause, judge_end=command.judge_end,
                prompt=command.prompt)
        except EngineError as e:  # the key's audio spent, the workers busy, the session's budget used...
            self._session.transcription_failed(command.item_id, e.message, command.tag, e.code)
        except Exception:
            log.exception("transcribing %s failed", command.item_id)
            self._session.transcription_failed(command.item_id, "the speech could not be transcribed", command.tag)
        else:
            self._session.transcribed(command.item_id, heard.text, heard.seconds, command.tag, heard.finished)
        self._pump()

    async def _speak(self, text: str, voice: str) -> tuple[bytes, tuple[Mark, ...]]:
        await self._spend(max(len(text.strip()), 1) / SPOKEN_CHARS_PER_S)
        return await self._service.synthesize(text, voice, owner=self)

    def _spoken_ahead(self, command: Synthesize) -> asyncio.Task[tuple[bytes, tuple[Mark, ...]]] | None:
        """The job speaking ``command``'s phrase ahead, if it is that phrase (one spoken ahead for
        this response that is not its first phrase after all is dropped)."""
        ahead = self._ahead
        if ahead is None or ahead.response_id != command.response_id or command.index != 0:
            return None
        self._ahead = None
        if (ahead.text, ahead.voice) == (command.text, command.voice):
            return ahead.job
        ahead.job.cancel()
        return None

    async def _synthesize(self, command: Synthesize) -> None:
        ahead = self._spoken_ahead(command)
        try:
            audio, marks = await (ahead if ahead is not None else self._speak(command.text, command.voice))
        except EngineError as e:
            self._session.speech_failed(command.response_id, e.message, e.code)
        except Exception:
            log.exception("speaking a phrase of %s failed", command.response_id)
            self._session.speech_failed(command.response_id, "the speech could not be made")
        else:
            self._session.speech_ready(command.response_id, command.index, audio, marks)
        self._pump()
