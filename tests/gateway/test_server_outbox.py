"""The per-connection send queue: order kept, deltas merged only when behind, bounded size."""

import asyncio
import json

from gateway.ws.outbox import Outbox
from gateway.ws.server_events import OtherEvent, TextDelta


def delta(text: str, item: str = "i1", content_index: int = 0) -> TextDelta:
    return TextDelta(type="response.output_text.delta", event_id=f"e-{text}", response_id="r1", item_id=item,
                     output_index=0, content_index=content_index, delta=text)


def other(kind: str, **fields: object) -> OtherEvent:
    return OtherEvent(type=kind, event_id=f"e-{kind}", fields=fields)


def make(high: int = 3, limit: int = 100, max_bytes: int = 1 << 20) -> Outbox:
    return Outbox(json.dumps, high=high, limit=limit, max_bytes=max_bytes)


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
