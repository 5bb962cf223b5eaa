"""One turn while the cascade runs it: its flight (the stage holding it now, on which tier),
and the stream the caller reads (the decision's events, then the serving stage's).

``CascadeEngine`` decides; this module carries the decision out, and needs of the cascade only
a way to forget a flight once its turn is over.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from gateway.cascade.route import RouteInfo
from llm_shared.channel import Delivered, Subscriber, as_pushing
from llm_shared.contract import Engine, FinishEvent, Priority, SamplingParams, StreamEvent
from llm_shared.errors import EngineError

log = logging.getLogger(__name__)

CascadeEvent = StreamEvent | RouteInfo


@dataclass(frozen=True)
class Ask:
    """What every stage of a turn passes on to the tier it runs on, as the caller gave it."""

    priority: Priority
    session_id: str
    cache_salt: str  # the caller's tenant: each tier reuses cached prefixes only within it


@dataclass
class Flight:
    """One request while the cascade runs it."""

    aborted: bool = False
    engine: Engine | None = None  # the tier holding the request now
    stage_id: str = ""  # the request id in that tier (a second stage on one tier gets a fresh one)
    stream: AsyncIterator[StreamEvent] | None = None
    finished: bool = True  # the current stage's stream sent its FinishEvent (or never started)

    def start(self, engine: Engine, rid: str, prompt: list[int], params: SamplingParams, ask: Ask,
              drafts: Sequence[int] = ()) -> AsyncIterator[StreamEvent]:
        """A stage of the turn on ``engine`` (request id ``rid``): the flight now holds it."""
        stream = engine.generate(rid, prompt, params, ask.priority, session_id=ask.session_id, draft_ids=drafts,
                                 cache_salt=ask.cache_salt)
        self.engine, self.stream, self.finished, self.stage_id = engine, stream, False, rid
        return stream

    async def next(self, stream: AsyncIterator[StreamEvent]) -> StreamEvent:
        try:
            event = await anext(stream)
        except EngineError:
            self.finished = True  # refused before its first event, or broken: nothing to abort
            raise
        except StopAsyncIteration:
            self.finished = True
            raise EngineError("the engine's stream ended without finishing") from None
        if isinstance(event, FinishEvent):
            self.finished = True
        return event

    async def stop(self) -> None:
        """Abort the current stage unless it finished (its KV is free on return), close its stream."""
        engine, stream, rid = self.engine, self.stream, self.stage_id
        self.engine, self.stream = None, None
        if engine is not None and not self.finished:
            try:
                await engine.abort(rid)
            except EngineError as e:
                log.warning("aborting %s on the %s tier failed: %s", rid, engine.tier, e.message)
        self.finished = True
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except (EngineError, RuntimeError) as e:  # a broken stream has nothing left to free
                log.debug("closing the %s stream of %s: %s", engine.tier if engine else "?", rid, e)


@dataclass
class Forward:
    """The rest of a turn once the cascade has decided: ``prefix`` (the released held tokens, an
    escalated stage's first event), then every event of ``stream`` (None: the prefix ends the turn)."""

    stream: AsyncIterator[StreamEvent] | None
    prefix: list[StreamEvent]
    on_event: Callable[[StreamEvent], None] | None = None  # sees each event given on
    at_end: Callable[[], None] | None = None  # once, when the turn is over or left


class CascadeStream:
    """What ``CascadeEngine.generate`` returns: the decision's events (iterated), then the serving
    stage's. Once decided, a consumer may ``subscribe`` (``Turn.run``) when that stage's stream
    can push: the rest of the prefix is delivered at once, then the tier's events by call from its
    step, so a cascade turn costs per token what a direct one does. Closing it (or reading past
    the end, or an error) stops the current stage and forgets the flight, once."""

    def __init__(self, flight: Flight, decide: AsyncIterator[CascadeEvent | Forward],
                 forget: Callable[[], None]) -> None:
        """``forget``: the cascade stops counting the flight (once, when the turn is over)."""
        self._flight = flight
        self._forget = forget
        self._decide = decide
        self._forward: Forward | None = None
        self._prefix: deque[StreamEvent] = deque()
        self._done = False  # the turn's FinishEvent was given on
        self._ended = False
        self._subscriber: Subscriber | None = None

    def __aiter__(self) -> CascadeStream:
        return self

    async def __anext__(self) -> CascadeEvent:
        try:
            if self._forward is None:
                item = await anext(self._decide)
                if not isinstance(item, Forward):
                    return item
                self._forward = item
                self._prefix.extend(item.prefix)
            if self._prefix:
                return self._seen(self._prefix.popleft())
            if self._done or self._forward.stream is None:
                raise StopAsyncIteration
            return self._seen(await self._flight.next(self._forward.stream))
        except BaseException:
            await self._end()  # refused, broken, cancelled or over: nothing more will be read
            raise

    def _seen(self, event: StreamEvent) -> StreamEvent:
        forward = self._forward
        if forward is not None and forward.on_event is not None:
            forward.on_event(event)
        if isinstance(event, FinishEvent):
            self._done = True
            self._over()  # a consumer that stops reading at the finish leaves nothing behind
        return event

    def _over(self) -> None:
        """The turn is over for the cascade (finished, or left): its metrics, and the flight goes."""
        forward = self._forward
        if forward is not None and forward.at_end is not None:
            at_end, forward.at_end = forward.at_end, None  # once
            at_end()
        self._forget()

    def can_subscribe(self) -> bool:
        forward = self._forward
        if forward is None or self._done or self._subscriber is not None:
            return False
        if forward.stream is None:
            return True
        stream = as_pushing(forward.stream)
        return stream is not None and stream.can_subscribe()

    def subscribe(self, callback: Subscriber) -> None:
        if not self.can_subscribe():
            raise RuntimeError("this cascade stream cannot push now; iterate it")
        assert self._forward is not None
        self._subscriber = callback
        while self._prefix and self._subscriber is callback:
            callback(self._seen(self._prefix.popleft()))
        stream = as_pushing(self._forward.stream)
        if self._done or stream is None or self._subscriber is not callback:
            return
        flight = self._flight

        def delivered(item: Delivered) -> None:
            if isinstance(item, (FinishEvent, EngineError)):
                flight.finished = True  # as ``Flight.next`` marks it: nothing left to abort
            callback(self._seen(item) if not isinstance(item, EngineError) else item)

        stream.subscribe(delivered)

    def unsubscribe(self) -> None:
        self._subscriber = None
        stream = as_pushing(self._forward.stream) if self._forward is not None else None
        if stream is not None:
            stream.unsubscribe()

    async def aclose(self) -> None:
        await self._end()

    async def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        self.unsubscribe()
        try:
            await self._decide.aclose()
        finally:
            await asyncio.shield(self._flight.stop())
            self._over()
