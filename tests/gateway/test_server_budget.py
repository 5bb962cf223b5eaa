"""Token budgets are reserved when a generation is admitted, not charged after it ends, so a
burst of concurrent requests cannot spend more than the key's budget; and a key has a cap on
generations running at once, on both APIs."""

from __future__ import annotations

import asyncio

import aiohttp
import websockets
from fake_engine import FakeEngine
from gateway_harness import MODEL, recv_json, recv_until, running_gateway, send, user_item

KEY = "sk-budget-test"


def slow_engine() -> FakeEngine:
    return FakeEngine(tokens_per_second=50, reply=lambda p, s: [f"t{i} " for i in range(8)])


async def chat(http: aiohttp.ClientSession, max_tokens: int = 8) -> tuple[int, dict]:
    async with http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
            "model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}) as r:
        return r.status, await r.json()


async def test_a_concurrent_burst_respects_the_token_budget() -> None:
    async with running_gateway(slow_engine(), api_keys=(KEY,), tokens_per_minute=10,
                               requests_per_minute=1000) as gw, aiohttp.ClientSession(gw.http) as http:
        results = await asyncio.gather(*(chat(http) for _ in range(20)))
        ok = [body for status, body in results if status == 200]
        refused = [body for status, body in results if status == 429]
        assert len(ok) + len(refused) == 20 and refused
        assert all(b["error"]["code"] == "rate_limit_exceeded" and b["error"]["type"] == "tokens" for b in refused)
        spent = sum(b["usage"]["completion_tokens"] for b in ok)
        assert 0 < spent <= 10 + 1  # the budget, plus at most a token refilled during the test
        # Realtime turns draw on the same budget: now spent, a response fails with the same code.
        async with websockets.connect(gw.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            await recv_json(ws)
            await send(ws, user_item("hi"))
            await send(ws, {"type": "response.create", "response": {"max_output_tokens": 8}})
            done = (await recv_until(ws, "response.done", timeout=10))[-1]["response"]
            assert done["status"] == "failed"
            assert done["status_details"]["error"]["code"] == "rate_limit_exceeded"


async def test_unused_reservations_are_given_back() -> None:
    engine = FakeEngine(reply=lambda p, s: ["a ", "b "])  # 2 tokens, whatever max_tokens asks
    async with running_gateway(engine, api_keys=(KEY,), tokens_per_minute=100, requests_per_minute=1000) as gw, \
            aiohttp.ClientSession(gw.http) as http:
        for _ in range(10):  # 10 x max_tokens 60 would be 600 reserved; each gives back 58
            status, body = await chat(http, max_tokens=60)
            assert status == 200 and body["usage"]["completion_tokens"] == 2


async def test_a_key_has_a_cap_on_generations_running_at_once() -> None:
    engine = FakeEngine(tokens_per_second=20, reply=lambda p, s: [f"t{i} " for i in range(10)])
    async with running_gateway(engine, api_keys=(KEY,), max_concurrent_requests_per_key=2,
                               requests_per_minute=1000) as gw, aiohttp.ClientSession(gw.http) as http:
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, engine.running)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(chat(http, max_tokens=10) for _ in range(5)))
        watcher.cancel()
        statuses = sorted(status for status, _ in results)
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1
        assert all("generations running" in body["error"]["message"] for status, body in results if status == 429)
        assert peak == 2  # never more than the cap ran at once
        status, _ = await chat(http, max_tokens=10)  # once they ended, the key may run again
        assert status == 200
