"""The wire dicts of both APIs become the request types, and bad ones are refused with an error whose
``param`` names the field. Payloads for Pydantic models come from the official openai SDK itself
(what ``chat.completions.parse()`` and ``pydantic_function_tool`` send)."""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel
from structured_helpers import TIMER, WEATHER, chat_tool, constraints

from llm_shared.errors import InvalidRequestError
from llm_shared.structured import (
    OutputConstraints,
    SchemaError,
    StructuredLimits,
    ToolChoice,
    parse_chat_constraints,
    parse_realtime_constraints,
    parse_response_format,
    parse_tools,
)


class Address(BaseModel):
    street: str
    zip: int | None


class Person(BaseModel):
    name: str
    kind: Literal["a", "b"]
    home: Address
    work: Address | None
    tags: list[str]


def refused(call: Any, param: str, *words: str, kind: type[Exception] = InvalidRequestError) -> str:
    with pytest.raises(kind) as info:
        call()
    assert isinstance(info.value, InvalidRequestError) and info.value.param == param, (info.value.param, param)
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value.message


def test_chat_tools_keep_their_fields_and_schema_key_order() -> None:
    schema = {
        "type": "object",
        "properties": {"z": {"type": "string"}, "a": {"type": "integer"}},
        "required": ["z", "a"],
    }
    (tool,) = parse_tools([chat_tool("f", schema, strict=False)], api="chat")
    assert (tool.name, tool.description, tool.strict) == ("f", "the f function", False)
    assert tool.parameters() == schema
    assert tool.parameters_json.index('"z"') < tool.parameters_json.index('"a"')  # order is the output's
    assert tool.param == "tools[0].function.parameters"


def test_a_function_without_parameters_takes_an_empty_object() -> None:
    (tool,) = parse_tools([chat_tool("ping")], api="chat")
    assert tool.parameters() == {"type": "object", "properties": {}, "additionalProperties": False}


def test_realtime_tools_are_flat_and_strict() -> None:
    (tool,) = parse_tools(
        [{"type": "function", "name": "set_timer", "description": "d", "parameters": TIMER}],
        api="realtime",
        param="session.tools",
    )
    assert (tool.name, tool.strict, tool.param) == ("set_timer", True, "session.tools[0].parameters")
    assert tool.parameters() == TIMER


def test_each_api_names_the_shape_it_expects() -> None:
    flat = {"type": "function", "name": "f", "parameters": TIMER}
    refused(lambda: parse_tools([flat], api="chat"), "tools[0].function", "chat completions shape")
    refused(lambda: parse_tools([chat_tool("f", TIMER)], api="realtime"), "tools[0].function", "Realtime shape")


def test_the_sdks_parse_payload_is_accepted() -> None:
    rf = type_to_response_format_param(Person)
    tool = openai.pydantic_function_tool(Person, name="save_person")
    c = parse_chat_constraints({"tools": [tool], "response_format": rf, "tool_choice": "auto"})
    assert c.response_format.type == "json_schema" and c.response_format.strict
    assert c.response_format.name == "Person"
    assert json.loads(c.response_format.schema_json or "") == rf["json_schema"]["schema"]
    assert c.tools[0].strict and c.tools[0].parameters() == tool["function"]["parameters"]


@pytest.mark.parametrize(
    ("tools", "param", "words"),
    [
        ([chat_tool("f", TIMER), chat_tool("f", WEATHER)], "tools[1]", ["unique"]),
        ([chat_tool("bad name", TIMER)], "tools[0].function.name", ["a-z"]),
        ([chat_tool("x" * 65, TIMER)], "tools[0].function.name", ["64"]),
        ([{"type": "code_interpreter"}], "tools[0].type", ["function"]),
        ([{"type": "function", "function": {"name": "f", "strct": True}}], "tools[0].function.strct", ["strct"]),
        ([chat_tool("f", {"type": "array"})], "tools[0].function.parameters", ["object"]),
        (
            [{"type": "function", "function": {"name": "f", "parameters": TIMER, "strict": "yes"}}],
            "tools[0].function.strict",
            ["boolean"],
        ),
        ("not a list", "tools", ["list"]),
    ],
)
def test_bad_tools_are_refused_naming_the_field(tools: Any, param: str, words: list[str]) -> None:
    refused(lambda: parse_chat_constraints({"tools": tools}), param, *words)


def test_too_many_tools_are_refused() -> None:
    tools = [chat_tool(f"f{i}", TIMER) for i in range(5)]
    refused(lambda: parse_tools(tools, api="chat", limits=StructuredLimits(max_tools=4)), "tools", "at most 4")


