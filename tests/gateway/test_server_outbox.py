"""The per-connection send queue: order kept, deltas merged only when behind, bounded size."""

import asyncio
import json

import msgpack
import pytest
import websockets
from gateway_harness import running_gateway

from gateway.ws.codec import MSGPACK_SUBPROTOCOL
from gateway.ws.outbox import Outbox
from gateway.ws.server_events import OtherEvent, TextDelta


def delta(text: str, item: str = "i1", content_index: int = 0) -> TextDelta:
    return TextDelta(type="response.output_text.delta", event_id=f"e-{text}", response_id="r1", item_id=item,
                     output_index=0, content_index=content_index, delta=text)


def other(kind: str, **fields: object) -> OtherEvent:
    return OtherEvent(type=kind, event_id=f"e-{kind}", fields=fields)


def make(high: int = 3, limit: int = 100, max_bytes: int = 1 << 20) -> Outbox:
    return Outbox(lambda event: json.dumps(event.to_wire()), high=high, limit=limit, max_bytes=max_bytes)


async def drain(box: Outbox) -> list[dict]:
    box.close()
    out = []
    while (frame := await box.get()) is not None:
        out.append(json.loads(frame))
    return out


async def test_below_high_nothing_is_merged() -> None:
    box = make(high=10)
    for t in "abc":
        box.put(delta(t))
    assert [e["delta"] for e in await drain(box)] == ["a", "b", "c"]
    assert box.coalesced == 0


async def test_above_high_consecutive_deltas_of_one_part_merge() -> None:
    box = make(high=2)
    box.put(other("response.created"))
    box.put(delta("a"))
    for t in "bcd":
        box.put(delta(t))
    box.put(delta("x", content_index=1))  # another part: not merged into the first
    box.put(delta("y", content_index=1))
    box.put(other("response.done"))
    box.put(delta("z", content_index=1))  # not consecutive with the earlier part-1 delta
    events = await drain(box)
    assert [(e["type"], e.get("delta")) for e in events] == [
        ("response.created", None),
        ("response.output_text.delta", "abcd"),
        ("response.output_text.delta", "xy"),
        ("response.done", None),
        ("response.output_text.delta", "z"),
    ]
    assert box.coalesced == 4


async def test_merging_does_not_touch_the_callers_dict() -> None:
    box = make(high=0 + 1)
    first = delta("a")
    box.put(first)
    box.put(delta("b"))
    assert first.to_wire()["delta"] == "a"


async def test_limits_by_count_and_bytes() -> None:
    box = make(high=2, limit=5)
    for i in range(4):
        box.put(other("t", i=i))
    assert not box.over_limit
    box.put(other("t"))
    assert box.over_limit
    small = make(high=2, limit=100, max_bytes=1000)
    small.put(other("x"))
    small.put(delta("a"))
    small.put(delta("b" * 1000))  # merged, but its bytes still count
    assert len(small) == 2 and small.over_limit
    await drain(small)
    assert small.queued_bytes == 0


async def test_wait_writable_blocks_above_high_until_drained() -> None:
    box = make(high=2)
    box.put(other("a"))
    box.put(other("b"))
    waiter = asyncio.ensure_future(box.wait_writable())
    await asyncio.sleep(0)
    assert not waiter.done()
    await box.get()
    await asyncio.wait_for(waiter, 1)


async def test_discard_drops_everything_and_ends_the_writer() -> None:
    box = make()
    box.put(other("a"))
    box.discard()
    assert await box.get() is None
    box.put(other("late"))
    assert len(box) == 0


class Socket:
    """A DirectWriter whose kernel buffer the test fills and empties."""

    def __init__(self) -> None:
        self.full = False
        self.gone = False
        self.writes: list[list[dict]] = []

    def writable(self) -> bool:
        return not self.full

    def write(self, frames: list) -> None:
        if self.gone:
            raise ConnectionResetError("peer gone")
        self.writes.append([json.loads(f) for f in frames])


def with_socket(high: int = 3) -> tuple[Outbox, Socket]:
    sock = Socket()
    box = Outbox(lambda event: json.dumps(event.to_wire()), high=high, limit=100, max_bytes=1 << 20, direct=sock)
    return box, sock


