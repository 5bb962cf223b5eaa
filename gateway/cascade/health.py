"""Each tier's health, known before a user's turn needs it.

A probe task calls every tier's ``Engine.probe`` (a round trip through its worker or core
process) every ``probe_interval_s`` under a ``probe_timeout_s`` limit. A tier is down at once
when its engine says it is not ready or a probe fails, and after ``slow_probes_to_down``
probes in a row that did not answer in time (one slow probe on a busy machine is not a dead
tier: marking both tiers down would refuse every turn). A probe that timed out while the tier
kept stepping (its ``stats()["steps"]`` went up meanwhile) does not count either: the tier is
busy serving turns, and a loaded machine delays the probe's round trip, not the tier's work.
A turn that meets an unavailable tier marks it down at once (``mark_down``); the next probe
that answers brings it back. So a dead or wedged tier costs at most one probe interval of wrong
routing, and never a request that hangs waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llm_shared.contract import Engine
from llm_shared.errors import EngineError

log = logging.getLogger(__name__)


@dataclass
class TierState:
    up: bool = True  # optimistic until a probe or a turn says otherwise: the tiers start ready
    reason: str = ""  # why it is down
    since: float = 0.0  # monotonic time of the latest change
    probes: int = 0
    failures: int = 0
    slow_in_a_row: int = 0  # consecutive probes that timed out while the tier made no step
    slow_while_stepping: int = 0  # probes that timed out while the tier went on stepping


class HealthMonitor:
    def __init__(self, engines: Mapping[str, Engine], *, interval_s: float, timeout_s: float,
                 slow_probes_to_down: int = 3, on_change: Callable[[str, bool], None] | None = None) -> None:
        self._engines = dict(engines)
        self._interval = interval_s
        self._timeout = timeout_s
        self._slow_to_down = slow_probes_to_down
        self._on_change = on_change
        self._states = {tier: TierState(since=time.monotonic()) for tier in self._engines}
        self._task: asyncio.Task[None] | None = None
        self._started = 0  # probe rounds begun
        self._round = 0  # the latest round finished
        self._round_done: asyncio.Condition | None = None

    def up(self, tier: str) -> bool:
        engine = self._engines.get(tier)
        return engine is not None and engine.ready and self._states[tier].up

    def state(self, tier: str) -> TierState:
        return self._states[tier]

    def mark_down(self, tier: str, reason: str) -> None:
        """A turn found ``tier`` unavailable: route around it until a probe answers again."""
        if tier in self._states:
            self._set(tier, False, reason)

    def start(self) -> None:
        """Start probing (on the running loop); idempotent."""
        if self._task is None or self._task.done():
            self._round_done = asyncio.Condition()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="tier-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def probe_all(self) -> None:
        """One round: every tier probed concurrently, each within the timeout."""
        self._started += 1
        number = self._started
        await asyncio.gather(*(self._probe(tier, engine) for tier, engine in self._engines.items()))
        self._round = max(self._round, number)
        if self._round_done is not None:
            async with self._round_done:
                self._round_done.notify_all()

    async def wait_rounds(self, n: int = 1) -> None:
        """Until ``n`` probe rounds that start after this call have finished (tests await this
        instead of sleeping)."""
        assert self._round_done is not None, "start() first"
        target = self._started + n
        async with self._round_done:
            await self._round_done.wait_for(lambda: self._round >= target)

    async def _loop(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self._interval)

    async def _probe(self, tier: str, engine: Engine) -> None:
        state = self._states[tier]
        state.probes += 1
        if not engine.ready:
            self._set(tier, False, "not ready")
            return
        steps = _steps(engine)
        try:
            await asyncio.wait_for(engine.probe(), self._timeout)
        except TimeoutError:
            state.failures += 1
            if steps is not None and (_steps(engine) or 0.0) > steps:
                state.slow_while_stepping += 1
                return  # slow, but alive and working: not a step towards down
            state.slow_in_a_row += 1
            if state.slow_in_a_row >= self._slow_to_down:
                self._set(tier, False, f"{state.slow_in_a_row} probes in a row took over {self._timeout:g} s")
        except EngineError as e:
            state.failures += 1
            self._set(tier, False, e.message)
        except Exception as e:  # a probe must never end the monitor
            state.failures += 1
            log.exception("probing the %s tier failed", tier)
            self._set(tier, False, f"probe failed: {type(e).__name__}")
        else:
            state.slow_in_a_row = 0
            self._set(tier, True, "")

    def _set(self, tier: str, up: bool, reason: str) -> None:
        state = self._states[tier]
        if state.up != up:
            state.since = time.monotonic()
            if up:
                log.info("the %s tier is up again", tier)
            else:
                log.warning("the %s tier is down: %s", tier, reason)
            if self._on_change is not None:
                self._on_change(tier, up)
        state.up, state.reason = up, reason


def _steps(engine: Engine) -> float | None:
    """The tier's step counter (every tier reports ``steps``), or None when it reports none."""
    try:
        value = engine.stats().get("steps")
    except Exception:  # stats are advisory here; the probe decides
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
