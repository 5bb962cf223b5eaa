"""The conversation of one Realtime session: an ordered list of text message items.

Pure data with no protocol knowledge: the session decides what to emit, this module keeps
the items, their order and their text, and turns them into chat messages for the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["system", "user", "assistant"]
ItemStatus = Literal["completed", "incomplete", "in_progress"]
ROOT = "root"  # previous_item_id that inserts at the very beginning (Realtime API convention)


@dataclass
class Item:
    """One message. ``parts`` are the texts of its content parts, in order; the wire type of
    each part (``input_text`` / ``output_text`` / ``text``) follows from the role."""

    id: str
    role: Role
    parts: list[str]
    status: ItemStatus = "completed"

    @property
    def text(self) -> str:
        # Several parts of one message are one turn to the model; a newline keeps words apart.
        return "\n".join(self.parts)

    @property
    def chars(self) -> int:
        return sum(len(p) for p in self.parts)


def to_messages(instructions: str, items: Iterable[Item]) -> list[dict[str, str]]:
    """Chat messages for the engine: instructions as the first system message, then the items.

    Empty assistant items (a response cancelled before its first token, or truncated to
    nothing) are left out: an empty assistant turn only confuses small models.
    """
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item.role == "assistant" and not item.text:
            continue
        messages.append({"role": item.role, "content": item.text})
    return messages


@dataclass
class Conversation:
    """Items in order, addressable by id. Limits are checked by the caller before inserting,
    so that it can answer with a protocol error naming the right parameter."""

    id: str
    _items: list[Item] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        return iter(self._items)

    def __contains__(self, item_id: object) -> bool:
        return any(i.id == item_id for i in self._items)

    @property
    def chars(self) -> int:
        return sum(i.chars for i in self._items)

    def get(self, item_id: str) -> Item | None:
        for item in self._items:
            if item.id == item_id:
                return item
        return None

    def insert(self, item: Item, previous_item_id: str | None = None) -> str | None:
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
