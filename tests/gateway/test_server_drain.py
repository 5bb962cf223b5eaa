"""Draining a replica over a real loopback server: a response in progress finishes, then its
session closes with 1001 and a reconnect hint; idle sessions close at once; /readyz, new sessions
and new chat completions say 503 draining; a response that does not end in time is cancelled;
``serve()`` finishes even when a response never would."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import websockets
from fake_engine import FakeEngine
from gateway_harness import MODEL, make_config, recv_json, recv_until, running_gateway, send, sse_chunks, user_item
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.process import server as gateway_server
from gateway.process.drain import MAX_CLOSE_REASON_BYTES, jittered_hint, reconnect_hint
from llm_shared.contract import FinishEvent, StreamEvent

WAIT_S = 15.0  # generous: a busy 2-core machine


class HeldEngine(FakeEngine):
    """Streams its tokens at once, then holds each request's finish until ``release`` is set."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.release = asyncio.Event()

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[StreamEvent]:  # type: ignore[override]
        async for event in super().generate(*args, **kwargs):
            if isinstance(event, FinishEvent):
                await self.release.wait()
            yield event


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def endless_engine() -> FakeEngine:
    """A response that does not end by itself within any drain timeout a test uses."""
    return FakeEngine(tokens_per_second=20, reply=lambda p, s: [f"t{i} " for i in range(100_000)])


def hint_of(ws: websockets.ClientConnection, spread_ms: int) -> int:
    """The close was a drain's: 1001 with ``{"reconnect":true,"after_ms":N}``, N within the spread."""
    assert ws.close_code == 1001, (ws.close_code, ws.close_reason)
    hint = json.loads(ws.close_reason)
    assert hint["reconnect"] is True and set(hint) == {"reconnect", "after_ms"}
    assert isinstance(hint["after_ms"], int) and 0 <= hint["after_ms"] <= spread_ms
    return int(hint["after_ms"])


async def rest_until_closed(ws: websockets.ClientConnection) -> list[dict[str, Any]]:
    """Every event the server still sends, until it closes the connection."""
    events = []
    try:
        while True:
            events.append(await recv_json(ws, WAIT_S))
    except ConnectionClosed:
        return events


async def start_response(ws: websockets.ClientConnection, text: str = "hi") -> None:
    await recv_json(ws, WAIT_S)  # session.created
    await send(ws, user_item(text))
    await send(ws, {"type": "response.create"})
    await recv_until(ws, "response.output_text.delta", WAIT_S)


def test_the_hint_is_short_json_jittered_within_the_spread() -> None:
    assert reconnect_hint(1234) == '{"reconnect":true,"after_ms":1234}'
    assert len(reconnect_hint(600_000).encode()) <= MAX_CLOSE_REASON_BYTES
    rng = random.Random(7)
    draws = [json.loads(jittered_hint(5000, rng))["after_ms"] for _ in range(500)]
    assert all(0 <= d <= 5000 for d in draws)
    assert len(set(draws)) > 400 and min(draws) < 500 and max(draws) > 4500  # spread out, not bunched
    assert json.loads(jittered_hint(0))["after_ms"] == 0


