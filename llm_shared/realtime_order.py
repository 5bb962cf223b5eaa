"""The order of one Realtime response's events, written once.

The gateway's ``ResponseStream`` (``gateway/ws/responses.py``) and the Python SDK's on-device
``DeviceResponse`` (``rtgw/device_response.py``) both emit a response's structure through
``ResponseOrder``: an output item opened (``output_item.added``, then ``conversation.item.added``
when the response belongs to the conversation, then a message's ``content_part.added``), and
closed (a message's ``output_text.done`` or ``output_audio.done`` with its transcript's, then
``content_part.done``; a call's ``function_call_arguments.done``; then ``output_item.done`` and
``conversation.item.done``). So an answer made on the device reads, event for event, as the
gateway's, and the two cannot drift apart.

Each side keeps its own items (the gateway's conversation objects, the SDK's dicts) and hands
them over as their wire form (``wire``); deltas, the per-token hot path, stay each side's own.
Sans-I/O: ``emit(ga_type, fields)`` receives each event; no import beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Emit = Callable[[str, dict[str, Any]], None]


class ResponseOrder:
    def __init__(self, response_id: str, emit: Emit, *, beta: bool = False) -> None:
        """``beta``: the beta API's shapes (no ``conversation.item.done``, no call name in
        ``function_call_arguments.done``); the event names are GA here, the emitter renames."""
        self.response_id = response_id
        self._emit = emit
        self._beta = beta

    def message_opened(self, item: dict[str, Any], output_index: int, previous_id: str | bool | None,
                       *, audio: bool) -> None:
        """A message joined the output (``previous_id``: the conversation item before it, or False
        for a response outside the conversation); its one content part opens empty."""
        self.item_opened(item, output_index, previous_id)
        part = {"type": "audio", "transcript": ""} if audio else {"type": "text", "text": ""}
        self._emit("response.content_part.added", {**self._ids(item["id"], output_index), "part": part})

    def item_opened(self, item: dict[str, Any], output_index: int, previous_id: str | bool | None) -> None:
        self._emit("response.output_item.added", {"response_id": self.response_id, "output_index": output_index,
                                                  "item": item})
        if previous_id is not False:
            self._emit("conversation.item.added", {"previous_item_id": previous_id, "item": item})

    def message_closed(self, item: dict[str, Any], output_index: int, text: str, previous_id: str | bool | None,
                       *, audio: bool) -> None:
        """The open message ends with ``text`` (its transcript when spoken); ``item`` is its final form."""
        ids = self._ids(item["id"], output_index)
        if audio:
            self._emit("response.output_audio.done", ids)
            self._emit("response.output_audio_transcript.done", {**ids, "transcript": text})
            self._emit("response.content_part.done", {**ids, "part": {"type": "audio", "transcript": text}})
        else:
            self._emit("response.output_text.done", {**ids, "text": text})
            self._emit("response.content_part.done", {**ids, "part": {"type": "text", "text": text}})
        self.item_closed(item, output_index, previous_id)

    def call_closed(self, item: dict[str, Any], output_index: int, call_id: str, name: str, arguments: str,
                    previous_id: str | bool | None) -> None:
        done: dict[str, Any] = {"response_id": self.response_id, "item_id": item["id"], "output_index": output_index,
                                "call_id": call_id}
        if not self._beta:
            done["name"] = name  # GA only: the beta event has no name
        self._emit("response.function_call_arguments.done", {**done, "arguments": arguments})
        self.item_closed(item, output_index, previous_id)

    def item_closed(self, item: dict[str, Any], output_index: int, previous_id: str | bool | None) -> None:
        """``output_item.done``, then (GA, in the conversation) ``conversation.item.done``."""
        self._emit("response.output_item.done", {"response_id": self.response_id, "output_index": output_index,
                                                 "item": item})
        if previous_id is not False and not self._beta:
            self._emit("conversation.item.done", {"previous_item_id": previous_id, "item": item})

    def _ids(self, item_id: str, output_index: int) -> dict[str, Any]:
        return {"response_id": self.response_id, "item_id": item_id, "output_index": output_index, "content_index": 0}
