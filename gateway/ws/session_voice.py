"""The voice half of a Realtime session: input audio, turn detection, transcripts and speech.

A mixin of ``RealtimeSession`` (same state, same rules: sans-I/O, never raises at the caller).
Speech in: appended audio goes to ``InputAudio``; with server VAD, speech that starts cancels the
active response (``interrupt_response``) and speech that stops is committed as a user item
whose transcript the adapter makes (``Transcribe``), then answered (``create_response``). A
response whose prompt holds a transcript not made yet is created at once but started only when
the transcript is there. Speech out: an audio response asks for its phrases' audio
(``Synthesize``), which the adapter hands back through ``speech_ready``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.ws.audio_events import AudioAppend, AudioClear, AudioCommit, AudioEvent
from gateway.ws.audio_input import SegmenterFactory, SpeechPaused, SpeechStarted
from gateway.ws.commands import AbortGeneration, AdmitResponse, CancelSpeech, Synthesize, Transcribe
from gateway.ws.conversation import Item
from gateway.ws.events import ItemTruncate, ResponseCreate
from gateway.ws.fields import ProtocolError
from gateway.ws.speech_out import PhraseSplitter, truncated
from gateway.ws.wire import item_wire
from voice.alignment import Mark

if TYPE_CHECKING:
    from gateway.ws.session import RealtimeSession

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VoiceHooks:
    """What a session needs of the voice pipeline without doing I/O: a server VAD per session and
    a phrase splitter per audio response. None where the server has no voice."""

    segmenters: SegmenterFactory
    phrases: Callable[[], PhraseSplitter]


class SessionVoice:
    """Voice handlers; ``self`` is the ``RealtimeSession``."""

    # ----- the adapter reports ----------------------------------------------------------------

    def transcribed(self: RealtimeSession, item_id: str, transcript: str, seconds: float, tag: int = 0) -> None:
        """The transcript of a user item's speech (``seconds`` of audio) cut at ``tag`` (its
        ``Transcribe``'s): applied if the item waits for that cut, kept if the speech it was started
        for at a pause has not ended yet, dropped if the user went on. Never raises."""
        try:
            entry = self._transcribing.get(item_id)
            if entry is None:
                if self._eager == (item_id, tag):
                    self._early = {item_id: (tag, transcript, seconds)}  # the turn may end at this pause
                return
            item, expected = entry
            if tag != expected:
                return
            del self._transcribing[item_id]
            item.parts[0] = transcript
            item.transcribing = False
            self._emit("conversation.item.input_audio_transcription.completed", item_id=item_id, content_index=0,
                       transcript=transcript, usage={"type": "duration", "seconds": round(seconds, 3)})
            self._release_held()
        except Exception:
            logger.exception("internal error handling the transcript of %s", item_id)
            self._internal_error(None)

    def transcription_failed(self: RealtimeSession, item_id: str, message: str, tag: int = 0) -> None:
        """The item's speech could not be transcribed: it stays in the conversation without a
        transcript (the model does not hear it). A job started at a pause that fails is forgotten:
        the end of the turn starts a new one. Never raises."""
        try:
            entry = self._transcribing.get(item_id)
            if entry is None or entry[1] != tag:
                if self._eager == (item_id, tag):
                    self._eager = None
                return
            item = self._transcribing.pop(item_id)[0]
            item.transcribing = False
            self._emit("conversation.item.input_audio_transcription.failed", item_id=item_id, content_index=0,
                       error={"type": "server_error", "code": "transcription_failed", "message": message,
                              "param": None})
            self._release_held()
        except Exception:
            logger.exception("internal error handling the failed transcription of %s", item_id)
            self._internal_error(None)

    def speech_ready(self: RealtimeSession, response_id: str, index: int, audio: bytes,
                     marks: Sequence[Mark] = ()) -> None:
        """The audio (PCM16, 24 kHz) of phrase ``index`` of ``response_id``, with the synthesizer's
        timing marks (character, sample at 24 kHz); ignored once the response is done."""
        response = self._active
        if response is None or response.id != response_id:
            return
        try:
            response.spoken(index, audio, marks)
        except Exception:
            logger.exception("internal error sending the speech of %s", response_id)
            self._abandon(response)
        self._settle()

    def speech_failed(self: RealtimeSession, response_id: str, message: str) -> None:
        response = self._active
        if response is None or response.id != response_id:
            return
        self._commands.append(AbortGeneration(response.id))
        response.speech_failed(message)
        self._settle()

    # ----- client events ----------------------------------------------------------------------

    def _audio_event(self: RealtimeSession, event: AudioEvent) -> None:
        if self._voice is None:
            raise ProtocolError("unsupported_feature", "voice is not enabled on this server", "type")
        if isinstance(event, AudioAppend):
            self._audio_append(event.audio)
        elif isinstance(event, AudioCommit):
            previous_speech = self._speech_item
            audio = self._input.commit()
            self._speech_item = None
            self._commit_speech(previous_speech or self._ids("item"), audio, respond=False)
        elif isinstance(event, AudioClear):
            self._input.clear()
            self._speech_item = None
            self._eager, self._early = None, {}  # a job started at a pause is moot: its result is dropped
            self._emit("input_audio_buffer.cleared")

    def _audio_append(self: RealtimeSession, pcm: bytes) -> None:
        vad = self._audio.turn_detection
        for speech in self._input.append(pcm):
            if isinstance(speech, SpeechStarted):
                self._speech_item = self._ids("item")
                self._speech_start_ms = speech.audio_start_ms
                self._emit("input_audio_buffer.speech_started", audio_start_ms=speech.audio_start_ms,
                           item_id=self._speech_item)
                active = self._active
                if vad is not None and vad.interrupt_response and active is not None and active.in_conversation:
                    self._cancel(active, "turn_detected")  # barge-in: the engine frees the work now
                continue
            if isinstance(speech, SpeechPaused):
                if self._speech_item is not None:  # transcribe now: the turn may end here
                    self._eager = (self._speech_item, speech.speech_end_ms)
                    self._early = {}
                    self._commands.append(Transcribe(item_id=self._speech_item, tag=speech.speech_end_ms,
                                                     audio=self._input.peek(self._speech_start_ms,
                                                                            speech.speech_end_ms)))
                continue
            item_id = self._speech_item or self._ids("item")
            start = self._speech_start_ms
            self._speech_item = None
            self._emit("input_audio_buffer.speech_stopped", audio_end_ms=speech.audio_end_ms, item_id=item_id)
            audio = self._input.take(start, speech.audio_end_ms)
            try:
                self._commit_speech(item_id, audio, respond=vad is not None and vad.create_response,
                                    cut=speech.speech_end_ms)
            except ProtocolError as e:  # no room for the item: said, and the chunk's later speech still counts
                self._eager, self._early = None, {}
                self._error(e)

    def _commit_speech(self: RealtimeSession, item_id: str, audio: bytes, *, respond: bool,
                       cut: int | None = None) -> None:
        """The user's speech becomes an item (its transcript to come), and maybe a response. When
        the speech ended where a job started at its pause cut it (``cut``: the silence's start),
        that job's transcript is the item's (already here, or on its way)."""
        item = Item(id=item_id, role="user", parts=[""], audio=True, transcribing=True)
        self._check_room(extra_items=1, extra_chars=0, param=None)
        previous_id = self._conversation.insert(item)
        self._emit("input_audio_buffer.committed", previous_item_id=previous_id, item_id=item_id)
        self._emit("conversation.item.added", previous_item_id=previous_id, item=item_wire(item, self._beta))
        if not self._beta:
            self._emit("conversation.item.done", previous_item_id=previous_id, item=item_wire(item, self._beta))
        eager, early = self._eager, self._early.pop(item_id, None)
        self._eager, self._early = None, {}
        if cut is not None and eager == (item_id, cut):
            self._transcribing[item_id] = (item, cut)
            if early is not None:
                self.transcribed(item_id, early[1], early[2], cut)
        else:
            self._transcribing[item_id] = (item, 0)
            self._commands.append(Transcribe(item_id=item_id, audio=audio))
        if respond and self._active is None and not self._admitting:
            self._admitting = True  # the response starts once the key is charged for it
            self._commands.append(AdmitResponse(item_id))

    def response_admitted(self: RealtimeSession, ok: bool) -> None:
        """The adapter's answer to ``AdmitResponse``: charged (the response starts now, unless one
        started meanwhile) or refused (the adapter has told the client why). Never raises."""
        self._admitting = False
        if not ok or self._active is not None:
            return
        try:
            self._response_create(ResponseCreate(event_id=None))
        except ProtocolError as e:
            self._error(e)
        except Exception:
            logger.exception("internal error starting a response of %s", self._session_id)
            self._internal_error(None)

    def _truncate_audio(self: RealtimeSession, item: Item, event: ItemTruncate) -> None:
        """Voice barge-in: keep the text said by ``audio_end_ms`` of the item's speech."""
        speech = item.speech
        if speech is None or item.role != "assistant":
            raise ProtocolError("invalid_value", "only assistant messages can be truncated", "item_id")
        if event.audio_end_ms > speech.total_ms:
            raise ProtocolError("invalid_value", f"audio_end_ms {event.audio_end_ms} is past the end of the "
                                f"item's audio ({int(speech.total_ms)} ms)", "audio_end_ms")
        if self._active is not None and self._is_active_item(item.id):
            self._cancel(self._active, "client_cancelled")
        item.speech = truncated(speech, event.audio_end_ms)
        item.parts[0] = item.speech.text
        self._emit("conversation.item.truncated", item_id=item.id, content_index=0,
                   audio_end_ms=event.audio_end_ms)

    # ----- responses --------------------------------------------------------------------------

    def _collect_speech(self: RealtimeSession) -> None:
        """The phrases the active response asked for become ``Synthesize`` commands."""
        response = self._active
        if response is None or not response.phrases_asked:
            return
        asked, response.phrases_asked = response.phrases_asked, []
        voice = response.voice
        self._commands.extend(Synthesize(response_id=response.id, index=i, text=text, voice=voice)
                              for i, text in asked)

    def _stop_speech(self: RealtimeSession, response_id: str) -> None:
        self._commands.append(CancelSpeech(response_id))

