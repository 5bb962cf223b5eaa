"""Function calls in the Python SDK, without I/O: the protocol core fed literal server events (a
call, a call after text, a call cut short, a lost connection mid-call), the outputs that answer
calls, the restore of call items; the on-device answer told as the gateway's events
(``DeviceResponse``), which the core reads as it reads the gateway's; the conversation rendered for
the device's model as the gateway renders it; a turn's stream of text and calls in order."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rtgw import ClientProtocol, FunctionCall, FunctionCallItem, FunctionCallOutputItem, Item, TextDelta, TurnResult
from rtgw.device_response import DeviceResponse
from rtgw.offline import render_conversation
from rtgw.tools import normalize_tools, response_fields
from rtgw.turn import Turn

from llm_shared.structured import (
    ArgumentsDelta,
    CallDone,
    CallStarted,
    get_family,
    parse_realtime_constraints,
)
from llm_shared.structured import TextDelta as ParsedText

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ARGS = '{"city": "Paris"}'


def call_events(response_id: str, item_id: str, call_id: str, pieces: list[str], *, status: str = "completed",
                previous: str | None = None) -> list[dict[str, Any]]:
    """What the gateway sends for one call of a response (GA names), up to its output_item.done."""
    item = {"id": item_id, "object": "realtime.item", "type": "function_call", "status": "in_progress",
            "call_id": call_id, "name": "get_weather", "arguments": ""}
    arguments = "".join(pieces)
    done = {**item, "status": status, "arguments": arguments}
    return [
        {"type": "response.output_item.added", "response_id": response_id, "output_index": 0, "item": item},
        {"type": "conversation.item.added", "previous_item_id": previous, "item": item},
        *({"type": "response.function_call_arguments.delta", "response_id": response_id, "item_id": item_id,
           "output_index": 0, "call_id": call_id, "delta": piece} for piece in pieces),
        {"type": "response.function_call_arguments.done", "response_id": response_id, "item_id": item_id,
         "output_index": 0, "call_id": call_id, "name": "get_weather", "arguments": arguments},
        {"type": "response.output_item.done", "response_id": response_id, "output_index": 0, "item": done},
    ]


def feed(protocol: ClientProtocol, events: list[dict[str, Any]]) -> list[Any]:
    return [typed for event in events for typed in protocol.receive(event)]


def a_call(protocol: ClientProtocol) -> TurnResult:
    """A user turn answered with one call; its TurnResult."""
    protocol.user_turn("Weather in Paris?", tool_choice="required")
    out = feed(protocol, [{"type": "response.created", "response": {"id": "resp_1"}},
                          *call_events("resp_1", "item_c", "call_1", ['{"city": ', '"Paris"}'])])
    assert out == [FunctionCall("call_1", "get_weather", ARGS, {"city": "Paris"}, "item_c", "resp_1")]
    [done] = protocol.receive({"type": "response.done", "response": {
        "id": "resp_1", "status": "completed", "metadata": {"x_tier": "edge"},
        "output": [{"id": "item_c", "type": "function_call", "status": "completed", "call_id": "call_1",
                    "name": "get_weather", "arguments": ARGS}]}})
    assert isinstance(done, TurnResult)
    return done


def test_a_call_is_an_event_with_parsed_arguments_and_part_of_the_result_and_the_conversation() -> None:
    protocol = ClientProtocol()
    result = a_call(protocol)
    assert result.status == "completed" and result.text == "" and result.item_id is None
    [call] = result.calls
    assert (call.call_id, call.name, call.parsed, call.complete) == ("call_1", "get_weather", {"city": "Paris"}, True)
    user, item = protocol.items
    assert isinstance(user, Item) and item == FunctionCallItem("item_c", "call_1", "get_weather", ARGS, "completed")
    assert protocol.last_assistant() is None  # a call is not a message: barge-in has nothing to cut


def test_outputs_answer_calls_and_ask_for_the_next_response() -> None:
    protocol = ClientProtocol()
    a_call(protocol)
    with pytest.raises(ValueError, match="call_nope"):
        protocol.tool_outputs({"call_nope": "{}"})
    with pytest.raises(ValueError):
        protocol.tool_outputs({})
    assert len(protocol.items) == 2  # nothing added by a refused answer
    create, respond = protocol.tool_outputs({"call_1": '{"temperature": 21}'}, tool_choice="none")
    output = protocol.items[-1]
    assert isinstance(output, FunctionCallOutputItem) and output.call_id == "call_1"
    assert create["item"] == {"type": "function_call_output", "id": output.id, "call_id": "call_1",
                              "output": '{"temperature": 21}'}
    assert respond == {**respond, "type": "response.create", "response": {"tool_choice": "none"}}
    # The server echoes our item: not added twice.
    protocol.receive({"type": "conversation.item.added", "previous_item_id": "item_c", "item": create["item"]})
    assert [i.type for i in protocol.items] == ["message", "function_call", "function_call_output"]


def test_restore_recreates_calls_and_outputs_in_order_with_their_ids() -> None:
    protocol = ClientProtocol()
    a_call(protocol)
    protocol.tool_outputs({"call_1": "sunny"})
    events = protocol.restore_events()
    assert [e["item"]["type"] for e in events] == ["message", "function_call", "function_call_output"]
    assert events[1]["item"] == {"type": "function_call", "id": "item_c", "call_id": "call_1", "name": "get_weather",
                                 "arguments": ARGS, "status": "completed"}
    assert events[2]["item"]["call_id"] == "call_1" and events[2]["item"]["id"] == protocol.items[2].id


def test_text_then_a_call_cut_short_then_a_lost_connection() -> None:
    protocol = ClientProtocol()
    protocol.user_turn("Hi")
    feed(protocol, [{"type": "response.created", "response": {"id": "resp_2"}},
                    {"type": "conversation.item.added",
                     "item": {"id": "item_m", "type": "message", "role": "assistant", "content": []}}])
    [delta] = protocol.receive({"type": "response.output_text.delta", "response_id": "resp_2", "item_id": "item_m",
                                "delta": "Let me look. "})
    assert delta == TextDelta("resp_2", "Let me look. ")
    events = call_events("resp_2", "item_c", "call_2", ['{"ci'], previous="item_m")
    assert feed(protocol, events[:3]) == []  # streaming: no event until the call is done
    call = protocol.items[-1]
    assert isinstance(call, FunctionCallItem) and call.arguments == '{"ci' and call.status == "in_progress"
    lost = protocol.connection_lost()
    assert lost is not None and lost.status == "failed"
    assert protocol.message("item_m").text == "Let me look. " and call.status == "incomplete"
    assert protocol.restore_events()[-1]["item"]["status"] == "incomplete"


def test_a_call_cut_short_by_the_length_limit_has_no_parsed_arguments() -> None:
    protocol = ClientProtocol()
    protocol.user_turn("Hi")
    out = feed(protocol, [{"type": "response.created", "response": {"id": "resp_3"}},
                          *call_events("resp_3", "item_c", "call_3", ['{"city": "Pa'], status="incomplete")])
    assert out[0].status == "incomplete" and out[0].parsed is None and not out[0].complete


def device_answer(parsed: list[Any], status: str = "completed") -> list[dict[str, Any]]:
    ids = iter(f"id_{n}" for n in range(100))
    device = DeviceResponse("resp_d", ids=lambda prefix: f"{prefix}_{next(ids)}")
    return [*device.created(), *device.parsed(parsed),
            *device.finish(status, usage={"output_tokens": 9}, metadata={"x_tier": "device"})]


def test_the_devices_answer_reads_as_the_gateways() -> None:
    """Text, then a call, as the family's parser reports them: the same typed events, result and items."""
    protocol = ClientProtocol()
    protocol.user_turn("Weather?")
    events = device_answer([ParsedText("Checking. "), CallStarted(0, "get_weather"), ArgumentsDelta(0, '{"city": '),
                            ArgumentsDelta(0, '"Paris"}'), CallDone(0, "get_weather", ARGS)])
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_text.delta") < kinds.index("response.function_call_arguments.delta")
    # the message is done before the call after it is added, as the gateway orders output items
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    typed = feed(protocol, events)
    text, call, result = typed
    assert text == TextDelta("resp_d", "Checking. ")
    assert isinstance(call, FunctionCall) and call.parsed == {"city": "Paris"} and call.call_id.startswith("call_")
    assert isinstance(result, TurnResult) and result.text == "Checking. " and result.calls == (call,)
    assert result.tier == "device" and result.usage == {"output_tokens": 9}
    assert [(i.type, getattr(i, "role", None)) for i in protocol.items] == [
        ("message", "user"), ("message", "assistant"), ("function_call", None)]
    assert protocol.message(result.item_id).status == "completed"


