"""A real turn through the real edge backend (llama.cpp with the embedded SmolLM2-135M)."""

import asyncio

import pytest
import websockets
from gateway_harness import MODEL, make_config, recv_json, recv_until, send, user_item
from openai import AsyncOpenAI

from gateway.engines import load_engines
from gateway.server import create_app, start_server
from gateway.state import STATE

pytestmark = pytest.mark.model


async def test_real_edge_engine_serves_realtime_and_chat() -> None:
    config = load_config_small()
    app = create_app(config)
    server = await start_server(app)
    state = app[STATE]
    try:
        state.set_engines(await load_engines(config), owned=True)
        engine = state.engines["edge"]
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "instructions": "Answer in one short sentence."})
            await conn.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]})
            await conn.response.create(response={"max_output_tokens": 12})
            text = ""
            async for event in conn:
                if event.type == "response.output_text.delta":
                    text += event.delta
                elif event.type == "response.done":
                    assert event.response.status in ("completed", "incomplete")
                    assert event.response.metadata == {"x_tier": "edge"}
                    assert event.response.usage.output_tokens > 0
                    break
        assert text.strip()
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0

        # A cancel mid-answer frees the sequence's KV cells.
        ws_url = f"ws://127.0.0.1:{server.port}/v1/realtime?model={MODEL}"
        async with websockets.connect(ws_url) as ws:
            await recv_json(ws)
            await send(ws, user_item("Write a long story about a lighthouse keeper."))
            await send(ws, {"type": "response.create", "response": {"max_output_tokens": 200}})
            await recv_until(ws, "response.output_text.delta", timeout=30)
            await send(ws, {"type": "response.cancel"})
            done = (await recv_until(ws, "response.done", timeout=30))[-1]["response"]
            assert done["status"] == "cancelled"
        for _ in range(100):  # the worker publishes its stats after its next step
            if engine.stats()["kv_cells_used"] == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.stats()["kv_cells_used"] == 0
    finally:
        await server.stop()
    assert not engine.ready  # the app owned the engine and closed it


def load_config_small():
    # A small context keeps the test light on the two shared cores.
    from dataclasses import replace

    config = make_config()
    return replace(config, edge=replace(config.edge, n_ctx=2048, n_seq_max=2))
