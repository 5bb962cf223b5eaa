"""The client side of a Realtime session, without I/O.

``ClientProtocol`` builds the client events to send (as dicts) and takes the server's events in
(``receive``), returning typed events and keeping a local copy of the conversation: every item
(messages with their role and text, function calls, their outputs) as the server last described
it. The asyncio client (``client.py``) moves the dicts over a WebSocket; the on-device fallback
(``offline.py``) tells its answers as the same server events, so its turns join the same
conversation and a later session can be restored from it (``restore_events``).

A response that calls functions ends each call with a ``FunctionCall`` event (its arguments parsed)
and lists them in ``TurnResult.calls``; ``tool_outputs`` answers them with ``function_call_output``
items and asks for the next response.

Item ids are chosen here for the client's items (the API lets a client name its items), and taken
from the server for the response's items, so the same ids survive a reconnect.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from rtgw.voice_events import TRANSCRIPT_DELTAS, AudioDelta, InputTranscript, ServerVoiceEvent, voice_event

Role = Literal["system", "user", "assistant"]

GOING_AWAY = 1001
MAX_RECONNECT_AFTER_MS = 60_000  # a hint asking for a longer wait is held to this


def reconnect_hint(code: int | None, reason: str | None) -> int | None:
    """The gateway's drain hint: a close with 1001 whose reason is ``{"reconnect":true,
    "after_ms":N}`` asks the client to reconnect after N ms (the load balancer then picks a
    replica that is not going away). The delay in ms, or None for any other close."""
    if code != GOING_AWAY or not reason:
        return None
    try:
        hint = json.loads(reason)
    except ValueError:
        return None
    if not isinstance(hint, dict) or hint.get("reconnect") is not True:
        return None
    after = hint.get("after_ms", 0)
    if isinstance(after, bool) or not isinstance(after, (int, float)) or not after >= 0:
        after = 0
    return int(min(after, MAX_RECONNECT_AFTER_MS))


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


@dataclass
class Item:
    """One message of the conversation, as both sides know it."""

    type: ClassVar[str] = "message"
    id: str
    role: Role
    text: str
    status: str = "completed"

    def wire(self) -> dict[str, Any]:
        kind = "output_text" if self.role == "assistant" else "input_text"
        return {"type": "message", "id": self.id, "role": self.role, "content": [{"type": kind, "text": self.text}]}


@dataclass
class FunctionCallItem:
    """A function call a response made: its arguments grow while they stream."""

    type: ClassVar[str] = "function_call"
    id: str
    call_id: str  # what the output that answers it names
    name: str
    arguments: str  # the arguments object as JSON text, as generated (cut short: incomplete)
    status: str = "completed"

    def wire(self) -> dict[str, Any]:
        # An in-progress call is restored as cut short: the response that was writing it is gone.
        status = "incomplete" if self.status == "in_progress" else self.status
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.arguments, "status": status}


@dataclass
class FunctionCallOutputItem:
    """The client's result of a function call, for the next response to read."""

    type: ClassVar[str] = "function_call_output"
    id: str
    call_id: str
    output: str

    def wire(self) -> dict[str, Any]:
        return {"type": "function_call_output", "id": self.id, "call_id": self.call_id, "output": self.output}


ConversationItem = Item | FunctionCallItem | FunctionCallOutputItem


@dataclass(frozen=True)
class TextDelta:
    response_id: str
    text: str


@dataclass(frozen=True)
class TranscriptDelta(TextDelta):
    """The words of a spoken answer, sent just before the audio that says them (a phrase at a
    time). A ``TextDelta``, so that iterating a turn reads a spoken answer as text."""

    item_id: str = ""


@dataclass(frozen=True)
class FunctionCall:
    """A function call of a response, once its arguments are complete (or cut short). Answer it with
    ``RealtimeClient.send_tool_output(call.call_id, output)``."""

    call_id: str
    name: str
    arguments: str  # the arguments object as JSON text, as generated
    parsed: dict[str, Any] | None  # the arguments parsed; None when they are not a JSON object (cut short)
    item_id: str = ""
    response_id: str = ""
    status: str = "completed"  # incomplete: the output ended inside the call (a length limit, a cancel)

    @property
    def complete(self) -> bool:
        return self.status == "completed" and self.parsed is not None

    @classmethod
    def of(cls, item: FunctionCallItem, response_id: str) -> FunctionCall:
        return cls(item.call_id, item.name, item.arguments, parse_arguments(item.arguments), item.id, response_id,
                   item.status)


