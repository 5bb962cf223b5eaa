"""OpenAI wire dicts -> the types of ``spec.py``, refusing bad input with an error naming the field.

Two shapes of the same things: chat completions nests a function (``{"type": "function",
"function": {"name": ..., "parameters": ...}}``, ``tool_choice`` ``{"type": "function", "function":
{"name": ...}}``); Realtime flattens it (``{"type": "function", "name": ..., "parameters": ...}``,
``tool_choice`` ``{"type": "function", "name": ...}``). Each API gets its own shape, and an error
for the other shape says which one is expected. Everything here is plain Python (no llguidance):
whether the compiler supports a schema is learnt when it compiles, with the same ``param``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from llm_shared.errors import InvalidRequestError
from llm_shared.structured.errors import SchemaError
from llm_shared.structured.schema_check import canonical_schema
from llm_shared.structured.spec import (
    TEXT,
    FunctionTool,
    OutputConstraints,
    ResponseFormat,
    StructuredLimits,
    ToolChoice,
)

Api = Literal["chat", "realtime"]

DEFAULT_LIMITS = StructuredLimits()
# OpenAI's rule for function and json_schema names; the grammar and the prompt embed names as is.
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# A function without parameters takes none: its arguments are exactly {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
CHAT_TOOL_KEYS = frozenset({"type", "function"})
CHAT_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
REALTIME_TOOL_KEYS = frozenset({"type", "name", "description", "parameters"})
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
# A Realtime session's tool_choice is "auto" until set, with or without tools.
REALTIME_DEFAULT = OutputConstraints(tool_choice=ToolChoice("auto"))


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _object(raw: Any, param: str, what: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise _bad(f"{param} must be {what}", param)
    return raw


def _no_unknown_keys(raw: Mapping[str, Any], allowed: frozenset[str], param: str) -> None:
    # Unknown keys are refused, not dropped: a misspelt "strict" would otherwise silently mean False.
    extra = sorted(str(k) for k in raw if k not in allowed)
    if extra:
        raise _bad(f"{param} has unsupported fields {extra}", f"{param}.{extra[0]}")


def _name(raw: Any, param: str) -> str:
    if not isinstance(raw, str) or not NAME.fullmatch(raw):
        raise _bad(f"{param} must be 1 to 64 characters of a-z, A-Z, 0-9, '_' or '-', got {raw!r}", param)
    return raw


def _bool(raw: Any, param: str, default: bool) -> bool:
    if raw is None:
        return default
    if not isinstance(raw, bool):
        raise _bad(f"{param} must be a boolean", param)
    return raw


def _text(raw: Any, param: str) -> str:
    if raw is None:
        return ""
    if not isinstance(raw, str):
        raise _bad(f"{param} must be a string", param)
    return raw


def parse_tools(
    raw: Any, *, api: Api, param: str = "tools", limits: StructuredLimits = DEFAULT_LIMITS
) -> tuple[FunctionTool, ...]:
    """The function tools of a request (``None``: none)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _bad(f"{param} must be a list of tools", param)
    if len(raw) > limits.max_tools:
        raise _bad(f"{param} has {len(raw)} tools, at most {limits.max_tools} are allowed", param)
    tools: list[FunctionTool] = []
    seen: set[str] = set()
    total = 0
    for i, entry in enumerate(raw):
        where = f"{param}[{i}]"
        tool = _chat_tool(entry, where, limits) if api == "chat" else _realtime_tool(entry, where, limits)
        if tool.name in seen:
            raise _bad(f"{where} repeats the function name {tool.name!r}; names must be unique", where)
        seen.add(tool.name)
        total += len(tool.parameters_json.encode("utf-8"))
        if total > limits.max_total_schema_bytes:
            raise SchemaError(
                f"the parameter schemas of {param} together exceed {limits.max_total_schema_bytes} bytes", param=param
            )
        tools.append(tool)
    return tuple(tools)


