"""Connection limits over a real loopback server: frame size, idle timeout, shutdown, slow readers."""

import asyncio
import json
import socket

import aiohttp
import websockets
from fake_engine import FakeEngine
from gateway_harness import MODEL, recv_json, recv_until, running_gateway, send, sse_chunks, user_item


async def test_invalid_utf8_text_frame_closes_with_1007() -> None:
    async with running_gateway() as gw:
        async with aiohttp.ClientSession() as http, http.ws_connect(gw.ws_url) as ws:
            await ws.receive_json()
            # aiohttp's client can put raw bytes in a text frame; websockets' cannot.
            await ws._writer.send_frame(b'{"type": "\xff"}', aiohttp.WSMsgType.TEXT)
            msg = await ws.receive()
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1007


async def test_idle_timeout_closes_with_a_reason() -> None:
    async with running_gateway(idle_timeout_s=0.3) as gw, websockets.connect(gw.ws_url) as ws:
        await recv_json(ws)
        await ws.wait_closed()
        assert ws.close_code == 1000 and "idle timeout" in ws.close_reason


async def test_a_client_that_stops_answering_pings_is_dropped() -> None:
    async with running_gateway(ping_interval_s=0.2, ping_timeout_s=0.2) as gw:
        ws = await websockets.connect(gw.ws_url, ping_interval=None)
        await recv_json(ws)
        assert len(gw.state.connections) == 1
        ws.transport.pause_reading()  # a frozen client: it never reads the pings, so never answers
        await gw.wait_sessions_gone()
        ws.transport.abort()


async def test_a_streaming_response_is_not_idle() -> None:
    engine = FakeEngine(tokens_per_second=20)  # 8 tokens: 0.4 s, longer than the idle timeout
    async with running_gateway(engine, idle_timeout_s=0.25) as gw, websockets.connect(gw.ws_url) as ws:
        await recv_json(ws)
        await send(ws, user_item("hi"))
        await send(ws, {"type": "response.create"})
        done = (await recv_until(ws, "response.done"))[-1]
        assert done["response"]["status"] == "completed"
        await ws.wait_closed()
        assert ws.close_code == 1000


async def test_conversation_limits_come_from_the_config() -> None:
    async with running_gateway(max_conversation_items=2) as gw, websockets.connect(gw.ws_url) as ws:
        await recv_json(ws)
        for _ in range(2):
            await send(ws, user_item("hi"))
            await recv_until(ws, "conversation.item.done")
        await send(ws, user_item("one too many"))
        error = await recv_json(ws)
        assert error["type"] == "error" and error["error"]["code"] == "conversation_limit_exceeded"


