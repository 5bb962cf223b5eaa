"""The cascade end to end: ``make serve``'s default configuration (the real SmolLM2 on both
tiers, the shipped threshold), the official openai SDK as the client.

The two opening prompts sit far on either side of the shipped threshold in the calibration
run (confidence 0.85 and 0.12 against 0.22), so which tier serves each is known; every other
turn is checked for consistency (the edge serves exactly the turns scored at or above the
threshold) and the metrics must count what the responses said.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from gateway_harness import serving
from openai import AsyncOpenAI

from gateway.config import DEFAULT_CONFIG, load_config

pytestmark = pytest.mark.model

CONFIDENT = "What is the chemical symbol for gold?"
UNSURE = "What is the capital of France?"


async def session_turns(client: AsyncOpenAI, model: str, prompts: list[str]) -> list[tuple[str, Any]]:
    """One Realtime session, a turn per prompt: (streamed text, response.done's response) each."""
    out = []
    async with client.realtime.connect(model=model) as conn:
        # Greedy, as the calibration ran: at the Realtime default of 0.8 the held tokens are
        # sampled, and their confidence varies from run to run.
        await conn.session.update(session={"type": "realtime", "temperature": 0.0})
        for prompt in prompts:
            await conn.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]})
            await conn.response.create(response={"max_output_tokens": 24})
            streamed = ""
            async for event in conn:
                if event.type == "response.output_text.delta":
                    streamed += event.delta
                elif event.type == "response.done":
                    out.append((streamed, event.response))
                    break
    return out


def check_consistent(response: Any) -> str:
    """The route a response reports agrees with its confidence and threshold; its tier."""
    meta = response.metadata
    assert response.status in ("completed", "incomplete"), response.status_details
    assert meta["x_route"] in ("confident", "escalated"), meta  # not a fallback: both tiers were up
    assert meta["x_degraded"] == "false" and response.usage.output_tokens > 0
    confident = float(meta["x_confidence"]) >= float(meta["x_threshold"])
    assert meta["x_route"] == ("confident" if confident else "escalated")
    assert meta["x_tier"] == ("edge" if confident else "gpu")
    return meta["x_tier"]


async def test_the_default_configuration_serves_each_turn_on_the_tier_its_confidence_picks() -> None:
    config = load_config(DEFAULT_CONFIG).with_server(host="127.0.0.1", port=0, api_keys_env="")
    # The shipped config as it is: health that tells busy from dead (a slow probe on a loaded
    # machine is not a down tier); one turn at a time, so no tier is too full to start it.
    assert config.routing.default == "cascade"
    async with serving(config) as (server, state):
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
        model = config.routing.default_model
        turns = await session_turns(client, model, [CONFIDENT, "And for silver?"])
        turns += await session_turns(client, model, [UNSURE, "Thanks! And Germany?"])
        tiers = [check_consistent(response) for _, response in turns]
        assert tiers[0] == "edge" and tiers[2] == "gpu"
        assert all(text.strip() for text, _ in turns)

        # The same prompts pinned to one tier by model id: no cascade fields, that tier only.
        [(_, pinned)] = await session_turns(client, config.routing.edge_model, [UNSURE])
        assert pinned.metadata == {"x_tier": "edge"}
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": UNSURE}], max_tokens=8, temperature=0)
        assert chat.model_extra["x_tier"] == "gpu" and chat.model_extra["x_route"]["route"] == "escalated"

        async with aiohttp.ClientSession() as http:
            metrics = await (await http.get(f"{server.url}/metrics")).text()
        edge_turns, gpu_turns = tiers.count("edge"), tiers.count("gpu")
        assert f'gateway_cascade_turns_total{{api="realtime",route="confident",tier="edge"}} {edge_turns}.0' in metrics
        assert f'gateway_cascade_turns_total{{api="realtime",route="escalated",tier="gpu"}} {gpu_turns}.0' in metrics
        assert 'gateway_cascade_turns_total{api="realtime",route="model",tier="edge"} 1.0' in metrics
        held = {line.split("}")[0].split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("gateway_cascade_held_tokens_total{")}
        # every escalation (the Realtime ones and the chat completion) handed over up to 8 held tokens
        assert 0 < held["accepted"] + held["rejected"] <= 8 * (gpu_turns + 1)
        assert 'gateway_tier_up{tier="gpu"} 1.0' in metrics
        stats = await state.engines["gpu"].refresh_stats()
        assert stats["kv_blocks_in_use"] == 0 and stats["running"] == 0
        assert state.engines["edge"].stats()["open_streams"] == 0
