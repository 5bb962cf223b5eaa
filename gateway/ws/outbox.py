"""The bounded outgoing queue of one WebSocket connection.

The session produces events as fast as the engine makes tokens; a client may read slowly.
One writer task drains this queue. Above ``high`` queued frames, a text delta that continues
the last queued delta of the same item and content part is merged into it, so a slow reader
gets fewer, longer deltas instead of a growing backlog. Past ``limit`` frames or ``max_bytes``
the connection cancels the response (``over_limit``); the reader stops reading client events
while the queue holds ``high`` frames or half of ``max_bytes`` (``wait_writable``), whatever
produced them (a response, or replies to the client's own events such as retrieves), so a
client that does not read cannot grow it by more than one event's reply.

Events are encoded when queued (by the codec), except text deltas, which stay
typed until sent so that they can still be merged (their texts are joined once, at send time,
not copied per merge).

The fast lane (``put_all`` with a ``DirectWriter``): while nothing is queued and the socket
takes data at once (its send buffer is empty), the events of one pump are encoded and written
right away, in one write, instead of waking the writer task per event. This is the common
case, one write per token of a client that keeps up; the queue, the merging and the bounds
above take over the moment the client falls behind, and hand back once it caught up.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

from gateway.ws.server_events import ServerEvent, TextDelta

Frame = str | bytes
# A queued delta's share of memory besides its text (its object and ids); an estimate.
DELTA_OVERHEAD_BYTES = 192


class _PendingDelta:
    """A queued text delta and the texts merged into it since."""

    __slots__ = ("chars", "event", "texts")

    def __init__(self, event: TextDelta) -> None:
        self.event = event
        self.texts = [event.delta]
        self.chars = len(event.delta)

    def merged(self) -> TextDelta:
        """The delta as sent: a new event, the one the session made stays as it was."""
        return replace(self.event, delta="".join(self.texts)) if len(self.texts) > 1 else self.event


class DirectWriter(Protocol):
    """The socket behind an outbox, for its fast lane."""

    def writable(self) -> bool:
        """True when frames written now go straight to the socket (nothing is buffered)."""
        ...

    def write(self, frames: list[Frame]) -> None:
        """Write ``frames`` in order, at once; raises ConnectionError when the peer is gone."""
        ...


class Outbox:
    def __init__(self, encode: Callable[[ServerEvent], Frame], *, high: int, limit: int, max_bytes: int,
                 direct: DirectWriter | None = None) -> None:
        self._encode = encode
        self._direct = direct
        self._high = high
        self._limit = limit
        self._max_bytes = max_bytes
        self._high_bytes = max_bytes // 2  # the reader pauses here, leaving room for one more reply
        self._items: deque[Frame | _PendingDelta] = deque()
        self._bytes = 0
        self._closed = False
        self._nonempty = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self.coalesced = 0  # deltas merged into an earlier one, for metrics and tests
        self.written_directly = 0  # frames that took the fast lane, for tests

    def __len__(self) -> int:
        return len(self._items)

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    @property
    def over_limit(self) -> bool:
        return len(self._items) >= self._limit or self._bytes >= self._max_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def put_all(self, events: Iterable[ServerEvent]) -> None:
        """Queue ``events`` in order, or write them at once when nothing is queued and the
        socket takes them now (the fast lane; see the module's doc)."""
        if self._closed:
            return
        direct = self._direct_now()
        if direct is None:
            for event in events:
                self.put(event)
            return
        encode = self._encode
        frames = [encode(event) for event in events]
        if frames:
            self._write_direct(direct, frames)

    def send_now(self, event: ServerEvent) -> bool:
        """The fast lane for one event (a token's delta): written at once and True when nothing is
        queued and the socket takes it now; False, and nothing done, otherwise (``put`` it)."""
        direct = self._direct_now()
        if direct is None:
            return False
        self._write_direct(direct, [self._encode(event)])
        return True

    def _direct_now(self) -> DirectWriter | None:
        """The socket, when frames may go straight to it: the outbox is open and empty, and the
        socket's own buffer is empty too."""
        direct = self._direct
        if direct is None or self._items or self._closed or not direct.writable():
            return None
        return direct

    def _write_direct(self, direct: DirectWriter, frames: list[Frame]) -> None:
        try:
            direct.write(frames)
        except ConnectionError:
            self.discard()  # the client is gone: the reader sees the close next
            return
        self.written_directly += len(frames)

    def put(self, event: ServerEvent) -> None:
        """Queue one server event (dropped once the outbox is closed)."""
        if self._closed:
            return
        if isinstance(event, TextDelta):
            last = self._items[-1] if self._items else None
            if len(self._items) >= self._high and isinstance(last, _PendingDelta) and event.continues(last.event):
                last.texts.append(event.delta)
                last.chars += len(event.delta)
                self._bytes += len(event.delta)
                self.coalesced += 1
                return
            self._items.append(_PendingDelta(event))
            self._bytes += len(event.delta) + DELTA_OVERHEAD_BYTES
        else:
            frame = self._encode(event)
            self._items.append(frame)
            self._bytes += len(frame)
        self._nonempty.set()
        self._update_writable()

    async def get(self) -> Frame | None:
        """The next frame to send; None once the outbox is closed and empty."""
        while not self._items:
            if self._closed:
                return None
            self._nonempty.clear()
            await self._nonempty.wait()
        item = self._items.popleft()
        if isinstance(item, _PendingDelta):
            self._bytes -= item.chars + DELTA_OVERHEAD_BYTES
            frame = self._encode(item.merged())
        else:
            self._bytes -= len(item)
            frame = item
        self._update_writable()
        return frame

    def _update_writable(self) -> None:
        if self._closed or (len(self._items) < self._high and self._bytes < self._high_bytes):
            self._writable.set()
        else:
            self._writable.clear()

    @property
    def writable(self) -> bool:
        """Fewer than ``high`` frames and half of ``max_bytes`` are queued (or the outbox is closed)."""
        return self._writable.is_set()

    async def wait_writable(self) -> None:
        """Return when fewer than ``high`` frames and half of ``max_bytes`` are queued (or the
        outbox is closed)."""
        await self._writable.wait()

    def close(self) -> None:
        """No more events; ``get`` drains what is queued, then returns None."""
        self._closed = True
        self._nonempty.set()
        self._writable.set()

    def discard(self) -> None:
        """Drop everything queued (the client is gone)."""
        self._items.clear()
        self._bytes = 0
        self.close()
