"""Voice sessions are admitted, not assumed (issue 42): at most ``[voice] max_sessions`` sessions
use voice at once; the next one is told ``voice_sessions_full`` and may go on in text; a seat
comes back when its session ends."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import pytest
import websockets
from fake_engine import FakeEngine
from gateway_harness import recv_json, recv_until, send, user_item
from session_helpers import drain
from test_session_voice import HOOKS, QUIET, append, make, tone, types
from voice_serving import serve

from gateway.ws.voice_input import VoiceSeats
from gateway.ws.voice_service import GatewayVoice
from voice.config import VoiceConfig


def test_the_session_past_the_limit_is_refused_voice_and_goes_on_in_text() -> None:
    hooks = replace(HOOKS, seats=VoiceSeats(1))
    first, second = make(hooks=hooks), make(hooks=hooks)
    assert append(first, tone(100, QUIET)) == []  # takes the one seat
    (error,) = append(second, tone(100, QUIET))
    assert error["type"] == "error" and error["error"]["code"] == "voice_sessions_full"
    assert "at most 1 voice sessions" in error["error"]["message"]
    second.receive({"type": "session.update", "session": {"output_modalities": ["audio"]}})
    (error,) = drain(second)
    assert (error["error"]["code"], error["error"]["param"]) == ("voice_sessions_full", "session.output_modalities")
    second.receive({"type": "response.create", "response": {"output_modalities": ["audio"]}})
    assert drain(second)[0]["error"]["code"] == "voice_sessions_full"
    second.receive({"type": "session.update", "session": {"instructions": "Be brief."}})
    (updated,) = drain(second)
    assert updated["session"]["output_modalities"] == ["text"]  # the refused update changed nothing

    first.ended()
    assert append(second, tone(100, QUIET)) == []  # the seat came back
    assert hooks.seats is not None and hooks.seats.in_use == 1
    assert types(append(second, tone(100, QUIET))) == []  # the same session keeps its seat


@pytest.fixture(scope="module")
def voice() -> Iterator[GatewayVoice]:
    service = GatewayVoice(VoiceConfig(pool_threads=1, max_sessions=2))
    try:
        yield service
    finally:
        service.close()


async def seats_in_use(voice: GatewayVoice, want: int, timeout_s: float = 30.0) -> int:
    """The seats in use once they are ``want`` (a closed session's teardown gives its seat back
    after the close), or what they are after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while voice.seats.in_use != want and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return voice.seats.in_use


async def test_a_served_gateway_admits_its_voice_sessions_and_frees_a_seat_at_close(voice: GatewayVoice) -> None:
    async for served in serve(voice, FakeEngine()):
        url = f"{served.url.replace('http', 'ws')}/v1/realtime"
        silence = {"type": "input_audio_buffer.append", "audio": "AAAA" * 100}
        async with websockets.connect(url) as one, websockets.connect(url) as two, websockets.connect(url) as three:
            for ws in (one, two):
                await recv_json(ws)
                await send(ws, silence)
            await recv_json(three)
            assert await seats_in_use(voice, 2) == 2
            await send(three, silence)
            error = (await recv_until(three, "error"))[-1]["error"]
            assert error["code"] == "voice_sessions_full"
            await send(three, user_item("hi"))  # text goes on
            await send(three, {"type": "response.create"})
            assert (await recv_until(three, "response.done"))[-1]["response"]["status"] == "completed"
            await one.close()
            assert await seats_in_use(voice, 1) == 1
            await send(three, silence)  # takes the freed seat
            await send(three, {"type": "conversation.item.retrieve", "item_id": "none"})
            error = (await recv_until(three, "error"))[-1]["error"]
            assert error["code"] == "item_not_found"  # the append before it was taken without an error
            assert voice.seats.in_use == 2
        assert await seats_in_use(voice, 0) == 0
