"""The Python SDK's close() against a session being opened, by the user (connect, send) or by the
reconnect a draining gateway asked for: the call fails with ``ClientClosed``, what it opened is
closed again, ``wait_reconnected()`` says False, and no session outlives close(). A scripted
server holds the opening handshake, so that close() comes exactly while the client is in it."""

from __future__ import annotations

import asyncio

import pytest
from rtgw import Backoff, ClientClosed, RealtimeClient
from scripted_gateway import HINT, ScriptedGateway
from websockets.asyncio.server import Server, serve

WAIT_S = 30.0


def client(server: Server) -> RealtimeClient:
    port = server.sockets[0].getsockname()[1]
    return RealtimeClient(f"http://127.0.0.1:{port}", request_timeout=WAIT_S, silence_timeout=WAIT_S,
                          backoff=Backoff(initial=0.01, attempts=3))


@pytest.mark.parametrize("call", ["connect", "send"])
async def test_close_while_connecting_fails_the_call_and_leaves_no_session(call: str) -> None:
    script = ScriptedGateway(hold_handshake=1)
    async with serve(script.handler, "127.0.0.1", 0, process_request=script.process_request) as server:
        c = client(server)
        opening = asyncio.create_task(c.connect() if call == "connect" else c.send("Hi"))
        async with asyncio.timeout(WAIT_S):
            await script.held.wait()  # the client is in the opening handshake
            await c.close()
            script.release.set()  # the handshake completes after close() returned
            with pytest.raises(ClientClosed):
                await opening
            await script.connections[0].wait_closed()  # the client closed what it had opened
        assert not c.online and c.conversation == []
        await c.connect()  # asked again after close(): the client opens again
        assert c.online
        assert await asyncio.wait_for(c.ask("Hi"), WAIT_S) == "Hello!"
        await c.close()
        assert not c.online


async def drained_and_reconnecting(script: ScriptedGateway, c: RealtimeClient) -> None:
    """A turn the gateway drained the session on, untaken; then the client's own reconnect, held
    in the next handshake (the reconnect task holds the client's lock there)."""
    await c.connect()
    await c.send("Hi")
    await asyncio.wait_for(script.held.wait(), WAIT_S)


async def test_close_during_a_drain_reconnect_makes_wait_reconnected_return_false() -> None:
    script = ScriptedGateway(drain_on_create=HINT % 0, hold_handshake=2)
    async with serve(script.handler, "127.0.0.1", 0, process_request=script.process_request) as server:
        c = client(server)
        await drained_and_reconnecting(script, c)
        closing = asyncio.create_task(c.close())  # runs once we wait below: it cancels the reconnect
        async with asyncio.timeout(WAIT_S):
            assert await c.wait_reconnected() is False  # an answer, not a CancelledError
            await closing
            await script.connections[1].wait_closed()  # the reconnect's handshake was dropped
        assert not c.online and c.reconnects == 0
        script.release.set()


async def test_a_waiter_cancelled_in_wait_reconnected_leaves_the_reconnect_running() -> None:
    script = ScriptedGateway(drain_on_create=HINT % 0, hold_handshake=2)
    async with serve(script.handler, "127.0.0.1", 0, process_request=script.process_request) as server:
        c = client(server)
        await drained_and_reconnecting(script, c)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(c.wait_reconnected(), 0.05)  # its own cancel propagates
        script.release.set()
        async with asyncio.timeout(WAIT_S):
            assert await c.wait_reconnected() is True  # the reconnect went on and finished
        assert c.online and c.reconnects == 1
        await c.close()


async def test_a_connect_waiting_behind_a_drain_reconnect_fails_when_close_comes() -> None:
    script = ScriptedGateway(drain_on_create=HINT % 0, hold_handshake=2)
    async with serve(script.handler, "127.0.0.1", 0, process_request=script.process_request) as server:
        c = client(server)
        await drained_and_reconnecting(script, c)
        closing = asyncio.create_task(c.close())  # runs once connect() below waits for the lock
        async with asyncio.timeout(WAIT_S):
            with pytest.raises(ClientClosed):
                await c.connect()  # not a session opened after close() returned
            await closing
        assert not c.online and c.reconnects == 0 and len(script.connections) == 2
        script.release.set()
