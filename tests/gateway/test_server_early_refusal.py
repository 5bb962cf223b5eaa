"""Under overload a turn is refused before its prompt is encoded: a tier that can tell cheaply
that it is full (``saturated()``) is asked first, so each refusal costs no chat template and no
tokenizing on the event loop the admitted streams share."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import websockets
from gateway_harness import MODEL, make_config, recv_until, send, user_item

from engine_edge import create_backend
from engine_edge.config import EdgeConfig
from gateway.process.server import create_app, start_server
from llm_shared.modelfile import default_gguf_path

pytestmark = pytest.mark.model


def create(max_output_tokens: int) -> dict[str, Any]:
    return {"type": "response.create", "response": {"max_output_tokens": max_output_tokens}}


async def test_a_full_tier_refuses_before_encoding_and_admits_again_once_free() -> None:
    backend = create_backend(EdgeConfig(backend="synthetic", synthetic_tokens_per_s=20, synthetic_max_streams=1),
                             default_gguf_path())
    calls = {"encode_chat": 0}
    encode_chat = backend.tokenizer.encode_chat

    def counting(*args: Any, **kwargs: Any) -> list[int]:
        calls["encode_chat"] += 1
        return encode_chat(*args, **kwargs)

    backend.tokenizer.encode_chat = counting  # type: ignore[method-assign]
    server = await start_server(create_app(make_config(), {"edge": backend}))
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?model={MODEL}"
    try:
        async with websockets.connect(url) as busy, websockets.connect(url) as other:
            await recv_until(busy, "session.created", timeout=30)
            await recv_until(other, "session.created", timeout=30)
            await send(busy, user_item("Tell me a long story."))
            await send(busy, create(400))
            await recv_until(busy, "response.output_text.delta", timeout=30)
            assert calls["encode_chat"] == 1

            await send(other, user_item("And me?"))
            await send(other, create(8))
            done = (await recv_until(other, "response.done", timeout=30))[-1]["response"]
            assert done["status"] == "failed" and done["status_details"]["error"]["code"] == "overloaded"
            assert calls["encode_chat"] == 1, "the refused turn was encoded anyway"

            await send(busy, {"type": "response.cancel"})
            await recv_until(busy, "response.done", timeout=30)
            await asyncio.wait_for(_until(lambda: not backend.saturated()), 30)
            await send(other, create(8))
            done = (await recv_until(other, "response.done", timeout=60))[-1]["response"]
            assert done["status"] == "incomplete" and calls["encode_chat"] == 2  # ran to its 8 tokens
    finally:
        await server.stop()
        await backend.close()


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.01)
