"""A streaming parser for calls written as a JSON list of ``{"name": ..., "arguments": {...}}``
objects between an opening and a closing marker, the form SmolLM2 (and the xLAM / APIGen data it
was tuned on) uses. Families with this form configure it; others write their own parser.

It scans incrementally, one character at a time once inside a block: a call's name is announced
when its string closes, and its arguments stream out as they are generated, so that the joined
fragments are exactly the arguments' JSON text. Outside a block, text is passed through except a
tail that could be the start of the opening marker, held until the next piece decides it.

Under a grammar the block is always well formed. Unconstrained output may not be: a block that
breaks before any call was announced comes out as text; one that breaks later ends the open call
as cut short and the rest comes out as text. Nothing is dropped silently, nothing raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum, auto

from llm_shared.structured.families.base import (
    ArgumentsDelta,
    CallDone,
    CallStarted,
    TextDelta,
    ToolCallEvent,
    ToolCallParser,
)

WHITESPACE = " \t\n\r"


class _Step(Enum):
    """Where the scanner is inside a block."""

    LIST_OPEN = auto()  # before "[" (or a bare "{": one call without the list)
    FIRST_ITEM = auto()  # after "[": an item's "{", or "]" (the empty list: no call)
    ITEM = auto()  # after ",": an item's "{"
    AFTER_ITEM = auto()  # after an item's "}": "," or "]"
    KEY_OR_END = auto()  # inside an item: a key's opening quote, or "}"
    KEY = auto()  # inside a key string
    COLON = auto()
    VALUE = auto()  # inside a value (a _Value scans it)
    AFTER_VALUE = auto()  # "," or "}"
    CLOSE = auto()  # matching the closing marker


class _Value:
    """Finds where one JSON value ends, given its characters one by one. Tracks only nesting and
    strings; validity is the grammar's job (or, unconstrained, json.loads's at the end)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.scalar = False  # a number or literal: it ends at the first delimiter, not on a char of its own

    def take(self, c: str) -> tuple[bool, bool]:
        """(whether ``c`` belongs to the value, whether the value is complete after it)."""
        if not self.started:
            self.started = True
            if c == '"':
                self.in_string = True
                return True, False
            if c in "{[":
                self.depth = 1
                return True, False
            self.scalar = True
            return True, False
        if self.scalar:
            if c in ",}]" or c in WHITESPACE:
                return False, True
            return True, False
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                return True, self.depth == 0
            return True, False
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return True, self.depth == 0
        return True, False


@dataclass
class _Call:
    """The item being scanned."""

    name: str | None = None
    arguments: list[str] = field(default_factory=list)
    arguments_done: bool = False
    announced: bool = False  # CallStarted sent


