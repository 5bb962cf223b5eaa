"""The conversation of one Realtime session: an ordered list of items (text messages, function
calls and their outputs).

Pure data with no protocol knowledge: the session decides what to emit, this module keeps
the items, their order and their text, and turns them into the history the prompt is rendered
from (``gateway.shaping.Message``s: text, an assistant's calls, or a tool's result).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from llm_shared.structured import Message, ToolCall

if TYPE_CHECKING:
    from voice.alignment import Alignment

Role = Literal["system", "user", "assistant"]
ItemStatus = Literal["completed", "incomplete", "in_progress"]
ROOT = "root"  # previous_item_id that inserts at the very beginning (Realtime API convention)


@dataclass
class Item:
    """One message. ``parts`` are the texts of its content parts, in order; the wire type of
    each part (``input_text`` / ``output_text`` / ``text``) follows from the role."""

    type: ClassVar[str] = "message"
    id: str
    role: Role
    parts: list[str]
    status: ItemStatus = "completed"
    # Spoken content: ``parts`` hold transcripts (input_audio / output_audio parts on the wire).
    audio: bool = False
    transcribing: bool = False  # a user's speech whose transcript is not known yet
    speech: Alignment | None = None  # an assistant's speech: what was said by when (truncate)

    @property
    def text(self) -> str:
        # Several parts of one message are one turn to the model; a newline keeps words apart.
        return "\n".join(self.parts)

    @property
    def chars(self) -> int:
        return sum(len(p) for p in self.parts)


@dataclass
class FunctionCall:
    """A function call: one a response made (its arguments grow while it streams), or one a
    client replays into the history."""

    type: ClassVar[str] = "function_call"
    id: str
    call_id: str  # what a function_call_output names to answer it
    name: str
    arguments: str  # the arguments object as JSON text (as generated: may be cut short)
    status: ItemStatus = "completed"

    @property
    def chars(self) -> int:
        return len(self.name) + len(self.arguments)


@dataclass
class FunctionCallOutput:
    """The client's result of a function call, for the next response to read."""

    type: ClassVar[str] = "function_call_output"
    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"

    @property
    def chars(self) -> int:
        return len(self.output)


AnyItem = Item | FunctionCall | FunctionCallOutput


def to_history(instructions: str, items: Iterable[AnyItem]) -> list[Message]:
    """The turns of a prompt: instructions as the first system message, then the items.

    Function calls join the assistant turn right before them (the text a response wrote before
    its calls, or the calls of one response, are one turn to the model); a call's output is a
    ``tool`` turn. Empty assistant messages (a response cancelled before its first token, or
    truncated to nothing) are left out: an empty assistant turn only confuses small models.
    """
    messages = [Message("system", instructions)] if instructions else []
    for item in items:
        if isinstance(item, FunctionCall):
            call = ToolCall(item.call_id, item.name, item.arguments)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = Message("assistant", last.content, (*last.tool_calls, call))
            else:
                messages.append(Message("assistant", "", (call,)))
        elif isinstance(item, FunctionCallOutput):
            messages.append(Message("tool", item.output, tool_call_id=item.call_id))
        elif (item.role != "assistant" and not item.audio) or item.text:
            # (speech that could not be transcribed, like an empty assistant turn, says nothing)
            messages.append(Message(item.role, item.text))
    return messages


@dataclass
class Conversation:
    """Items in order, addressable by id. Limits are checked by the caller before inserting,
    so that it can answer with a protocol error naming the right parameter."""

    id: str
    _items: list[AnyItem] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[AnyItem]:
        return iter(self._items)

    def __contains__(self, item_id: object) -> bool:
        return any(i.id == item_id for i in self._items)

    @property
    def chars(self) -> int:
        return sum(i.chars for i in self._items)

    def get(self, item_id: str) -> AnyItem | None:
        for item in self._items:
            if item.id == item_id:
                return item
        return None

    def insert(self, item: AnyItem, previous_item_id: str | None = None) -> str | None:
        """Insert after ``previous_item_id`` (None: at the end; ``"root"``: at the start).

        Returns the id of the item now before it (None when it is first). The caller has
        checked that ``previous_item_id`` exists and ``item.id`` is new.
        """
        if previous_item_id is None:
            index = len(self._items)
        elif previous_item_id == ROOT:
            index = 0
        else:
            index = next(n for n, i in enumerate(self._items) if i.id == previous_item_id) + 1
        self._items.insert(index, item)
        return self._items[index - 1].id if index > 0 else None

    def has_call(self, call_id: str) -> bool:
        """A function call with this ``call_id`` is in the conversation."""
        return any(isinstance(i, FunctionCall) and i.call_id == call_id for i in self._items)

    def previous_id(self, item_id: str) -> str | None:
        for n, item in enumerate(self._items):
            if item.id == item_id:
                return self._items[n - 1].id if n > 0 else None
        return None

    def delete(self, item_id: str) -> bool:
        for n, item in enumerate(self._items):
            if item.id == item_id:
                del self._items[n]
                return True
        return False
