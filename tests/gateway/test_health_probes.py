"""The tier health monitor on its own: when a probe that does not answer in time marks a tier down."""

from __future__ import annotations

from fake_engine import FakeEngine

from gateway.cascade.health import HealthMonitor

TIMEOUT_S = 0.05  # a hung probe costs this per round; the tiers here answer at once or never


class SteppingEngine(FakeEngine):
    """A tier busy serving turns: it has made another step by every look at its stats (as on a
    loaded machine, where the probe's round trip is what is slow, not the tier)."""

    def __init__(self, stepping: bool) -> None:
        super().__init__(tier="edge")
        self.stepping = stepping
        self.steps = 0

    def stats(self) -> dict[str, float]:
        if self.stepping:
            self.steps += 1
        return {**super().stats(), "steps": float(self.steps)}


async def rounds(monitor: HealthMonitor, n: int) -> None:
    for _ in range(n):
        await monitor.probe_all()


async def test_slow_probes_of_a_tier_that_keeps_stepping_do_not_mark_it_down() -> None:
    busy = SteppingEngine(stepping=True)
    busy.probe_hangs = True
    monitor = HealthMonitor({"edge": busy}, interval_s=1.0, timeout_s=TIMEOUT_S, slow_probes_to_down=3)
    await rounds(monitor, 6)
    state = monitor.state("edge")
    assert monitor.up("edge") and state.slow_in_a_row == 0 and state.slow_while_stepping == 6


async def test_a_tier_that_stopped_stepping_is_down_after_its_slow_probes_and_back_when_one_answers() -> None:
    wedged = SteppingEngine(stepping=False)
    wedged.probe_hangs = True
    monitor = HealthMonitor({"edge": wedged}, interval_s=1.0, timeout_s=TIMEOUT_S, slow_probes_to_down=3)
    await rounds(monitor, 2)
    assert monitor.up("edge")
    await rounds(monitor, 1)
    assert not monitor.up("edge") and "3 probes in a row" in monitor.state("edge").reason
    wedged.stepping = True  # stepping again does not bring it back: only an answered probe does
    await rounds(monitor, 1)
    assert not monitor.up("edge")
    wedged.probe_hangs = False
    await rounds(monitor, 1)
    assert monitor.up("edge")


async def test_a_tier_without_a_step_count_is_judged_by_its_probes_alone() -> None:
    plain = FakeEngine(tier="gpu")  # its stats have no "steps"
    plain.probe_hangs = True
    monitor = HealthMonitor({"gpu": plain}, interval_s=1.0, timeout_s=TIMEOUT_S, slow_probes_to_down=2)
    await rounds(monitor, 2)
    assert not monitor.up("gpu")
