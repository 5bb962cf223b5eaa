"""Speech in, for one Realtime session: appended audio, turn detection, and the transcripts of
the user's speech. Sans-I/O like the session that holds it (never raises at the caller on a
report; a client event it refuses is a ``ProtocolError``).

Appended audio goes to ``InputAudio``; with server VAD, speech that starts interrupts the active
response (``interrupt_response``), speech that pauses starts its transcript early (the turn may
end there), and speech that stops is committed as a user item whose transcript the adapter makes
(``Transcribe``), then answered (``create_response``, once the key is charged: ``AdmitResponse``).
A transcript reaches the client as ``...input_audio_transcription.delta`` events, one per piece
the recognizer decodes (a Whisper segment), as it decodes them, then ``.completed``. A job started
at a pause may be for a cut of the speech that the user then goes on from, and its pieces must
not reach the client as the item's: they are held until the turn ends at that cut, then sent.
The deltas join to the transcript exactly (the first piece without its leading blank; what the
final transcript adds, as one last delta). Short turns are one piece, so one delta.

A response whose prompt holds a transcript not made yet waits for it: ``transcribing`` tells the
session, and ``Turns.transcripts_changed`` tells it when to look again.

``idle_timeout_ms`` is counted in audio, not wall time: from where the last response's speech
would have finished playing (the input position at its end plus the audio it sent, the API's
"response.done time plus playback"), or from where the buffer started, with no speech since.
Clients stream their microphone, silence included, so audio time is wall time for them; a
client that stops sending audio stops the count (documented).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gateway.ws.audio_events import (
    PCM_BYTES_PER_MS,
    AudioAppend,
    AudioClear,
    AudioCommit,
    AudioEvent,
    AudioSettings,
    ServerVad,
    format_error,
)
from gateway.ws.audio_input import (
    InputAudio,
    SegmenterFactory,
    SpeechEndProposed,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
)
from gateway.ws.commands import AdmitResponse, Command, Transcribe
from gateway.ws.conversation import Item
from gateway.ws.events import ProtocolError, SessionLimits
from gateway.ws.items import ItemStore
from gateway.ws.server_events import Emitter
from gateway.ws.speech_out import PhraseSplitter
from voice.errors import AudioError
from voice.formats import PCM16, AudioFormat, InputStream

logger = logging.getLogger(__name__)


class _Early(NamedTuple):
    """The transcript of the job started at a pause (``VoiceInput._eager``), come before the turn ended."""

    text: str
    seconds: float
    finished: bool | None  # asked for under semantic_vad: whether the words are a finished turn


class VoiceSeats:
    """The sessions that may use voice at once, server-wide (``[voice] max_sessions``): recognition
    and synthesis share the cores with the text turns, so a voice session is admitted, not assumed.
    A session takes a seat with its first audio (an append, or audio asked of the answers) and
    holds it until it ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: set[object] = set()

    @property
    def in_use(self) -> int:
        return len(self._held)

    def take(self, owner: object) -> bool:
        if owner not in self._held:
            if len(self._held) >= self.limit:
                return False
            self._held.add(owner)
        return True

    def release(self, owner: object) -> None:
        self._held.discard(owner)


@dataclass(frozen=True)
class VoiceHooks:
    """What a session needs of the voice pipeline without doing I/O: a server VAD per session, a
    phrase splitter per audio response, the server's voice seats (None: unbounded), and whether a
    turn's answer is started at its pause (``gateway.ws.foresight``). None where the server has no voice."""

    segmenters: SegmenterFactory
    phrases: Callable[[], PhraseSplitter]
    seats: VoiceSeats | None = None
    answer_ahead: bool = True


class Turns(Protocol):
    """The session's responses, as speech in sees them."""

    def interrupt(self) -> None:
        """The user started speaking: cancel the active response if it is in the conversation."""

    def responding(self) -> bool:
        """A response is active."""

    def transcripts_changed(self) -> None:
        """A transcript came, failed or was dropped: a response waiting for them may start."""

    def foresee(self, item_id: str, cut: int, transcript: str) -> None:
        """The speech ``item_id`` paused at ``cut`` and its words so far are ``transcript``: start the
        answer the turn will get if it ends there (``gateway.ws.foresight``)."""

    def drop_foresight(self) -> None:
        """The answer started ahead is moot: the user went on, or the buffer is gone."""

    def error(self, e: ProtocolError) -> None:
        """Tell the client (an ``error`` event), the session going on."""