def _check_function_type(entry: Mapping[str, Any], where: str) -> None:
    kind = entry.get("type")
    if kind != "function":
        raise _bad(
            f"{where}.type must be 'function' (only function tools are supported), got {kind!r}", f"{where}.type"
        )


def _chat_tool(entry: Any, where: str, limits: StructuredLimits) -> FunctionTool:
    entry = _object(entry, where, 'a tool object {"type": "function", "function": {...}}')
    _check_function_type(entry, where)
    if "function" not in entry and "name" in entry:
        raise _bad(
            f"{where} must nest the function in 'function' (the chat completions shape "
            '{"type": "function", "function": {"name": ...}})',
            f"{where}.function",
        )
    _no_unknown_keys(entry, CHAT_TOOL_KEYS, where)
    fn_where = f"{where}.function"
    fn = _object(entry.get("function"), fn_where, "an object with name, description and parameters")
    _no_unknown_keys(fn, CHAT_FUNCTION_KEYS, fn_where)
    return _function(fn, fn_where, _bool(fn.get("strict"), f"{fn_where}.strict", False), limits)


def _realtime_tool(entry: Any, where: str, limits: StructuredLimits) -> FunctionTool:
    entry = _object(entry, where, 'a tool object {"type": "function", "name": ..., "parameters": ...}')
    _check_function_type(entry, where)
    if "function" in entry:
        raise _bad(
            f"{where} must not nest the function (the Realtime shape is "
            '{"type": "function", "name": ..., "parameters": ...})',
            f"{where}.function",
        )
    _no_unknown_keys(entry, REALTIME_TOOL_KEYS, where)
    # Realtime has no per-tool "strict": its schemas are enforced as far as they can be compiled.
    return _function(entry, where, True, limits)


def _function(fn: Mapping[str, Any], where: str, strict: bool, limits: StructuredLimits) -> FunctionTool:
    name = _name(fn.get("name"), f"{where}.name")
    description = _text(fn.get("description"), f"{where}.description")
    schema_param = f"{where}.parameters"
    schema = fn.get("parameters")
    parameters_json = canonical_schema(
        NO_PARAMETERS if schema is None else schema, param=schema_param, limits=limits, object_root=True
    )
    return FunctionTool(name, description, parameters_json, strict, param=schema_param)


