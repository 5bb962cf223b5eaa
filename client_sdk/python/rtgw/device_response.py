"""An on-device answer told as the gateway's Realtime server events.

The on-device fallback feeds what its model writes through the model family's tool-call parser
(``llm_shared.structured``) and hands the parser's events here; ``DeviceResponse`` turns them into
the events the gateway would have sent for the same output (``response.created``, the message and
its text deltas, each ``function_call`` item with its arguments, ``response.done``): items open and
close through ``llm_shared.realtime_order.ResponseOrder``, the gateway's own order
(``gateway/ws/responses.py`` emits through it too; ``tests/test_response_order.py`` compares them). A spoken answer (``audio=True``) tells each phrase as
its transcript delta and its audio deltas (``spoken``), as the gateway does for ``output_modalities``
``["audio"]``. The client feeds them to its protocol core as if
they came off the socket, so an offline turn's deltas, calls, result and conversation items are
the online ones by construction. Pure: no I/O, and no import of the runtime (the parser's events
are read by their ``kind`` tag), so it is tested with literals.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from rtgw.protocol import new_id

AUDIO_CHUNK_BYTES = 500 * 48  # audio deltas of at most half a second of PCM16 at 24 kHz, as the gateway's


class DeviceResponse:
    """One response of the device, from ``created`` to ``finish``; every method returns the server
    events it makes, to be received in order."""

    def __init__(self, response_id: str, *, ids: Callable[[str], str] = new_id, audio: bool = False,
                 after: str | None = None) -> None:
        """``after``: the conversation's last item when the response starts (its first output
        item's ``previous_item_id``)."""
        self.id = response_id
        self._ids = ids
        self.audio = audio  # the message is spoken: its content is a transcript with audio
        self._after = after
        self._made: list[dict[str, Any]] = []  # events ResponseOrder made, taken by the caller
        self._order_made: Any = None
        self._output: list[dict[str, Any]] = []  # every output item, in order (response.done's output)
        self._message: dict[str, Any] | None = None  # the open message
        self._calls: dict[int, dict[str, Any]] = {}  # parser index -> the open call item
        self.done = False

    @property
    def message_id(self) -> str | None:
        """The open message's id (None between messages)."""
        return self._message["id"] if self._message is not None else None

    def created(self) -> list[dict[str, Any]]:
        return [{"type": "response.created", "response": {"id": self.id, "object": "realtime.response",
                                                          "status": "in_progress", "output": []}}]

    def text(self, text: str) -> list[dict[str, Any]]:
        """Answer text (no tool-call parser: the whole output is text)."""
        if not text or self.done:
            return []
        assert not self.audio, "a spoken answer's text comes with its audio: spoken()"
        events = [] if self._message is not None else self._open_message()
        message = self._message
        assert message is not None
        message["content"][0]["text"] += text
        return [*events, {"type": "response.output_text.delta", "response_id": self.id, "item_id": message["id"],
                          "output_index": self._output.index(message), "content_index": 0, "delta": text}]

    def spoken(self, text: str, pcm: bytes) -> list[dict[str, Any]]:
        """A phrase of a spoken answer: its transcript delta, then its audio (PCM16 24 kHz, raw bytes,
        as the msgpack subprotocol carries it) in deltas of at most half a second."""
        if self.done or not (text or pcm):
            return []
        events = [] if self._message is not None else self._open_message()
        message = self._message
        assert message is not None
        message["content"][0]["transcript"] += text
        ids = {"response_id": self.id, "item_id": message["id"], "output_index": self._output.index(message),
               "content_index": 0}
        if text:
            events.append({"type": "response.output_audio_transcript.delta", **ids, "delta": text})
        events += [{"type": "response.output_audio.delta", **ids, "delta": pcm[start:start + AUDIO_CHUNK_BYTES]}
                   for start in range(0, len(pcm), AUDIO_CHUNK_BYTES)]
        return events

    def parsed(self, events: Sequence[Any]) -> list[dict[str, Any]]:
        """The parser's events (``TextDelta``, ``CallStarted``, ``ArgumentsDelta``, ``CallDone``)."""
        out: list[dict[str, Any]] = []
        for event in events:
            kind = event.kind
            if kind == "text":
                out += self.text(event.text)
            elif kind == "call_started":
                out += self._open_call(event.index, event.name)
            elif kind == "arguments_delta":
                item = self._calls[event.index]
                item["arguments"] += event.delta
                out.append({"type": "response.function_call_arguments.delta", "response_id": self.id,
                            "item_id": item["id"], "output_index": self._output.index(item),
                            "call_id": item["call_id"], "delta": event.delta})
            elif kind == "call_done":
                out += self._close_call(event.index, event.arguments, complete=event.complete)
        return out

    def finish(self, status: str, *, reason: str | None = None, error: dict[str, Any] | None = None,
               usage: dict[str, Any] | None = None, metadata: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Close what is open, then ``response.done``. ``status``: completed, incomplete, cancelled or
        failed; ``reason`` explains a cancelled or incomplete one, ``error`` a failed one. The
        parser's ``finish()`` events go to ``parsed`` first."""
        if self.done:
            return []
        out: list[dict[str, Any]] = []
        if not self._output and status in ("completed", "incomplete"):
            out += self._open_message()  # a finished turn always has its (maybe empty) message, as online
        out += self._close_message(status)
        for index, item in list(self._calls.items()):  # calls the parser left open (none expected)
            out += self._close_call(index, item["arguments"], complete=False)
        self.done = True
        details: dict[str, Any] | None = None
        if error is not None:
            details = {"type": status, "error": error}
        elif reason is not None:
            details = {"type": status, "reason": reason}
        out.append({"type": "response.done", "response": {
            "id": self.id, "object": "realtime.response", "status": status, "status_details": details,
            "output": copy.deepcopy(self._output), "metadata": metadata or {}, "usage": usage or {}}})
        return out

    # --- items ----------------------------------------------------------------------------------

    @property
    def _order(self) -> Any:
        """The gateway's ``ResponseOrder``, made when the first item opens: it comes with the edge
        runtime (the ``offline`` extra), which an answer that gets that far has loaded; one that
        fails before (no runtime installed) ends with ``response.done`` alone, as online."""
        if self._order_made is None:
            from llm_shared.realtime_order import ResponseOrder

            self._order_made = ResponseOrder(self.id, lambda ga_type, fields: self._made.append(
                {"type": ga_type, **fields}))
        return self._order_made

    def _take(self) -> list[dict[str, Any]]:
        made, self._made = self._made, []
        return made

    def _previous(self, item: dict[str, Any]) -> str | None:
        """The conversation item before ``item`` (its output's previous, or what the response followed)."""
        index = next(i for i, output in enumerate(self._output) if output is item)
        return self._output[index - 1]["id"] if index else self._after

    def _open_message(self) -> list[dict[str, Any]]:
        part = {"type": "output_audio", "transcript": ""} if self.audio else {"type": "output_text", "text": ""}
        self._message = {"id": self._ids("item"), "object": "realtime.item", "type": "message",
                         "status": "in_progress", "role": "assistant", "content": []}
        self._output.append(self._message)
        self._order.message_opened(copy.deepcopy(self._message), len(self._output) - 1,
                                   self._previous(self._message), audio=self.audio)
        self._message["content"].append(part)  # (opened empty, then its part, as the gateway's)
        return self._take()

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, self._message = self._message, None
        if message is None:
            return []
        message["status"] = "completed" if status == "completed" else "incomplete"
        part = message["content"][0]
        self._order.message_closed(copy.deepcopy(message), self._output.index(message),
                                   part["transcript"] if self.audio else part["text"], self._previous(message),
                                   audio=self.audio)
        return self._take()

    def _open_call(self, index: int, name: str) -> list[dict[str, Any]]:
        out = self._close_message("completed")  # the text before a call is complete: the call follows it
        item = {"id": self._ids("item"), "object": "realtime.item", "type": "function_call", "status": "in_progress",
                "call_id": self._ids("call"), "name": name, "arguments": ""}
        self._calls[index] = item
        self._output.append(item)
        self._order.item_opened(copy.deepcopy(item), len(self._output) - 1, self._previous(item))
        return out + self._take()

    def _close_call(self, index: int, arguments: str, *, complete: bool) -> list[dict[str, Any]]:
        item = self._calls.pop(index)
        item["arguments"] = arguments
        item["status"] = "completed" if complete else "incomplete"
        self._order.call_closed(copy.deepcopy(item), self._output.index(item), item["call_id"], item["name"],
                                arguments, self._previous(item))
        return self._take()
