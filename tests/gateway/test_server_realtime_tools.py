"""Function calling over the Realtime protocol, end to end: ``make serve``'s default configuration
(the real SmolLM2 on both tiers, the cascade), the official openai SDK's realtime client.

A session with a ``get_weather`` tool and ``tool_choice: "required"`` answers with a function-call
item whose streamed arguments parse and validate against the tool's schema; its
``function_call_output`` and a ``response.create`` with ``tool_choice: "none"`` give a text answer.
Schemas that cannot be enforced and unknown tool names are ``error`` events naming the field, and
the session goes on. The msgpack subprotocol carries the same events.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgpack
import pytest
import websockets
from gateway_harness import serving
from openai import AsyncOpenAI
from realtime_sdk_check import check_server_event

from gateway.config import DEFAULT_CONFIG, load_config
from gateway.ws.codec import MSGPACK_SUBPROTOCOL

pytestmark = pytest.mark.model

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
              "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": PARAMETERS}
ASK = {"type": "message", "role": "user",
       "content": [{"type": "input_text", "text": "What is the weather in Paris, in Celsius?"}]}


async def until(conn: Any, last: str) -> list[dict[str, Any]]:
    """Every event up to and with the first of type ``last``, as sent (checked against the SDK's models),
    but ``rate_limits.updated`` (which follows each response.done)."""
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] != last:
        event = json.loads(await conn.recv_bytes())
        check_server_event(event, beta=False)
        if event["type"] != "rate_limits.updated":
            events.append(event)
    return events


def the_call(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The one function call of a response, checked against what was streamed for it."""
    done = events[-1]["response"]
    assert done["status"] == "completed", done["status_details"]
    [call] = [item for item in done["output"] if item["type"] == "function_call"]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
              and e["item_id"] == call["id"]]
    [args_done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert "".join(deltas) == args_done["arguments"] == call["arguments"]
    assert call["name"] == args_done["name"] == "get_weather" and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), PARAMETERS)
    return call


async def test_a_realtime_function_call_round_trip_with_the_official_sdk() -> None:
    config = load_config(DEFAULT_CONFIG).with_server(host="127.0.0.1", port=0, api_keys_env="")
    async with serving(config) as (server, state):
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model=config.routing.default_model) as conn:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "temperature": 0.0, "max_output_tokens": 80,
                                               "tools": [WEATHER], "tool_choice": "required"})
            [updated] = await until(conn, "session.updated")
            assert updated["session"]["tools"] == [WEATHER] and updated["session"]["tool_choice"] == "required"
            await conn.conversation.item.create(item=ASK)
            await conn.response.create()
            call = the_call(await until(conn, "response.done"))

            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                      "output": json.dumps({"temperature": 21, "sky": "clear"})})
            added = await until(conn, "conversation.item.done")
            assert added[-1]["item"]["type"] == "function_call_output"
            await conn.response.create(response={"tool_choice": "none", "max_output_tokens": 40})
            events = await until(conn, "response.done")
            done = events[-1]["response"]
            assert done["status"] in ("completed", "incomplete"), done["status_details"]
            assert [item["type"] for item in done["output"]] == ["message"]
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text.strip() and not any("function_call" in e["type"] for e in events)

            # Refusals name the field; the session goes on.
            bad_ref = {**WEATHER, "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}}
            await conn.session.update(session={"type": "realtime", "tools": [bad_ref]}, event_id="bad1")
            [error] = await until(conn, "error")
            assert error["error"]["param"] == "session.tools[0].parameters" and error["error"]["event_id"] == "bad1"
            await conn.session.update(session={"type": "realtime",
                                               "tool_choice": {"type": "function", "name": "nope"}})
            [error] = await until(conn, "error")
            assert error["error"]["param"] == "session.tool_choice.name"
            # Unsupported by the grammar compiler: learnt when the response's grammar compiles.
            unsupported = {"type": "function", "name": "f", "parameters": {
                "type": "object", "properties": {"x": {"not": {"type": "string"}}}, "required": ["x"],
                "additionalProperties": False}}
            await conn.response.create(response={"tools": [unsupported], "tool_choice": "required"}, event_id="bad2")
            events = await until(conn, "response.done")
            [error] = [e for e in events if e["type"] == "error"]
            assert error["error"]["param"] == "response.tools[0].parameters" and error["error"]["event_id"] == "bad2"
            assert events[-1]["response"]["status"] == "failed"

        # The msgpack subprotocol carries the same events (the edge tier alone, for speed).
        url = f"ws://127.0.0.1:{server.port}/v1/realtime?model={config.routing.edge_model}"
        async with websockets.connect(url, subprotocols=[MSGPACK_SUBPROTOCOL]) as ws:
            assert msgpack.unpackb(await ws.recv())["type"] == "session.created"
            for event in ({"type": "session.update", "session": {"temperature": 0.0, "tools": [WEATHER],
                                                                 "tool_choice": "required"}},
                          {"type": "conversation.item.create", "item": ASK},
                          {"type": "response.create", "response": {"max_output_tokens": 80}}):
                await ws.send(msgpack.packb(event))
            events = []
            while not events or events[-1]["type"] != "response.done":
                events.append(msgpack.unpackb(await ws.recv()))
                check_server_event(events[-1], beta=False)
            the_call(events)

            # A cancel once the arguments stream: the call ends as the API ends one cut short (when the
            # cancel lands before the model closes it), and the engine lets go of the request either way.
            await ws.send(msgpack.packb({"type": "response.create", "response": {"max_output_tokens": 80}}))
            events = []
            while not events or events[-1]["type"] != "response.done":
                events.append(msgpack.unpackb(await ws.recv()))
                if events[-1]["type"] == "response.function_call_arguments.delta" and not any(
                        e["type"] == "response.function_call_arguments.delta" for e in events[:-1]):
                    await ws.send(msgpack.packb({"type": "response.cancel"}))
            done = events[-1]["response"]
            [call] = done["output"]
            [args_done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
            assert args_done["arguments"] == call["arguments"]
            assert (done["status"], call["status"]) in (("cancelled", "incomplete"), ("completed", "completed"))

        stats = await state.engines["gpu"].refresh_stats()
        assert stats["kv_blocks_in_use"] == 0 and stats["running"] == 0
        assert state.engines["edge"].stats()["open_streams"] == 0
