"""The conversation-editing half of a Realtime session: items created, deleted, truncated, and
the items a response's ``input`` names. A mixin of ``RealtimeSession`` (same state, same rules:
sans-I/O; a refusal is a ``ProtocolError`` the session turns into an ``error`` event)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gateway.ws.commands import CancelTranscription
from gateway.ws.conversation import ROOT, AnyItem, FunctionCall, FunctionCallOutput, Item
from gateway.ws.events import (
    ItemCreate,
    ItemDelete,
    ItemReference,
    ItemTruncate,
    NewFunctionCall,
    NewFunctionCallOutput,
    NewItems,
    ProtocolError,
)
from gateway.ws.wire import item_wire

if TYPE_CHECKING:
    from gateway.ws.session import RealtimeSession


class SessionItems:
    """Item handlers; ``self`` is the ``RealtimeSession``."""

    def _item_create(self: RealtimeSession, event: ItemCreate) -> None:
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

    def _item_delete(self: RealtimeSession, event: ItemDelete) -> None:
        self._item(event.item_id, "item_id")
        if self._active is not None and self._is_active_item(event.item_id):
            self._cancel(self._active, "client_cancelled")
        self._conversation.delete(event.item_id)
        transcribing = self._transcribing.pop(event.item_id, None) is not None
        if transcribing or (self._eager is not None and self._eager[0] == event.item_id):
            self._eager = None
            self._commands.append(CancelTranscription(event.item_id))  # its job's work is moot: freed now
        self._emit("conversation.item.deleted", item_id=event.item_id)
        self._release_held()

    def _item_truncate(self: RealtimeSession, event: ItemTruncate) -> None:
        """Text barge-in: keep only the first ``x_text_end`` characters the user saw.

        Truncating the item the active response is writing cancels that response first, so
        the engine stops and no later delta can grow the item again.
        """
        item = self._item(event.item_id, "item_id")
        if not isinstance(item, Item) or item.role != "assistant":
            raise ProtocolError("invalid_value", "only assistant messages can be truncated", "item_id")
        if item.audio and event.text_end is None:
            if event.content_index != 0:
                raise ProtocolError("invalid_value", f"item {item.id!r} has no content part {event.content_index}",
                                    "content_index")
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
        if self._active is not None and self._is_active_item(item.id):
            self._cancel(self._active, "client_cancelled")
        # What follows the cut, in this part and in later parts, was never seen.
        item.parts[event.content_index] = item.parts[event.content_index][:event.text_end]
        del item.parts[event.content_index + 1:]
        self._emit("conversation.item.truncated", item_id=item.id, content_index=event.content_index,
                   audio_end_ms=event.audio_end_ms, x_text_end=event.text_end)

    def _resolve_input(self: RealtimeSession, entries: tuple[Any, ...]) -> list[AnyItem]:
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

    def _new_item(self: RealtimeSession, new: NewItems) -> AnyItem:
        """A client's item as stored, with the ids it left to the server."""
        item_id = new.id or self._ids("item")
        if isinstance(new, NewFunctionCall):
            return FunctionCall(id=item_id, call_id=new.call_id or self._ids("call"), name=new.name,
                                arguments=new.arguments)
        if isinstance(new, NewFunctionCallOutput):
            return FunctionCallOutput(id=item_id, call_id=new.call_id, output=new.output)
        return Item(id=item_id, role=new.role, parts=list(new.parts))

    def _item(self: RealtimeSession, item_id: str, param: str) -> AnyItem:
        item = self._conversation.get(item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"item {item_id!r} does not exist in the conversation", param)
        return item

    def _check_room(self: RealtimeSession, *, extra_items: int, extra_chars: int, param: str | None) -> None:
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


def _has_call(items: Iterable[AnyItem], call_id: str) -> bool:
    return any(isinstance(i, FunctionCall) and i.call_id == call_id for i in items)
