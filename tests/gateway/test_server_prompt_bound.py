"""A prompt far past the serving tier's context is refused before it is tokenized.

No token decodes to more than ``Tokenizer.max_token_bytes`` bytes, so a prompt of N bytes has at
least ceil(N / max_token_bytes) tokens; when that alone (plus the output for the torch tier) is
past every context that could serve the turn, the gateway answers with the error the full check
gives (``context_length_exceeded``: HTTP 400, a failed Realtime response) without tokenizing.
Prompts within the bound are tokenized and checked by the tier as before."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import websockets
from fake_engine import FakeEngine, FakeTokenizer
from gateway_harness import (
    MODEL,
    make_config,
    recv_json,
    recv_until,
    running_gateway,
    send,
    tiny_chat_model,
    tiny_gpu_gateway,
    user_item,
)

from gateway.cascade.router import prompt_token_limit
from gateway.http.state import STATE
from gateway.process.server import create_app, start_server
from gateway.tiers.supervisor import SupervisedEngine
from llm_shared.modelfile import default_gguf_path
from llm_shared.models import ModelConfig
from llm_shared.tokenizer import Tokenizer

FAR_PAST = "lorem ipsum dolor sit amet " * 4000  # 108,000 bytes: at least 1,334 tokens for SmolLM2's 81-byte tokens


class Spy:
    """Counts calls of a tokenizer's methods that tokenize (``encode``, ``encode_chat``)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.calls = 0
        for name in ("encode", "encode_chat"):
            setattr(tokenizer, name, self._counting(getattr(tokenizer, name)))

    def _counting(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return method(*args, **kwargs)
        return call


@pytest.fixture(scope="module")
def smollm_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


@pytest.fixture
def spied(smollm_tokenizer: Tokenizer) -> Iterator[tuple[Tokenizer, Spy]]:
    spy = Spy(smollm_tokenizer)
    yield smollm_tokenizer, spy
    for name in ("encode", "encode_chat"):
        delattr(smollm_tokenizer, name)  # the class's own methods again


async def chat(http: aiohttp.ClientSession, content: str, model: str = MODEL, max_tokens: int = 8) -> tuple[int, Any]:
    async with http.post("/v1/chat/completions", json={
            "model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}) as r:
        return r.status, await r.json()


async def realtime_failure(url: str, content: str) -> dict[str, Any]:
    async with websockets.connect(url) as ws:
        await recv_json(ws)
        await send(ws, user_item(content))
        await send(ws, {"type": "response.create"})
        return (await recv_until(ws, "response.done", timeout=30))[-1]["response"]


@pytest.mark.model
async def test_a_prompt_far_past_the_context_is_refused_without_tokenizing(spied: tuple[Tokenizer, Spy]) -> None:
    tokenizer, spy = spied
    engine = FakeEngine(tokenizer=tokenizer, n_ctx=1024)  # holds 1,023 prompt tokens
    async with running_gateway(engine) as gw, aiohttp.ClientSession(gw.http) as http:
        status, body = await chat(http, FAR_PAST)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert "at least" in body["error"]["message"]
        response = await realtime_failure(gw.ws_url, FAR_PAST)
        assert response["status"] == "failed"
        assert response["status_details"]["error"]["code"] == "context_length_exceeded"
        assert spy.calls == 0 and engine.started == []  # neither API tokenized it, nothing reached the engine

        status, body = await chat(http, "What is 2+2?")  # within the bound: tokenized and served
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
        assert spy.calls > 0 and len(engine.started) == 1

        # Past the context but within the bound (ordinary text is ~4 bytes a token, not 81):
        # tokenized, then refused by the full check with the same error.
        calls = spy.calls
        status, body = await chat(http, "lorem ipsum dolor sit amet " * 300)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert spy.calls > calls and len(engine.started) == 1


def test_each_tier_bounds_the_prompt_by_its_own_context() -> None:
    edge = FakeEngine(n_ctx=4096)  # the edge holds the prompt alone; output stops at the context

    class TorchLike:  # the torch tier's client counts the output in its context
        tier = "gpu"
        max_model_len = 2048

    assert prompt_token_limit(edge, 512) == 4095
    assert prompt_token_limit(TorchLike(), 512) == 1536  # type: ignore[arg-type]
    assert prompt_token_limit(object(), 512) is None  # type: ignore[arg-type]  # says nothing: no early check


async def test_the_supervised_torch_tier_reports_its_cores_context() -> None:
    class Core(FakeEngine):
        max_model_len = 2048

        async def wait_lost(self) -> None:
            await asyncio.Event().wait()  # never lost while the test runs

    async def start() -> Core:
        return Core(tier="gpu")

    supervised = SupervisedEngine(await start(), start)
    try:
        assert supervised.max_model_len == 2048 and prompt_token_limit(supervised, 48) == 2000  # type: ignore[arg-type]
    finally:
        await supervised.close()


async def test_the_cascade_bounds_a_prompt_by_the_largest_context_of_its_tiers() -> None:
    """The cascade sends what the edge cannot hold to the torch tier, so only a prompt past both
    is refused early; one past the edge's alone is pre-routed as before."""
    tokenizer = FakeTokenizer()  # one character, one token; up to 4 bytes a token
    edge = FakeEngine(tier="edge", tokenizer=tokenizer, n_ctx=2048)
    gpu = FakeEngine(tier="gpu", tokenizer=tokenizer, n_ctx=16384)
    config = make_config()
    config = replace(config, routing=replace(config.routing, default="cascade"))
    server = await start_server(create_app(config, {"edge": edge, "gpu": gpu}))
    try:
        async with aiohttp.ClientSession(server.url) as http:
            cascade = config.routing.cascade_model
            status, body = await chat(http, "x" * 12_000, cascade)  # >= 3,000 tokens: past the edge, not the gpu
            assert status == 200 and body["x_route"]["reason"] == "prompt_exceeds_edge_context", body
            encodes = tokenizer.chat_encodes
            status, body = await chat(http, "\u00e9" * 80_000, cascade)  # 160,000 bytes: >= 40,000 tokens
            assert status == 400 and body["error"]["code"] == "context_length_exceeded"
            assert tokenizer.chat_encodes == encodes and len(gpu.started) == 1 and edge.started == []
    finally:
        await server.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-bound"))


async def test_the_torch_tier_bound_counts_the_output_tokens(tiny_model: ModelConfig) -> None:
    """A real core: its context (the tiny model's 512 positions) holds the prompt and the output.
    The tiny vocabulary's longest token is 5 bytes (the text of "<unk>")."""
    async with tiny_gpu_gateway(tiny_model) as (server, config), aiohttp.ClientSession(server.url) as http:
        model = config.routing.gpu_model
        spy = Spy(server.app[STATE].engines["gpu"].tokenizer)
        status, body = await chat(http, "a" * 2000, model, max_tokens=400)  # >= 400 tokens, + 400 > 512
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert "at least" in body["error"]["message"] and spy.calls == 0
        status, body = await chat(http, "a" * 200, model, max_tokens=400)  # within the bound (>= 44 tokens)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"  # the tier's own check
        assert spy.calls > 0
        status, body = await chat(http, "a" * 200, model, max_tokens=8)
        assert status == 200 and body["usage"]["completion_tokens"] > 0