class JsonCallListParser(ToolCallParser):
    """``opening`` + JSON list of call objects + ``closing``, anywhere in the output."""

    def __init__(self, opening: str, closing: str, *, name_key: str = "name", arguments_key: str = "arguments") -> None:
        self._opening = opening
        self._closing = closing
        self._name_key = name_key
        self._arguments_key = arguments_key
        self._events: list[ToolCallEvent] = []
        self._held = ""  # text that may be the start of the opening marker
        self._in_block = False
        self._raw: list[str] = []  # the block's text so far, given back as text if it breaks early
        self._announced_in_block = False
        self._next_index = 0
        self._step = _Step.LIST_OPEN
        self._bare = False  # the block holds one object, not a list
        self._call = _Call()
        self._key: list[str] = []
        self._key_escape = False
        self._current_key = ""
        self._value = _Value()
        self._value_text: list[str] = []
        self._closing_pos = 0
        self._index_of_call = 0  # the index of the call being scanned, once announced

    # -- output ---------------------------------------------------------------------------------

    def _text(self, text: str) -> None:
        if not text:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, TextDelta):
            self._events[-1] = TextDelta(last.text + text)
        else:
            self._events.append(TextDelta(text))

    def _arguments(self, index: int, text: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, ArgumentsDelta) and last.index == index:
            self._events[-1] = ArgumentsDelta(index, last.delta + text)
        else:
            self._events.append(ArgumentsDelta(index, text))

    def _take_events(self) -> list[ToolCallEvent]:
        events, self._events = self._events, []
        return events

    # -- the two modes --------------------------------------------------------------------------

    def feed(self, text: str) -> list[ToolCallEvent]:
        pos = 0
        while pos < len(text):
            if self._in_block:
                self._raw.append(text[pos])
                self._block_char(text[pos])
                pos += 1
            else:
                pos = self._scan_text(text, pos)
        return self._take_events()

    def _scan_text(self, text: str, pos: int) -> int:
        """Pass text through up to the opening marker; returns where the scan stopped."""
        chunk = self._held + text[pos:]
        start = chunk.find(self._opening)
        if start >= 0:
            self._text(chunk[:start])
            self._held = ""
            self._open_block()
            # what follows the marker is re-read in block mode from the right place of ``text``
            return len(text) - (len(chunk) - start - len(self._opening))
        keep = self._partial_opening(chunk)
        self._text(chunk[: len(chunk) - keep])
        self._held = chunk[len(chunk) - keep :]
        return len(text)

    def _partial_opening(self, chunk: str) -> int:
        """Length of the longest tail of ``chunk`` that is a proper prefix of the opening marker."""
        for n in range(min(len(chunk), len(self._opening) - 1), 0, -1):
            if self._opening.startswith(chunk[-n:]):
                return n
        return 0

    def _open_block(self) -> None:
        self._in_block = True
        self._raw = [self._opening]
        self._announced_in_block = False
        self._step = _Step.LIST_OPEN
        self._bare = False
        self._closing_pos = 0

    def finish(self) -> list[ToolCallEvent]:
        if self._in_block:
            if not self._announced_in_block:
                self._text("".join(self._raw))
            elif self._call.announced:
                self._cut_short()
            self._in_block = False
        self._text(self._held)
        self._held = ""
        return self._take_events()

    # -- inside a block -------------------------------------------------------------------------

    def _block_char(self, c: str) -> None:
        step = self._step
        if step is _Step.VALUE:
            self._value_char(c)
        elif step is _Step.KEY:
            self._key_char(c)
        elif step is _Step.CLOSE:
            if c == self._closing[self._closing_pos]:
                self._closing_pos += 1
                if self._closing_pos == len(self._closing):
                    self._in_block = False
            elif not (self._closing_pos == 0 and c in WHITESPACE):
                self._broken(c)
        elif c in WHITESPACE:
            return
        elif step is _Step.LIST_OPEN:
            if c == "[":
                self._step = _Step.FIRST_ITEM
            elif c == "{":
                self._bare = True
                self._start_item()
            else:
                self._broken(c)
        elif step is _Step.FIRST_ITEM or step is _Step.ITEM:
            if c == "{":
                self._start_item()
            elif c == "]" and step is _Step.FIRST_ITEM:
                self._step = _Step.CLOSE
            else:
                self._broken(c)
        elif step is _Step.AFTER_ITEM:
            if c == "," and not self._bare:
                self._step = _Step.ITEM
            elif c == "]" and not self._bare:
                self._step = _Step.CLOSE
            else:
                self._broken(c)
        elif step is _Step.KEY_OR_END:
            if c == '"':
                self._key, self._key_escape = ['"'], False
                self._step = _Step.KEY
            elif c == "}":
                self._end_item()
            else:
                self._broken(c)
        elif step is _Step.COLON:
            if c == ":":
                self._value, self._value_text = _Value(), []
                self._step = _Step.VALUE
            else:
                self._broken(c)
        elif step is _Step.AFTER_VALUE:
            if c == ",":
                self._step = _Step.KEY_OR_END
            elif c == "}":
                self._end_item()
            else:
                self._broken(c)

    def _start_item(self) -> None:
        self._call = _Call()
        self._step = _Step.KEY_OR_END

    def _key_char(self, c: str) -> None:
        self._key.append(c)
        if self._key_escape:
            self._key_escape = False
        elif c == "\\":
            self._key_escape = True
        elif c == '"':
            try:
                self._current_key = json.loads("".join(self._key))
            except ValueError:
                self._broken(c)
                return
            self._step = _Step.COLON

    def _value_char(self, c: str) -> None:
        if self._value.started is False and c in WHITESPACE:
            return
        belongs, done = self._value.take(c)
        if belongs:
            self._value_text.append(c)
            if self._current_key == self._arguments_key and not self._call.arguments_done:
                self._call.arguments.append(c)
                if self._call.announced:
                    self._arguments(self._index_of_call, c)
        if done:
            self._end_value()
            if not belongs and self._in_block:
                self._block_char(c)  # the delimiter that ended a number or literal

    def _end_value(self) -> None:
        self._step = _Step.AFTER_VALUE
        call = self._call
        if self._current_key == self._arguments_key and not call.arguments_done:
            call.arguments_done = True
        elif self._current_key == self._name_key and call.name is None:
            try:
                name = json.loads("".join(self._value_text))
            except ValueError:
                name = None
            if not isinstance(name, str):
                self._broken("")
                return
            call.name = name
            self._announce()

    def _announce(self) -> None:
        call = self._call
        call.announced = True
        self._announced_in_block = True
        self._index_of_call = self._next_index
        self._next_index += 1
        self._events.append(CallStarted(self._index_of_call, call.name or ""))
        if call.arguments:  # the arguments came before the name
            self._arguments(self._index_of_call, "".join(call.arguments))

    def _end_item(self) -> None:
        call = self._call
        if not call.announced:
            self._broken("}")
            return
        if not call.arguments:  # no arguments written: a function without parameters
            call.arguments.append("{}")
            self._arguments(self._index_of_call, "{}")
        self._events.append(CallDone(self._index_of_call, call.name or "", "".join(call.arguments)))
        self._call = _Call()
        self._step = _Step.CLOSE if self._bare else _Step.AFTER_ITEM

    def _cut_short(self) -> None:
        call = self._call
        self._events.append(CallDone(self._index_of_call, call.name or "", "".join(call.arguments), complete=False))
        self._call = _Call()

    def _broken(self, c: str) -> None:
        """The block is not what the family writes: give it back as text, or end what was announced."""
        self._in_block = False
        if not self._announced_in_block:
            self._text("".join(self._raw))
            return
        if self._call.announced:
            self._cut_short()
        self._text(c)
