"""Each tier's health, known before a user's turn needs it: busy is not dead.

A tier is down when there is evidence that it cannot serve, and only then:
- it says it is not ready (its core process is gone or restarting, its worker thread ended);
- it refuses a probe (``Engine.probe`` raises an ``EngineError``), or a turn finds it
  unavailable (``mark_down``);
- it stalls: it has work (running or waiting requests) and its step counter (the ``steps``
  stat) has not moved for ``stall_timeout_s``, or a probe has gone unanswered that long.

How fast a probe answers is not evidence: on a busy host a tier's steps take seconds (a batch
of prompts while the other tier's threads share the cores), and a probe answered between two
steps waits for them. Marking such a tier down sent every turn to the other tier, which then
looked slow in turn, until both were "down" and every turn was refused.

Every ``probe_interval_s`` the monitor looks at each tier's stats and keeps one probe in flight
per tier. A down tier comes back through the same evidence: a probe that answers after it went
down, while it is not stalled.
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
    up: bool = True  # optimistic until evidence says otherwise: the tiers start ready
    reason: str = ""  # why it is down
    since: float = 0.0  # monotonic time of the latest change
    probes: int = 0  # probes started
    failures: int = 0  # probes refused, and looks that found it not ready
    steps: float | None = None  # its step counter at the latest look (None: it reports none)
    progress_at: float = 0.0  # when it last stepped, or was seen with nothing to do
    probe_started: float | None = None  # the probe in flight began then (None: none in flight)
    answered_at: float = 0.0  # the latest probe answer
    transitions: int = 0  # up/down changes since start


class HealthMonitor:
    def __init__(self, engines: Mapping[str, Engine], *, interval_s: float, stall_timeout_s: float,
                 on_change: Callable[[str, bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engines = dict(engines)
        self._interval = interval_s
        self._stall = stall_timeout_s
        self._on_change = on_change
        self._clock = clock
        now = clock()
        self._states = {tier: TierState(since=now, progress_at=now) for tier in self._engines}
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._started = 0  # rounds begun
        self._round = 0  # the latest round finished
        self._round_done: asyncio.Condition | None = None

    def up(self, tier: str) -> bool:
        engine = self._engines.get(tier)
        return engine is not None and engine.ready and self._states[tier].up

    def state(self, tier: str) -> TierState:
        return self._states[tier]

    def why_down(self, tier: str) -> str:
        """Why ``tier`` cannot take a turn now ("" while it is up)."""
        engine = self._engines.get(tier)
        if engine is None:
            return "not configured"
        if not engine.ready:
            return "not ready (its process is gone or restarting)"
        state = self._states[tier]
        return "" if state.up else state.reason

    def unavailable_message(self) -> str:
        """The error a turn gets when no tier can take it: each tier and why it is down."""
        why = "; ".join(f"the {tier} tier is down: {self.why_down(tier)}" for tier in self._engines
                        if not self.up(tier))
        return f"no engine tier can take this turn ({why}); retry shortly"

    def transitions(self) -> int:
        """Up/down changes of every tier since start (``/metrics``, the load benchmark)."""
        return sum(state.transitions for state in self._states.values())

    def mark_down(self, tier: str, reason: str) -> None:
        """A turn found ``tier`` unavailable: route around it until a probe answers again."""
        if tier in self._states:
            self._set(tier, False, reason)

    def start(self) -> None:
        """Start watching (on the running loop); idempotent."""
        if self._task is None or self._task.done():
            self._round_done = asyncio.Condition()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="tier-health")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._probes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        self._probes.clear()

    async def probe_all(self) -> None:
        """One round: every tier looked at, a probe started where none is in flight, and the
        probes given up to one interval to answer before the verdicts."""
        self._started += 1
        number = self._started
        for tier, engine in self._engines.items():
            self._look(tier, engine)
        pending = [task for task in self._probes.values() if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=self._interval)
        for tier, engine in self._engines.items():
            self._judge(tier, engine)
        self._round = max(self._round, number)
        if self._round_done is not None:
            async with self._round_done:
                self._round_done.notify_all()

    async def wait_rounds(self, n: int = 1) -> None:
        """Until ``n`` rounds that start after this call have finished (tests await this
        instead of sleeping)."""
        assert self._round_done is not None, "start() first"
        target = self._started + n
        async with self._round_done:
            await self._round_done.wait_for(lambda: self._round >= target)

    async def _loop(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self._interval)

    def _look(self, tier: str, engine: Engine) -> None:
        """Read its progress and start a probe unless one is in flight."""
        state = self._states[tier]
        if not engine.ready:
            return
        now = self._clock()
        stats = _stats(engine)
        steps = stats.get("steps")
        if steps is not None and (state.steps is None or steps > state.steps):
            state.progress_at = now
        state.steps = steps
        if stats.get("running", 0.0) + stats.get("waiting", 0.0) == 0.0:
            state.progress_at = now  # nothing to do is not a stall
        if state.probe_started is None:
            state.probes += 1
            state.probe_started = now
            self._probes[tier] = asyncio.get_running_loop().create_task(self._probe(tier, engine),
                                                                        name=f"probe-{tier}")

    async def _probe(self, tier: str, engine: Engine) -> None:
        state = self._states[tier]
        try:
            await engine.probe()
        except EngineError as e:
            state.failures += 1
            self._set(tier, False, f"it refused a probe: {e.message}")
        except Exception as e:  # a probe must never end the monitor
            state.failures += 1
            log.exception("probing the %s tier failed", tier)
            self._set(tier, False, f"a probe failed: {type(e).__name__}")
        else:
            state.answered_at = self._clock()
        finally:
            state.probe_started = None

    def _judge(self, tier: str, engine: Engine) -> None:
        state = self._states[tier]
        if not engine.ready:
            state.failures += 1
            self._set(tier, False, "not ready (its process is gone or restarting)")
            return
        now = self._clock()
        stats = _stats(engine)
        work = stats.get("running", 0.0) + stats.get("waiting", 0.0)
        if state.probe_started is not None and now - state.probe_started > self._stall:
            self._set(tier, False, f"it has not answered a probe for {now - state.probe_started:.0f} s")
            probe = self._probes.pop(tier, None)
            if probe is not None:  # given up on (a lost probe never answers): the next round asks afresh
                probe.cancel()
            state.probe_started = None
        elif state.steps is not None and work > 0 and now - state.progress_at > self._stall:
            self._set(tier, False, f"it has not stepped for {now - state.progress_at:.0f} s with "
                                   f"{stats.get('running', 0.0):g} requests running and "
                                   f"{stats.get('waiting', 0.0):g} waiting")
        elif not state.up and state.answered_at > state.since:
            self._set(tier, True, "")

    def _set(self, tier: str, up: bool, reason: str) -> None:
        state = self._states[tier]
        if state.up != up:
            state.since = self._clock()
            state.transitions += 1
            if up:
                log.info("the %s tier is up again", tier)
            else:
                log.warning("the %s tier is down: %s", tier, reason)
            if self._on_change is not None:
                self._on_change(tier, up)
        state.up, state.reason = up, reason


def _stats(engine: Engine) -> dict[str, float]:
    """The numbers of the tier's stats this monitor reads (absent where it reports none)."""
    try:
        raw = engine.stats()
    except Exception:  # stats are advisory here; probes and readiness decide
        return {}
    return {key: float(value) for key in ("steps", "running", "waiting")
            if isinstance(value := raw.get(key), (int, float)) and not isinstance(value, bool)}
