"""The Python SDK and a draining gateway: a close with 1001 and ``{"reconnect":true,"after_ms":N}``
makes the client reconnect by itself after N ms and restore the conversation, with no error and
no on-device fallback. First against a scripted server (the hint's parsing, a turn the drained
session never took), then against real gateway processes sent SIGTERM (the embedded model)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from gateway_process import GatewayProcess, write_config
from rtgw import Backoff, OfflineConfig, RealtimeClient
from rtgw.protocol import reconnect_hint
from scripted_gateway import HINT, ScriptedGateway
from websockets.asyncio.server import serve

KEY = "sk-sdk-drain-key"
WAIT_S = 30.0


def test_the_hint_is_read_from_a_1001_close_and_nothing_else() -> None:
    assert reconnect_hint(1001, HINT % 1234) == 1234
    assert reconnect_hint(1001, '{"reconnect":true}') == 0
    assert reconnect_hint(1001, '{"reconnect":true,"after_ms":1e12}') == 60_000  # held to a minute
    assert reconnect_hint(1001, '{"reconnect":true,"after_ms":-3}') == 0
    assert reconnect_hint(1001, '{"reconnect":true,"after_ms":NaN}') == 0
    for code, reason in ((1001, "server shutting down"), (1001, '{"reconnect":false}'), (1001, "[1]"),
                         (1001, ""), (1000, HINT % 5), (None, HINT % 5)):
        assert reconnect_hint(code, reason) is None, (code, reason)


async def test_a_turn_the_drained_session_never_took_starts_on_the_next_one(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rtgw")
    script = ScriptedGateway(drain_on_create=HINT % 20)
    async with serve(script.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with RealtimeClient(f"http://127.0.0.1:{port}", request_timeout=WAIT_S, silence_timeout=WAIT_S,
                                  backoff=Backoff(initial=0.01, attempts=3)) as c:
            turn = await c.send("Hi", max_output_tokens=9)
            result = await asyncio.wait_for(turn.result(), WAIT_S)
            assert (result.status, result.text, result.error) == ("completed", "Hello!", None)
            assert c.reconnects == 1 and c.online
            user = c.conversation[0]
            first, second = script.received
            assert [e["type"] for e in first] == ["conversation.item.create", "response.create"]
            # the new session: the conversation restored (the user item, same id), then the request again
            assert [e["type"] for e in second] == ["conversation.item.create", "response.create"]
            assert second[0]["item"]["id"] == user.id and second[1]["response"] == {"max_output_tokens": 9}
            assert [(i.role, i.text) for i in c.conversation] == [("user", "Hi"), ("assistant", "Hello!")]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "reconnecting in 20 ms" in caplog.text


async def test_a_1001_without_the_hint_keeps_the_old_behaviour() -> None:
    script = ScriptedGateway(drain_on_create="server shutting down")
    async with serve(script.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with RealtimeClient(f"http://127.0.0.1:{port}", request_timeout=WAIT_S,
                                  backoff=Backoff(initial=0.01, attempts=3)) as c:
            result = await asyncio.wait_for((await c.send("Hi")).result(), WAIT_S)
            assert result.status == "failed" and result.error and result.error["code"] == "connection_lost"
            assert not await c.wait_reconnected()  # nothing under way: the next operation reconnects
            assert c.reconnects == 0 and len(script.received) == 1


# --- against real gateway processes ---------------------------------------------------------

SPREAD_MS = 300
DRAIN_TIMEOUT_S = 600  # a turn on a busy shared 2-core machine can take minutes; the drain must not cut it
LONG = "Write a long story about a lighthouse keeper and a storm, with many details."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    directory = tmp_path_factory.mktemp("sdk-drain-gateway")
    config = write_config(directory, api_keys=(KEY,), server={"drain_reconnect_spread_ms": SPREAD_MS,
                                                               "drain_timeout_s": DRAIN_TIMEOUT_S})
    process = GatewayProcess(config, directory / "gateway.log")
    process.start()
    try:
        yield process
    finally:
        process.stop()


def drained_client(gateway: GatewayProcess) -> RealtimeClient:
    """With an on-device fallback configured, to show it is not what serves the turn after the
    drain, and a backoff long enough to outlast the next gateway's start."""
    return RealtimeClient(gateway.url, api_key=KEY, connect_timeout=30, silence_timeout=120, request_timeout=30,
                          backoff=Backoff(initial=0.5, max_delay=2, attempts=150), retry_online_s=0.0,
                          offline=OfflineConfig(max_output_tokens=8, temperature=0.0))


async def check_restored(c: RealtimeClient, before: list[tuple[str, str, str]]) -> None:
    for item_id, role, text in before:  # the new gateway holds the earlier turns, same ids and text
        restored = await c.retrieve_item(item_id)
        assert (restored.role, restored.text) == (role, text)


def no_warnings(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.name.startswith("rtgw") and r.levelno >= logging.WARNING], caplog.text


@pytest.mark.model
async def test_a_drained_gateway_hands_the_conversation_to_the_next_one(gateway: GatewayProcess,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rtgw")
    async with drained_client(gateway) as c:
        for text in ("My name is Ada. Please remember it.", "I live in Lisbon, by the river."):
            result = await (await c.send(text, max_output_tokens=16, temperature=0)).result()
            assert result.status in ("completed", "incomplete") and not result.offline, result.error
        before = [(i.id, i.role, i.text) for i in c.conversation]
        # SIGTERM: the gateway closes our idle session with the hint and exits; a fresh process
        # then starts on the same port, as another replica behind the same address would serve.
        await asyncio.to_thread(gateway.restart)
        assert await asyncio.wait_for(c.wait_reconnected(), 300)  # by itself: no operation asked for it
        assert c.reconnects == 1
        third = await (await c.send("What is my name, and where do I live?", max_output_tokens=16,
                                    temperature=0)).result()
        assert third.status in ("completed", "incomplete"), third.error
        assert not third.offline and third.tier == "edge"
        await check_restored(c, before)
        assert third.usage["input_tokens"] > 60  # the prompt carried the history, not just the question
    no_warnings(caplog)
    assert "the gateway is draining this session: reconnecting in" in caplog.text


@pytest.mark.model
async def test_a_turn_in_progress_finishes_before_the_drain_closes(gateway: GatewayProcess,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rtgw")
    async with drained_client(gateway) as c:
        turn = await c.send(LONG, max_output_tokens=48, temperature=0)
        async for _ in turn:  # streaming: now the gateway is told to go
            break
        gateway.terminate()
        result = await turn.result()
        assert result.status in ("completed", "incomplete") and result.error is None  # not cancelled, not lost
        assert result.usage["output_tokens"] > 1
        answered = [(i.id, i.role, i.text) for i in c.conversation]
        assert answered[-1] == (result.item_id, "assistant", result.text)
        await asyncio.to_thread(gateway.stop)  # waits for the exit
        await asyncio.to_thread(gateway.start)
        assert await asyncio.wait_for(c.wait_reconnected(), 300)
        follow = await (await c.send("Thanks.", max_output_tokens=8, temperature=0)).result()
        assert follow.status in ("completed", "incomplete") and not follow.offline, follow.error
        await check_restored(c, answered)
    no_warnings(caplog)

