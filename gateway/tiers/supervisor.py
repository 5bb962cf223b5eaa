"""Keeping an engine tier alive: a dead torch engine core is restarted with backoff.

``SupervisedEngine`` is an ``Engine`` that forwards to the current instance a factory made
(``EngineClient.start`` for the torch tier). When that instance's connection ends without the
gateway asking (the core crashed, was killed, ran out of memory), its in-flight streams have
already ended with a reason (the client fails them the moment the socket closes), the tier
reports not ready (so ``/readyz`` and the cascade's health see it at once and route around it),
and a new instance is started after 1, 2, 4 ... up to ``max_backoff_s`` seconds, until one comes
up. New turns then succeed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from llm_shared.channel import EventChannel
from llm_shared.contract import Engine, Priority, SamplingParams, StreamEvent
from llm_shared.cores import CoreShare, SharesCores
from llm_shared.errors import EngineError, EngineUnavailableError
from llm_shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Restartable(Engine, Protocol):
    async def wait_lost(self) -> None:
        """Return when the instance is gone for good."""
        ...


class SupervisedEngine:
    def __init__(self, first: Restartable, factory: Callable[[], Awaitable[Restartable]], *,
                 initial_backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
        self.tier = first.tier
        self._current: Restartable | None = first
        self._tokenizer = first.tokenizer
        self._factory = factory
        self._initial_backoff = initial_backoff_s
        self._max_backoff = max_backoff_s
        self._closing = False
        self._share: CoreShare | None = None  # share_cores: passed on to every instance
        self.restarts = 0  # instances started after the first
        self.failed_starts = 0
        self._task = asyncio.get_running_loop().create_task(self._watch(), name=f"supervise-{self.tier}")

    @property
    def current(self) -> Restartable | None:
        return self._current

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def ready(self) -> bool:
        return self._current is not None and self._current.ready

    @property
    def max_model_len(self) -> int:
        """The current instance's context (prompt plus output tokens); 0 while there is none."""
        current = self._current
        return int(getattr(current, "max_model_len", 0)) if current is not None else 0

    def _engine(self) -> Restartable:
        current = self._current
        if current is None or not current.ready:
            raise EngineUnavailableError(f"the {self.tier} engine is restarting; retry shortly")
        return current

    def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 priority: Priority = Priority.INTERACTIVE, session_id: str = "",
                 draft_ids: Sequence[int] = (), cache_salt: str = "") -> AsyncIterator[StreamEvent]:
        """The current instance's own stream, handed through as it is (an ``EventChannel`` keeps
        its push path); refused at the first event while no instance is ready."""
        try:
            engine = self._engine()
        except EngineError as e:
            return EventChannel.refused(e)
        return engine.generate(request_id, prompt_ids, params, priority, session_id=session_id,
                               draft_ids=draft_ids, cache_salt=cache_salt)

    async def abort(self, request_id: str) -> None:
        current = self._current
        if current is not None and current.ready:
            await current.abort(request_id)

    async def end_session(self, session_id: str) -> None:
        current = self._current
        if current is not None and current.ready:
            await current.end_session(session_id)

    async def probe(self) -> None:
        await self._engine().probe()

    def stats(self) -> dict[str, float]:
        current = self._current
        stats: dict[str, Any] = dict(current.stats()) if current is not None and current.ready else {}
        stats["restarts"] = float(self.restarts)
        return stats

    def share_cores(self, share: CoreShare) -> bool:
        """The current instance and every restarted one claim ``share`` (``llm_shared.cores``)."""
        if not isinstance(self._current, SharesCores) or not self._current.share_cores(share):
            return False
        self._share = share
        return True

    async def set_threads(self, threads: int) -> None:
        """The current instance's threads; with none running nothing computes, so nothing to do."""
        current = self._current
        if isinstance(current, SharesCores) and current.ready:
            await current.set_threads(threads)

    async def refresh_stats(self) -> dict[str, float]:
        """The current instance's stats, fetched now (an EngineClient's round trip)."""
        refresh = getattr(self._engine(), "refresh_stats", None)
        return await refresh() if refresh is not None else self.stats()

    async def close(self) -> None:
        self._closing = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        current, self._current = self._current, None
        if current is not None:
            await current.close()

    async def _watch(self) -> None:
        while not self._closing:
            current = self._current
            assert current is not None
            await current.wait_lost()
            if self._closing:
                return
            log.error("the %s engine died; restarting it", self.tier)
            self._current = None
            with contextlib.suppress(EngineError):
                await current.close()  # reap the dead process
            self._current = await self._restart()
            if self._share is not None and isinstance(self._current, SharesCores):
                self._current.share_cores(self._share)
            self.restarts += 1
            log.info("the %s engine is back (restart %d)", self.tier, self.restarts)

    async def _restart(self) -> Restartable:
        delay = self._initial_backoff
        while True:
            await asyncio.sleep(delay)
            try:
                return await self._factory()
            except (EngineError, OSError) as e:
                self.failed_starts += 1
                delay = min(self._max_backoff, delay * 2)
                log.error("restarting the %s engine failed (%s); next try in %.0f s", self.tier, e, delay)
