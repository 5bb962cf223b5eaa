"""Function calling in the sans-I/O Realtime session: tools and tool_choice (session and per
response), function-call items streamed out of the model's output, function_call_output items
in the history, and every refusal as an ``error`` naming its param. Literal events in, events
and commands out; the model family is SmolLM2's (``<tool_call>[...]</tool_call>``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from session_helpers import drain
from session_helpers import make as make_session

from gateway.ws.session import AbortGeneration, RealtimeSession, StartGeneration
from llm_shared.contract import FinishEvent, TokenEvent
from llm_shared.structured import SchemaError, get_family

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'


def make(*, beta: bool = False, family: bool = True) -> RealtimeSession:
    return make_session(beta=beta, family=get_family("smollm2") if family else None)


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def update(session: RealtimeSession, **fields: Any) -> list[dict[str, Any]]:
    session.receive({"type": "session.update", "event_id": "u", "session": fields})
    return drain(session)


def user(session: RealtimeSession, text: str) -> None:
    session.receive({"type": "conversation.item.create",
                     "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})


def start(session: RealtimeSession, **response: Any) -> StartGeneration:
    session.receive({"type": "response.create", "event_id": "rc", "response": response})
    (command,) = session.commands()
    assert isinstance(command, StartGeneration)
    assert types(drain(session)) == ["response.created"]
    return command


def stream(session: RealtimeSession, rid: str, text: str, *, size: int = 5) -> None:
    """``text`` as tokens of ``size`` characters (splits land inside the trigger, names and values)."""
    for n in range(0, len(text), size):
        session.engine_event(rid, TokenEvent(token_id=n, text=text[n:n + size], logprob=-0.1))


def stop(session: RealtimeSession, rid: str, reason: str = "stop") -> list[dict[str, Any]]:
    session.engine_event(rid, FinishEvent(reason=reason, prompt_tokens=40, completion_tokens=20))
    return drain(session)


def error_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    (event,) = events
    assert event["type"] == "error", event
    return event["error"]


def test_session_update_sets_tools_and_echoes_them_in_the_realtime_shape() -> None:
    session = make()
    (updated,) = update(session, tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_weather"},
                        parallel_tool_calls=False)
    echoed = updated["session"]
    assert echoed["tools"] == [WEATHER, {**TIME, "description": ""}]
    assert echoed["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert echoed["parallel_tool_calls"] is False
    # A later update that sets other fields keeps the tools; tool_choice alone may change.
    (updated,) = update(session, tool_choice="required")
    assert [t["name"] for t in updated["session"]["tools"]] == ["get_weather", "get_time"]
    assert updated["session"]["tool_choice"] == "required"
    (updated,) = update(session, tools=[], tool_choice="auto")
    assert updated["session"]["tools"] == [] and updated["session"]["tool_choice"] == "auto"


def test_a_required_call_streams_as_a_function_call_item() -> None:
    session = make()
    update(session, instructions="Be brief.", tools=[WEATHER], tool_choice="required")
    user(session, "Weather in Paris?")
    drain(session)
    command = start(session, max_output_tokens=80)
    assert command.constraints is not None and command.constraints.tool_choice.mode == "required"
    system = command.messages[0]
    assert system["role"] == "system" and "<tools>" in system["content"] and "get_weather" in system["content"]
    assert system["content"].endswith("Be brief.")  # the instructions follow the tool listing
    assert command.messages[1:] == [{"role": "user", "content": "Weather in Paris?"}]

    rid = command.response_id
    stream(session, rid, CALL)
    events = drain(session)
    assert types(events)[:2] == ["response.output_item.added", "conversation.item.added"]
    added = events[0]
    assert added["output_index"] == 0
    item = added["item"]
    assert item["type"] == "function_call" and item["status"] == "in_progress"
    assert item["name"] == "get_weather" and item["arguments"] == "" and item["call_id"].startswith("call_")
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas and all(d["item_id"] == item["id"] and d["call_id"] == item["call_id"] for d in deltas)
    assert "".join(d["delta"] for d in deltas) == '{"city": "Paris"}'
    assert types(events)[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                                  "conversation.item.done"]
    done_args = events[-3]
    assert (done_args["name"], done_args["arguments"], done_args["output_index"]) == (
        "get_weather", '{"city": "Paris"}', 0)
    assert events[-2]["item"]["status"] == "completed"

    done = stop(session, rid)
    assert types(done) == ["response.done"]  # no empty message: the answer is the call
    response = done[0]["response"]
    assert response["status"] == "completed"
    assert [o["type"] for o in response["output"]] == ["function_call"]
    assert json.loads(response["output"][0]["arguments"]) == {"city": "Paris"}

    # The call is in the conversation: its output is accepted and the next prompt carries both.
    session.receive({"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": item["call_id"], "output": '{"temperature": 21}'}})
    added_output = drain(session)
    assert types(added_output) == ["conversation.item.added", "conversation.item.done"]
    assert added_output[0]["item"]["type"] == "function_call_output"
    assert added_output[0]["previous_item_id"] == item["id"]
    command = start(session, tool_choice="none")
    assert command.constraints is None  # nothing to call: the turn compiles no grammar
    assert command.messages == [
        {"role": "system", "content": "Be brief."},  # no tool listing under "none"
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
                                         "</tool_call>"},
        {"role": "user", "content": '<tool_response>\n{"temperature": 21}\n</tool_response>'},
    ]
    stream(session, command.response_id, "It is 21 degrees.")
    answer = stop(session, command.response_id)
    assert "response.output_text.delta" in types(answer) and "response.function_call_arguments.delta" not in types(
        answer)


def test_text_before_a_call_is_a_message_item_done_before_the_call_is_added() -> None:
    session = make()
    update(session, tools=[WEATHER, TIME])  # tool_choice "auto": text, or text then calls
    user(session, "Weather and time?")
    drain(session)
    rid = start(session).response_id
    assert session.engine_token(rid, TokenEvent(1, "Let me check. ", -0.1)) is None  # parsed: never the fast path
    stream(session, rid, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                         '{"name": "get_time", "arguments": {}}]</tool_call>', size=7)
    events = drain(session) + stop(session, rid)
    kinds = types(events)
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Let me check. "
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "message"), (1, "function_call"), (2, "function_call")]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["output_index"], e["name"], e["arguments"]) for e in done] == [
        (1, "get_weather", '{"city": "Oslo"}'), (2, "get_time", "{}")]
    assert len({e["call_id"] for e in done}) == 2
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["message", "function_call", "function_call"]
    assert all(o["status"] == "completed" for o in output)
    # Both calls and the text are one assistant turn of the next prompt.
    command = start(session)
    assert command.messages[-1]["role"] == "assistant"
    assert command.messages[-1]["content"].startswith("Let me check. \n<tool_call>[")
    assert '"get_time"' in command.messages[-1]["content"]


@pytest.mark.parametrize("end", ["cancel", "length"])
def test_a_call_cut_short_ends_incomplete(end: str) -> None:
    """A response cancelled (or out of tokens) inside a call ends that call's item as the API does:
    ``arguments.done`` with what was generated, the item ``incomplete``; a cancel aborts the engine."""
    session = make()
    update(session, tools=[WEATHER], tool_choice="required")
    user(session, "Weather?")
    drain(session)
    rid = start(session).response_id
    stream(session, rid, CALL[:CALL.index("Paris") + 3])
    drain(session)
    if end == "cancel":
        session.receive({"type": "response.cancel"})
        assert session.commands() == [AbortGeneration(rid)]
        events = drain(session)
    else:
        events = stop(session, rid, "length")
    assert types(events) == ["response.function_call_arguments.done", "response.output_item.done",
                             "conversation.item.done", "response.done"]
    assert events[0]["arguments"] == '{"city": "Par'
    assert events[1]["item"]["status"] == "incomplete"
    response = events[-1]["response"]
    assert response["status"] == ("cancelled" if end == "cancel" else "incomplete")
    assert response["output"][0]["status"] == "incomplete"
    assert session.active_response_id is None
    stream(session, rid, "late")  # nothing after response.done
    assert drain(session) == [] and session.commands() == []


def test_deleting_the_call_being_written_cancels_the_response() -> None:
    session = make()
    update(session, tools=[WEATHER], tool_choice="required")
    user(session, "Weather?")
    drain(session)
    rid = start(session).response_id
    stream(session, rid, CALL[:50])
    item_id = drain(session)[0]["item"]["id"]
    session.receive({"type": "conversation.item.delete", "item_id": item_id})
    assert session.commands() == [AbortGeneration(rid)]
    events = drain(session)
    assert types(events)[-2:] == ["response.done", "conversation.item.deleted"]
    assert events[-2]["response"]["status"] == "cancelled"


def test_function_call_output_must_answer_a_call_of_the_conversation() -> None:
    session = make()
    session.receive({"type": "conversation.item.create", "event_id": "o1", "item": {
        "type": "function_call_output", "call_id": "call_nope", "output": "21"}})
    error = error_of(drain(session))
    assert (error["code"], error["param"], error["event_id"]) == ("invalid_tool_call_id", "item.call_id", "o1")
    # A client replaying history: its call (id given by the server when left out), then the output.
    session.receive({"type": "conversation.item.create", "item": {
        "type": "function_call", "name": "get_weather", "arguments": '{"city": "Rome"}'}})
    call = drain(session)[0]["item"]
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    session.receive({"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}})
    assert types(drain(session)) == ["conversation.item.added", "conversation.item.done"]
    session.receive({"type": "conversation.item.retrieve", "item_id": call["id"]})
    assert drain(session)[0]["item"] == call
    # Only messages can be truncated.
    session.receive({"type": "conversation.item.truncate", "item_id": call["id"], "content_index": 0,
                     "x_text_end": 0})
    assert error_of(drain(session))["param"] == "item_id"
    # Out of band: an output may answer a call earlier in the same input.
    command = start(session, conversation="none", input=[
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}])
    assert [m["role"] for m in command.messages] == ["assistant", "user", "user"]
    stop(session, command.response_id)
    session.receive({"type": "response.create", "response": {"conversation": "none", "input": [
        {"type": "function_call_output", "call_id": "c2", "output": "x"}]}})
    assert error_of(drain(session))["param"] == "response.input[0].call_id"


def test_a_response_overrides_the_session_tools_for_itself_only() -> None:
    session = make()
    update(session, tools=[WEATHER], tool_choice="auto")
    user(session, "Time?")
    drain(session)
    command = start(session, tools=[TIME], tool_choice={"type": "function", "name": "get_time"})
    assert command.constraints is not None
    assert [t.name for t in command.constraints.tools] == ["get_time"]
    assert command.constraints.tool_choice.name == "get_time"
    stop(session, command.response_id)
    command = start(session)
    assert command.constraints is not None and [t.name for t in command.constraints.tools] == ["get_weather"]
    stop(session, command.response_id)
    command = start(session, parallel_tool_calls=False)
    assert command.constraints is not None and command.constraints.parallel_tool_calls is False
    assert "at most one function call" in command.messages[0]["content"]


BAD_TOOLS: list[tuple[str, str, dict[str, Any], str, str]] = [
    # (case, event type, object, code, param)
    ("unknown tool in tool_choice", "session.update",
     {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "invalid_request",
     "session.tool_choice.name"),
    ("required without tools", "session.update", {"tools": [], "tool_choice": "required"}, "invalid_request",
     "session.tool_choice"),
    ("bad tool_choice", "session.update", {"tool_choice": "sometimes"}, "invalid_request", "session.tool_choice"),
    ("dangling $ref", "session.update", {"tools": [{**WEATHER, "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}]}, "invalid_schema",
     "session.tools[0].parameters"),
    ("parameters not an object schema", "session.update", {"tools": [{**WEATHER, "parameters": {"type": "string"}}]},
     "invalid_schema", "session.tools[0].parameters"),
    ("chat-shaped tool", "session.update", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "invalid_request", "session.tools[0].function"),
    ("bad name", "session.update", {"tools": [{**WEATHER, "name": "get weather"}]}, "invalid_request",
     "session.tools[0].name"),
    ("repeated name", "session.update", {"tools": [WEATHER, WEATHER]}, "invalid_request", "session.tools[1]"),
    ("too many tools", "session.update", {"tools": [{**TIME, "name": f"t{n}"} for n in range(129)]},
     "invalid_request", "session.tools"),
    ("schema too deep", "session.update", {"tools": [{**WEATHER, "parameters": {
        "type": "object", "properties": {"a": json.loads('{"items": ' * 40 + "{}" + "}" * 40)}}}]},
     "invalid_schema", "session.tools[0].parameters"),
    ("response names a session tool it dropped", "response.create",
     {"tools": [TIME], "tool_choice": {"type": "function", "name": "get_weather"}}, "invalid_request",
     "response.tool_choice.name"),
]


@pytest.mark.parametrize(("kind", "obj", "code", "param"), [c[1:] for c in BAD_TOOLS], ids=[c[0] for c in BAD_TOOLS])
def test_bad_tools_are_error_events_naming_the_param_and_change_nothing(kind: str, obj: dict[str, Any], code: str,
                                                                         param: str) -> None:
    session = make()
    update(session, tools=[WEATHER], tool_choice="auto")
    key = "session" if kind == "session.update" else "response"
    session.receive({"type": kind, "event_id": "bad", key: obj})
    error = error_of(drain(session))
    assert (error["code"], error["param"], error["event_id"]) == (code, param, "bad")
    assert session.commands() == [] and session.active_response_id is None
    # The session lives on, its tools as they were.
    (updated,) = update(session, instructions="still here")
    assert [t["name"] for t in updated["session"]["tools"]] == ["get_weather"]
    assert updated["session"]["tool_choice"] == "auto"


def test_a_model_without_a_tool_call_format_refuses_callable_tools() -> None:
    session = make(family=False)
    error = error_of(update(session, tools=[WEATHER]))  # tool_choice "auto": they could be called
    assert (error["code"], error["param"]) == ("unsupported_feature", "session.tools")
    (updated,) = update(session, tools=[WEATHER], tool_choice="none")  # listed, never called: fine
    assert updated["session"]["tool_choice"] == "none"
    user(session, "Hi")
    drain(session)
    command = start(session)
    assert command.constraints is None
    stop(session, command.response_id)
    session.receive({"type": "response.create", "response": {"tool_choice": "required"}})
    assert error_of(drain(session))["param"] == "response.tools"


def test_a_schema_the_compiler_refuses_is_an_error_naming_the_field_and_fails_the_response() -> None:
    """Whether llguidance supports a schema is learnt when the turn compiles its grammar (the
    adapter's ``Turn.prepare``); the session answers the response.create with an error naming the
    field, and the response ends failed."""
    session = make()
    update(session, tools=[WEATHER], tool_choice="required")
    user(session, "Weather?")
    drain(session)
    rid = start(session).response_id
    session.engine_failed(rid, SchemaError("session.tools[0].parameters cannot be enforced: not is not supported",
                                           param="session.tools[0].parameters"))
    events = drain(session)
    assert types(events) == ["error", "response.done"]
    assert (events[0]["error"]["code"], events[0]["error"]["param"], events[0]["error"]["event_id"]) == (
        "invalid_schema", "session.tools[0].parameters", "rc")
    assert events[1]["response"]["status"] == "failed"
    assert events[1]["response"]["status_details"]["error"]["code"] == "invalid_schema"


def test_beta_clients_get_the_same_calls_in_beta_shapes() -> None:
    session = make(beta=True)
    (updated,) = update(session, tools=[WEATHER], tool_choice="required")
    assert updated["session"]["tools"] == [WEATHER] and updated["session"]["tool_choice"] == "required"
    user(session, "Weather?")
    drain(session)
    rid = start(session).response_id
    stream(session, rid, CALL)
    events = drain(session) + stop(session, rid)
    assert types(events)[:2] == ["response.output_item.added", "conversation.item.created"]
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert "name" not in done and done["arguments"] == '{"city": "Paris"}'
    assert "conversation.item.done" not in types(events)
    assert events[-1]["response"]["output"][0]["type"] == "function_call"
