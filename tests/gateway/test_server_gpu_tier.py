"""A real turn through the torch engine tier: gateway → engine core process → SmolLM2 (the dtype
``auto`` picks), with each speculation method the config offers."""


import aiohttp
import pytest
from gateway_harness import gpu_tier_config, sdk_turn, serving
from openai import AsyncOpenAI

pytestmark = pytest.mark.model


@pytest.mark.parametrize("method", ["edge", "ngram", "off"])
async def test_gpu_tier_serves_a_turn_and_frees_its_blocks(method: str) -> None:
    config = gpu_tier_config(method)
    async with serving(config) as (server, state):
        engine = state.engines["gpu"]
        assert engine.tier == "gpu"
        model = config.routing.gpu_model
        text, response = await sdk_turn(server.url, "What is 2+2?", max_output_tokens=8, model=model)
        assert response.status in ("completed", "incomplete")
        assert response.metadata == {"x_tier": "gpu"}
        assert response.usage.output_tokens > 0
        assert text.strip()

        # The same prompt again over HTTP: the engine's prefix cache serves most of it.
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens > 0
        assert chat.usage.prompt_tokens_details.cached_tokens >= 16

        stats = await engine.refresh_stats()
        assert stats["kv_blocks_in_use"] == 0
        async with aiohttp.ClientSession() as http:
            metrics = await (await http.get(f"{server.url}/metrics")).text()
        if method == "off":
            assert "spec_enabled" not in stats and stats["spec_draft_tokens"] == 0  # no speculator
        else:  # the speculator's figures reach /metrics
            assert stats["spec_draft_tokens"] >= 0 and 'engine_spec_acceptance_rate{tier="gpu"}' in metrics
        if method == "edge":
            assert stats["drafter_kv_cells_total"] > 0 and stats["drafter_slots_in_use"] == 0
    assert not engine.ready
