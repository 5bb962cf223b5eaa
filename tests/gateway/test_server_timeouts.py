"""Every wait on a peer has a timeout: an engine whose abort never returns still lets a cancel
end the response, the session go on, and graceful shutdown finish within its grace period."""

from __future__ import annotations

import asyncio
import time

import websockets
from fake_engine import FakeEngine
from gateway_harness import recv_json, recv_until, running_gateway, send, user_item


async def test_a_wedged_abort_still_ends_the_response_and_lets_shutdown_finish_in_time() -> None:
    engine = FakeEngine(tokens_per_second=20, reply=lambda p, s: [f"t{i} " for i in range(200)])
    grace = 2.0
    async with running_gateway(engine, engine_abort_timeout_s=0.3, shutdown_grace_s=grace) as gw:
        engine.abort_hangs = True
        ws = await websockets.connect(gw.ws_url)
        await recv_json(ws)
        await send(ws, user_item("hello"))
        await send(ws, {"type": "response.create"})
        await recv_until(ws, "response.output_text.delta", timeout=10)
        started = time.monotonic()
        await send(ws, {"type": "response.cancel"})
        done = (await recv_until(ws, "response.done", timeout=10))[-1]["response"]
        assert done["status"] == "cancelled" and time.monotonic() - started < 5
        await send(ws, {"type": "response.create"})  # the session is not frozen
        await recv_until(ws, "response.created", timeout=10)
        stopping = time.monotonic()
        await asyncio.wait_for(gw.server.stop(), grace + 10)
        # Shutdown waited for no abort: its share of the grace period, the teardown's own waits.
        assert time.monotonic() - stopping < grace + 8
        await ws.close()