class VoiceInput:
    def __init__(self, limits: SessionLimits, hooks: VoiceHooks | None, items: ItemStore, ids: Callable[[str], str],
                 events: Emitter, commands: list[Command], turns: Turns, clock: Callable[[], float]) -> None:
        self._input = InputAudio(limits, hooks.segmenters if hooks is not None else None, clock=clock)
        self._seats = hooks.seats if hooks is not None else None
        self._answer_ahead = hooks is not None and hooks.answer_ahead
        self._seated = False
        self._limits = limits
        self._items = items
        self._ids = ids
        self._events = events
        self._commands = commands
        self._turns = turns
        self._vad: ServerVad | None = None
        self._prompt: str | None = None  # audio.input.transcription.prompt; None: the server's
        self._format: AudioFormat = PCM16
        self._stream: InputStream = PCM16.stream()  # the appends' converter (a codec's filter history)
        self._speech_item: str | None = None  # the user item the speech in progress will become
        self._speech_start_ms = 0
        # User items whose transcript is being made, with the cut of their speech it will be for.
        self._transcribing: dict[str, tuple[Item, int]] = {}
        # The job started at the latest pause of the speech in progress (item id, cut), and its
        # transcript if it came before the speech ended.
        self._eager: tuple[str, int] | None = None
        self._early: _Early | None = None
        # semantic_vad: the cut the turn model proposed to end the speech at, waiting for the words
        # of the eager job (which must say the turn is finished too).
        self._proposed: int | None = None
        self._held: tuple[tuple[str, int] | None, list[str]] = (None, [])  # the eager job's pieces so far
        self._streamed: dict[str, str] = {}  # item id -> the transcript's text sent as deltas so far
        self._admitting = False  # a response server VAD asked for waits for the key's admission
        self._idle_from: int | None = None  # session audio ms the idle timeout counts from (None: not counting)

    def configure(self, audio: AudioSettings) -> None:
        """The session's audio settings changed: its turn detection, the transcription prompt, the
        format appends carry."""
        if audio.turn_detection != self._vad:
            self._idle_from = None  # counted afresh from the next audio
        self._vad = audio.turn_detection
        self._prompt = audio.transcription.prompt if audio.transcription is not None else None
        if audio.input_format is not self._format:
            self._format = audio.input_format
            self._stream = audio.input_format.stream()
        self._input.configure(audio.turn_detection)

    @property
    def transcribing(self) -> bool:
        """Some user item's transcript is still being made."""
        return bool(self._transcribing)

    def waits_for(self, item_id: str) -> bool:
        """``item_id``'s transcript is still being made."""
        return item_id in self._transcribing

    # ----- client events ----------------------------------------------------------------------

    def seat(self, param: str) -> None:
        """This session uses voice from now on: it takes one of the server's voice seats, held
        until ``release_seat``; ``voice_sessions_full`` (naming ``param``) when none is free."""
        if self._seated or self._seats is None:
            return
        if not self._seats.take(self):
            raise ProtocolError("voice_sessions_full", f"this server serves at most {self._seats.limit} voice "
                                "sessions at once and all are in use; use text (output_modalities [\"text\"], no "
                                "audio appends), or try again later", param)
        self._seated = True

    def release_seat(self) -> None:
        if self._seated and self._seats is not None:
            self._seats.release(self)
            self._seated = False

    def receive(self, event: AudioEvent) -> None:
        if isinstance(event, AudioAppend):
            self.seat("type")
            self._check_size(event.audio)
            try:
                pcm = self._stream.to_session(event.audio)
            except AudioError as e:
                raise format_error(e, "audio") from None
            self._append(pcm)
        elif isinstance(event, AudioCommit):
            previous_speech = self._speech_item
            audio = self._input.commit()
            self._speech_item, self._proposed = None, None
            self._idle_from = None
            self._turns.drop_foresight()  # a commit of the client's own is not answered by itself
            self._commit(previous_speech or self._ids("item"), audio, respond=False)
        elif isinstance(event, AudioClear):
            self._input.clear()
            self._speech_item = None
            self._idle_from = None
            self._eager, self._early, self._proposed = None, None, None  # a job started at a pause is moot
            self._turns.drop_foresight()
            self._events.emit("input_audio_buffer.cleared")

    def _check_size(self, audio: bytes) -> None:
        """The append bound counts session audio (the parse bounded the wire's bytes): an 8 kHz
        append may carry as many ms as a 24 kHz one, not 6 times more."""
        limit = self._limits.max_audio_append_bytes
        if self._format.session_bytes(len(audio)) > limit:
            most = limit // PCM_BYTES_PER_MS
            raise ProtocolError("audio_too_large", f"'audio' is {len(audio) // self._format.bytes_per_ms} ms of "
                                f"{self._format.type}; at most {most} ms are accepted at once", "audio")

    def forget(self, item_id: str) -> bool:
        """``item_id`` was deleted: its transcript is moot. True when a job for it may be running
        (the adapter frees it)."""
        transcribing = self._transcribing.pop(item_id, None) is not None
        self._streamed.pop(item_id, None)
        if transcribing or (self._eager is not None and self._eager[0] == item_id):
            self._eager = None
            self._turns.drop_foresight()
            return True
        return False

    def _append(self, pcm: bytes) -> None:
        vad = self._vad
        before = self._input.total_ms
        for speech in self._input.append(pcm):
            if isinstance(speech, SpeechStarted):
                self._speech_item = self._ids("item")
                self._speech_start_ms = speech.audio_start_ms
                self._events.emit("input_audio_buffer.speech_started", audio_start_ms=speech.audio_start_ms,
                                  item_id=self._speech_item)
                if vad is not None and vad.interrupt_response:
                    self._turns.interrupt()  # barge-in: the engine frees the work now
                continue
            if isinstance(speech, SpeechPaused):
                self._proposed = None
                if self._speech_item is not None:  # transcribe now: the turn may end here
                    self._eager = (self._speech_item, speech.speech_end_ms)
                    self._early = None
                    self._commands.append(Transcribe(
                        item_id=self._speech_item, tag=speech.speech_end_ms,
                        audio=self._input.peek(self._speech_start_ms, speech.speech_end_ms),
                        judge_end=vad is not None and vad.kind == "semantic_vad", prompt=self._prompt))
                continue
            if isinstance(speech, SpeechResumed):
                self._turns.drop_foresight()  # the user went on: the turn did not end at that pause
                continue
            if isinstance(speech, SpeechEndProposed):
                self._proposed = speech.speech_end_ms
                self._check_proposal()
                continue
            self._stopped(speech)
        self._check_idle(before)

    def _check_proposal(self) -> None:
        """semantic_vad: the turn model proposed an end at a pause. The words of the job started
        there decide: finished (or not judged: no words, the job failed) ends the turn now;
        unfinished leaves it open for more speech or the eagerness's bound. Until they come, wait."""
        cut, item_id = self._proposed, self._speech_item
        if cut is None or item_id is None:
            return
        at_pause = self._eager == (item_id, cut)
        if at_pause and self._early is None:
            return  # the words are on their way
        self._proposed = None
        if at_pause and self._early is not None and self._early.finished is False:
            logger.debug("end of turn at %d ms held: the words are unfinished (%r)", cut, self._early.text)
            return
        stopped = self._input.confirm_end(cut)
        if stopped is not None:
            self._stopped(stopped)

    def _stopped(self, speech: SpeechStopped) -> None:
        """The user's speech ended: committed as their item (and answered, as configured)."""
        vad = self._vad
        self._proposed = None
        item_id = self._speech_item or self._ids("item")
        start = self._speech_start_ms
        self._speech_item = None
        self._idle_from = speech.audio_end_ms  # the user's turn: idle counts from its end
        self._events.emit("input_audio_buffer.speech_stopped", audio_end_ms=speech.audio_end_ms, item_id=item_id)
        audio = self._input.take(start, speech.audio_end_ms)
        try:
            self._commit(item_id, audio, respond=vad is not None and vad.create_response, cut=speech.speech_end_ms)
        except ProtocolError as e:  # no room for the item: said, and the chunk's later speech still counts
            self._eager, self._early = None, None
            self._turns.drop_foresight()
            self._turns.error(e)

    def response_finished(self, audio_ms: int) -> None:
        """A response ended, having sent ``audio_ms`` of speech: idle counts from where it has played."""
        self._idle_from = self._input.total_ms + audio_ms

    def _check_idle(self, chunk_start_ms: int) -> None:
        """Server VAD's ``idle_timeout_ms``: no speech for that long, nothing answering, so the
        (silent) buffer is committed as the user's turn and answered, as the API does."""
        vad = self._vad
        if vad is None or vad.idle_timeout_ms is None:
            return
        if self._speech_item is not None or self._turns.responding():
            self._idle_from = None  # counted again once the speech, or the answer, is over
            return
        if self._admitting:
            return
        now = self._input.total_ms
        if self._idle_from is None:
            self._idle_from = chunk_start_ms
        if now - self._idle_from < vad.idle_timeout_ms:
            return
        item_id = self._ids("item")
        self._events.emit("input_audio_buffer.timeout_triggered", audio_start_ms=self._idle_from, audio_end_ms=now,
                          item_id=item_id)
        self._idle_from = None
        audio = self._input.take(self._input.start_ms, now)
        try:
            self._commit(item_id, audio, respond=True)
        except ProtocolError as e:  # no room for the item: said; the count starts again
            self._turns.error(e)

    def _commit(self, item_id: str, audio: bytes, *, respond: bool, cut: int | None = None) -> None:
        """The user's speech becomes an item (its transcript to come), and maybe a response. When
        the speech ended where a job started at its pause cut it (``cut``: the silence's start),
        that job's transcript is the item's (already here, or on its way)."""
        item = Item(id=item_id, role="user", parts=[""], audio=True, transcribing=True)
        self._items.add_speech(item, lambda previous_id: self._events.emit(
            "input_audio_buffer.committed", previous_item_id=previous_id, item_id=item_id))
        eager, early = self._eager, self._early
        self._eager, self._early = None, None
        if cut is not None and eager == (item_id, cut):
            self._transcribing[item_id] = (item, cut)
            held, self._held = self._held, (None, [])
            if held[0] == eager:
                for piece in held[1]:
                    self._delta(item_id, piece)
            if early is not None:
                self.transcribed(item_id, early.text, early.seconds, cut)
        else:
            self._transcribing[item_id] = (item, 0)
            self._commands.append(Transcribe(item_id=item_id, audio=audio, prompt=self._prompt))
        if respond and not self._turns.responding() and not self._admitting:
            self._admitting = True  # the response starts once the key is charged for it
            self._commands.append(AdmitResponse(item_id))

    def admission_answered(self) -> None:
        """The adapter answered ``AdmitResponse``: another may be asked for."""
        self._admitting = False

    # ----- the adapter reports ----------------------------------------------------------------

    def piece(self, item_id: str, tag: int, text: str) -> None:
        """A piece of the transcript of ``item_id``'s speech cut at ``tag``, as the recognizer
        decodes it: a delta now if the item waits for that cut, held if the job was started at a
        pause the turn may yet end at, dropped otherwise."""
        entry = self._transcribing.get(item_id)
        if entry is not None and entry[1] == tag:
            self._delta(item_id, text)
        elif self._eager == (item_id, tag):
            if self._held[0] != self._eager:
                self._held = (self._eager, [])
            self._held[1].append(text)

    def _delta(self, item_id: str, text: str) -> None:
        sent = self._streamed.get(item_id, "")
        if not sent:
            text = text.lstrip()  # the transcript is stripped; so is its start
        if text:
            self._streamed[item_id] = sent + text
            self._events.emit("conversation.item.input_audio_transcription.delta", item_id=item_id,
                              content_index=0, delta=text)

    def transcribed(self, item_id: str, transcript: str, seconds: float, tag: int = 0,
                    finished: bool | None = None) -> None:
        """The transcript of a user item's speech (``seconds`` of audio) cut at ``tag`` (its
        ``Transcribe``'s): applied if the item waits for that cut, kept if the speech it was started
        for at a pause has not ended yet (``finished``: whether its words are a finished turn, asked
        for with ``judge_end``; an end proposed at that pause is decided now), dropped if the user
        went on."""
        entry = self._transcribing.get(item_id)
        if entry is None:
            if self._eager == (item_id, tag):
                self._early = _Early(transcript, seconds, finished)  # the turn may end at this pause
                self._check_proposal()
                self._foresee(item_id, tag, transcript, finished)
            return
        item, expected = entry
        if tag != expected:
            return
        del self._transcribing[item_id]
        item.parts[0] = transcript
        item.transcribing = False
        sent = self._streamed.pop(item_id, "")
        # What the pieces sent did not say yet: nothing as a rule, the whole when no piece came.
        rest = transcript[len(sent):] if transcript.startswith(sent) else ""
        if rest:
            self._events.emit("conversation.item.input_audio_transcription.delta", item_id=item_id,
                              content_index=0, delta=rest)
        self._events.emit("conversation.item.input_audio_transcription.completed", item_id=item_id, content_index=0,
                          transcript=transcript, usage={"type": "duration", "seconds": round(seconds, 3)})
        self._turns.transcripts_changed()

    def _foresee(self, item_id: str, cut: int, transcript: str, finished: bool | None) -> None:
        """The words of the pause at ``cut`` came and the turn is still open: its answer is
        started ahead if the turn's end will start one (not when the words say it goes on)."""
        vad = self._vad
        if (not self._answer_ahead or vad is None or not vad.create_response or finished is False or not transcript.strip()
                or self._eager != (item_id, cut) or self._speech_item != item_id
                or self._admitting or self._turns.responding()):
            return
        self._turns.foresee(item_id, cut, transcript)

    def transcription_failed(self, item_id: str, message: str, tag: int = 0, code: str = "transcription_failed") -> None:
        """The item's speech could not be transcribed: it stays in the conversation without a
        transcript (the model does not hear it). A job started at a pause that fails is forgotten:
        the end of the turn starts a new one."""
        entry = self._transcribing.get(item_id)
        if entry is None or entry[1] != tag:
            if self._eager == (item_id, tag):
                self._eager = None
                self._check_proposal()  # no words to judge: the audio's end stands
            return
        item = self._transcribing.pop(item_id)[0]
        item.transcribing = False
        self._streamed.pop(item_id, None)
        self._events.emit("conversation.item.input_audio_transcription.failed", item_id=item_id, content_index=0,
                          error={"type": "server_error", "code": code, "message": message,
                                 "param": None})
        self._turns.transcripts_changed()