async def test_a_client_that_keeps_up_gets_each_pump_in_one_write_with_nothing_queued() -> None:
    box, sock = with_socket()
    box.put_all([other("response.created"), delta("a")])
    box.put_all([delta("b")])
    assert [[e.get("delta", e["type"]) for e in write] for write in sock.writes] == [["response.created", "a"], ["b"]]
    assert len(box) == 0 and box.queued_bytes == 0 and box.written_directly == 3


async def test_once_the_socket_backs_up_events_queue_in_order_until_the_queue_is_empty_again() -> None:
    box, sock = with_socket(high=2)
    box.put_all([delta("a")])
    sock.full = True
    box.put_all([delta("b")])
    box.put_all([delta("c"), delta("d")])  # behind: merged into one delta
    sock.full = False
    box.put_all([delta("e")])  # writable again, but frames are queued: it waits its turn (merged, still behind)
    assert [[e["delta"] for e in w] for w in sock.writes] == [["a"]]
    assert [e["delta"] for e in await drain(box)] == ["b", "cde"]


async def test_a_single_delta_goes_out_at_once_only_when_nothing_is_ahead_of_it() -> None:
    """``send_now``, a token's way out: written when the queue is empty and the socket takes it;
    refused (the caller queues it) while the socket is full or frames wait, so order is kept."""
    box, sock = with_socket(high=2)
    assert box.send_now(delta("a"))
    sock.full = True
    assert not box.send_now(delta("b"))
    box.put(delta("b"))
    sock.full = False
    assert not box.send_now(delta("c"))  # "b" is still queued: "c" must not overtake it
    box.put(delta("c"))
    assert [[e["delta"] for e in w] for w in sock.writes] == [["a"]] and box.written_directly == 1
    assert [e["delta"] for e in await drain(box)] == ["b", "c"]
    fresh, gone = with_socket()
    gone.gone = True
    assert fresh.send_now(delta("x")) and fresh.closed and gone.writes == []


async def test_a_peer_gone_mid_write_discards_the_queue() -> None:
    box, sock = with_socket()
    sock.gone = True
    box.put_all([delta("a")])
    assert box.closed and len(box) == 0
    box.put_all([delta("b")])
    assert sock.writes == [] and await box.get() is None


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
async def test_frames_of_every_length_reach_a_real_client_through_the_fast_lane(encoding: str) -> None:
    """The fast lane writes RFC 6455 frames itself: a 7-bit, a 16-bit and a 64-bit payload
    length (items of 10, 1,000 and 100,000 characters, retrieved) all arrive whole and in order."""
    async with running_gateway(max_frame_bytes=256 * 1024) as gw:
        protocols = [MSGPACK_SUBPROTOCOL] if encoding == "msgpack" else None
        async with websockets.connect(gw.ws_url, subprotocols=protocols, max_size=None) as ws:

            async def event() -> dict:
                data = await asyncio.wait_for(ws.recv(), 10)
                return msgpack.unpackb(data) if encoding == "msgpack" else json.loads(data)

            def frame(value: dict) -> str | bytes:
                return msgpack.packb(value) if encoding == "msgpack" else json.dumps(value, ensure_ascii=False)

            assert (await event())["type"] == "session.created"
            texts = {f"i{n}": "é" * n for n in (10, 1_000, 100_000)}
            for item_id, text in texts.items():
                await ws.send(frame({"type": "conversation.item.create", "item": {
                    "id": item_id, "type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": text}]}}))
                assert (await event())["type"] == "conversation.item.added"
                assert (await event())["type"] == "conversation.item.done"
            for item_id, text in texts.items():
                await ws.send(frame({"type": "conversation.item.retrieve", "item_id": item_id}))
                retrieved = await event()
                assert retrieved["type"] == "conversation.item.retrieved"
                assert retrieved["item"]["id"] == item_id and retrieved["item"]["content"][0]["text"] == text
            connection = next(iter(gw.state.connections))
            assert connection.outbox.written_directly >= 10  # they took the fast lane, not the writer task
