"""An answer made on the device reads as the gateway's, event for event.

The same model output goes through the gateway's sans-I/O session (``gateway/ws/session.py``,
its family's tool-call parser inside) and through the Python SDK's ``DeviceResponse`` fed by the
same parser, and (text, which is what it answers) through the JS SDK's ``DeviceResponse`` under
Node: the event types, the items they carry and the final output must be the same, ids aside.
Python's both emit a response's structure through ``llm_shared.realtime_order.ResponseOrder``; the
JS one cannot import it, so this test is what keeps it in step: it fails if any side adds, drops
or reorders an event of its own.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from rtgw.device_response import DeviceResponse

from gateway.ws.server_events import to_wire
from gateway.ws.session import RealtimeSession, StartGeneration
from llm_shared.contract import FinishEvent, TokenEvent
from llm_shared.structured import get_family

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
OUTPUTS = {
    "text": ["Hello", " there", ", friend."],
    "text then a call": ["Let me check. ", "<tool_call>[{\"name\": \"get_weather\", ",
                         "\"arguments\": {\"city\": \"Paris\"}}]</tool_call>"],
    "empty": [],
}


def gateway_events(chunks: list[str], status_reason: str) -> list[dict[str, Any]]:
    counter = itertools.count(1)
    session = RealtimeSession(session_id="sess", model="smollm2-135m", family=get_family("smollm2"),
                              id_factory=lambda prefix: f"{prefix}_{next(counter)}")
    session.start()
    session.receive({"type": "session.update", "session": {"tools": [WEATHER]}})
    session.receive({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}})
    session.events_to_send()
    session.receive({"type": "response.create"})
    (command,) = session.commands()
    assert isinstance(command, StartGeneration)
    for n, chunk in enumerate(chunks):
        session.engine_event(command.response_id, TokenEvent(token_id=n, text=chunk, logprob=-0.1))
    session.engine_event(command.response_id, FinishEvent(reason=status_reason, prompt_tokens=9, completion_tokens=3))
    return [to_wire(e) for e in session.events_to_send()]


def device_events(chunks: list[str], status: str, after: str) -> list[dict[str, Any]]:
    counter = itertools.count(100)
    family = get_family("smollm2")
    assert family is not None
    parser = family.new_parser()
    device = DeviceResponse("resp_d", ids=lambda prefix: f"{prefix}_{next(counter)}", after=after)
    events = device.created()
    for chunk in chunks:
        events += device.parsed(parser.feed(chunk))
    events += device.parsed(parser.finish())
    return events + device.finish(status)


def shape(value: Any) -> Any:
    """``value`` with ids, numbers of the run and fields one side alone reports (usage, response
    metadata) left out, so what remains is what a client reads the same either way."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()
                if k not in ("event_id", "usage", "metadata", "conversation_id", "max_output_tokens",
                             "temperature", "output_modalities", "audio", "status_details")}
    if isinstance(value, list):
        return [shape(v) for v in value]
    if isinstance(value, str) and re.fullmatch(r"(item|call|resp|conv)_\w+", value):
        return value.split("_")[0]
    return value


@pytest.mark.parametrize("output", sorted(OUTPUTS))
def test_the_device_tells_an_answer_as_the_gateway_does(output: str) -> None:
    online = gateway_events(OUTPUTS[output], "stop")
    offline = device_events(OUTPUTS[output], "completed", after="item_1")  # the user's item, as online
    assert [e["type"] for e in offline] == [e["type"] for e in online]
    assert [shape(e) for e in offline] == [shape(e) for e in online]


JS_SDK = Path(__file__).resolve().parent.parent / "client_sdk" / "js" / "rtgw.js"
JS_ANSWER = """
import { DeviceResponse } from "%s";
const [chunks, after] = JSON.parse(process.argv[1]);
const device = new DeviceResponse("resp_d", { after });
const events = [...device.created()];
for (const chunk of chunks) events.push(...device.text(chunk));
events.push(...device.finish("completed"));
console.log(JSON.stringify(events));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="the JS SDK runs under Node (make system-deps)")
@pytest.mark.parametrize("output", ["text", "empty"])
def test_the_js_device_tells_a_text_answer_as_the_gateway_does(output: str) -> None:
    online = gateway_events(OUTPUTS[output], "stop")
    done = subprocess.run(["node", "--input-type=module", "-e", JS_ANSWER % JS_SDK.as_uri(),
                           json.dumps([OUTPUTS[output], "item_1"])], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    offline = json.loads(done.stdout)
    assert [e["type"] for e in offline] == [e["type"] for e in online]
    assert [shape(e) for e in offline] == [shape(e) for e in online]
