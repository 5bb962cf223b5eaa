"""The frame gate (gateway/ws/frame_gate.py): large frames within a server-wide budget, the rest
dropped with an error event while the session goes on; small frames as before, whatever the reads.

The gate's own tests feed it bytes the way a socket would (any split) and look at what reaches
the parser behind it; the server's tests send real frames to a real gateway."""

import asyncio
import json
import struct

import websockets
from gateway_harness import MODEL, recv_json, recv_until, running_gateway, send, user_item
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.ws.frame_gate import FrameGate, LargeFrameBudget, Passed, Refused

SMALL, CAP = 100, 1000


def frame(payload: bytes, opcode: int = 0x1, *, fin: bool = True, mask: bytes = b"\x01\x02\x03\x04") -> bytes:
    """One client frame (masked, as clients must; a large one with the zero key, which leaves it as it is)."""
    head = bytes([(0x80 if fin else 0) | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    if n >= 4096:
        return head + b"\0\0\0\0" + payload
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + mask + masked


class Recorder:
    """Stands for aiohttp's parser: keeps what it is fed."""

    def __init__(self) -> None:
        self.data = bytearray()

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.data += data
        return False, b""

    def feed_eof(self) -> None:
        pass


def gate(budget: int = 1500) -> tuple[FrameGate, Recorder, LargeFrameBudget]:
    inner, pool = Recorder(), LargeFrameBudget(budget)
    return FrameGate(inner, pool, small=SMALL, cap=CAP), inner, pool


def test_small_frames_pass_untouched() -> None:
    g, inner, pool = gate()
    stream = frame(b"a" * 10) + frame(b"b" * SMALL) + frame(b"", opcode=0x9)
    assert g.feed_data(stream) == (False, b"")
    assert bytes(inner.data) == stream
    assert list(g.messages) == [Passed(0), Passed(0)] and pool.in_flight == 0


def test_a_large_frame_holds_budget_until_handled() -> None:
    g, inner, pool = gate()
    big = frame(b"x" * 600)
    g.feed_data(big)
    assert bytes(inner.data) == big and pool.in_flight == 600
    assert g.delivered() == 600
    g.handled()
    assert pool.in_flight == 0 and not g.messages


def test_over_the_budget_a_large_frame_is_dropped_and_the_next_one_passes() -> None:
    g, inner, pool = gate(budget=1000)
    refused: list[int] = []
    g.on_refused = lambda: refused.append(1)
    first, second, after = frame(b"x" * 600), frame(b"y" * 600), frame(b"z" * 5)
    g.feed_data(first + second + after)
    assert bytes(inner.data) == first + after  # the second never reaches the parser
    assert pool.in_flight == 600 and refused == [1]
    assert [type(m) for m in g.messages] == [Passed, Refused, Passed]
    assert g.refusals() == []  # not due: the first message is still to be handled
    g.handled()
    (refusal,) = g.refusals()
    assert refusal.code == "large_frames_busy" and "send it again" in refusal.message
    assert g.delivered() == 0 and pool.in_flight == 0


def test_a_frame_over_the_cap_is_dropped_whatever_the_budget() -> None:
    g, inner, pool = gate(budget=10_000)
    g.feed_data(frame(b"x" * (CAP + 1)) + frame(b"ok"))
    assert bytes(inner.data) == frame(b"ok")
    assert g.refusals()[0].code == "frame_too_large" and pool.in_flight == 0


def test_fragments_are_held_until_small_or_large_is_known() -> None:
    g, inner, _ = gate()
    parts = frame(b"a" * 40, fin=False) + frame(b"b" * 40, opcode=0x0, fin=False)
    g.feed_data(parts)
    assert inner.data == b""  # 80 bytes so far: could still be a small message
    ping = frame(b"p", opcode=0x9)
    g.feed_data(ping)
    assert bytes(inner.data) == ping  # control frames are not held
    last = frame(b"c" * 10, opcode=0x0)
    g.feed_data(last)
    assert bytes(inner.data) == ping + parts + last and list(g.messages) == [Passed(0)]

    g2, inner2, pool2 = gate()
    g2.feed_data(parts + frame(b"c" * 50, opcode=0x0, fin=False))  # past SMALL: takes the cap
    assert pool2.in_flight == CAP and len(inner2.data) > 0
    g2.feed_data(frame(b"d", opcode=0x0))
    assert list(g2.messages) == [Passed(CAP)]
    g2.close()
    assert pool2.in_flight == 0


def test_close_gives_back_what_a_connection_held() -> None:
    g, _, pool = gate(budget=5000)
    g.feed_data(frame(b"x" * 600) + frame(b"y" * 500)[:300])  # one whole, one under way
    assert pool.in_flight == 1100
    g.close()
    assert pool.in_flight == 0


messages = st.lists(st.tuples(st.sampled_from(["small", "large", "huge", "fragmented", "ping"]),
                              st.integers(0, 3)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(messages, st.lists(st.integers(1, 400), min_size=1, max_size=30), st.integers(0, 2500))
def test_any_split_of_the_stream_routes_the_same(kinds: list[tuple[str, int]], cuts: list[int], budget: int) -> None:
    stream = b""
    for kind, n in kinds:
        if kind == "small":
            stream += frame(b"s" * (10 * n))
        elif kind == "large":
            stream += frame(b"l" * (SMALL + 200 * n + 1), opcode=0x2)
        elif kind == "huge":
            stream += frame(b"h" * (CAP + n + 1))
        elif kind == "fragmented":
            stream += frame(b"f" * 60, fin=False) + frame(b"p", opcode=0xA) + frame(b"g" * (60 * n), opcode=0x0)
        else:
            stream += frame(b"", opcode=0x9)
    whole, whole_inner, _ = gate(budget)
    whole.feed_data(stream)
    split, split_inner, _ = gate(budget)
    pos, i = 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        split.feed_data(stream[pos:pos + step])
        pos, i = pos + step, i + 1
    assert bytes(split_inner.data) == bytes(whole_inner.data)
    assert list(split.messages) == list(whole.messages)
    assert len(whole.messages) == sum(kind != "ping" for kind, _ in kinds)


# ----- over a real gateway --------------------------------------------------------------------


async def test_a_large_frame_that_is_not_an_append_is_refused_and_the_session_goes_on() -> None:
    async with running_gateway(max_frame_bytes=4096) as gw, websockets.connect(gw.ws_url) as ws:
        await recv_json(ws)
        await send(ws, user_item("x" * 3000))  # under the limit: fine
        assert (await recv_json(ws))["type"] == "conversation.item.added"
        await recv_until(ws, "conversation.item.done")
        await send(ws, user_item("x" * 5000))
        error = await recv_json(ws)
        assert error["type"] == "error" and error["error"]["code"] == "frame_too_large"
        assert "input_audio_buffer.append" in error["error"]["message"]
        await send(ws, {"type": "response.create"})
        done = (await recv_until(ws, "response.done"))[-1]
        assert done["response"]["status"] == "completed"
        assert gw.state.large_frames.in_flight == 0


async def test_frames_over_the_budget_or_the_cap_are_refused_in_order() -> None:
    async with running_gateway(max_frame_bytes=4096, max_large_frame_bytes=64 * 1024,
                               large_frames_budget_bytes=8192) as gw, websockets.connect(gw.ws_url) as ws:
        await recv_json(ws)
        await send(ws, {"type": "input_audio_buffer.append", "event_id": "too-big", "audio": "AAAA" * 20_000})
        await send(ws, {"type": "input_audio_buffer.append", "audio": "AAAA" * 5_000})  # 20 kB > the 8 kB budget
        await send(ws, user_item("after"))
        first, second, added = await recv_json(ws), await recv_json(ws), await recv_json(ws)
        assert first["error"]["code"] == "frame_too_large"
        assert second["error"]["code"] == "large_frames_busy"
        assert added["type"] == "conversation.item.added"
        assert gw.state.large_frames.in_flight == 0


async def test_fragments_past_the_cap_close_with_1009() -> None:
    async with running_gateway(max_frame_bytes=4096, max_large_frame_bytes=16 * 1024) as gw:
        async with websockets.connect(gw.ws_url, max_size=None) as ws:
            await recv_json(ws)
            head = '{"type": "input_audio_buffer.append", "audio": "'
            await ws.send(piece for piece in [head, "A" * 8192, "A" * 8192, "A" * 8192, '"}'])
            await ws.wait_closed()
            assert ws.close_code == 1009
        assert gw.state.large_frames.in_flight == 0


async def test_frames_sent_with_the_handshake_go_through_the_gate() -> None:
    """A client that does not wait for the 101 before its first frames: those bytes reach aiohttp
    with the handshake, and the gate must still see them from their first byte."""
    async with running_gateway(max_frame_bytes=4096, large_frames_budget_bytes=0) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        key = "dGhlIHNhbXBsZSBub25jZQ=="
        big = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA" * 2000}).encode()
        small = json.dumps(user_item("hello")).encode()
        writer.write((f"GET /v1/realtime?model={MODEL} HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                      ).encode() + frame(big) + frame(small))
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        kinds = []
        while len(kinds) < 3:
            head = await asyncio.wait_for(reader.readexactly(2), 10)
            n = head[1] & 0x7F
            if n == 126:
                n = struct.unpack("!H", await reader.readexactly(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", await reader.readexactly(8))[0]
            event = json.loads(await reader.readexactly(n))
            kinds.append(event.get("error", {}).get("code") or event["type"])
        assert kinds == ["session.created", "large_frames_busy", "conversation.item.added"]
        writer.close()


async def test_many_sessions_of_large_appends_hold_at_most_the_budget() -> None:
    """Every session sends a 15 MiB append at once: the server holds at most its budget of them
    (the others are told to send again), and a text session beside them is served."""
    budget = 48 * 2**20
    appends = 64
    async with running_gateway(large_frames_budget_bytes=budget, max_sessions_per_key=appends + 1) as gw:
        audio = "A" * (15 * 2**20)
        payload = json.dumps({"type": "input_audio_buffer.append", "audio": audio}).encode()
        del audio
        big = frame(payload)
        peak = 0

        async def flood() -> str:
            async with websockets.connect(gw.ws_url, max_size=None) as ws:
                await recv_json(ws, timeout=30)
                ws.transport.write(big)
                event = await recv_json(ws, timeout=120)
                return event.get("error", {}).get("code") or event["type"]

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, gw.state.large_frames.in_flight)
                await asyncio.sleep(0.005)

        async def healthy() -> int:
            async with websockets.connect(gw.ws_url) as ws:
                await recv_json(ws, timeout=30)
                turns = 0
                for _ in range(3):
                    await send(ws, user_item("hi"))
                    await send(ws, {"type": "response.create"})
                    done = (await recv_until(ws, "response.done", timeout=120))[-1]
                    turns += done["response"]["status"] == "completed"
                return turns

        watcher = asyncio.create_task(watch())
        codes, turns = await asyncio.gather(asyncio.gather(*(flood() for _ in range(appends))), healthy())
        watcher.cancel()
        assert turns == 3
        assert 0 < peak <= budget
        assert codes.count("large_frames_busy") >= appends - budget // len(payload) - 1
        assert set(codes) <= {"large_frames_busy", "invalid_json", "invalid_event", "unsupported_feature"}
        assert gw.state.large_frames.in_flight == 0
