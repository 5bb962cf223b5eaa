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
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from gateway.shaping import CallStream
from gateway.ws.commands import AbortGeneration, Command, StartGeneration
from gateway.ws.conversation import (
    ROOT,
    AnyItem,
    Conversation,
    FunctionCall,
    FunctionCallOutput,
    Item,
    to_history,
)
from gateway.ws.events import (
    ClientEvent,
    ItemCreate,
    ItemDelete,
    ItemReference,
    ItemRetrieve,
    ItemTruncate,
    NewFunctionCall,
    NewFunctionCallOutput,
    NewItems,
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


class RealtimeSession:
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
    ) -> None:
        """``models``: the ids ``session.update`` may switch to (the served ones); ``model`` is
        always one of them. ``family``: the served model's tool-call syntax (how tools, calls and
        results are written in the prompt, and how calls are parsed back out of the output); None
        when it has none, and then tools that could be called are refused."""
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
        if response is None or response.id != response_id or self._events.pending or self._commands:
            self.engine_event(response_id, event)
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

    def _session_update(self, event: SessionUpdate) -> None:
        if event.model is not None and event.model not in self._models:
            raise ProtocolError("invalid_value", f"model {event.model!r} is not served here; available: "
                                f"{sorted(self._models)}", "session.model")
        # Everything is checked before anything changes: a refused update leaves the session as it was.
        if event.tools is not None:
            self._constraints = self._apply_tools(event.tools, "session", self._constraints)
        if event.model is not None:
            self._model = event.model  # picks the route of the responses created from now on
        if event.instructions is not None:
            self._instructions = event.instructions
        if event.max_output_tokens is not None:
            self._max_output_tokens = event.max_output_tokens
        if event.temperature is not None:
            self._temperature = event.temperature
        self._emit("session.updated", session=session_wire(self._view(), self._beta))

    def _item_create(self, event: ItemCreate) -> None:
        new, conversation = event.item, self._conversation
        if new.id is not None and (new.id in conversation or self._is_active_item(new.id)):
            raise ProtocolError("duplicate_item_id", f"an item with id {new.id!r} already exists", "item.id")
        previous = event.previous_item_id
        if previous is not None and previous != ROOT and previous not in conversation:
            raise ProtocolError("item_not_found", f"previous item {previous!r} does not exist", "previous_item_id")
        if isinstance(new, NewFunctionCallOutput) and not conversation.has_call(new.call_id):
            # As the API: an output must answer a function_call item of the conversation.
            raise ProtocolError("invalid_tool_call_id", f"Tool call ID {new.call_id!r} not found in conversation.",
                                "item.call_id")
        item = self._new_item(new)
        self._check_room(extra_items=1, extra_chars=item.chars, param="item")
        previous_id = conversation.insert(item, previous)
        self._emit("conversation.item.added", previous_item_id=previous_id, item=item_wire(item, self._beta))
        if not self._beta:
            self._emit("conversation.item.done", previous_item_id=previous_id, item=item_wire(item, self._beta))

    def _item_delete(self, event: ItemDelete) -> None:
        self._item(event.item_id, "item_id")
        if self._active is not None and self._is_active_item(event.item_id):
            self._cancel(self._active, "client_cancelled")
        self._conversation.delete(event.item_id)
        self._emit("conversation.item.deleted", item_id=event.item_id)

    def _item_truncate(self, event: ItemTruncate) -> None:
        """Text barge-in: keep only the first ``x_text_end`` characters the user saw.

        Truncating the item the active response is writing cancels that response first, so
        the engine stops and no later delta can grow the item again.
        """
        item = self._item(event.item_id, "item_id")
        if not isinstance(item, Item) or item.role != "assistant":
            raise ProtocolError("invalid_value", "only assistant messages can be truncated", "item_id")
        if event.content_index >= len(item.parts):
            raise ProtocolError("invalid_value", f"item {item.id!r} has no content part {event.content_index}",
                                "content_index")
        if event.text_end > len(item.parts[event.content_index]):
            raise ProtocolError("invalid_value", f"x_text_end {event.text_end} is past the end of the text "
                                f"({len(item.parts[event.content_index])} characters)", "x_text_end")
        if self._active is not None and self._is_active_item(item.id):
            self._cancel(self._active, "client_cancelled")
        # What follows the cut, in this part and in later parts, was never seen.
        item.parts[event.content_index] = item.parts[event.content_index][:event.text_end]
        del item.parts[event.content_index + 1:]
        self._emit("conversation.item.truncated", item_id=item.id, content_index=event.content_index,
                   audio_end_ms=event.audio_end_ms, x_text_end=event.text_end)

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
        items = list(self._conversation) if event.input is None else self._resolve_input(event.input)
        instructions = self._instructions if event.instructions is None else event.instructions
        # The tools are listed in the system prompt only when they may be called (render_messages).
        messages = render_messages(to_history(instructions, items), constraints, self._family)
        prompt_chars = sum(len(m["content"]) for m in messages)
        if prompt_chars > self._limits.max_conversation_chars:
            raise ProtocolError("conversation_limit_exceeded",
                                f"the prompt has {prompt_chars} characters, more than this server's limit of "
                                f"{self._limits.max_conversation_chars}; delete items or shorten the instructions",
                                "response.input" if event.input is not None else None)
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
            calls=CallStream(family.new_parser()) if family is not None else None)
        self._active = response
        self._active_event_id = event.event_id
        response.created()
        self._commands.append(StartGeneration(response_id=response.id, messages=messages, params=params,
                                              metadata=dict(event.metadata or {}), model=self._model,
                                              constraints=constraints if family is not None else None))

    def _resolve_input(self, entries: tuple[Any, ...]) -> list[AnyItem]:
        """The items an out-of-band input names, sized as they are resolved: references to one
        large item repeated many times are refused before any string is joined. A function call's
        output must answer a call of the input before it, or of the conversation."""
        items: list[AnyItem] = []
        chars = 0
        for n, entry in enumerate(entries):
            if isinstance(entry, ItemReference):
                found = self._conversation.get(entry.id)
                if found is None:
                    raise ProtocolError("item_not_found", f"referenced item {entry.id!r} does not exist",
                                        f"response.input[{n}].id")
                item = found
            else:
                if isinstance(entry, NewFunctionCallOutput) and not (
                        _has_call(items, entry.call_id) or self._conversation.has_call(entry.call_id)):
                    raise ProtocolError("invalid_tool_call_id", f"Tool call ID {entry.call_id!r} not found in the "
                                        "input or the conversation.", f"response.input[{n}].call_id")
                item = self._new_item(entry)
            chars += item.chars
            if chars > self._limits.max_conversation_chars:
                raise ProtocolError("conversation_limit_exceeded",
                                    f"the input holds more than this server's limit of "
                                    f"{self._limits.max_conversation_chars} characters", f"response.input[{n}]")
            items.append(item)
        return items

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
        self._commands.append(AbortGeneration(response.id))
        response.cancel(reason)
        self._settle()

    def _abandon(self, response: ResponseStream) -> None:
        """End a response whose state a bug may have broken: abort the engine and report a
        generic failure; if even that fails, forget the response without another event."""
        self._commands.append(AbortGeneration(response.id))
        try:
            response.fail({"type": "server_error", "code": "server_error", "message": INTERNAL_ERROR_MESSAGE})
        except Exception:
            logger.exception("could not report the failure of %s", response.id)
            response.done = True

    def _settle(self) -> None:
        """Forget the active response once it has sent response.done: later engine events for
        it no longer find it, which is the ordering guarantee."""
        if self._active is not None and self._active.done:
            self._active = None

    # ----- helpers ----------------------------------------------------------------------

    def _view(self) -> SessionView:
        return SessionView(id=self._session_id, model=self._model, instructions=self._instructions,
                           max_output_tokens=self._max_output_tokens, temperature=self._temperature,
                           constraints=self._constraints)

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

    def _new_item(self, new: NewItems) -> AnyItem:
        """A client's item as stored, with the ids it left to the server."""
        item_id = new.id or self._ids("item")
        if isinstance(new, NewFunctionCall):
            return FunctionCall(id=item_id, call_id=new.call_id or self._ids("call"), name=new.name,
                                arguments=new.arguments)
        if isinstance(new, NewFunctionCallOutput):
            return FunctionCallOutput(id=item_id, call_id=new.call_id, output=new.output)
        return Item(id=item_id, role=new.role, parts=list(new.parts))

    def _item(self, item_id: str, param: str) -> AnyItem:
        item = self._conversation.get(item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"item {item_id!r} does not exist in the conversation", param)
        return item

    def _is_active_item(self, item_id: str) -> bool:
        """``item_id`` is an item the active response is writing (its message or one of its calls)."""
        return self._active is not None and self._active.owns(item_id)

    def _check_room(self, *, extra_items: int, extra_chars: int, param: str | None) -> None:
        """Refuse what would take the conversation past SessionLimits (counting the message an
        active response has not opened yet, so that it always has room)."""
        active = self._active
        reserved = 1 if active is not None and active.needs_slot else 0
        items = len(self._conversation) + reserved + extra_items
        if items > self._limits.max_conversation_items:
            raise ProtocolError("conversation_limit_exceeded",
                                f"the conversation would have {items} items, more than this server's limit of "
                                f"{self._limits.max_conversation_items}; delete old items first", param)
        chars = self._conversation.chars + extra_chars
        if chars > self._limits.max_conversation_chars:
            raise ProtocolError("conversation_limit_exceeded",
                                f"the conversation would have {chars} characters, more than this server's limit "
                                f"of {self._limits.max_conversation_chars}; delete old items first", param)

    def _emit(self, ga_type: str, **fields: Any) -> None:
        self._events.emit(ga_type, **fields)

    def _error(self, e: ProtocolError) -> None:
        self._events.error(e)

    def _internal_error(self, event_id: str | None) -> None:
        self._error(ProtocolError("server_error", INTERNAL_ERROR_MESSAGE, type="server_error", event_id=event_id))


def _has_call(items: Iterable[AnyItem], call_id: str) -> bool:
    return any(isinstance(i, FunctionCall) and i.call_id == call_id for i in items)