def test_tool_choice_forms() -> None:
    tools = [chat_tool("get_weather", WEATHER), chat_tool("set_timer", TIMER)]
    assert constraints(tools).tool_choice == ToolChoice("auto")  # the default with tools
    assert constraints().tool_choice == ToolChoice("none")  # and without
    for mode in ("none", "auto", "required"):
        assert constraints(tools, tool_choice=mode).tool_choice == ToolChoice(mode)  # type: ignore[arg-type]
    named = {"type": "function", "function": {"name": "set_timer"}}
    assert constraints(tools, tool_choice=named).tool_choice == ToolChoice("function", "set_timer")


@pytest.mark.parametrize(
    ("choice", "param", "words"),
    [
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", ["nope", "get_weather"]),
        ({"type": "function", "name": "get_weather"}, "tool_choice", ['"function": {"name"']),
        ({"type": "custom", "custom": {"name": "x"}}, "tool_choice.type", ["function"]),
        ("sometimes", "tool_choice", ["required"]),
    ],
)
def test_bad_tool_choice_is_refused(choice: Any, param: str, words: list[str]) -> None:
    refused(lambda: constraints([chat_tool("get_weather", WEATHER)], tool_choice=choice), param, *words)


def test_a_tool_choice_needs_tools() -> None:
    refused(lambda: constraints(tool_choice="required"), "tool_choice", "needs tools")
    refused(lambda: constraints(tool_choice="auto"), "tool_choice", "needs tools")
    assert constraints(tool_choice="none").tool_choice == ToolChoice("none")


def test_parallel_tool_calls_must_be_a_boolean() -> None:
    assert constraints([chat_tool("f", TIMER)], parallel_tool_calls=False).parallel_tool_calls is False
    refused(lambda: constraints([chat_tool("f", TIMER)], parallel_tool_calls="no"), "parallel_tool_calls")


def test_response_formats() -> None:
    assert parse_response_format(None).type == "text"
    assert parse_response_format({"type": "text"}).type == "text"
    assert parse_response_format({"type": "json_object"}).type == "json_object"
    rf = parse_response_format({"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}})
    assert (rf.type, rf.name, rf.strict, rf.param) == ("json_schema", "w", True, "response_format.json_schema.schema")
    assert rf.schema_json is not None and json.loads(rf.schema_json) == WEATHER
    # without a schema the answer is still JSON: any object
    assert parse_response_format({"type": "json_schema", "json_schema": {"name": "w"}}).type == "json_object"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": WEATHER}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "w", "schema": "{}"}}, "response_format.json_schema.schema"),
        ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ],
)
def test_bad_response_formats_are_refused(raw: Any, param: str) -> None:
    refused(lambda: parse_response_format(raw), param)


def test_our_compiler_options_are_not_the_clients() -> None:
    schema = {"x-guidance": {"lenient": True}, "type": "object", "properties": {"a": {"type": "string"}}}
    (tool,) = parse_tools([chat_tool("f", schema)], api="chat")
    assert "x-guidance" not in tool.parameters()


def test_realtime_responses_inherit_and_override_the_session() -> None:
    session = parse_realtime_constraints(
        {"tools": [{"type": "function", "name": "set_timer", "parameters": TIMER}], "tool_choice": "required"}
    )
    assert session.tool_choice == ToolChoice("required") and session.tools[0].name == "set_timer"
    inherited = parse_realtime_constraints({}, param_prefix="response", base=session)
    assert inherited == session
    named = parse_realtime_constraints(
        {"tool_choice": {"type": "function", "name": "set_timer"}}, param_prefix="response", base=session
    )
    assert named.tool_choice == ToolChoice("function", "set_timer")
    refused(
        lambda: parse_realtime_constraints(
            {"tool_choice": {"type": "function", "name": "nope"}}, param_prefix="response", base=session
        ),
        "response.tool_choice.name",
        "nope",
    )
    # a response that replaces the tools cannot keep a choice naming one that is gone
    refused(
        lambda: parse_realtime_constraints(
            {"tools": [{"type": "function", "name": "other"}]}, param_prefix="response", base=named
        ),
        "response.tool_choice",
        "set_timer",
    )


def test_a_realtime_session_defaults_to_auto_without_tools() -> None:
    fresh = parse_realtime_constraints({})
    assert fresh.tool_choice == ToolChoice("auto") and not fresh.calls_allowed
    with_tools = parse_realtime_constraints({"tools": [{"type": "function", "name": "f"}]}, base=fresh)
    assert with_tools.calls_allowed


def test_the_types_hold_their_invariants() -> None:
    with pytest.raises(ValueError):
        ToolChoice("function")
    with pytest.raises(ValueError):
        OutputConstraints(tool_choice=ToolChoice("required"))


def test_total_schema_bytes_are_bounded() -> None:
    limits = StructuredLimits(max_schema_bytes=400, max_total_schema_bytes=600)
    body = {"tools": [chat_tool(f"f{i}", WEATHER) for i in range(5)]}
    refused(lambda: parse_chat_constraints(body, limits=limits), "tools", "600", kind=SchemaError)
