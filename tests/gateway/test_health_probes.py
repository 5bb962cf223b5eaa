"""The tier health monitor on its own: busy is not dead. A tier is down when it is not ready, refuses,
or has work and has stopped stepping; never because its probes answer slowly while it steps.

Time is a fake clock the tests move; a round waits at most one (tiny) interval for probes."""

from __future__ import annotations

import asyncio

from fake_engine import FakeEngine

from gateway.cascade.health import HealthMonitor
from llm_shared.errors import EngineUnavailableError

INTERVAL_S = 0.01  # real seconds a round waits for probes
STALL_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Tier(FakeEngine):
    """A tier whose steps, work and probe answers the test controls."""

    def __init__(self) -> None:
        super().__init__(tier="edge")
        self.steps = 0
        self.work = 0  # requests running
        self.answer = asyncio.Event()  # probes answer once set
        self.answer.set()
        self.refusing = False

    async def probe(self) -> None:
        await self.answer.wait()
        if self.refusing:
            raise EngineUnavailableError("the worker thread ended")
        self.probes += 1

    def stats(self) -> dict[str, float]:
        return {"steps": float(self.steps), "running": float(self.work), "waiting": 0.0}


async def rounds(monitor: HealthMonitor, clock: Clock, n: int, seconds: float = 2.0, tier: Tier | None = None,
                 stepping: bool = False) -> None:
    for _ in range(n):
        clock.now += seconds
        if tier is not None and stepping:
            tier.steps += 1
        await monitor.probe_all()


def monitor_of(tier: Tier, clock: Clock, changes: list[tuple[str, bool]] | None = None) -> HealthMonitor:
    return HealthMonitor({"edge": tier}, interval_s=INTERVAL_S, stall_timeout_s=STALL_S, clock=clock,
                         on_change=(lambda t, up: changes.append((t, up))) if changes is not None else None)


async def test_a_busy_tier_whose_probes_answer_late_is_never_marked_down() -> None:
    clock, tier = Clock(), Tier()
    tier.work = 8
    tier.answer.clear()  # each probe waits for steps that take many rounds (a loaded 2-core host)
    changes: list[tuple[str, bool]] = []
    monitor = monitor_of(tier, clock, changes)
    for _ in range(10):
        await rounds(monitor, clock, 5, tier=tier, stepping=True)  # 10 s of steps, the probe unanswered
        tier.answer.set()
        await rounds(monitor, clock, 1)
        tier.answer.clear()
    assert monitor.up("edge") and changes == [] and tier.probes >= 10
    await monitor.close()


async def test_a_tier_that_stops_stepping_with_work_is_down_within_its_bound_and_back_when_it_steps() -> None:
    clock, tier = Clock(), Tier()
    tier.work = 3
    monitor = monitor_of(tier, clock)
    await rounds(monitor, clock, 15)  # 28 s without a step since it was first seen: within the bound
    assert monitor.up("edge")
    await rounds(monitor, clock, 2)  # 32 s
    assert not monitor.up("edge")
    assert "has not stepped for 32 s with 3 requests running" in monitor.why_down("edge")
    await rounds(monitor, clock, 1, tier=tier, stepping=True)
    assert monitor.up("edge") and monitor.transitions() == 2
    await monitor.close()


async def test_an_idle_tier_is_not_stalled_and_one_that_never_answers_is() -> None:
    clock, tier = Clock(), Tier()
    monitor = monitor_of(tier, clock)
    await rounds(monitor, clock, 40)  # nothing to do, no steps for 80 s: idle, not stalled
    assert monitor.up("edge")
    tier.answer.clear()  # a wedged worker: its probe is never answered
    await rounds(monitor, clock, 16)  # the probe started 30 s ago: within the bound
    assert monitor.up("edge")
    await rounds(monitor, clock, 1)
    assert not monitor.up("edge") and "has not answered a probe for 32 s" in monitor.why_down("edge")
    tier.answer.set()
    await rounds(monitor, clock, 1)
    assert monitor.up("edge")
    await monitor.close()


async def test_a_killed_or_refusing_tier_is_down_at_once_and_back_with_its_next_answer() -> None:
    clock, tier = Clock(), Tier()
    monitor = monitor_of(tier, clock)
    tier.is_ready = False  # its process died
    await rounds(monitor, clock, 1)
    assert not monitor.up("edge") and "not ready" in monitor.why_down("edge")
    tier.is_ready = True
    await rounds(monitor, clock, 1)
    assert monitor.up("edge")
    tier.refusing = True
    await rounds(monitor, clock, 1)
    assert not monitor.up("edge") and "refused a probe: the worker thread ended" in monitor.why_down("edge")
    tier.refusing = False
    await rounds(monitor, clock, 1)
    assert monitor.up("edge")
    monitor.mark_down("edge", "a turn found it unavailable")
    assert not monitor.up("edge")
    await rounds(monitor, clock, 1)
    assert monitor.up("edge")
    await monitor.close()


async def test_no_tier_up_names_each_and_why() -> None:
    clock, edge, gpu = Clock(), Tier(), Tier()
    gpu.tier = "gpu"
    monitor = HealthMonitor({"edge": edge, "gpu": gpu}, interval_s=INTERVAL_S, stall_timeout_s=STALL_S, clock=clock)
    edge.is_ready = False
    gpu.refusing = True
    await rounds(monitor, clock, 1)
    message = monitor.unavailable_message()
    assert "the edge tier is down: not ready" in message and "the gpu tier is down: it refused a probe" in message
    await monitor.close()
