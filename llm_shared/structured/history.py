"""A conversation as the model reads it: text turns, an assistant's tool calls, tools' results,
rendered with the model family's syntax into the plain role/content messages a chat template takes.
The gateway renders Realtime conversations and chat histories with it, and the client SDK's
on-device fallback renders its local conversation the same way, so a model sees the same prompt
online and offline."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from llm_shared.content import ContentPart, TextPart, text_of
from llm_shared.structured.families.base import ToolCallFamily
from llm_shared.structured.spec import OutputConstraints


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant turn (history, or a response's output)."""

    call_id: str
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True)
class Message:
    """One turn of a conversation before rendering: text, an assistant's calls, or a tool's result
    (role "tool", with the id of the call it answers)."""

    role: str  # system, user, assistant or tool
    content: tuple[ContentPart, ...] | str  # typed parts; a str is one text part (stored as parts)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.content, str):
            object.__setattr__(self, "content", (TextPart(self.content),) if self.content else ())

    @property
    def text(self) -> str:
        """The content as the prompt holds it; ``UnsupportedContentError`` for a part no tier reads."""
        assert not isinstance(self.content, str)
        return text_of(self.content)


def render_messages(messages: Sequence[Message], constraints: OutputConstraints | None,
                    family: ToolCallFamily | None) -> list[dict[str, str]]:
    """Role/content messages for the chat template. The tools the turn may call are listed in the
    system prompt (the family's wording; the first system message keeps its text after it); a JSON
    answer is asked for in words as well as enforced by the grammar; assistant calls and tool results
    are written in the family's syntax. Without a family, calls and results are kept as plain JSON
    and text, so history stays readable to any model."""
    system: list[str] = []
    if constraints is not None:
        choice = constraints.tool_choice.mode
        tools = constraints.tools if choice != "function" else tuple(
            t for t in constraints.tools if t.name == constraints.tool_choice.name)
        if tools and choice != "none" and family is not None:
            system.append(family.render_tools(tools, allow_text=choice == "auto",
                                              parallel=constraints.parallel_tool_calls))
        fmt = constraints.response_format
        if fmt.type == "json_schema" and fmt.schema_json is not None:
            system.append(f"Answer with one JSON value that matches this JSON schema: {fmt.schema_json}")
        elif fmt.type == "json_object":
            system.append("Answer with one JSON object.")
    out: list[dict[str, str]] = []
    for message in messages:
        if message.role == "system":
            if out or not system:  # a later system turn, or nothing of ours to join it with
                out.append({"role": "system", "content": message.text})
            else:
                system.append(message.text)
            continue
        if message.role == "tool":
            content = family.render_tool_result(message.text) if family is not None else message.text
            out.append({"role": "user", "content": content})
            continue
        content = message.text
        if message.tool_calls:
            calls = [(call.name, call.arguments) for call in message.tool_calls]
            rendered = family.render_calls(calls) if family is not None else json.dumps(
                [{"name": n, "arguments": a} for n, a in calls])
            content = f"{content}\n{rendered}" if content else rendered
        out.append({"role": message.role, "content": content})
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return out
