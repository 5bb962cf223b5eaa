"""Sans-I/O core of one Realtime session.

No sockets, no asyncio: the adapter feeds decoded client events (``receive``), engine stream
events (``engine_event`` / ``engine_failed``) and voice reports (``transcribed``, ``speech_ready``...),
then drains typed server events (``events_to_send``, see ``server_events``) and commands
(``commands``), the way websockets' protocol.py turns bytes in into events out. The session owns
the responses; its items (``items.ItemStore``), settings (``settings.SessionSettings``) and speech
in (``voice_input.VoiceInput``) are objects of their own. Nothing here raises at the caller: bad
input becomes an ``error`` event, an unexpected failure a generic ``server_error`` one.

Guarantees the adapter can rely on: at most one response is active (a second ``response.create``
is refused); after ``response.done`` no event of that response is emitted, whatever the engine
sends late; every cancel of a started generation queues exactly one ``AbortGeneration``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from gateway.shaping import CallStream
from gateway.ws.active_response import ActiveResponse
from gateway.ws.commands import AbortGeneration, CancelSpeech, CancelTranscription, Command, StartGeneration
from gateway.ws.conversation import Conversation, Item
from gateway.ws.events import (
    AudioEvent,
    ClientEvent,
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    ProtocolError,
    ResponseCancel,
    ResponseCreate,
    SessionLimits,
    SessionUpdate,
    parse_client_event,
)
from gateway.ws.foresight import Foresight
from gateway.ws.ids import SessionIds
from gateway.ws.items import ItemStore
from gateway.ws.response_plan import plan_response
from gateway.ws.responses import ResponseStream
from gateway.ws.server_events import Emitter, ServerEvent, TextDelta
from gateway.ws.settings import SessionSettings
from gateway.ws.speech_out import SpeechOut
from gateway.ws.voice_input import VoiceHooks, VoiceInput
from gateway.ws.wire import item_wire, session_wire
from llm_shared.contract import FinishEvent, StreamEvent, TokenEvent
from llm_shared.errors import EngineError
from llm_shared.structured import SchemaError, ToolCallFamily
from voice.alignment import Mark

__all__ = ["AbortGeneration", "Command", "RealtimeSession", "SessionIds", "SessionLimits", "StartGeneration"]

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "The server had an error while processing this event."


class RealtimeSession:
    """One session's state, with its items (``ItemStore``) and speech in (``VoiceInput``) in
    objects of their own that reach back only through ``ActiveResponse``'s few calls."""

    def __init__(
        self,
        *,
        session_id: str,
        model: str,
        limits: SessionLimits = SessionLimits(),  # noqa: B008  # frozen, so one shared default is safe
        beta: bool = False,
        id_factory: Callable[[str], str] | None = None,
        models: frozenset[str] = frozenset(),
        family: ToolCallFamily | None = None,
        voice: VoiceHooks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``models``: the ids ``session.update`` may switch to (the served ones); ``model`` is
        always one of them. ``family``: the served model's tool-call syntax (how tools, calls and
        results are written in the prompt, and how calls are parsed back out of the output); None
        when it has none, and then tools that could be called are refused. ``voice``: the
        pipeline's pure parts (VAD, phrase splitting); None where the server has no voice, and then
        audio events and audio output are refused. ``clock``: the audio rate bound's."""
        self._session_id = session_id
        self._limits = limits
        self._beta = beta
        self._ids = id_factory or SessionIds()
        self._settings = SessionSettings(session_id=session_id, model=model, models=models, limits=limits,
                                         family=family, voice=voice is not None)
        self._conversation = Conversation(id=self._ids("conv"))
        self._events = Emitter(self._ids, beta)
        self._commands: list[Command] = []  # shared with the items and speech in: emptied in place
        self._active: ResponseStream | None = None
        self._active_event_id: str | None = None  # the response.create that started it
        self._started = False
        self._voice = voice
        self._held: Callable[[], None] | None = None  # starts the active response once transcripts are in
        self._foresight = Foresight(self._commands)  # the answer started at a pause, before the turn ended
        active = ActiveResponse(lambda: self._active, self._cancel, self._release_held, self._error,
                                foresee=self._foresee, drop_foresight=self._foresight.drop)
        self._items = ItemStore(self._conversation, limits, self._ids, self._events, beta, writer=active)
        self._voice_in = VoiceInput(limits, voice, self._items, self._ids, self._events, self._commands, turns=active,
                                    clock=clock)
        self._voice_in.configure(self._settings.view.audio)

    # ----- public API -------------------------------------------------------------------

    @property
    def active_response_id(self) -> str | None:
        return self._active.id if self._active else None

    @property
    def beta(self) -> bool:
        return self._beta

    @property
    def has_commands(self) -> bool:
        """Commands are waiting for ``commands()``."""
        return bool(self._commands)

    @property
    def has_events(self) -> bool:
        """Events are waiting for ``events_to_send()``."""
        return self._events.pending

    def start(self) -> None:
        """Queue ``session.created`` (and, for beta clients, ``conversation.created``)."""
        if self._started:
            return
        self._started = True
        self._emit("session.created", session=session_wire(self._settings.view, self._beta))
        if self._beta:
            self._emit("conversation.created",
                       conversation={"id": self._conversation.id, "object": "realtime.conversation"})

    def receive(self, event: object) -> None:
        """Handle one decoded client event. Never raises."""
        try:
            parsed = parse_client_event(event, self._limits)
        except ProtocolError as e:
            self._error(e)
            return
        except Exception:  # a bug in validation must not kill the connection
            logger.exception("internal error validating a client event")
            self._internal_error(None)
            return
        try:
            self._dispatch(parsed)
        except ProtocolError as e:
            e.event_id = parsed.event_id
            self._error(e)
        except Exception:
            logger.exception("internal error handling %s", parsed.type)
            self._internal_error(parsed.event_id)

    def receive_invalid(self, code: str, message: str) -> None:
        """The adapter could not decode a frame (invalid JSON, bad msgpack, too large...)."""
        self._error(ProtocolError(code, message))

    def engine_event(self, response_id: str, event: StreamEvent) -> None:
        """A TokenEvent or FinishEvent of ``response_id``; ignored once that response is done."""
        response = self._active
        if response is None or response.id != response_id:
            return
        try:
            if isinstance(event, TokenEvent):
                response.token(event.text)
            elif isinstance(event, FinishEvent):
                response.engine_finished(event)
        except Exception:  # a bug here must end this response cleanly, not the connection
            logger.exception("internal error handling an engine event of %s", response_id)
            self._abandon(response)
        self._settle()

    def engine_token(self, response_id: str, event: TokenEvent) -> TextDelta | None:
        """``engine_event`` for a token, in its common case without the queue: when nothing else
        is waiting to be sent and the token's only event is its delta, the delta is returned and
        the caller sends it at once. Otherwise (the response's first output, an event or command
        already waiting, a token of no text, another response) the token goes through
        ``engine_event`` and None is returned: drain as usual."""
        response = self._active
        if response is None or response.id != response_id or self._events.pending or self._commands or response.speaks:
            self.engine_event(response_id, event)  # (a spoken response asks for phrases: commands)
            return None
        try:
            delta = response.token_delta(event.text)
        except Exception:  # as in engine_event: a bug here ends this response, not the connection
            logger.exception("internal error handling a token of %s", response_id)
            self._abandon(response)
            self._settle()
            return None
        return delta

    def route(self, response_id: str, metadata: dict[str, str]) -> None:
        """How routing served ``response_id`` (our ``x_`` keys), for its ``response.done`` metadata."""
        response = self._active
        if response is not None and response.id == response_id:
            response.annotate(metadata)

    def engine_failed(self, response_id: str, error: EngineError) -> None:
        """The engine refused or lost the request: the response ends ``failed``. A tool schema that
        cannot be enforced (found when the turn compiles its grammar, before any generation) is
        also an ``error`` naming the field, answering the ``response.create``."""
        response = self._active
        if response is None or response.id != response_id:
            return
        if isinstance(error, SchemaError):
            self._error(ProtocolError(error.code, error.message, error.param, event_id=self._active_event_id))
        response.fail({"type": error.type, "code": error.code, "message": error.message})
        self._settle()

    def ended(self) -> None:
        """The connection is over: what the session held of the server goes back (its voice seat)."""
        self._voice_in.release_seat()

    def cancel_active(self, reason: str) -> None:
        """Adapter-initiated cancel (``client_too_slow``, ``server_shutdown``, ``client_disconnected``)."""
        if self._active is not None:
            self._cancel(self._active, reason)

    def rate_limits(self, limits: list[dict[str, Any]]) -> None:
        """Queue ``rate_limits.updated``; the adapter owns the numbers (name, limit, remaining,
        reset_seconds)."""
        self._emit("rate_limits.updated", rate_limits=[dict(limit) for limit in limits])

    def events_to_send(self) -> list[ServerEvent]:
        """The server events queued since the last call, in order (``to_wire`` makes dicts)."""
        return self._events.drain()

    def commands(self) -> list[Command]:
        commands = list(self._commands)
        self._commands.clear()
        return commands

    # ----- voice: the adapter reports -----------------------------------------------------------

    def transcription_piece(self, item_id: str, tag: int, text: str) -> None:
        """A piece of a transcript as the recognizer decodes it (``VoiceInput.piece``). Never raises."""
        self._voice_report(self._voice_in.piece, item_id, tag, text)

    def transcribed(self, item_id: str, transcript: str, seconds: float, tag: int = 0,
                    finished: bool | None = None) -> None:
        """The transcript of a user item's speech (``VoiceInput.transcribed``). Never raises."""
        self._voice_report(self._voice_in.transcribed, item_id, transcript, seconds, tag, finished)

    def transcription_failed(self, item_id: str, message: str, tag: int = 0, code: str = "transcription_failed") -> None:
        """The item's speech could not be transcribed (``VoiceInput.transcription_failed``). Never raises."""
        self._voice_report(self._voice_in.transcription_failed, item_id, message, tag, code)

    def _voice_report(self, handle: Callable[..., None], item_id: str, *args: Any) -> None:
        try:
            handle(item_id, *args)
        except Exception:
            logger.exception("internal error handling %s for %s", handle.__name__, item_id)
            self._internal_error(None)

    def response_admitted(self, ok: bool) -> None:
        """The adapter's answer to ``AdmitResponse``: charged (the response starts now, unless one
        started meanwhile) or refused (the adapter has told the client why). Never raises."""
        self._voice_in.admission_answered()
        if not ok or self._active is not None:
            self._foresight.drop()
            return
        try:
            self._response_create(ResponseCreate(event_id=None))
        except ProtocolError as e:
            self._error(e)
        except Exception:
            logger.exception("internal error starting a response of %s", self._session_id)
            self._internal_error(None)

    def speech_ready(self, response_id: str, index: int, audio: bytes, marks: Sequence[Mark] = ()) -> None:
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

    def speech_failed(self, response_id: str, message: str, code: str = "speech_failed") -> None:
        response = self._active
        if response is None or response.id != response_id:
            return
        self._commands.append(AbortGeneration(response.id))
        response.speech_failed(message, code)
        self._settle()

    # ----- client events ----------------------------------------------------------------

    def _dispatch(self, event: ClientEvent) -> None:
        if isinstance(event, SessionUpdate):
            self._session_update(event)
        elif isinstance(event, ItemCreate):
            self._items.create(event)
            self._foresight.drop()
        elif isinstance(event, ItemDelete):
            self._item_delete(event)
        elif isinstance(event, ItemRetrieve):
            self._emit("conversation.item.retrieved", item=item_wire(self._items.get(event.item_id, "item_id"),
                                                                     self._beta))
        elif isinstance(event, ItemTruncate):
            self._items.truncate(event)
        elif isinstance(event, ResponseCreate):
            self._response_create(event)
        elif isinstance(event, ResponseCancel):
            self._response_cancel(event)
        else:
            self._audio_event(event)

    def _audio_event(self, event: AudioEvent) -> None:
        if self._voice is None:
            raise ProtocolError("unsupported_feature", "voice is not enabled on this server", "type")
        self._voice_in.receive(event)

    def context_truncated(self, item_ids: Sequence[str]) -> None:
        """A response's prompt left out these oldest items (``truncation``)."""
        self._items.leave_out(item_ids)

    def _item_delete(self, event: ItemDelete) -> None:
        self._items.delete(event.item_id)
        self._foresight.drop()  # the conversation an answer was started for has changed
        if self._voice_in.forget(event.item_id):
            self._commands.append(CancelTranscription(event.item_id))  # its job's work is moot: freed now
        self._release_held()

    def _session_update(self, event: SessionUpdate) -> None:
        before = self._settings.view
        self._settings.update(event)
        if self._settings.view.audio.output_audio:
            try:
                self._voice_in.seat("session.output_modalities")
            except ProtocolError:
                self._settings.view = before  # refused whole, as any update
                raise
        self._voice_in.configure(self._settings.view.audio)
        session = session_wire(self._settings.view, self._beta)
        warnings = self._settings.warnings(self._beta)
        if warnings:
            # Inside session.updated, not an event of its own: Pipecat's parser raises on any server
            # event type it does not know, which would end its session (docs/protocol.md).
            session["x_warnings"] = warnings
        self._emit("session.updated", session=session)

    def _response_create(self, event: ResponseCreate) -> None:
        if self._active is not None:
            raise ProtocolError("conversation_already_has_active_response",
                                f"response {self._active.id!r} is still in progress; cancel it or wait for "
                                "response.done")
        if event.conversation not in ("auto", "none", self._conversation.id):
            raise ProtocolError("invalid_value", "conversation must be \"auto\", \"none\" or this session's "
                                "conversation id", "response.conversation")
        in_conversation = event.conversation != "none"
        items = self._items.in_context() if event.input is None else self._items.resolve_input(event.input)
        plan = plan_response(self._settings, self._limits, event, items, in_conversation=in_conversation)
        if plan.audio.output_audio:
            self._voice_in.seat("response.output_modalities")
        prompt = plan.prompt
        waits = any(self._voice_in.waits_for(item.id) for item in items)
        messages = [] if waits else prompt.render()
        if in_conversation:
            self._items.check_room(extra_items=1, extra_chars=0, param=None)
        # The answer started ahead of this turn's end (gateway.ws.foresight), when it is this very
        # request, is this response: it has the id that answer was started under.
        ahead = None if waits else self._foresight.take(plan.command("", messages), [i.id for i in items])
        if waits:
            self._foresight.drop()
        family = plan.family
        response = ResponseStream(
            response_id=ahead or self._ids("resp"), conversation=self._conversation if in_conversation else None,
            conversation_id=self._conversation.id, max_output_tokens=plan.max_output,
            temperature=plan.params.temperature, metadata=event.metadata, beta=self._beta, ids=self._ids,
            events=self._events, calls=CallStream(family.new_parser()) if family is not None else None,
            audio=plan.audio, speech=self._speech_factory())
        self._active = response
        self._active_event_id = event.event_id
        response.created()

        def start(messages: list[dict[str, str]]) -> None:
            self._commands.append(replace(plan.command(response.id, messages), foreseen=ahead is not None))

        if not waits:
            start(messages)
            return
        response.held = True

        def release() -> None:  # the transcripts are in: render the prompt now, or fail the response
            response.held = False
            try:
                messages = prompt.render()
            except ProtocolError as e:
                response.fail({"type": "invalid_request_error", "code": e.code, "message": e.message})
                self._settle()
                return
            start(messages)

        self._held = release

    def _foresee(self, item_id: str, cut: int, transcript: str) -> None:
        """The user paused, and the words so far are ``transcript``: start the answer the turn will
        get if it ends here (``gateway.ws.foresight``). Nothing is said to the client."""
        if self._active is not None:
            return
        speech = Item(id=item_id, role="user", parts=[transcript], audio=True)
        items = [*self._items.in_context(), speech]
        try:
            plan = plan_response(self._settings, self._limits, ResponseCreate(event_id=None), items, in_conversation=True)
            command = plan.command(self._ids("resp"), plan.prompt.render())
        except ProtocolError:
            return  # the response says why, if the turn ends here
        speaks = plan.audio.output_audio and plan.family is None  # (a call parsed out of it would change its phrases)
        self._foresight.start(command, [i.id for i in items], plan.audio.voice if speaks else None)

    def _response_cancel(self, event: ResponseCancel) -> None:
        active = self._active
        if active is None:
            raise ProtocolError("response_cancel_not_active", "there is no active response to cancel")
        if event.response_id is not None and event.response_id != active.id:
            raise ProtocolError("response_cancel_not_active",
                                f"response {event.response_id!r} is not the active response", "response_id")
        self._cancel(active, "client_cancelled")

    # ----- responses --------------------------------------------------------------------

    def _cancel(self, response: ResponseStream, reason: str) -> None:
        if response.held:  # created but never started: no engine request to abort
            self._held = None
        else:
            self._commands.append(AbortGeneration(response.id))
        response.cancel(reason)
        self._settle()

    def _abandon(self, response: ResponseStream) -> None:
        """End a response whose state a bug may have broken: abort the engine and report a
        generic failure; if even that fails, forget the response without another event."""
        if not response.held:
            self._commands.append(AbortGeneration(response.id))
        self._held = None
        try:
            response.fail({"type": "server_error", "code": "server_error", "message": INTERNAL_ERROR_MESSAGE})
        except Exception:
            logger.exception("could not report the failure of %s", response.id)
            response.done = True

    def _settle(self) -> None:
        """Forget the active response once it has sent response.done: later engine events for
        it no longer find it, which is the ordering guarantee. Phrases it asked to speak become
        commands first; once it is done, what it asked and was not spoken is cancelled."""
        if self._active is not None:
            self._commands.extend(self._active.take_phrases())
        if self._active is not None and self._active.done:
            if self._active.speaks:
                self._commands.append(CancelSpeech(self._active.id))
            self._voice_in.response_finished(self._active.audio_ms)
            self._active = None
            self._held = None

    def _release_held(self) -> None:
        """Start the held response once no transcript its prompt needs is still being made."""
        held = self._held
        if held is None or self._active is None:
            return
        if self._voice_in.transcribing:  # any transcript still being made (the user may have said more)
            return
        self._held = None
        held()

    def _speech_factory(self) -> Callable[[Callable[[int, str], None]], SpeechOut] | None:
        voice = self._voice
        if voice is None:
            return None
        return lambda request: SpeechOut(voice.phrases(), request)

    # ----- helpers ----------------------------------------------------------------------

    def _emit(self, ga_type: str, **fields: Any) -> None:
        self._events.emit(ga_type, **fields)

    def _error(self, e: ProtocolError) -> None:
        self._events.error(e)

    def _internal_error(self, event_id: str | None) -> None:
        self._error(ProtocolError("server_error", INTERNAL_ERROR_MESSAGE, type="server_error", event_id=event_id))
