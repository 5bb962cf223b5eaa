"""Function calls through the Python SDK with the real SmolLM2 (``tool_choice: "required"``, one
call per response, greedy, short answers): a round trip with a gateway process (the call with its
parsed arguments, its output sent back, the next answer), then the same round trip on the device
while the gateway is down, surfaced the same way, and carried over to the gateway once it is back
(the call and output items restored there with their ids). Tools the gateway refuses, the device
refuses alike, naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from gateway_process import GatewayProcess, free_port, serving, write_config
from rtgw import (
    Backoff,
    FunctionCall,
    FunctionCallItem,
    FunctionCallOutputItem,
    OfflineConfig,
    RealtimeClient,
    TurnResult,
)

pytestmark = pytest.mark.model

KEY = "sk-sdk-tools-key"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
              "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": PARAMETERS}
ASK = "What is the weather in Paris, in Celsius?"
OUTPUT = {"temperature": 21, "sky": "clear"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with serving(tmp_path_factory.mktemp("sdk-tools-gateway"), api_keys=(KEY,)) as process:
        yield process


async def the_call(client: RealtimeClient, tier: str) -> tuple[FunctionCall, TurnResult]:
    """Ask with the session's tool required: the turn's one event is its call, valid for the schema."""
    turn = await client.send(ASK, max_output_tokens=80, temperature=0.0)
    events = [event async for event in turn.events()]
    result = await turn.result()
    assert result.status == "completed" and result.tier == tier, result
    [call] = result.calls
    assert events == [call] and turn.calls == [call]
    assert call.name == "get_weather" and call.complete and call.call_id.startswith("call_")
    jsonschema.validate(call.parsed, PARAMETERS)
    return call, result


async def test_a_call_round_trip_with_the_gateway(gateway: GatewayProcess) -> None:
    async with RealtimeClient(gateway.url, api_key=KEY, connect_timeout=30, silence_timeout=120, request_timeout=30,
                              tools=[WEATHER], tool_choice="required", parallel_tool_calls=False) as client:
        call, _ = await the_call(client, "edge")
        on_server = await client.retrieve_item(call.item_id)
        assert isinstance(on_server, FunctionCallItem) and on_server.arguments == call.arguments

        follow = await client.send_tool_output(call.call_id, OUTPUT, tool_choice="none", max_output_tokens=40,
                                               temperature=0.0)
        answer = await follow.result()
        assert answer.status in ("completed", "incomplete") and answer.text.strip() and answer.calls == ()
        assert [i.type for i in client.conversation] == ["message", "function_call", "function_call_output", "message"]
        output = client.conversation[2]
        assert isinstance(output, FunctionCallOutputItem) and output.call_id == call.call_id
        assert await client.retrieve_item(output.id) == output  # the server holds it under our id

        # A session-level choice that names the function works the same; a wrong call id is refused here.
        await client.update_session(tool_choice={"type": "function", "name": "get_weather"})
        await the_call(client, "edge")
        with pytest.raises(ValueError, match="call_id"):
            await client.send_tool_output("call_unknown", "{}")


async def test_a_call_round_trip_on_the_device_then_carried_over_to_the_gateway(tmp_path: Path) -> None:
    process = GatewayProcess(write_config(tmp_path, api_keys=(KEY,)), tmp_path / "gateway.log", port=free_port())
    client = RealtimeClient(process.url, api_key=KEY, connect_timeout=5, request_timeout=30, silence_timeout=120,
                            offline=OfflineConfig(max_output_tokens=80, temperature=0.0), retry_online_s=0.0,
                            backoff=Backoff(attempts=1), tools=[WEATHER], tool_choice="required",
                            parallel_tool_calls=False)
    try:
        await client.connect()  # nothing listens: the device answers
        assert not client.online
        call, result = await the_call(client, "device")
        assert result.offline

        follow = await client.send_tool_output(call.call_id, OUTPUT, tool_choice="none", max_output_tokens=24)
        answer = await follow.result()
        assert answer.offline and answer.status in ("completed", "incomplete") and answer.text.strip()
        assert answer.calls == () and answer.usage["input_tokens"] > 0
        local = list(client.conversation)
        assert [i.type for i in local] == ["message", "function_call", "function_call_output", "message"]

        # What the gateway refuses, the device refuses the same way: the turn fails naming the field.
        unknown = await (await client.send("Hi", tool_choice={"type": "function", "name": "nope"})).result()
        assert unknown.status == "failed" and unknown.offline
        assert unknown.error["param"] == "response.tool_choice.name", unknown.error
        unsupported = {"type": "function", "name": "f", "parameters": {
            "type": "object", "properties": {"x": {"not": {"type": "string"}}}, "required": ["x"],
            "additionalProperties": False}}
        refused = await (await client.send("Hi", tools=[unsupported])).result()
        assert refused.status == "failed" and refused.error["param"] == "response.tools[0].parameters", refused.error

        await asyncio.to_thread(process.start)
        back = await client.send("Thanks!", max_output_tokens=8, tool_choice="none")
        online = await back.result()
        assert client.online and not online.offline and online.tier == "edge", online
        for item in local:  # the device's call and its output were carried over, with their ids
            carried = await client.retrieve_item(item.id)
            assert carried.type == item.type
            if isinstance(item, FunctionCallItem):
                assert carried == item
            elif isinstance(item, FunctionCallOutputItem):
                assert carried == item
    finally:
        await client.close()
        await asyncio.to_thread(process.stop)