async def test_graceful_shutdown_ends_responses_and_closes_with_1001() -> None:
    engine = FakeEngine(tokens_per_second=100, reply=lambda p, s: ["tok "] * 1000)
    async with running_gateway(engine) as gw:
        ws = await websockets.connect(gw.ws_url)
        idle = await websockets.connect(gw.ws_url)
        await recv_json(ws)
        await recv_json(idle)
        await send(ws, user_item("hi"))
        await send(ws, {"type": "response.create"})
        await recv_until(ws, "response.output_text.delta")
        async with aiohttp.ClientSession() as http:
            sse = await http.post(f"{gw.http}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
            await sse.content.readline()
            await gw.server.stop()
            tail = (await sse.read()).decode()
        assert sse_chunks(tail)[-1]["error"]["code"] == "server_shutdown" and tail.endswith("data: [DONE]\n\n")
        events = await recv_until(ws, "response.done")
        done = events[-1]["response"]
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "server_shutdown"
        await ws.wait_closed()
        await idle.wait_closed()
        assert ws.close_code == 1001 and idle.close_code == 1001
        assert engine.running == 0 and engine.blocks_in_use == 0
        assert not gw.state.connections
        try:
            await websockets.connect(gw.ws_url, open_timeout=1)
            raise AssertionError("connected after shutdown")
        except OSError:
            pass  # the port is closed


async def slow_reader(url: str) -> websockets.ClientConnection:
    """A client whose socket has a tiny receive buffer and whose library stops reading after one
    queued frame: the server's writes back up quickly."""
    host, port = "127.0.0.1", int(url.split(":")[2].split("/")[0])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return await websockets.connect(url, sock=sock, max_queue=1, max_size=None)


async def test_slow_reader_gets_coalesced_deltas_then_a_cancel() -> None:
    word = "x" * 200 + " "
    engine = FakeEngine(reply=lambda p, s: [word] * 4000)  # instant tokens: ~800 KB of text
    # The cancelled message stays in the conversation (~200 KB of it); the chars limit is raised
    # so that the turn after it is about the session going on, not about the conversation's size.
    async with running_gateway(engine, send_queue_high=8, send_queue_limit=1024,
                               send_queue_max_bytes=64 * 1024, max_output_tokens=4096,
                               max_conversation_chars=2_000_000) as gw:
        ws = await slow_reader(gw.ws_url)
        await recv_json(ws)
        # A slow network path: without a small server send buffer, loopback TCP autotuning would
        # absorb megabytes in the kernel before the server ever saw backpressure.
        connection = next(iter(gw.state.connections))
        connection._ws._req.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        await send(ws, user_item("hi"))
        await send(ws, {"type": "response.create", "response": {"max_output_tokens": 4000}})
        await asyncio.wait_for(_until(lambda: engine.aborts), 10)  # the server gave up on this reader
        assert gw.state.metrics.coalesced._value.get() > 0
        events = await recv_until(ws, "response.done", timeout=10)
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert max(len(d) for d in deltas) > len(word)  # some deltas carry several tokens
        assert "".join(deltas) == word * (len("".join(deltas)) // len(word))  # nothing lost or reordered
        done = events[-1]["response"]
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_too_slow"
        assert len("".join(deltas)) < len(word) * 4000
        assert engine.blocks_in_use == 0
        await send(ws, {"type": "response.create"})  # the session itself goes on
        after = await recv_until(ws, "response.created")
        assert not [e for e in after if e["type"] == "response.output_text.delta"]  # nothing after done
        await ws.close()


async def _until(condition) -> None:
    # The server side has no event a test can await for "gave up"; poll the fake engine.
    while not condition():
        await asyncio.sleep(0.01)



async def test_a_retrieve_flood_is_bounded_in_bytes_and_a_client_that_never_reads_is_closed() -> None:
    """Replies to the client's own events count against the byte bound too: ~100 KB items
    retrieved over and over by a client that reads nothing pause its reader at half the bound,
    and the server closes it once it stays behind, holding no more than the bound meanwhile."""
    max_bytes = 1024 * 1024
    async with running_gateway(send_queue_high=10_000, send_queue_limit=20_000, send_queue_max_bytes=max_bytes,
                               slow_client_timeout_s=1.0, max_conversation_chars=200_000) as gw:
        ws = await slow_reader(gw.ws_url)
        await recv_json(ws)
        connection = next(iter(gw.state.connections))
        connection._ws._req.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        big = "y" * 100_000
        await send(ws, {"type": "conversation.item.create", "item": {
            "id": "big", "type": "message", "role": "user", "content": [{"type": "input_text", "text": big}]}})
        peak = 0
        sent = 0
        retrieve = json.dumps({"type": "conversation.item.retrieve", "item_id": "big"})
        while connection in gw.state.connections and sent < 2000:  # 200 MB of replies if nothing bounded them
            try:
                await asyncio.wait_for(ws.send(retrieve), 0.5)
            except TimeoutError:
                break  # our own socket is full too: the server stopped reading us
            sent += 1
            peak = max(peak, connection.outbox.queued_bytes)
        for _ in range(600):  # the server closes the session after slow_client_timeout_s
            peak = max(peak, connection.outbox.queued_bytes)
            if connection not in gw.state.connections:
                break
            await asyncio.sleep(0.05)
        assert connection not in gw.state.connections, "the server kept a client that does not read"
        assert peak <= max_bytes // 2 + 2 * len(big) + 4096  # paused at half the bound, plus one reply
        cancels = gw.state.metrics.registry.get_sample_value(
            "gateway_cancels_total", {"api": "realtime", "reason": "client_too_slow"})
        assert cancels == 1
        ws.transport.abort()