async def test_drain_finishes_the_response_then_closes_with_a_reconnect_hint() -> None:
    engine = HeldEngine()
    spread = 250
    async with running_gateway(engine, drain_reconnect_spread_ms=spread, drain_timeout_s=60) as gw:
        busy = await websockets.connect(gw.ws_url)
        idle = await websockets.connect(gw.ws_url)
        await start_response(busy)
        await recv_json(idle, WAIT_S)
        draining = asyncio.create_task(gw.server.drain())

        # An idle session closes at once, with the hint.
        assert await rest_until_closed(idle) == []
        hint_of(idle, spread)

        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gw.http}/readyz") as ready:
                assert ready.status == 503 and ready.headers["Retry-After"] == "1"
                body = await ready.json()
                assert body["draining"] is True and body["status"] == "draining"
            async with http.post(f"{gw.http}/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as chat:
                assert chat.status == 503 and chat.headers["Retry-After"] == "1"
                assert (await chat.json())["error"]["code"] == "server_draining"
        with pytest.raises(InvalidStatus) as refused:
            await websockets.connect(gw.ws_url, open_timeout=WAIT_S)
        assert refused.value.response.status_code == 503
        assert refused.value.response.headers["Retry-After"] == "1"
        assert json.loads(refused.value.response.body)["error"]["code"] == "server_draining"

        assert not draining.done() and busy.close_code is None  # the response is still in progress
        engine.release.set()
        done = (await recv_until(busy, "response.done", WAIT_S))[-1]["response"]
        assert done["status"] == "completed"
        assert len(done["output"][0]["content"][0]["text"].split()) == 8  # every token of the answer
        after = await rest_until_closed(busy)
        assert [e["type"] for e in after] == ["rate_limits.updated"]  # nothing of a new response
        hint_of(busy, spread)
        await asyncio.wait_for(draining, WAIT_S)
        assert not gw.state.connections and engine.aborts == [] and engine.running == 0


async def test_drain_waits_for_a_streaming_chat_completion() -> None:
    engine = HeldEngine()
    async with running_gateway(engine, drain_timeout_s=60) as gw, aiohttp.ClientSession() as http:
        sse = await http.post(f"{gw.http}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert sse.status == 200
        await sse.content.readline()
        draining = asyncio.create_task(gw.server.drain())
        async with http.get(f"{gw.http}/readyz") as ready:
            assert ready.status == 503 and (await ready.json())["draining"] is True
        assert not draining.done()  # the completion is still running
        engine.release.set()
        body = (await asyncio.wait_for(sse.read(), WAIT_S)).decode()
        assert sse_chunks(body)[-1]["choices"][0]["finish_reason"] == "stop" and body.endswith("data: [DONE]\n\n")
        await asyncio.wait_for(draining, WAIT_S)
        assert engine.aborts == []


async def test_drain_timeout_cancels_a_response_that_does_not_finish() -> None:
    engine = endless_engine()
    async with running_gateway(engine, drain_timeout_s=0.5, drain_reconnect_spread_ms=100) as gw:
        ws = await websockets.connect(gw.ws_url)
        await start_response(ws)
        await asyncio.wait_for(gw.server.drain(), WAIT_S)
        events = await rest_until_closed(ws)
        done = next(e for e in events if e["type"] == "response.done")["response"]
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "server_shutdown"
        hint_of(ws, 100)
        assert engine.running == 0 and engine.blocks_in_use == 0
        await gw.wait_sessions_gone()


async def test_serve_finishes_even_when_a_response_would_never_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process path: ``serve`` drains on its stop event, then shuts down and closes the engines."""
    engine = endless_engine()

    async def fake_engines(config: object) -> dict[str, FakeEngine]:
        return {"edge": engine}

    monkeypatch.setattr(gateway_server, "load_engines", fake_engines)
    port = free_port()
    config = make_config(port=port, drain_timeout_s=0.5, shutdown_grace_s=1.0)
    stop = asyncio.Event()
    serving = asyncio.create_task(gateway_server.serve(config, stop=stop))
    url = f"ws://127.0.0.1:{port}/v1/realtime?model={MODEL}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    async with aiohttp.ClientSession() as http:
        while True:  # serve() opens the port, then sets the engines: wait until /readyz says so
            try:
                async with http.get(f"http://127.0.0.1:{port}/readyz") as ready:
                    if ready.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                pass
            assert loop.time() < deadline and not serving.done(), "serve() did not become ready"
            await asyncio.sleep(0.01)
    ws = await websockets.connect(url)
    await start_response(ws)
    stop.set()
    await asyncio.wait_for(serving, WAIT_S)
    events = await rest_until_closed(ws)
    assert [e["response"]["status_details"]["reason"] for e in events if e["type"] == "response.done"] == [
        "server_shutdown"]
    assert ws.close_code == 1001 and json.loads(ws.close_reason)["reconnect"] is True
    assert engine.closed and engine.running == 0