def parse_arguments(arguments: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended. ``status``: completed, incomplete, cancelled or failed. ``calls``: the
    functions the response called, in order (answer them with ``send_tool_outputs``)."""

    response_id: str
    status: str
    text: str
    item_id: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    usage: Mapping[str, Any] = field(default_factory=dict)
    reason: str | None = None  # why it was cancelled or incomplete
    error: Mapping[str, Any] | None = None  # why it failed
    offline: bool = False  # served by the on-device model, not the gateway
    calls: tuple[FunctionCall, ...] = ()

    @property
    def tier(self) -> str:
        return str(self.metadata.get("x_tier", ""))

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("input_token_details") or {}
        return int(details.get("cached_tokens", 0) or 0)


@dataclass(frozen=True)
class ServerError:
    """An ``error`` event: ``event_id`` names the client event it answers, when the server knows it."""

    code: str
    message: str
    param: str | None = None
    event_id: str | None = None


@dataclass(frozen=True)
class ItemTruncated:
    item_id: str
    text: str  # after a text truncate (x_text_end); a spoken item's kept words are read back by retrieve
    audio_end_ms: int | None = None  # a spoken item's truncate: the audio kept


@dataclass(frozen=True)
class ItemRetrieved:
    item: ConversationItem  # the server's copy (the local conversation is not changed by it)


@dataclass(frozen=True)
class SessionInfo:
    id: str
    model: str


Event = (TextDelta | FunctionCall | TurnResult | ServerError | ItemTruncated | ItemRetrieved | SessionInfo
         | ServerVoiceEvent)


@dataclass
class _Active:
    response_id: str
    item_id: str | None = None  # its (first) message
    text: str = ""


class ClientProtocol:
    def __init__(self) -> None:
        self.items: list[ConversationItem] = []  # the conversation, oldest first
        self.session: SessionInfo | None = None
        self._active: _Active | None = None

    # --- what to send ---------------------------------------------------------------------------

    @staticmethod
    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": new_id("evt"), **fields}

    def session_update(self, **session: Any) -> dict[str, Any]:
        return self.event("session.update", session={"type": "realtime", **session})

    def user_turn(self, text: str, **response: Any) -> list[dict[str, Any]]:
        """The user's message (added to the local conversation now) and the request to answer it."""
        item = Item(new_id("item"), "user", text)
        self.items.append(item)
        return [self.event("conversation.item.create", item=item.wire()), self._response_create(response)]

    def tool_outputs(self, outputs: Mapping[str, str], **response: Any) -> list[dict[str, Any]]:
        """A ``function_call_output`` item for each call id (added to the local conversation now)
        and the request for the next response. Raises ValueError, before anything is added, for
        a call id that no function call of the conversation has: the server would refuse it."""
        self.check_tool_outputs(outputs)
        events = []
        for call_id, output in outputs.items():
            item = FunctionCallOutputItem(new_id("item"), call_id, output)
            self.items.append(item)
            events.append(self.event("conversation.item.create", item=item.wire()))
        return [*events, self._response_create(response)]

    def check_tool_outputs(self, outputs: Mapping[str, str]) -> None:
        """ValueError unless every key is the call id of a function call in the conversation."""
        if not outputs:
            raise ValueError("no outputs: give at least one {call_id: output}")
        known = {i.call_id for i in self.items if isinstance(i, FunctionCallItem)}
        unknown = [call_id for call_id in outputs if call_id not in known]
        if unknown:
            raise ValueError(f"no function call in the conversation has the call_id {unknown[0]!r}")

    def _response_create(self, response: Mapping[str, Any]) -> dict[str, Any]:
        return self.event("response.create", response=dict(response)) if response else self.event("response.create")

    def cancel(self) -> dict[str, Any] | None:
        return self.event("response.cancel") if self._active is not None else None

    def truncate(self, item_id: str, heard_chars: int) -> dict[str, Any]:
        """Keep the first ``heard_chars`` characters of an assistant item (our ``x_text_end``)."""
        item = self.message(item_id)
        end = max(0, min(heard_chars, len(item.text) if item else heard_chars))
        return self.event("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=0,
                          x_text_end=end)

    def replace_events(self, item_id: str, text: str) -> list[dict[str, Any]]:
        """For a server without ``x_text_end``: delete the item, create it again holding ``text``."""
        index = self._index(item_id)
        previous = self.items[index - 1].id if index > 0 else None
        item = self.items[index]
        if not isinstance(item, Item):
            raise ValueError(f"item {item_id!r} is a {item.type}, not a message")
        item.text = text
        create = self.event("conversation.item.create", item=item.wire())
        if previous is not None:
            create["previous_item_id"] = previous
        return [self.event("conversation.item.delete", item_id=item_id), create]

    def restore_events(self) -> list[dict[str, Any]]:
        """Re-create the whole conversation on a new session, in order, with the same ids (calls
        before the outputs that answer them, as the server requires)."""
        return [self.event("conversation.item.create", item=item.wire()) for item in self.items
                if not isinstance(item, Item) or item.text]

    def add_local_user(self, text: str) -> Item:
        """A user message of a turn served without the gateway (on the device)."""
        item = Item(new_id("item"), "user", text)
        self.items.append(item)
        return item

    # --- what arrives -------------------------------------------------------------------------

    @property
    def active_response_id(self) -> str | None:
        return self._active.response_id if self._active else None

    def connection_lost(self) -> TurnResult | None:
        """The socket closed: the active turn (if any) ends ``failed``; its partial text stays,
        and a call it was writing is kept as cut short."""
        active, self._active = self._active, None
        if active is None:
            return None
        self._keep_partial(active)
        for item in self.items:
            if isinstance(item, FunctionCallItem) and item.status == "in_progress":
                item.status = "incomplete"
        return TurnResult(active.response_id, "failed", active.text, active.item_id,
                          error={"type": "connection_error", "code": "connection_lost",
                                 "message": "the connection to the gateway was lost"})

    def receive(self, event: Mapping[str, Any]) -> list[Event]:
        kind = event.get("type")
        if kind in ("session.created", "session.updated"):
            session = event.get("session") or {}
            self.session = SessionInfo(str(session.get("id", "")), str(session.get("model", "")))
            return [self.session]
        if kind == "response.created":
            self._active = _Active(str(event["response"]["id"]))
            return []
        if kind in ("conversation.item.added", "conversation.item.created"):
            self._item_added(event.get("item") or {}, event.get("previous_item_id"))
            return []
        if kind in ("response.output_text.delta", "response.text.delta") or kind in TRANSCRIPT_DELTAS:
            active = self._active
            if active is None or event.get("response_id") != active.response_id:
                return []
            active.item_id = active.item_id or event.get("item_id")
            active.text += event.get("delta", "")
            if kind in TRANSCRIPT_DELTAS:
                return [TranscriptDelta(active.response_id, event.get("delta", ""), str(event.get("item_id", "")))]
            return [TextDelta(active.response_id, event.get("delta", ""))]
        if kind == "response.function_call_arguments.delta":
            call = self._call(event.get("item_id"))
            if call is not None:
                call.arguments += str(event.get("delta") or "")
            return []
        if kind == "response.output_item.done":
            return self._output_item_done(event.get("item") or {}, str(event.get("response_id", "")))
        if kind == "response.done":
            return [self._response_done(event.get("response") or {})]
        if kind == "conversation.item.truncated":
            item = self.message(str(event.get("item_id")))
            if item is None:
                return []
            if event.get("x_text_end") is None:  # a spoken item, cut by audio_end_ms: the server knows the words
                return [ItemTruncated(item.id, item.text, int(event.get("audio_end_ms") or 0))]
            item.text = item.text[: int(event["x_text_end"])]
            return [ItemTruncated(item.id, item.text)]
        if kind == "conversation.item.retrieved":
            retrieved = _item_from_wire(event.get("item") or {}, default_role="user")
            return [ItemRetrieved(retrieved)] if retrieved is not None else []
        if kind == "conversation.item.deleted":
            self.items = [i for i in self.items if i.id != event.get("item_id")]
            return []
        voice = voice_event(event)
        if voice is not None:
            return self._voice(voice)
        if kind == "error":
            error = event.get("error") or {}
            return [ServerError(str(error.get("code") or "error"), str(error.get("message", "")), error.get("param"),
                                error.get("event_id"))]
        return []

    def item(self, item_id: str) -> ConversationItem | None:
        return next((i for i in self.items if i.id == item_id), None)

    def message(self, item_id: str) -> Item | None:
        item = self.item(item_id)
        return item if isinstance(item, Item) else None

    def last_assistant(self) -> Item | None:
        return next((i for i in reversed(self.items) if isinstance(i, Item) and i.role == "assistant"), None)

    # --- internals -------------------------------------------------------------------------------

    def _voice(self, event: ServerVoiceEvent) -> list[Event]:
        if isinstance(event, AudioDelta):
            active = self._active
            if active is None or event.response_id != active.response_id:
                return []  # a late delta of a cancelled response: not played
            active.item_id = active.item_id or event.item_id or None
        elif isinstance(event, InputTranscript):
            item = self.message(event.item_id)
            if item is not None:
                item.text = event.transcript  # the user's words join the local conversation
        return [event]

    def _index(self, item_id: str) -> int:
        for n, item in enumerate(self.items):
            if item.id == item_id:
                return n
        raise KeyError(item_id)

    def _call(self, item_id: object) -> FunctionCallItem | None:
        item = self.item(item_id) if isinstance(item_id, str) else None
        return item if isinstance(item, FunctionCallItem) else None

    def _item_added(self, raw: Mapping[str, Any], previous_id: object) -> None:
        item_id = raw.get("id")
        if not isinstance(item_id, str) or self.item(item_id) is not None:
            return  # ours (an item we named, or a restored one): already in the conversation
        item = _item_from_wire(raw)
        if item is None:
            return
        after = self.item(previous_id) if isinstance(previous_id, str) else None
        self.items.insert(self._index(after.id) + 1 if after else len(self.items), item)
        active = self._active
        if isinstance(item, Item) and item.role == "assistant" and active is not None and active.item_id is None:
            active.item_id = item_id

    def _output_item_done(self, raw: Mapping[str, Any], response_id: str) -> list[Event]:
        """A call's arguments are complete (or cut short): the local item takes the server's copy."""
        if raw.get("type") != "function_call":
            return []
        call = self._call(raw.get("id"))
        done = _item_from_wire(raw)
        if not isinstance(done, FunctionCallItem):
            return []
        if call is None:  # an out-of-band response (conversation "none"): not in the conversation
            call = done
        else:
            call.arguments, call.status = done.arguments, done.status
        return [FunctionCall.of(call, response_id or self.active_response_id or "")]

    def _keep_partial(self, active: _Active) -> None:
        if active.item_id is not None:
            item = self.message(active.item_id)
            if item is not None:
                item.text = active.text

    def _response_done(self, response: Mapping[str, Any]) -> TurnResult:
        active = self._active
        response_id = str(response.get("id", ""))
        if active is None or active.response_id != response_id:
            active = _Active(response_id)
        self._active = None
        output = [o for o in response.get("output") or [] if isinstance(o, Mapping)]
        messages = [o for o in output if o.get("type", "message") == "message"]
        if messages and not active.item_id:
            active.item_id = messages[0].get("id")
        if messages:
            active.text = "".join(str(p.get("text") or p.get("transcript") or "") for m in messages
                                  for p in m.get("content") or []) or active.text
        self._keep_partial(active)
        for raw in messages:
            local = self.message(str(raw.get("id", "")))
            if local is not None:
                local.status = str(raw.get("status") or local.status)
        calls = []
        for raw in output:
            done = _item_from_wire(raw)
            if not isinstance(done, FunctionCallItem):
                continue
            local = self._call(done.id)
            if local is not None:
                local.arguments, local.status = done.arguments, done.status
            calls.append(FunctionCall.of(done, response_id))
        details = response.get("status_details") or {}
        return TurnResult(response_id, str(response.get("status", "")), active.text, active.item_id,
                          metadata=dict(response.get("metadata") or {}), usage=dict(response.get("usage") or {}),
                          reason=details.get("reason"), error=details.get("error"), calls=tuple(calls))


def _item_from_wire(raw: Mapping[str, Any], default_role: str | None = None) -> ConversationItem | None:
    """A server's item as ours; None for a kind we do not keep (or a message without a known role)."""
    item_id = str(raw.get("id", ""))
    status = str(raw.get("status", "completed"))
    kind = raw.get("type", "message")
    if kind == "function_call":
        return FunctionCallItem(item_id, str(raw.get("call_id", "")), str(raw.get("name", "")),
                                str(raw.get("arguments") or ""), status)
    if kind == "function_call_output":
        return FunctionCallOutputItem(item_id, str(raw.get("call_id", "")), str(raw.get("output") or ""))
    role = raw.get("role", default_role)
    if kind != "message" or role not in ("system", "user", "assistant"):
        return None
    text = "".join(str(part.get("text") or part.get("transcript") or "") for part in raw.get("content") or [])
    return Item(item_id, role, text, status)
