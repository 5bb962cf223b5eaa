"""Function calling and structured outputs over chat completions, end to end: ``make serve``'s
default configuration (the real SmolLM2 on both tiers), the official openai SDK as the client.

``parse()`` with a Pydantic model returns a parsed object on the cascade and on each tier alone;
a streamed tool call accumulates (the SDK's ``stream()`` helper) to arguments that validate; a
conversation carrying a call and its result continues; schemas that cannot be enforced, unknown
tool names and malformed history are refused with a 400 naming the field, before any generation.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Literal

import openai
import pytest
from gateway_harness import serving
from openai import AsyncOpenAI
from pydantic import BaseModel

from gateway.config import DEFAULT_CONFIG, load_config

pytestmark = pytest.mark.model


class Person(BaseModel):
    name: str
    age: int
    city: Literal["Paris", "Berlin", "Rome"]


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str
    unit: Literal["C", "F"]


async def test_tools_and_structured_outputs_with_the_official_sdk() -> None:
    config = load_config(DEFAULT_CONFIG).with_server(host="127.0.0.1", port=0, api_keys_env="")
    routing = config.routing
    async with serving(config) as (server, _state):
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Invent a person who lives in Rome."}]

        for model in (routing.default_model, routing.edge_model, routing.gpu_model):
            done = await client.chat.completions.parse(model=model, messages=messages, response_format=Person,
                                                       max_tokens=60, temperature=0.7, seed=3)
            choice = done.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            assert isinstance(choice.message.parsed, Person), choice.message.content
            assert done.model_extra["x_tier"] in ("edge", "gpu")

        weather = openai.pydantic_function_tool(GetWeather)
        ask = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]
        async with client.chat.completions.stream(model=routing.default_model, messages=ask, tools=[weather],
                                                  tool_choice="required", parallel_tool_calls=False,
                                                  max_tokens=80, temperature=0) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_completion()
        assert "tool_calls.function.arguments.delta" in kinds
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == "GetWeather" and call.id.startswith("call_")
        assert isinstance(call.function.parsed_arguments, GetWeather)

        # the call and its result in the history: the conversation goes on (in text: "none")
        history = [*ask, {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
        answer = await client.chat.completions.create(model=routing.edge_model, messages=history, tools=[weather],
                                                      tool_choice="none", max_tokens=30, temperature=0)
        assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls

        # a named function, not streamed: exactly that call
        named = await client.chat.completions.create(
            model=routing.gpu_model, messages=ask, tools=[weather], max_tokens=80, temperature=0,
            tool_choice={"type": "function", "function": {"name": "GetWeather"}})
        assert named.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in named.choices[0].message.tool_calls] == ["GetWeather"]
        GetWeather.model_validate_json(named.choices[0].message.tool_calls[0].function.arguments)

        # refusals name the field, and nothing was generated
        bad_cases = [
            ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
                "type": "object", "properties": {"x": {"not": {"type": "string"}}}, "required": ["x"],
                "additionalProperties": False}}}]}, "tools[0].function.parameters"),
            ({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format"),
        ]
        for extra, param in bad_cases:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model=routing.default_model, messages=ask, max_tokens=8,
                                                     **extra)
            assert refused.value.status_code == 400
            assert (refused.value.body or {}).get("param", "").startswith(param), refused.value.body
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=routing.default_model, max_tokens=8, messages=[
                *ask, {"role": "tool", "content": "21 degrees"}])
        assert (refused.value.body or {}).get("param") == "messages[1].tool_call_id"


async def test_an_escalated_constrained_turn_is_verified_under_the_grammar() -> None:
    """Every turn escalates (threshold 1): the edge starts each one under the grammar, and the torch
    tier verifies its held tokens under the same grammar before anything reaches the client; the
    answer still parses, and the held tokens were offered for verification."""
    config = load_config(DEFAULT_CONFIG).with_server(host="127.0.0.1", port=0, api_keys_env="")
    config = replace(config, cascade=replace(config.cascade, threshold=1.0, min_threshold=1.0, load_aware=False))
    async with serving(config) as (server, state):
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for seed in (1, 2):
            done = await client.chat.completions.parse(
                model=config.routing.default_model, response_format=Person, max_tokens=60, temperature=0.7,
                seed=seed, messages=[{"role": "user", "content": "Invent a person who lives in Berlin."}])
            assert done.model_extra["x_route"]["route"] == "escalated" and done.model_extra["x_tier"] == "gpu"
            assert isinstance(done.choices[0].message.parsed, Person), done.choices[0].message.content
        held = sum(sample.value for metric in state.metrics.registry.collect()
                   if metric.name == "gateway_cascade_held_tokens" for sample in metric.samples
                   if sample.name.endswith("_total"))
        assert held > 0
