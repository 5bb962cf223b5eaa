"""The HTTP API on a real loopback server: the openai SDK for chat completions, aiohttp for the rest."""

import asyncio
import json

import aiohttp
import openai
import pytest
from fake_engine import FakeEngine, FakeTokenizer, default_reply
from gateway_harness import MODEL, make_config, running_gateway
from openai import AsyncOpenAI

from gateway.process.server import create_app, start_server
from llm_shared.contract import Priority, SamplingParams

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def expected(messages: list[dict[str, str]], n: int = 8) -> str:
    return "".join(default_reply(FakeTokenizer().encode_chat(messages), SamplingParams())[:n])


async def test_health_readiness_and_models() -> None:
    engine = FakeEngine()
    async with running_gateway(engine) as gw, aiohttp.ClientSession(gw.http) as http:
        assert (await http.get("/healthz")).status == 200
        ready = await http.get("/readyz")
        assert ready.status == 200 and (await ready.json())["tiers"] == {"edge": True}
        engine.is_ready = False  # e.g. the engine process died
        down = await http.get("/readyz")
        assert down.status == 503 and (await down.json())["status"] == "engine_down"
        engine.is_ready = True
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused")
        assert [m.id for m in (await client.models.list()).data] == [MODEL]
        assert (await client.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-9")


async def test_not_ready_while_the_engines_load() -> None:
    app = create_app(make_config())  # no engines yet: serve() loads them after the port opens
    server = await start_server(app)
    try:
        async with aiohttp.ClientSession(server.url) as http:
            assert (await http.get("/healthz")).status == 200
            ready = await http.get("/readyz")
            assert ready.status == 503 and (await ready.json())["status"] == "loading"
            chat = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
            assert chat.status == 503 and (await chat.json())["error"]["code"] == "engine_unavailable"
            ws = await http.get("/v1/realtime", headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                                         "Sec-WebSocket-Version": "13",
                                                         "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
            assert ws.status == 503
    finally:
        await server.stop()


async def test_chat_completion_non_streaming_via_sdk() -> None:
    async with running_gateway() as gw:
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused")
        first = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=7, stop=["zzz"])
        assert first.object == "chat.completion"
        assert first.choices[0].message.content == expected(MESSAGES)
        assert first.choices[0].finish_reason == "stop"
        assert first.usage.completion_tokens == 8
        assert first.usage.prompt_tokens == len(FakeTokenizer().encode_chat(MESSAGES))
        again = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
        assert again.choices[0].finish_reason == "length"
        assert again.choices[0].message.content == expected(MESSAGES, 3)
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # same prompt: the fake's prefix cache hit
        assert gw.engine.started[0][1] == Priority.INTERACTIVE
        assert gw.engine.blocks_in_use == 0 and gw.engine.running == 0


async def test_chat_completion_streaming_via_sdk() -> None:
    async with running_gateway() as gw:
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused")
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected(MESSAGES)
        assert chunks[-2].choices[0].finish_reason == "stop"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
        assert all(c.usage is None for c in chunks[:-1])
        plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        assert all(c.usage is None for c in [c async for c in plain])


async def test_logprobs_shape() -> None:
    async with running_gateway() as gw:
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused")
        result = await client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                                      max_tokens=2)
        content = result.choices[0].logprobs.content
        assert len(content) == 2 and content[0].logprob == -0.5 and len(content[0].top_logprobs) == 2
        assert bytes(content[0].bytes).decode() == content[0].token


async def test_sse_wire_format_ends_with_done() -> None:
    async with running_gateway() as gw, aiohttp.ClientSession(gw.http) as http:
        async with http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                            "stream": True}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            body = (await resp.read()).decode()
        frames = [f for f in body.split("\n\n") if f]
        assert all(f.startswith("data: ") for f in frames)
        assert frames[-1] == "data: [DONE]"


async def test_priorities_batch_and_flex() -> None:
    async with running_gateway() as gw:
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused")
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"priority": "batch"})
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, service_tier="flex")
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, service_tier="auto")
        assert [p for _, p in gw.engine.started] == [Priority.BATCH, Priority.BATCH, Priority.INTERACTIVE]


