"""Starting a real gateway in-process on an ephemeral loopback port, for tests."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import websockets
from fake_engine import FakeEngine

from gateway.config import DEFAULT_CONFIG, Config, load_config
from gateway.http.state import STATE, GatewayState
from gateway.process.server import RunningServer, create_app, start_server
from llm_shared.models import ModelConfig
from voice.config import VoiceConfig

MODEL = "smollm2-135m-edge"  # the edge tier's own id in the shipped config
KEY = "sk-test-key-1"


def make_config(**server: Any) -> Config:
    """The shipped default config on 127.0.0.1:0 with ``server`` overrides, routing every turn
    to the edge tier alone (the cascade's tests build both tiers); no API keys from the
    environment unless a test asks for them."""
    base = {"host": "127.0.0.1", "port": 0, "api_keys_env": ""}
    config = load_config(DEFAULT_CONFIG).with_server(**{**base, **server})
    # No voice models loaded by serve(): a test that needs them passes a pipeline to create_app.
    return replace(config, routing=replace(config.routing, default="edge"), voice=VoiceConfig(enabled=False))


def gpu_tier_config(method: str = "off", *, num_blocks: int = 256, max_model_len: int = 2048) -> Config:
    """The shipped config routing every turn to the torch tier alone (the real model, one
    thread), with speculation ``method`` (the edge drafter one-threaded too)."""
    config = make_config()
    spec = replace(config.engine.speculative, method=method, draft_model=config.edge.model, draft_threads=1)
    return replace(config, routing=replace(config.routing, default="gpu"),
                   engine=replace(config.engine, num_blocks=num_blocks, max_model_len=max_model_len, threads=1,
                                  speculative=spec))


# A chat template in the tiny test vocabulary (printable ASCII only: no newlines, no braces).
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_chat_model(directory: Path) -> ModelConfig:
    """The engine tests' tiny random checkpoint (tests/engine_gpu/tiny_engine.py) with a chat
    template, so a gateway can serve it on the torch tier: a real core that starts in seconds."""
    engine_tests = str(Path(__file__).resolve().parents[1] / "engine_gpu")
    if engine_tests not in sys.path:
        sys.path.insert(0, engine_tests)
    from tiny_engine import write_tiny_model  # imports torch: only the tests that ask for it pay

    model = write_tiny_model(directory)
    config_path = directory / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": TINY_CHAT_TEMPLATE}))
    return model


@asynccontextmanager
async def serving(config: Config) -> AsyncIterator[tuple[RunningServer, GatewayState]]:
    """A gateway on ``config`` with its real engines built as ``serve`` builds them (the server
    answers while they load); stopped, engines closed, afterwards."""
    from gateway.tiers.build import load_engines

    app = create_app(config)
    server = await start_server(app)
    try:
        app[STATE].set_engines(await load_engines(config), owned=True)
        yield server, app[STATE]
    finally:
        await server.stop()


@asynccontextmanager
async def tiny_gpu_gateway(model: ModelConfig, **server: Any) -> AsyncIterator[tuple[RunningServer, Config]]:
    """A gateway routing every turn to a real torch-tier core serving ``model`` (``tiny_chat_model``)."""
    from engine_gpu.client import EngineClient
    from engine_gpu.config import EngineConfig

    config = gpu_tier_config().with_server(**server)
    core = await EngineClient.start(model, EngineConfig(dtype="float32", block_size=16, num_blocks=128,
                                                        max_num_batched_tokens=128, threads=1))
    try:
        running = await start_server(create_app(config, {"gpu": core}))
        try:
            yield running, config
        finally:
            await running.stop()
    finally:
        await core.close()


@dataclass
class Gateway:
    server: RunningServer
    engine: FakeEngine

    @property
    def state(self) -> GatewayState:
        return self.server.app[STATE]

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def http(self) -> str:
        return self.server.url

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime?model={MODEL}"

    async def wait_sessions_gone(self) -> None:
        """Sessions end asynchronously after a client disconnects; wait for the app to drop them."""
        for _ in range(1000):
            if not self.state.connections and self.state.limits.held("session") == 0:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"{len(self.state.connections)} sessions still open")


@asynccontextmanager
async def running_gateway(engine: FakeEngine | None = None, **server: Any) -> AsyncIterator[Gateway]:
    engine = engine or FakeEngine()
    app = create_app(make_config(**server), {"edge": engine})
    running = await start_server(app)
    try:
        yield Gateway(running, engine)
    finally:
        await running.stop()


async def recv_json(ws: websockets.ClientConnection, timeout: float = 5.0) -> dict[str, Any]:
    data = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(data, str), f"expected a text frame, got {data!r:.80}"
    return json.loads(data)


async def recv_until(ws: websockets.ClientConnection, kind: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Every event up to and including the first of type ``kind``."""
    events = []
    while True:
        event = await recv_json(ws, timeout)
        events.append(event)
        if event["type"] == kind:
            return events


def user_item(text: str) -> dict[str, Any]:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


async def send(ws: websockets.ClientConnection, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


async def sdk_turn(base_url: str, text: str, *, max_output_tokens: int, instructions: str | None = None,
                   model: str = MODEL) -> tuple[str, Any]:
    """One Realtime turn through the official openai SDK: (streamed text, the response.done response)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    async with client.realtime.connect(model=model) as conn:
        if instructions is not None:
            await conn.session.update(session={"type": "realtime", "instructions": instructions})
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        await conn.response.create(response={"max_output_tokens": max_output_tokens})
        streamed = ""
        async for event in conn:
            if event.type == "response.output_text.delta":
                streamed += event.delta
            elif event.type == "response.done":
                return streamed, event.response
    raise AssertionError("the connection closed before response.done")


def sse_chunks(body: str) -> list[dict[str, Any]]:
    """The JSON objects of a chat-completions SSE body (``data: {...}`` lines), in order; the
    ``data: [DONE]`` line is not one of them."""
    return [json.loads(line[len("data: "):]) for line in body.split("\n") if line.startswith("data: {")]
