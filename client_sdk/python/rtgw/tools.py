"""The function-calling fields a client sends: ``tools``, ``tool_choice`` and
``parallel_tool_calls``, for ``session.update`` or one ``response.create``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ToolChoice = str | Mapping[str, Any]  # "auto", "none", "required", or {"type": "function", "name": ...}


def normalize_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Function tools in the Realtime shape (``{"type": "function", "name", "description",
    "parameters"}``); the chat completions shape (``{"type": "function", "function": {...}}``, as
    ``openai.pydantic_function_tool`` makes) is unwrapped to it."""
    out = []
    for tool in tools:
        inner = tool.get("function")
        if isinstance(inner, Mapping) and "name" not in tool:
            tool = {"type": "function", **{k: v for k, v in inner.items() if k != "strict"}}
        out.append(dict(tool))
    return out


def tool_fields(tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice | None,
                parallel_tool_calls: bool | None) -> dict[str, Any]:
    """The session or response fields of function calling that are set."""
    fields: dict[str, Any] = {}
    if tools is not None:
        fields["tools"] = normalize_tools(tools)
    if tool_choice is not None:
        fields["tool_choice"] = dict(tool_choice) if isinstance(tool_choice, Mapping) else tool_choice
    if parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = parallel_tool_calls
    return fields


def response_fields(max_output_tokens: int | None, temperature: float | None,
                     tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice | None,
                     parallel_tool_calls: bool | None) -> dict[str, Any]:
    response: dict[str, Any] = {}
    if max_output_tokens is not None:
        response["max_output_tokens"] = max_output_tokens
    if temperature is not None:
        response["temperature"] = temperature
    return {**response, **tool_fields(tools, tool_choice, parallel_tool_calls)}