@pytest.mark.parametrize("changes, status, code, param", [
    ({"model": "gpt-9"}, 404, "model_not_found", "model"),
    ({"n": 2}, 400, "invalid_value", "n"),
    ({"temperature": 3}, 400, "invalid_sampling_params", "temperature"),
    ({"temperature": "hot"}, 400, "invalid_type", "temperature"),
    ({"top_p": 0}, 400, "invalid_sampling_params", "top_p"),
    ({"max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ({"max_completion_tokens": 10**6}, 400, "invalid_value", "max_completion_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value", "stop"),
    ({"stop": 5}, 400, "invalid_type", "stop"),
    ({"seed": "x"}, 400, "invalid_type", "seed"),
    ({"top_logprobs": 2}, 400, "invalid_value", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "invalid_value", "top_logprobs"),
    ({"messages": []}, 400, "invalid_type", "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "invalid_value",
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, {
        "type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, 400, "unsupported_content",
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": "UklGRg==", "format": "wav"}}]}]}, 400, "unsupported_content", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "invalid_value",
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, 400, "invalid_value", "messages[0]"),
    ({"stream_options": {"include_usage": True}}, 400, "invalid_value", "stream_options"),
    ({"tools": [{"type": "function"}]}, 400, "invalid_request", "tools[0].function"),
    ({"functions": [{"name": "f"}]}, 400, "unsupported_parameter", "functions"),
    ({"tool_choice": "required"}, 400, "invalid_request", "tool_choice"),
    ({"frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
    ({"service_tier": "gold"}, 400, "invalid_value", "service_tier"),
    ({"priority": "urgent"}, 400, "invalid_value", "priority"),
])
async def test_body_validation(changes: dict, status: int, code: str, param: str) -> None:
    async with running_gateway() as gw, aiohttp.ClientSession(gw.http) as http:
        resp = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **changes})
        assert resp.status == status
        error = (await resp.json())["error"]
        assert (error["code"], error["param"]) == (code, param)
        assert error["message"] and error["type"]
        assert gw.engine.started == []


@pytest.mark.parametrize("body", [b"{not json", b"[1,2]", b'{"model": NaN}', b"\xff\xfe"])
async def test_malformed_bodies(body: bytes) -> None:
    async with running_gateway() as gw, aiohttp.ClientSession(gw.http) as http:
        resp = await http.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] in ("invalid_json", "invalid_type")


async def test_stream_client_disconnect_aborts_the_engine_request() -> None:
    engine = FakeEngine(tokens_per_second=50, reply=lambda p, s: ["tok "] * 500)
    async with running_gateway(engine) as gw:
        async with aiohttp.ClientSession(gw.http) as http:
            resp = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                  "stream": True})
            await resp.content.readline()  # the role chunk: the request is running
            assert engine.running == 1
            resp.close()  # drop the connection mid-stream
        await _wait_for(lambda: engine.running == 0)
        assert len(engine.aborts) == 1 and engine.blocks_in_use == 0
        assert not gw.state.http_requests


async def test_non_streaming_client_disconnect_aborts_the_engine_request() -> None:
    engine = FakeEngine(tokens_per_second=50, reply=lambda p, s: ["tok "] * 500)
    async with running_gateway(engine) as gw:
        async with aiohttp.ClientSession(gw.http) as http:
            async with engine.admitted:
                request = asyncio.ensure_future(http.post("/v1/chat/completions",
                                                          json={"model": MODEL, "messages": MESSAGES}))
                await engine.admitted.wait()
            request.cancel()  # the client gives up and closes its connection
            with pytest.raises(asyncio.CancelledError):
                await request
        await _wait_for(lambda: engine.running == 0)
        assert len(engine.aborts) == 1 and engine.blocks_in_use == 0


async def test_metrics_exposition() -> None:
    async with running_gateway() as gw, aiohttp.ClientSession(gw.http) as http:
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused")
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        resp = await http.get("/metrics")
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert samples['engine_kv_blocks_in_use{tier="edge"}'] == 0
    assert samples['engine_kv_blocks_total{tier="edge"}'] == 4096
    assert samples['engine_running_requests{tier="edge"}'] == 0
    assert 'engine_prefix_cache_hits{tier="edge"}' in samples
    assert samples['engine_ready{tier="edge"}'] == 1
    assert samples['gateway_ttft_seconds_count{api="chat"}'] == 1
    assert samples['gateway_inter_token_latency_seconds_count{api="chat"}'] == 7
    assert samples['gateway_output_tokens_total{api="chat"}'] == 8
    assert samples['gateway_requests_total{api="chat",tier="edge"}'] == 1
    assert "gateway_sessions_active" in samples


async def test_two_apps_in_one_process_have_separate_metrics() -> None:
    async with running_gateway() as a, running_gateway() as b:
        client = AsyncOpenAI(base_url=f"{a.http}/v1", api_key="unused")
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert a.state.metrics.token_series("chat").tokens == 8
        assert b.state.metrics.token_series("chat").tokens == 0


async def test_request_body_too_large_is_413() -> None:
    async with running_gateway(max_conversation_chars=1000) as gw, aiohttp.ClientSession(gw.http) as http:
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
        resp = await http.post("/v1/chat/completions", data=big, headers={"Content-Type": "application/json"})
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"


async def _wait_for(condition, timeout: float = 5.0) -> None:
    """Server-side clean-up after a disconnect has no event the client can await; poll briefly."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)
