"""The items of one Realtime session: created, deleted, truncated, and the items a response's
``input`` names. Sans-I/O like the session that holds it: a refusal is a ``ProtocolError`` the
session turns into an ``error`` event; events go to the session's ``Emitter``.

The store owns the conversation and its bounds. What it needs of the response in progress is
three narrow questions (``Writer``): does it write this item, how many item slots does it hold
in reserve, and stop it before an item it writes is edited.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from gateway.ws.conversation import ROOT, AnyItem, Conversation, FunctionCall, FunctionCallOutput, Item
from gateway.ws.events import (
    ItemCreate,
    ItemReference,
    ItemTruncate,
    NewFunctionCall,
    NewFunctionCallOutput,
    NewItems,
    ProtocolError,
    SessionLimits,
)
from gateway.ws.server_events import Emitter
from gateway.ws.speech_out import truncated
from gateway.ws.wire import item_wire


class Writer(Protocol):
    """The session's response in progress, as the items see it."""

    def writes(self, item_id: str) -> bool:
        """The active response is writing ``item_id`` (its message or one of its calls)."""

    def reserved_items(self) -> int:
        """Item slots the active response will take and has not opened yet."""

    def stop_writing(self, item_id: str) -> None:
        """Cancel the active response if it writes ``item_id`` (before that item is edited)."""