def test_the_device_ends_a_text_answer_and_an_empty_one_as_the_gateway_does() -> None:
    protocol = ClientProtocol()
    protocol.user_turn("Hi")
    *_, result = feed(protocol, device_answer([ParsedText("Hello")], status="incomplete"))
    assert result.status == "incomplete" and result.text == "Hello" and result.calls == ()
    protocol.user_turn("Again")
    *_, empty = feed(protocol, device_answer([]))
    assert empty.text == "" and protocol.message(empty.item_id) is not None  # a finished turn has its message
    protocol.user_turn("Stop")
    [cancelled] = feed(protocol, device_answer([], status="cancelled"))
    assert cancelled.status == "cancelled" and cancelled.item_id is None
    cut = feed(protocol, device_answer([CallStarted(0, "get_weather"), ArgumentsDelta(0, '{"ci'),
                                        CallDone(0, "get_weather", '{"ci', complete=False)], status="incomplete"))
    assert cut[0].status == "incomplete" and cut[-1].calls[0].parsed is None


def test_the_conversation_is_rendered_for_the_device_as_the_gateway_renders_it() -> None:
    family = get_family("smollm2")
    assert family is not None
    items = [Item("u", "user", "Weather in Paris?"), FunctionCallItem("c", "call_1", "get_weather", ARGS),
             FunctionCallOutputItem("o", "call_1", '{"temperature": 21}'), Item("e", "assistant", "")]
    required = parse_realtime_constraints({"tools": [WEATHER], "tool_choice": "required"})
    messages = render_conversation("Be brief.", items, required, family)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith(family.render_tools(required.tools, allow_text=False, parallel=True))
    assert messages[0]["content"].endswith("\n\nBe brief.")
    assert messages[2]["content"] == family.render_calls([("get_weather", ARGS)])
    assert messages[3]["content"] == family.render_tool_result('{"temperature": 21}')
    # tool_choice "none": the tools are not listed, the history is still in the family's syntax
    none = parse_realtime_constraints({"tool_choice": "none"}, base=required)
    assert render_conversation("", items, none, family)[1]["content"] == messages[2]["content"]


def test_tools_in_either_shape_and_a_responses_fields() -> None:
    chat = {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {}, "strict": True}}
    assert normalize_tools([chat, WEATHER]) == [{"type": "function", "name": "get_weather", "description": "d",
                                                 "parameters": {}}, WEATHER]
    fields = response_fields(40, 0.0, [WEATHER], {"type": "function", "name": "get_weather"}, False)
    assert fields == {"max_output_tokens": 40, "temperature": 0.0, "tools": [WEATHER],
                      "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False}
    assert json.loads(json.dumps(fields)) == fields


async def test_a_turn_streams_text_and_calls_in_order_and_its_text_alone() -> None:
    turn = Turn()
    call = FunctionCall("call_1", "get_weather", ARGS, {"city": "Paris"})
    turn._push("a")
    turn._push("b")
    turn._call(call)
    turn._push("c")
    turn._finish(TurnResult("r", "completed", "abc", calls=(call,)))
    assert [e async for e in turn.events()] == [TextDelta("", "ab"), call, TextDelta("", "c")]
    again = Turn()
    again._push("a")
    again._call(call)
    again._push("b")
    again._finish(TurnResult("r", "completed", "ab"))
    assert [d.text async for d in again] == ["a", "b"] and again.calls == [call]
