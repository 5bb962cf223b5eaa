"""SmolLM2's tool format: the prompt lists the tools as the model card does, calls rendered for the
history are what the grammar allows and the parser reads back, and the registry finds the family."""

from __future__ import annotations

import json

import pytest

from llm_shared.structured import (
    CallDone,
    CallStarted,
    GrammarCompiler,
    TextDelta,
    get_family,
    parse_chat_constraints,
    parse_tools,
)
from llm_shared.structured.families import FAMILIES
from llm_shared.structured.families.smollm2 import SmolLM2
from llm_shared.tokenizer import Tokenizer

TIMER = {"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1}}, "required": ["minutes"]}
TOOLS = [
    {"type": "function", "function": {"name": "set_timer", "description": "Start a timer.", "parameters": TIMER}},
    {
        "type": "function",
        "function": {
            "name": "lights_on",
            "description": "Lights on in a room.",
            "parameters": {"type": "object", "properties": {"room": {"type": "string"}}, "required": ["room"]},
        },
    },
]


def test_the_registry_finds_smollm2_and_nothing_else() -> None:
    assert isinstance(get_family("smollm2"), SmolLM2)
    assert get_family("llama3") is None
    assert set(FAMILIES) == {"smollm2"}


def test_the_prompt_lists_the_tools_as_json_inside_tools_tags() -> None:
    tools = parse_tools(TOOLS, api="chat")
    text = get_family("smollm2").render_tools(tools, allow_text=False, parallel=True)  # type: ignore[union-attr]
    listed = json.loads(text[text.index("<tools>") + len("<tools>") : text.index("</tools>")])
    assert listed == [
        {"name": "set_timer", "description": "Start a timer.", "parameters": TIMER},
        {"name": "lights_on", "description": "Lights on in a room.", "parameters": TOOLS[1]["function"]["parameters"]},
    ]
    assert "<tool_call>[" in text and "empty list '[]'" in text and "plain text" not in text
    auto = get_family("smollm2").render_tools(tools, allow_text=True, parallel=False)  # type: ignore[union-attr]
    assert "plain text" in auto and "at most one" in auto


@pytest.mark.model
def test_rendered_calls_are_what_the_grammar_allows_and_the_parser_reads(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    family = get_family("smollm2")
    assert family is not None
    calls = [("set_timer", '{"minutes":10}'), ("lights_on", '{"room": "kitchen"}')]
    text = family.render_calls(calls)
    assert text == (
        '<tool_call>[{"name": "set_timer", "arguments": {"minutes": 10}}, '
        '{"name": "lights_on", "arguments": {"room": "kitchen"}}]</tool_call>'
    )
    compiled = compiler.compile(parse_chat_constraints({"tools": TOOLS, "tool_choice": "required"}))
    assert compiled is not None
    ids = [*tokenizer.encode(text), tokenizer.eos_id]
    assert compiler.matcher(compiled).valid_prefix_len(ids) == len(ids)
    parser = family.new_parser()
    events = [*parser.feed(text), *parser.finish()]
    assert [e for e in events if isinstance(e, CallStarted)] == [
        CallStarted(0, "set_timer"),
        CallStarted(1, "lights_on"),
    ]
    done = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, CallDone)]
    assert done == [("set_timer", {"minutes": 10}), ("lights_on", {"room": "kitchen"})]
    assert not any(isinstance(e, TextDelta) for e in events)


def test_history_rendering_keeps_arguments_that_are_not_json_as_a_string() -> None:
    family = get_family("smollm2")
    assert family is not None
    assert family.render_calls([("f", "not json")]) == '<tool_call>[{"name": "f", "arguments": "not json"}]</tool_call>'
    assert family.render_tool_result('{"ok": true}') == '<tool_response>\n{"ok": true}\n</tool_response>'
