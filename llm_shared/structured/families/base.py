"""What a model family's tool-call syntax must provide, and the events its output parser yields.

A family knows how its chat template lists tools and writes calls (SmolLM2: ``<tools>...</tools>``
in the system prompt, ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`` in the
answer). ``grammar.py`` asks it for the Lark rules of a call block and owns everything else (the
arguments' schemas, ``tool_choice``, the text alternative); the server feeds its streamed output to
the family's parser and maps the events to the wire. Adding a family is one module in this
package plus a line in the registry (``families/__init__.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from llm_shared.structured.spec import FunctionTool


@dataclass(frozen=True)
class TextDelta:
    """Answer text (never part of a call)."""

    text: str
    kind: Literal["text"] = "text"


@dataclass(frozen=True)
class CallStarted:
    """A call's function name is known. The server gives the call its id (``call_`` + random hex)."""

    index: int  # 0-based position of the call in this response (chat's delta.tool_calls[].index)
    name: str
    kind: Literal["call_started"] = "call_started"


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next fragment of a call's arguments JSON; a call's fragments, joined, are its arguments."""

    index: int
    delta: str
    kind: Literal["arguments_delta"] = "arguments_delta"


@dataclass(frozen=True)
class CallDone:
    index: int
    name: str
    arguments: str  # the arguments JSON text exactly as generated
    # False when the output ended inside the call (a length limit, a cancel): ``arguments`` is then
    # what had been generated, as the APIs report a call cut short.
    complete: bool = True
    kind: Literal["call_done"] = "call_done"


ToolCallEvent = TextDelta | CallStarted | ArgumentsDelta | CallDone


class ToolCallParser(ABC):
    """Splits one response's streamed text into answer text and tool calls. Not thread-safe: one
    per response. Deltas may split anywhere (inside the trigger, a name, an escape): the events for
    any split, with adjacent deltas of the same call joined, are the same."""

    @abstractmethod
    def feed(self, text: str) -> list[ToolCallEvent]:
        """Events that ``text`` (the next piece of output) completes; text that could still turn
        out to start a call is held back until it is known."""

    @abstractmethod
    def finish(self) -> list[ToolCallEvent]:
        """The output ended: held-back text, and a ``CallDone(complete=False)`` for a call cut short."""


class ToolCallFamily(ABC):
    """One model family's tool-call syntax. Stateless: one instance serves every request."""

    name: ClassVar[str]
    # The text that opens a call block. Under tool_choice "auto" free text never contains it (the
    # grammar forbids it), so a parser that sees it knows a call follows.
    trigger: ClassVar[str]

    @abstractmethod
    def calls_rules(self, args_rules: Sequence[tuple[str, str]], *, parallel: bool, allow_empty: bool) -> str:
        """Lark rules defining ``tc_body``: everything after the trigger to the end of the answer.
        ``args_rules``: (function name, name of the rule for its arguments) for each callable
        function. ``parallel``: more than one call allowed; ``allow_empty``: the family's "no call"
        form is allowed (only under "auto"). Rule names must start with ``tc_`` or ``TC_``."""

    @abstractmethod
    def render_tools(self, tools: Sequence[FunctionTool], *, allow_text: bool, parallel: bool) -> str:
        """The system-prompt text that lists ``tools`` and says how to call them. ``allow_text``:
        the model may answer in text instead (tool_choice "auto")."""

    @abstractmethod
    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """An assistant turn's calls, (name, arguments JSON) each, as the model writes them: for
        conversation history."""

    @abstractmethod
    def render_tool_result(self, content: str) -> str:
        """A tool's output as the model expects to read it (the content of the turn that carries it)."""

    @abstractmethod
    def new_parser(self) -> ToolCallParser:
        """A parser for one response's output."""
