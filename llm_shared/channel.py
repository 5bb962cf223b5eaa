"""One request's events on their way from an engine to its consumer, on one event loop.

An ``EventChannel`` is what a tier's ``generate`` returns: an async iterator of ``StreamEvent``
like any other, and one more way to read it. A consumer that ``subscribe``s a callback gets every
event by a plain call from the engine's own step, as the event is put: no task wakes, no queue,
no coroutine chain per token. The gateway streams a response that way (``Turn.run``), which is
most of what one token costs it; anything else (the cascade, tests, chat completions) just
iterates.

The producer calls ``put`` for each event and ``fail`` for an error that ends the stream, both on
the consumer's event loop (a worker thread hands its events over with ``call_soon_threadsafe``
first). A channel made with ``refused`` raises its error from the first ``__anext__``, as the
engine contract asks of a request refused before it started.

``on_close(finished)`` runs once, when the request is over for the engine: its ``FinishEvent``
(or error) was put (``finished`` True), or the consumer closed the channel (``aclose``) before
that (False: the engine frees the request there). A consumer that stops reading after the
``FinishEvent`` without closing leaves nothing behind.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Protocol, cast

from llm_shared.contract import FinishEvent, StreamEvent
from llm_shared.errors import EngineError

Delivered = StreamEvent | EngineError  # what a subscriber is called with; an error ends the stream
Subscriber = Callable[[Delivered], None]


class Pushing(Protocol):
    """A stream that can deliver by callback: an ``EventChannel``, or a stream that hands its
    channel on (the torch tier's client, once its request is sent)."""

    def can_subscribe(self) -> bool:
        """Whether ``subscribe`` would deliver the rest of the stream now (else: iterate it)."""
        ...

    def subscribe(self, callback: Subscriber) -> None: ...

    def unsubscribe(self) -> None: ...


def as_pushing(stream: object) -> Pushing | None:
    """``stream`` when it has ``Pushing``'s methods, else None: a plain attribute check, where
    ``isinstance`` against the runtime-checkable Protocol walks its members (5-11 µs, on every turn)."""
    return cast(Pushing, stream) if callable(getattr(stream, "can_subscribe", None)) else None


class EventChannel:
    __slots__ = ("_backlog", "_closed", "_ended", "_on_close", "_subscriber", "_waiter")

    def __init__(self, on_close: Callable[[bool], None] | None = None) -> None:
        self._backlog: deque[Delivered] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._subscriber: Subscriber | None = None
        self._ended = False  # the FinishEvent or an error was put: nothing more comes
        self._closed = False  # the consumer left (or read past the end): on_close has run
        self._on_close = on_close

    @classmethod
    def refused(cls, error: EngineError) -> EventChannel:
        """A request refused before it started: the first ``__anext__`` raises ``error``."""
        channel = cls()
        channel.fail(error)
        return channel

    @property
    def ended(self) -> bool:
        """The producer is done: its FinishEvent (or error) was put."""
        return self._ended

    @property
    def closed(self) -> bool:
        """The consumer left (``aclose``) or read past the end: nothing more is delivered."""
        return self._closed

    # ----- the producer ----------------------------------------------------------------

    def put(self, event: StreamEvent) -> None:
        """Deliver ``event``: at once to a subscriber, else to the iterator. Ignored once the stream
        ended or the consumer left."""
        if self._ended or self._closed:
            return
        if isinstance(event, FinishEvent):
            self._ended = True
        self._deliver(event)
        if self._ended:
            self._release(finished=True)

    def fail(self, error: EngineError) -> None:
        """End the stream with ``error`` (raised to an iterating consumer, passed to a subscriber)."""
        if self._ended or self._closed:
            return
        self._ended = True
        self._deliver(error)
        self._release(finished=True)

    def _deliver(self, item: Delivered) -> None:
        subscriber = self._subscriber
        if subscriber is not None:
            subscriber(item)
            return
        self._backlog.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ----- the consumer ----------------------------------------------------------------

    def can_subscribe(self) -> bool:
        return self._subscriber is None and self._waiter is None and not self._closed

    def subscribe(self, callback: Subscriber) -> None:
        """From now on every event (and an ending error) is passed to ``callback`` as it is put,
        starting with any not yet read. ``callback`` runs inside the producer's step: it must not
        block, and what it raises propagates into the producer (the gateway's catches its own)."""
        if self._subscriber is not None:
            raise RuntimeError("this channel already has a subscriber")
        if self._waiter is not None:
            raise RuntimeError("this channel is being iterated")
        self._subscriber = callback
        while self._backlog and self._subscriber is not None:
            callback(self._backlog.popleft())

    def unsubscribe(self) -> None:
        """Stop calling the subscriber; later events wait for the iterator (or are dropped at close)."""
        self._subscriber = None

    def __aiter__(self) -> EventChannel:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._subscriber is not None:
            raise RuntimeError("this channel delivers to its subscriber")
        while not self._backlog:
            if self._ended or self._closed:
                self._close(finished=self._ended)
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._backlog.popleft()
        if isinstance(item, EngineError):
            raise item
        return item

    async def aclose(self) -> None:
        """The consumer is done with the stream, finished or not."""
        self._close(finished=self._ended)

    def _close(self, *, finished: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._subscriber = None
        self._backlog.clear()
        self._release(finished=finished)

    def _release(self, *, finished: bool) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(finished)