def parse_tool_choice(raw: Any, tools: tuple[FunctionTool, ...], *, api: Api, param: str = "tool_choice") -> ToolChoice:
    """``None`` means the API's default: ``auto`` with tools, ``none`` without."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise _bad(f"{param} must be 'none', 'auto', 'required' or a function, got {raw!r}", param)
        # Realtime sessions default to "auto" before any tool is set; chat completions refuses a
        # tool_choice without tools, as OpenAI does.
        if (raw == "required" or (api == "chat" and raw == "auto")) and not tools:
            raise _bad(f"{param} {raw!r} needs tools; this request has none", param)
        return ToolChoice(raw)  # type: ignore[arg-type]  # one of the three literals, checked above
    shape = '{"type": "function", "function": {"name": ...}}' if api == "chat" else '{"type": "function", "name": ...}'
    entry = _object(raw, param, f"'none', 'auto', 'required' or {shape}")
    if entry.get("type") != "function":
        raise _bad(
            f"{param}.type must be 'function' (only function tools are supported), got {entry.get('type')!r}",
            f"{param}.type",
        )
    if api == "chat":
        if set(entry) != {"type", "function"}:
            raise _bad(f"{param} must be {shape}", param)
        name_param = f"{param}.function.name"
        name_raw = _object(entry["function"], f"{param}.function", 'an object {"name": ...}').get("name")
    else:
        if set(entry) != {"type", "name"}:
            raise _bad(f"{param} must be {shape}", param)
        name_param = f"{param}.name"
        name_raw = entry["name"]
    name = _name(name_raw, name_param)
    if name not in {t.name for t in tools}:
        known = sorted(t.name for t in tools)
        raise _bad(f"{name_param} {name!r} is not one of the request's tools {known}", name_param)
    return ToolChoice("function", name)


def parse_response_format(
    raw: Any, *, param: str = "response_format", limits: StructuredLimits = DEFAULT_LIMITS
) -> ResponseFormat:
    """Chat completions' ``response_format`` (``None``: text)."""
    if raw is None:
        return TEXT
    entry = _object(raw, param, 'an object {"type": "text" | "json_object" | "json_schema", ...}')
    kind = entry.get("type")
    if kind == "text" or kind == "json_object":
        _no_unknown_keys(entry, frozenset({"type"}), param)
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise _bad(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{param}.type")
    _no_unknown_keys(entry, frozenset({"type", "json_schema"}), param)
    where = f"{param}.json_schema"
    spec = _object(entry.get("json_schema"), where, "an object with name and schema")
    _no_unknown_keys(spec, JSON_SCHEMA_KEYS, where)
    name = _name(spec.get("name"), f"{where}.name")
    _text(spec.get("description"), f"{where}.description")
    strict = _bool(spec.get("strict"), f"{where}.strict", False)
    if spec.get("schema") is None:
        return ResponseFormat("json_object", name=name, strict=strict)  # no schema: any JSON object
    schema_param = f"{where}.schema"
    schema_json = canonical_schema(spec["schema"], param=schema_param, limits=limits)
    return ResponseFormat("json_schema", name=name, schema_json=schema_json, strict=strict, param=schema_param)


def parse_chat_constraints(body: Mapping[str, Any], *, limits: StructuredLimits = DEFAULT_LIMITS) -> OutputConstraints:
    """``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` of a chat
    completions request body (absent or null: the API's defaults)."""
    tools = parse_tools(body.get("tools"), api="chat", limits=limits)
    choice = parse_tool_choice(body.get("tool_choice"), tools, api="chat")
    parallel = _bool(body.get("parallel_tool_calls"), "parallel_tool_calls", True)
    response_format = parse_response_format(body.get("response_format"), limits=limits)
    total = sum(len(t.parameters_json.encode("utf-8")) for t in tools) + len(
        (response_format.schema_json or "").encode("utf-8")
    )
    if total > limits.max_total_schema_bytes:
        raise SchemaError(
            f"the request's schemas together exceed {limits.max_total_schema_bytes} bytes", param="response_format"
        )
    return OutputConstraints(tools, choice, parallel, response_format)


def parse_realtime_constraints(
    obj: Mapping[str, Any],
    *,
    param_prefix: str = "session",
    base: OutputConstraints = REALTIME_DEFAULT,
    limits: StructuredLimits = DEFAULT_LIMITS,
) -> OutputConstraints:
    """``tools`` and ``tool_choice`` of a Realtime ``session`` (``session.update``) or ``response``
    (``response.create``) object. ``base``: the constraints in force (the session's), which this
    object overrides field by field; the result's ``tool_choice`` must fit its tools."""
    prefix = f"{param_prefix}." if param_prefix else ""
    tools = base.tools
    if obj.get("tools") is not None:
        tools = parse_tools(obj["tools"], api="realtime", param=f"{prefix}tools", limits=limits)
    choice = base.tool_choice
    if obj.get("tool_choice") is not None:
        choice = parse_tool_choice(obj["tool_choice"], tools, api="realtime", param=f"{prefix}tool_choice")
    elif choice.name is not None and choice.name not in {t.name for t in tools}:
        raise _bad(
            f"tool_choice names {choice.name!r}, which is not among {prefix}tools; set {prefix}tool_choice as well",
            f"{prefix}tool_choice",
        )
    elif choice.mode == "required" and not tools:
        raise _bad(f"tool_choice 'required' needs tools; {prefix}tools is empty", f"{prefix}tool_choice")
    return OutputConstraints(tools, choice, base.parallel_tool_calls, base.response_format)
