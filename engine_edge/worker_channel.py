"""How an asyncio front talks to the one worker thread that owns a backend's model context.

The front puts commands on a thread-safe queue; the worker answers through
``concurrent.futures.Future`` objects (awaited with ``asyncio.wrap_future``) and streams a
request's events into that request's ``asyncio.Queue`` on the loop that asked for it, via
``call_soon_threadsafe``. Nothing here blocks the event loop or needs a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_edge.base import Draft
from llm_shared.channel import EventChannel
from llm_shared.contract import Priority, SamplingParams, StreamEvent
from llm_shared.structured import SequenceMatcher


class EventSink:
    """Delivers one request's events from the worker thread to its consumer's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, channel: EventChannel) -> None:
        self._loop = loop
        self.channel = channel

    def put(self, event: StreamEvent) -> bool:
        """False when the consumer's loop is closed: nobody will read, so the worker may drop the request."""
        try:
            self._loop.call_soon_threadsafe(self.channel.put, event)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True


@dataclass(frozen=True)
class GenerateCmd:
    request_id: str
    prompt: tuple[int, ...]  # validated by the front
    params: SamplingParams
    priority: Priority
    sink: EventSink
    session: str = ""  # the conversation it belongs to: its KV stays reusable until the session ends
    salt: str = ""  # cache salt (checked by the front): it reuses only KV that requests with the same salt left
    matcher: SequenceMatcher | None = None  # the output grammar (params.grammar, compiled by the front)


@dataclass(frozen=True)
class AbortCmd:
    request_id: str
    done: concurrent.futures.Future[None] | None = None  # None: the consumer left, nobody waits


@dataclass(frozen=True)
class ProposeCmd:
    context: tuple[int, ...]  # validated by the front
    k: int
    done: concurrent.futures.Future[Draft] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class CallCmd:
    """Run ``fn`` on the worker thread between steps (inspection of state the worker owns)."""

    fn: Callable[[], Any]
    done: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class CloseCmd:
    pass


Command = GenerateCmd | AbortCmd | ProposeCmd | CallCmd | CloseCmd


def resolve(future: concurrent.futures.Future[Any] | None, value: Any) -> None:
    """Set a result unless the waiter already gave up (cancelled the future)."""
    if future is not None and future.set_running_or_notify_cancel():
        future.set_result(value)


def reject(future: concurrent.futures.Future[Any] | None, error: BaseException) -> None:
    if future is not None and future.set_running_or_notify_cancel():
        future.set_exception(error)
