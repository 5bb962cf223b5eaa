"""EventChannel: one request's events, read by iterating or by a callback from the producer's step."""

from __future__ import annotations

import asyncio

import pytest

from llm_shared.channel import EventChannel, as_pushing
from llm_shared.contract import FinishEvent, TokenEvent
from llm_shared.errors import EngineError, OverloadedError


def token(i: int) -> TokenEvent:
    return TokenEvent(i, f"t{i} ", -0.1)


FINISH = FinishEvent("stop", 3, 2)


async def test_iterating_gets_every_event_in_order_and_ends_after_the_finish() -> None:
    closed: list[bool] = []
    channel = EventChannel(on_close=closed.append)

    async def produce() -> None:
        for i in range(3):
            await asyncio.sleep(0)
            channel.put(token(i))
        channel.put(FINISH)
        channel.put(token(99))  # after the end: dropped

    producer = asyncio.create_task(produce())
    events = [event async for event in channel]
    await producer
    assert events == [token(0), token(1), token(2), FINISH]
    assert closed == [True]  # once, as finished


async def test_the_request_is_released_when_its_finish_is_put_even_if_never_read() -> None:
    closed: list[bool] = []
    channel = EventChannel(on_close=closed.append)
    channel.put(token(0))
    assert closed == []
    channel.put(FINISH)
    assert closed == [True]  # a consumer that walks away after the end leaves nothing to free
    assert [event async for event in channel] == [token(0), FINISH]  # still readable
    await channel.aclose()
    assert closed == [True]


async def test_a_refused_channel_raises_its_error_from_the_first_anext() -> None:
    channel = EventChannel.refused(OverloadedError("busy"))
    with pytest.raises(OverloadedError, match="busy"):
        await anext(channel)
    with pytest.raises(StopAsyncIteration):
        await anext(channel)


async def test_a_subscriber_is_called_from_put_after_the_backlog() -> None:
    channel = EventChannel()
    channel.put(token(0))
    assert await anext(channel) == token(0)
    channel.put(token(1))  # put before anyone subscribed: waits in the backlog
    got: list[object] = []
    channel.subscribe(got.append)
    assert got == [token(1)]
    channel.put(token(2))
    assert got == [token(1), token(2)]  # synchronously, inside put
    channel.fail(EngineError("the engine failed"))
    assert isinstance(got[-1], EngineError)
    channel.put(token(3))
    assert len(got) == 3  # nothing after the error
    with pytest.raises(RuntimeError):
        await anext(channel)  # a subscribed channel is not iterated as well


async def test_closing_early_runs_on_close_unfinished_and_drops_later_events() -> None:
    closed: list[bool] = []
    channel = EventChannel(on_close=closed.append)
    got: list[object] = []
    channel.subscribe(got.append)
    channel.put(token(0))
    await channel.aclose()
    await channel.aclose()
    channel.put(token(1))
    channel.put(FINISH)
    assert got == [token(0)] and closed == [False]


async def test_closing_after_the_finish_was_put_counts_as_finished() -> None:
    closed: list[bool] = []
    channel = EventChannel(on_close=closed.append)
    channel.put(token(0))
    channel.put(FINISH)
    assert channel.ended
    await channel.aclose()  # the consumer never read it: the engine still finished the request
    assert closed == [True]


async def test_a_waiting_iterator_wakes_on_put_and_on_fail() -> None:
    channel = EventChannel()
    waiting = asyncio.create_task(anext(channel))
    await asyncio.sleep(0)
    assert not waiting.done()
    channel.put(token(7))
    assert await asyncio.wait_for(waiting, 10) == token(7)
    waiting = asyncio.create_task(anext(channel))
    await asyncio.sleep(0)
    channel.fail(EngineError("gone"))
    with pytest.raises(EngineError, match="gone"):
        await asyncio.wait_for(waiting, 10)


async def test_only_streams_with_the_pushing_methods_are_taken_as_pushing() -> None:
    async def generated():  # type: ignore[no-untyped-def]
        yield TokenEvent(1, "a", -0.1)

    channel, stream = EventChannel(), generated()
    assert as_pushing(channel) is channel and as_pushing(stream) is None and as_pushing(None) is None
    await stream.aclose()
