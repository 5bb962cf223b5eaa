"""Sans-I/O core of one Realtime session (text subset of the OpenAI Realtime API).

No sockets, no asyncio: the adapter feeds decoded client events (``receive``) and engine
stream events (``engine_event`` / ``engine_failed``), then drains typed server events
(``events_to_send``, see ``server_events``) and engine commands (``commands``), the way
websockets' protocol.py turns bytes in into events out. Nothing here raises at the caller:
bad input becomes an ``error`` event, an unexpected failure a generic ``server_error`` one.

Guarantees the adapter can rely on:
- at most one response is active; a second ``response.create`` is refused;
- after ``response.done`` no event of that response is emitted, whatever the engine sends late;
- every cancel of a started generation queues exactly one ``AbortGeneration``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gateway.shaping import CallStream
from gateway.ws.audio_events import AudioSettings
from gateway.ws.audio_input import InputAudio
from gateway.ws.commands import AbortGeneration, Command, StartGeneration
from gateway.ws.conversation import (
    Conversation,
    Item,
    to_history,
)
from gateway.ws.events import (
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
    ToolsPatch,
    parse_client_event,
)
from gateway.ws.ids import SessionIds
from gateway.ws.responses import ResponseStream
from gateway.ws.server_events import Emitter, ServerEvent, TextDelta
from gateway.ws.session_items import SessionItems
from gateway.ws.session_voice import SessionVoice, VoiceHooks
from gateway.ws.speech_out import SpeechOut
from gateway.ws.wire import SessionView, item_wire, session_wire
from llm_shared.contract import FinishEvent, SamplingParams, StreamEvent, TokenEvent
from llm_shared.errors import EngineError, InvalidRequestError
from llm_shared.structured import (
    OutputConstraints,
    SchemaError,
    ToolCallFamily,
    parse_realtime_constraints,
    render_messages,
)
from llm_shared.structured.parse import REALTIME_DEFAULT

__all__ = ["AbortGeneration", "Command", "RealtimeSession", "SessionIds", "SessionLimits", "StartGeneration"]

logger = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 0.8  # the Realtime API's default
INTERNAL_ERROR_MESSAGE = "The server had an error while processing this event."


class RealtimeSession(SessionItems, SessionVoice):
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
        self._model = model
        self._models = models | {model}
        self._limits = limits
        self._beta = beta
        self._ids = id_factory or SessionIds()
        self._instructions = ""
        self._max_output_tokens: int | str = limits.default_max_output_tokens
        self._temperature = DEFAULT_TEMPERATURE
        self._family = family
        self._constraints: OutputConstraints = REALTIME_DEFAULT  # tools, tool_choice, parallel_tool_calls
        self._conversation = Conversation(id=self._ids("conv"))
        self._events = Emitter(self._ids, beta)
        self._commands: list[Command] = []
        self._active: ResponseStream | None = None
        self._active_event_id: str | None = None  # the response.create that started it
        self._started = False
        self._voice = voice
        self._audio = AudioSettings()
        self._input = InputAudio(limits, voice.segmenters if voice is not None else None, clock=clock)
        self._input.configure(self._audio.turn_detection)
        self._speech_item: str | None = None  # the user item the speech in progress will become
        self._speech_start_ms = 0
        # User items whose transcript is being made, with the cut of their speech it will be for.
        self._transcribing: dict[str, tuple[Item, int]] = {}
        # The job started at the latest pause of the speech in progress (item id, cut), and its
        # transcript if it came before the speech ended.
        self._eager: tuple[str, int] | None = None
        self._early: dict[str, tuple[int, str, float]] = {}
        self._held: Callable[[], None] | None = None  # starts the active response once transcripts are in
        self._admitting = False  # a response server VAD asked for waits for the key's admission

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
        self._emit("session.created", session=session_wire(self._view(), self._beta))
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
        commands, self._commands = self._commands, []
        return commands

    # ----- client events ----------------------------------------------------------------

    def _dispatch(self, event: ClientEvent) -> None:
        if isinstance(event, SessionUpdate):
            self._session_update(event)
        elif isinstance(event, ItemCreate):
            self._item_create(event)
        elif isinstance(event, ItemDelete):
            self._item_delete(event)
        elif isinstance(event, ItemRetrieve):
            self._emit("conversation.item.retrieved", item=item_wire(self._item(event.item_id, "item_id"), self._beta))
        elif isinstance(event, ItemTruncate):
            self._item_truncate(event)
        elif isinstance(event, ResponseCreate):
            self._response_create(event)
        elif isinstance(event, ResponseCancel):
            self._response_cancel(event)
        else:
            self._audio_event(event)

    def _session_update(self, event: SessionUpdate) -> None:
        if event.model is not None and event.model not in self._models:
            raise ProtocolError("invalid_value", f"model {event.model!r} is not served here; available: "
                                f"{sorted(self._models)}", "session.model")
        # Everything is checked before anything changes: a refused update leaves the session as it was.
        audio = self._audio.apply(event.audio)
        if audio.output_audio and self._voice is None:
            raise ProtocolError("unsupported_feature", "voice is not enabled on this server: use "
                                "output_modalities [\"text\"]", "session.output_modalities")
        if event.tools is not None:
            self._constraints = self._apply_tools(event.tools, "session", self._constraints)
        self._audio = audio
        self._input.configure(audio.turn_detection)
        if event.model is not None:
            self._model = event.model  # picks the route of the responses created from now on
        if event.instructions is not None:
            self._instructions = event.instructions
        if event.max_output_tokens is not None:
            self._max_output_tokens = event.max_output_tokens
        if event.temperature is not None:
            self._temperature = event.temperature
        self._emit("session.updated", session=session_wire(self._view(), self._beta))

    def _response_create(self, event: ResponseCreate) -> None:
        if self._active is not None:
            raise ProtocolError("conversation_already_has_active_response",
                                f"response {self._active.id!r} is still in progress; cancel it or wait for "
                                "response.done")
        if event.conversation not in ("auto", "none", self._conversation.id):
            raise ProtocolError("invalid_value", "conversation must be \"auto\", \"none\" or this session's "
                                "conversation id", "response.conversation")
        in_conversation = event.conversation != "none"
        constraints = self._constraints
        if event.tools is not None:
            constraints = self._apply_tools(event.tools, "response", constraints)
        audio = self._audio.apply(event.audio)
        if audio.output_audio and self._voice is None:
            raise ProtocolError("unsupported_feature", "voice is not enabled on this server: use "
                                "output_modalities [\"text\"]", "response.output_modalities")
        items = list(self._conversation) if event.input is None else self._resolve_input(event.input)
        instructions = self._instructions if event.instructions is None else event.instructions

        def render() -> list[dict[str, str]]:
            # The tools are listed in the system prompt only when they may be called (render_messages).
            messages = render_messages(to_history(instructions, items), constraints, self._family)
            prompt_chars = sum(len(m["content"]) for m in messages)
            if prompt_chars > self._limits.max_conversation_chars:
                raise ProtocolError("conversation_limit_exceeded",
                                    f"the prompt has {prompt_chars} characters, more than this server's limit of "
                                    f"{self._limits.max_conversation_chars}; delete items or shorten the "
                                    "instructions", "response.input" if event.input is not None else None)
            return messages

        waits = any(item.id in self._transcribing for item in items)
        messages = [] if waits else render()
        if in_conversation:
            self._check_room(extra_items=1, extra_chars=0, param=None)
        max_output = event.max_output_tokens if event.max_output_tokens is not None else self._max_output_tokens
        max_tokens = self._limits.max_output_tokens if max_output == "inf" else int(max_output)
        temperature = self._temperature if event.temperature is None else event.temperature
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=event.ignore_eos)
        # The grammar Turn compiles allows calls exactly when the constraints do (build_grammar), so
        # the output is parsed for calls from the first token, before the grammar exists.
        # (_apply_tools refused callable tools already where the model has no family.)
        family = self._family if constraints.calls_allowed else None
        response = ResponseStream(
            response_id=self._ids("resp"), conversation=self._conversation if in_conversation else None,
            conversation_id=self._conversation.id, max_output_tokens=max_output, temperature=temperature,
            metadata=event.metadata, beta=self._beta, ids=self._ids, events=self._events,
            calls=CallStream(family.new_parser()) if family is not None else None,
            audio=audio, speech=self._speech_factory())
        self._active = response
        self._active_event_id = event.event_id
        response.created()
        model = self._model

        def start(messages: list[dict[str, str]]) -> None:
            self._commands.append(StartGeneration(response_id=response.id, messages=messages, params=params,
                                                  metadata=dict(event.metadata or {}), model=model,
                                                  constraints=constraints if family is not None else None))

        if not waits:
            start(messages)
            return
        response.held = True

        def release() -> None:  # the transcripts are in: render the prompt now, or fail the response
            response.held = False
            try:
                messages = render()
            except ProtocolError as e:
                response.fail({"type": "invalid_request_error", "code": e.code, "message": e.message})
                self._settle()
                return
            start(messages)

        self._held = release

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
        self._collect_speech()
        if self._active is not None and self._active.done:
            if self._active.speaks:
                self._stop_speech(self._active.id)
            self._active = None
            self._held = None

    def _release_held(self) -> None:
        """Start the held response once no transcript its prompt needs is still being made."""
        held = self._held
        if held is None or self._active is None:
            return
        if self._transcribing:  # any transcript still being made (the user may have said more)
            return
        self._held = None
        held()

    def _speech_factory(self) -> Callable[[Callable[[int, str], None]], SpeechOut] | None:
        voice = self._voice
        if voice is None:
            return None
        return lambda request: SpeechOut(voice.phrases(), request)

    # ----- helpers ----------------------------------------------------------------------

    def _view(self) -> SessionView:
        return SessionView(id=self._session_id, model=self._model, instructions=self._instructions,
                           max_output_tokens=self._max_output_tokens, temperature=self._temperature,
                           constraints=self._constraints, audio=self._audio)

    def _apply_tools(self, patch: ToolsPatch, prefix: str, base: OutputConstraints) -> OutputConstraints:
        """``base`` with the patch's tools, tool_choice and parallel_tool_calls; a ProtocolError
        naming the field (``session.tools[0].parameters``, ``response.tool_choice.name``...) when
        they are malformed, do not fit together, or could be called by a model that cannot call."""
        try:
            constraints = parse_realtime_constraints(patch.raw, param_prefix=prefix, base=base)
        except InvalidRequestError as e:  # SchemaError included: a schema past its bounds
            raise ProtocolError(e.code, e.message, e.param) from None
        if patch.parallel_tool_calls is not None:
            constraints = replace(constraints, parallel_tool_calls=patch.parallel_tool_calls)
        if constraints.calls_allowed and self._family is None:
            raise ProtocolError("unsupported_feature", "this model has no known tool-call format, so it cannot "
                                "call tools; set tool_choice \"none\" or no tools", f"{prefix}.tools")
        return constraints

    def _is_active_item(self, item_id: str) -> bool:
        """``item_id`` is an item the active response is writing (its message or one of its calls)."""
        return self._active is not None and self._active.owns(item_id)

    def _emit(self, ga_type: str, **fields: Any) -> None:
        self._events.emit(ga_type, **fields)

    def _error(self, e: ProtocolError) -> None:
        self._events.error(e)

    def _internal_error(self, event_id: str | None) -> None:
        self._error(ProtocolError("server_error", INTERNAL_ERROR_MESSAGE, type="server_error", event_id=event_id))