class ItemStore:
    def __init__(self, conversation: Conversation, limits: SessionLimits, ids: Callable[[str], str],
                 events: Emitter, beta: bool, writer: Writer) -> None:
        self.conversation = conversation
        self._limits = limits
        self._ids = ids
        self._events = events
        self._beta = beta
        self._writer = writer
        self._out_of_context: set[str] = set()  # items truncation left out of every later prompt

    def in_context(self) -> list[AnyItem]:
        """The conversation from where truncation last cut it: what a response's prompt holds."""
        return [item for item in self.conversation if item.id not in self._out_of_context]

    def leave_out(self, item_ids: Iterable[str]) -> None:
        """A response's prompt left out these oldest items (``truncation``): so do the next ones,
        which then share its prefix (see ``gateway.context_fit``). They stay in the conversation."""
        self._out_of_context.update(item_ids)

    def get(self, item_id: str, param: str) -> AnyItem:
        item = self.conversation.get(item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"item {item_id!r} does not exist in the conversation", param)
        return item

    def create(self, event: ItemCreate) -> None:
        new, conversation = event.item, self.conversation
        if new.id is not None and (new.id in conversation or self._writer.writes(new.id)):
            raise ProtocolError("duplicate_item_id", f"an item with id {new.id!r} already exists", "item.id")
        previous = event.previous_item_id
        if previous is not None and previous != ROOT and previous not in conversation:
            raise ProtocolError("item_not_found", f"previous item {previous!r} does not exist", "previous_item_id")
        if isinstance(new, NewFunctionCallOutput) and not conversation.has_call(new.call_id):
            # As the API: an output must answer a function_call item of the conversation.
            raise ProtocolError("invalid_tool_call_id", f"Tool call ID {new.call_id!r} not found in conversation.",
                                "item.call_id")
        item = self._new_item(new)
        self.check_room(extra_items=1, extra_chars=item.chars, param="item")
        self._added(conversation.insert(item, previous), item)

    def add_speech(self, item: Item, before_added: Callable[[str | None], None]) -> None:
        """A user's speech committed as ``item`` at the end; ``before_added`` emits what the API
        sends between the insert and ``conversation.item.added`` (``input_audio_buffer.committed``)."""
        self.check_room(extra_items=1, extra_chars=0, param=None)
        previous_id = self.conversation.insert(item)
        before_added(previous_id)
        self._added(previous_id, item)

    def delete(self, item_id: str) -> None:
        self.get(item_id, "item_id")
        self._writer.stop_writing(item_id)
        self.conversation.delete(item_id)
        self._out_of_context.discard(item_id)
        self._events.emit("conversation.item.deleted", item_id=item_id)

    def truncate(self, event: ItemTruncate) -> None:
        """Barge-in: keep what the user heard (``audio_end_ms`` of a spoken item) or saw (our
        ``x_text_end`` characters of a text one). Truncating the item the active response is
        writing cancels that response first, so no later delta can grow the item again."""
        item = self.get(event.item_id, "item_id")
        if not isinstance(item, Item) or item.role != "assistant":
            raise ProtocolError("invalid_value", "only assistant messages can be truncated", "item_id")
        if item.audio and event.text_end is None:
            self._truncate_audio(item, event)
            return
        if event.text_end is None:
            raise ProtocolError("missing_required_parameter",
                                "text items are truncated by character offset: give 'x_text_end' (an extension of "
                                "this server; 'audio_end_ms' applies to spoken items)", "x_text_end")
        if event.content_index >= len(item.parts):
            raise ProtocolError("invalid_value", f"item {item.id!r} has no content part {event.content_index}",
                                "content_index")
        if event.text_end > len(item.parts[event.content_index]):
            raise ProtocolError("invalid_value", f"x_text_end {event.text_end} is past the end of the text "
                                f"({len(item.parts[event.content_index])} characters)", "x_text_end")
        self._writer.stop_writing(item.id)
        # What follows the cut, in this part and in later parts, was never seen.
        item.parts[event.content_index] = item.parts[event.content_index][:event.text_end]
        del item.parts[event.content_index + 1:]
        self._events.emit("conversation.item.truncated", item_id=item.id, content_index=event.content_index,
                          audio_end_ms=event.audio_end_ms, x_text_end=event.text_end)

    def _truncate_audio(self, item: Item, event: ItemTruncate) -> None:
        """Keep the text said by ``audio_end_ms`` of the item's speech."""
        if event.content_index != 0:
            raise ProtocolError("invalid_value", f"item {item.id!r} has no content part {event.content_index}",
                                "content_index")
        speech = item.speech
        if speech is None:
            raise ProtocolError("invalid_value", "only assistant messages can be truncated", "item_id")
        if event.audio_end_ms > speech.total_ms:
            raise ProtocolError("invalid_value", f"audio_end_ms {event.audio_end_ms} is past the end of the "
                                f"item's audio ({int(speech.total_ms)} ms)", "audio_end_ms")
        self._writer.stop_writing(item.id)
        item.speech = truncated(speech, event.audio_end_ms)
        item.parts[0] = item.speech.text
        self._events.emit("conversation.item.truncated", item_id=item.id, content_index=0,
                          audio_end_ms=event.audio_end_ms)

    def resolve_input(self, entries: tuple[Any, ...]) -> list[AnyItem]:
        """The items an out-of-band input names, sized as they are resolved: references to one
        large item repeated many times are refused before any string is joined. A function call's
        output must answer a call of the input before it, or of the conversation."""
        items: list[AnyItem] = []
        chars = 0
        for n, entry in enumerate(entries):
            if isinstance(entry, ItemReference):
                found = self.conversation.get(entry.id)
                if found is None:
                    raise ProtocolError("item_not_found", f"referenced item {entry.id!r} does not exist",
                                        f"response.input[{n}].id")
                item = found
            else:
                if isinstance(entry, NewFunctionCallOutput) and not (
                        _has_call(items, entry.call_id) or self.conversation.has_call(entry.call_id)):
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

    def check_room(self, *, extra_items: int, extra_chars: int, param: str | None) -> None:
        """Refuse what would take the conversation past SessionLimits (counting the message an
        active response has not opened yet, so that it always has room). Items truncation left out
        of the prompt go first, oldest first (each a ``conversation.item.deleted``): a conversation
        that outgrew the model's context goes on within the server's bounds."""
        self._evict_out_of_context(extra_items, extra_chars)
        items = len(self.conversation) + self._writer.reserved_items() + extra_items
        if items > self._limits.max_conversation_items:
            raise ProtocolError("conversation_limit_exceeded",
                                f"the conversation would have {items} items, more than this server's limit of "
                                f"{self._limits.max_conversation_items}; delete old items first", param)
        chars = self.conversation.chars + extra_chars
        if chars > self._limits.max_conversation_chars:
            raise ProtocolError("conversation_limit_exceeded",
                                f"the conversation would have {chars} characters, more than this server's limit "
                                f"of {self._limits.max_conversation_chars}; delete old items first", param)

    def _evict_out_of_context(self, extra_items: int, extra_chars: int) -> None:
        limits, conversation = self._limits, self.conversation
        while self._out_of_context and (
                len(conversation) + self._writer.reserved_items() + extra_items > limits.max_conversation_items
                or conversation.chars + extra_chars > limits.max_conversation_chars):
            oldest = next(item.id for item in conversation if item.id in self._out_of_context)
            self._out_of_context.discard(oldest)
            conversation.delete(oldest)
            self._events.emit("conversation.item.deleted", item_id=oldest)

    def _added(self, previous_id: str | None, item: AnyItem) -> None:
        self._events.emit("conversation.item.added", previous_item_id=previous_id, item=item_wire(item, self._beta))
        if not self._beta:
            self._events.emit("conversation.item.done", previous_item_id=previous_id, item=item_wire(item, self._beta))

    def _new_item(self, new: NewItems) -> AnyItem:
        """A client's item as stored, with the ids it left to the server."""
        item_id = new.id or self._ids("item")
        if isinstance(new, NewFunctionCall):
            return FunctionCall(id=item_id, call_id=new.call_id or self._ids("call"), name=new.name,
                                arguments=new.arguments)
        if isinstance(new, NewFunctionCallOutput):
            return FunctionCallOutput(id=item_id, call_id=new.call_id, output=new.output)
        return Item(id=item_id, role=new.role, parts=list(new.parts))


def _has_call(items: Iterable[AnyItem], call_id: str) -> bool:
    return any(isinstance(i, FunctionCall) and i.call_id == call_id for i in items)
