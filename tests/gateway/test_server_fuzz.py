"""Hostile input over a real connection: each frame yields an ``error`` event or a close with the
right code, never a crash, and a healthy session on the same server keeps streaming meanwhile.

The server, the fuzzing client and the healthy session run on an event loop in a background
thread, so Hypothesis drives plain synchronous test functions.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import msgpack
import pytest
import websockets
from fake_engine import FakeEngine
from gateway_harness import recv_json, recv_until, running_gateway, send, user_item
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.ws.codec import MSGPACK_SUBPROTOCOL

MAX_FRAME = 16 * 1024
SETUP_TIMEOUT_S = 120.0
EVENT_TIMEOUT_S = 30.0  # one awaited server event; far above any healthy wait, even on a loaded machine  # harness start and stop: set-up and teardown never decide a test
EVENT_TYPES = ["session.update", "conversation.item.create", "conversation.item.delete",
               "conversation.item.retrieve", "conversation.item.truncate", "response.create", "response.cancel",
               "input_audio_buffer.append", "nonsense.event", ""]
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
event_fields = ["event_id", "item", "item_id", "content_index", "x_text_end", "response", "response_id", "session",
                "previous_item_id", "instructions", "max_output_tokens", "temperature", "metadata"]
events = st.fixed_dictionaries(
    {"type": st.sampled_from(EVENT_TYPES) | st.text(max_size=20)},
    optional={name: json_values for name in event_fields},
)


class Harness:
    """A gateway plus one fuzzing connection per encoding, driven from the test thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sockets: dict[str, websockets.ClientConnection] = {}
        self.closes: list[int] = []

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        # Generous: a busy 2-core machine (a benchmark beside the suite) can stall the loop for seconds.
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start(self) -> None:
        self._gateway_cm = running_gateway(FakeEngine(tokens_per_second=400), max_frame_bytes=MAX_FRAME)
        self.gw = await self._gateway_cm.__aenter__()
        self.healthy = asyncio.ensure_future(self._healthy_session())
        self.healthy_turns = 0

    async def stop(self) -> None:
        self.healthy.cancel()
        # Its outcome (a failure included) was already judged by the last test of the module.
        await asyncio.gather(self.healthy, return_exceptions=True)
        for ws in self.sockets.values():
            await ws.close()
        await self._gateway_cm.__aexit__(None, None, None)

    async def _healthy_session(self) -> None:
        async with websockets.connect(self.gw.ws_url) as ws:
            await recv_json(ws)
            while True:
                await send(ws, user_item("are you still there?"))
                await send(ws, {"type": "response.create"})
                # Generous: on a busy 2-core machine a turn can wait seconds for the event loop;
                # the test is that turns keep completing, not how fast.
                done = (await recv_until(ws, "response.done", timeout=EVENT_TIMEOUT_S))[-1]["response"]
                assert done["status"] == "completed", done
                self.healthy_turns += 1

    async def _socket(self, encoding: str) -> websockets.ClientConnection:
        ws = self.sockets.get(encoding)
        if ws is None or ws.close_code is not None:
            protocols = [MSGPACK_SUBPROTOCOL] if encoding == "msgpack" else None
            ws = await websockets.connect(self.gw.ws_url, subprotocols=protocols, max_size=None)
            created = await ws.recv()
            assert (msgpack.unpackb(created) if encoding == "msgpack" else json.loads(created))["type"] == \
                "session.created"
            self.sockets[encoding] = ws
        return ws

    async def exchange(self, encoding: str, frame: str | bytes) -> list[dict[str, Any]] | int:
        """Send one frame; return the events it caused, or the close code if the server closed.
        A ``conversation.item.retrieve`` marker after it tells where its events end."""
        ws = await self._socket(encoding)
        marker = {"type": "conversation.item.retrieve", "item_id": "no-such-item", "event_id": "marker"}
        try:
            await ws.send(frame)
            await ws.send(msgpack.packb(marker) if encoding == "msgpack" else json.dumps(marker))
            events = []
            while True:
                data = await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S)
                event = msgpack.unpackb(data) if isinstance(data, bytes) else json.loads(data)
                if event["type"] == "error" and event["error"].get("event_id") == "marker":
                    return events
                events.append(event)
        except websockets.ConnectionClosed:
            await ws.wait_closed()
            self.closes.append(ws.close_code)
            return ws.close_code


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    h = Harness(loop)
    h.run(h.start(), timeout=SETUP_TIMEOUT_S)
    try:
        yield h
    finally:
        h.run(h.stop(), timeout=SETUP_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(SETUP_TIMEOUT_S)
        loop.close()


def check(result: list[dict[str, Any]] | int) -> None:
    if isinstance(result, int):
        assert result in (1007, 1009), f"unexpected close code {result}"
        return
    # A fuzzed event is either refused with an error, or a valid event with its normal answer.
    for event in result:
        assert isinstance(event.get("type"), str)
        if event["type"] == "error":
            assert event["error"]["code"] != "server_error", event  # never an internal failure
            assert event["error"]["message"]


@FUZZ
@given(text=st.text(max_size=300))
def test_random_text_frames(harness: Harness, text: str) -> None:
    check(harness.run(harness.exchange("json", text)))


@FUZZ
@given(event=events)
def test_random_event_objects_json(harness: Harness, event: dict[str, Any]) -> None:
    result = harness.run(harness.exchange("json", json.dumps(event)))
    check(result)
    if event["type"] not in EVENT_TYPES[:7]:
        assert_one_error(result)


def assert_one_error(result: list[dict[str, Any]] | int) -> None:
    """Exactly one error; other events can only be late ones of an earlier example's response
    (a slow machine delivers them after the next frame was sent)."""
    assert isinstance(result, list) and [e["type"] for e in result if e["type"] == "error"] == ["error"]
    assert all(e["type"].startswith(("response.", "rate_limits.", "conversation.item.")) for e in result
               if e["type"] != "error")


@FUZZ
@given(event=events)
def test_random_event_objects_msgpack(harness: Harness, event: dict[str, Any]) -> None:
    check(harness.run(harness.exchange("msgpack", msgpack.packb(event))))


@FUZZ
@given(data=st.binary(max_size=400))
def test_binary_garbage(harness: Harness, data: bytes) -> None:
    for encoding in ("json", "msgpack"):
        result = harness.run(harness.exchange(encoding, data))
        check(result)
        assert_one_error(result)


def nested_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("frame", [
    b"\x91" * 10_000 + b"\xc0",
    b"\xdd\xff\xff\xff\xff",
    b"\xdb\x7f\xff\xff\xff" + b"a" * 100,
    msgpack.packb({"type": "response.create", "response": {"metadata": {"k": nested_list(40)}}}),
    msgpack.packb({"type": "x", "a": list(range(5000))}),
    b"\xd6\xff\x00\x00\x00\x00",  # the timestamp ext type
])
def test_msgpack_bombs(harness: Harness, frame: bytes) -> None:
    result = harness.run(harness.exchange("msgpack", frame))
    assert isinstance(result, list) and [e["type"] for e in result] == ["error"]


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_oversized_frames_are_refused_and_the_session_goes_on(harness: Harness, encoding: str) -> None:
    """Over ``max_frame_bytes`` only an append is taken (within the server's large-frame budget):
    anything else is an error event, not a close (issue 41)."""
    event = user_item("x" * (MAX_FRAME + 1))
    frame = msgpack.packb(event) if encoding == "msgpack" else json.dumps(event)
    result = harness.run(harness.exchange(encoding, frame))
    assert isinstance(result, list) and [e["error"]["code"] for e in result if e["type"] == "error"] == [
        "frame_too_large"]


def test_the_healthy_session_kept_streaming(harness: Harness) -> None:
    """Runs last in this module: the concurrent well-behaved session never saw a failure."""
    assert not harness.healthy.done(), harness.healthy.exception() if harness.healthy.done() else None
    assert harness.healthy_turns >= 3, f"only {harness.healthy_turns} healthy turns completed during the fuzzing"
