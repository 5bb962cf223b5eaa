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


async def test_an_sse_client_that_stops_reading_is_dropped_and_its_turn_aborted() -> None:
    import socket

    word = "z" * 20_000 + " "  # 4 MB/s of stream: the kernel's socket buffers fill within seconds
    engine = FakeEngine(tokens_per_second=200, reply=lambda p, s: [word] * 20_000)
    async with running_gateway(engine, sse_write_timeout_s=0.5, max_output_tokens=20_000) as gw:
        body = (b'{"model": "smollm2-135m-edge", "stream": true, "max_tokens": 20000, '
                b'"messages": [{"role": "user", "content": "go"}]}')
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", gw.port))
        await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Type: application/json\r\nContent-Length: "
                                      + str(len(body)).encode() + b"\r\n\r\n" + body)
        for _ in range(3000):  # never reading: the server gives up on us and aborts the turn
            if engine.aborts:
                break
            await asyncio.sleep(0.01)
        assert engine.aborts and engine.blocks_in_use == 0
        sock.close()


async def test_operator_endpoints_can_require_a_key() -> None:
    import aiohttp

    async with running_gateway(api_keys=("sk-operator",), operator_endpoints_need_key=True) as gw, \
            aiohttp.ClientSession(gw.http) as http:
        for path in ("/metrics", "/readyz"):
            assert (await http.get(path)).status == 401
            assert (await http.get(path, headers={"Authorization": "Bearer sk-operator"})).status == 200
        assert (await http.get("/healthz")).status == 200  # liveness stays open


async def test_metrics_need_the_api_key_by_default_when_keys_are_configured() -> None:
    """/metrics tells other tenants' load and costs the event loop per scrape: behind the key by
    default (issue 39, item 7); /readyz stays open for probes; metrics_need_key = false opens it."""
    import aiohttp

    async with running_gateway(api_keys=("sk-tenant",)) as gw, aiohttp.ClientSession(gw.http) as http:
        assert (await http.get("/metrics")).status == 401
        assert (await http.get("/metrics", headers={"Authorization": "Bearer sk-tenant"})).status == 200
        assert (await http.get("/readyz")).status == 200
    async with running_gateway(api_keys=("sk-tenant",), metrics_need_key=False) as gw, \
            aiohttp.ClientSession(gw.http) as http:
        assert (await http.get("/metrics")).status == 200
