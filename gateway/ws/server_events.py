"""Server events as the session core produces them: typed until they reach the wire.

The outbox merges text deltas and the connection counts errors and cancels; both read the
typed fields here instead of digging into dicts. ``to_wire`` turns an event into the plain
dict that the codec encodes (JSON or msgpack), with the keys in the order clients see them.
Every event carries its wire name already (GA or beta, see ``wire.event_name``).

``Emitter`` is the one place that draws event ids and names, so that the session and its
``ResponseStream`` queue events in one order.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway.ws.fields import ProtocolError
from gateway.ws.wire import event_name


@dataclass(slots=True)  # not frozen: one is made per token, and frozen __init__ costs 4x; none is ever changed
class TextDelta:
    """``response.output_text.delta`` (beta: ``response.text.delta``): the only event the
    outbox may merge, so the fields it compares are typed."""

    type: str  # the wire name, which differs between GA and beta
    event_id: str
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str

    def continues(self, earlier: TextDelta) -> bool:
        """True when this delta extends the same content part as ``earlier`` (may be merged)."""
        return (self.type == earlier.type and self.response_id == earlier.response_id
                and self.item_id == earlier.item_id and self.output_index == earlier.output_index
                and self.content_index == earlier.content_index)

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "event_id": self.event_id, "response_id": self.response_id,
                "item_id": self.item_id, "output_index": self.output_index,
                "content_index": self.content_index, "delta": self.delta}


@dataclass(frozen=True, slots=True)
class AudioDelta:
    """``response.output_audio.delta`` (beta: ``response.audio.delta``): PCM16 at 24 kHz, raw
    here; base64 in JSON, bytes as they are on the msgpack subprotocol (``FrameCodec``)."""

    type: str
    event_id: str
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    audio: bytes

    def to_wire(self, binary: bool = False) -> dict[str, Any]:
        return {"type": self.type, "event_id": self.event_id, "response_id": self.response_id,
                "item_id": self.item_id, "output_index": self.output_index, "content_index": self.content_index,
                "delta": self.audio if binary else base64.b64encode(self.audio).decode("ascii")}


@dataclass(frozen=True, slots=True)
class ResponseDone:
    """``response.done``: the end of one response, counted by status in the metrics."""

    type: ClassVar[str] = "response.done"
    event_id: str
    response: dict[str, Any]  # the response object as sent (output, usage, status_details...)
    status: str  # completed, incomplete, cancelled or failed (also inside ``response``)
    reason: str | None  # status_details.reason of a cancelled or incomplete response
    error_code: str | None  # status_details.error.code of a failed response

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "event_id": self.event_id, "response": self.response}


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """``error``: a refused client event (or a generic internal error); counted by code."""

    type: ClassVar[str] = "error"
    event_id: str
    code: str
    message: str
    param: str | None
    error_type: str  # OpenAI's error type, e.g. invalid_request_error
    client_event_id: str | None  # the client event this answers, when it had a usable id

    def to_wire(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code,
                 "event_id": self.client_event_id}
        return {"type": self.type, "event_id": self.event_id, "error": error}


@dataclass(frozen=True, slots=True)
class OtherEvent:
    """Any other server event; nothing in the gateway reads its fields before the wire."""

    type: str
    event_id: str
    fields: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "event_id": self.event_id, **self.fields}


ServerEvent = TextDelta | AudioDelta | ResponseDone | ErrorEvent | OtherEvent


def to_wire(event: ServerEvent) -> dict[str, Any]:
    """The plain dict sent for ``event`` (a new dict: callers may keep or change it)."""
    return event.to_wire()


class Emitter:
    """Collects the server events of one session in order, naming and numbering them."""

    def __init__(self, ids: Callable[[str], str], beta: bool) -> None:
        self._ids = ids
        self._beta = beta
        self._events: list[ServerEvent] = []
        self._delta_name = event_name("response.output_text.delta", beta)

    @property
    def pending(self) -> bool:
        return bool(self._events)

    def drain(self) -> list[ServerEvent]:
        events, self._events = self._events, []
        return events

    def emit(self, ga_type: str, **fields: Any) -> None:
        self._events.append(OtherEvent(event_name(ga_type, self._beta), self._ids("event"), fields))

    def text_delta(self, response_id: str, item_id: str, output_index: int, content_index: int,
                   delta: str) -> TextDelta:
        """The next text delta, numbered in this session's order but not queued: ``queue`` it, or
        send it at once, before anything emitted after it."""
        return TextDelta(self._delta_name, self._ids("event"), response_id, item_id, output_index, content_index,
                         delta)

    def audio_delta(self, response_id: str, item_id: str, output_index: int, content_index: int,
                    audio: bytes) -> None:
        self._events.append(AudioDelta(event_name("response.output_audio.delta", self._beta), self._ids("event"),
                                       response_id, item_id, output_index, content_index, audio))

    def queue(self, event: ServerEvent) -> None:
        self._events.append(event)

    def response_done(self, response: dict[str, Any], status: str, *, reason: str | None,
                      error_code: str | None) -> None:
        self._events.append(ResponseDone(self._ids("event"), response, status, reason, error_code))

    def error(self, e: ProtocolError) -> None:
        self._events.append(ErrorEvent(self._ids("event"), e.code, e.message, e.param, e.type, e.event_id))
