"""The supervisor of an engine tier: a dead instance is replaced with backoff, and meanwhile
the tier says it is not ready and refuses turns at once instead of hanging them."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine

from gateway.tiers.supervisor import SupervisedEngine
from llm_shared.contract import FinishEvent, SamplingParams
from llm_shared.errors import EngineUnavailableError


class MortalEngine(FakeEngine):
    """A fake tier that can die like a killed core process."""

    def __init__(self) -> None:
        super().__init__(tier="gpu", tokens_per_second=200)
        self._lost = asyncio.get_running_loop().create_future()

    async def wait_lost(self) -> None:
        await asyncio.shield(self._lost)

    def die(self) -> None:
        self.is_ready = False
        if not self._lost.done():
            self._lost.set_result(None)

    async def close(self) -> None:
        await super().close()
        self.die()


async def turn(engine: SupervisedEngine, rid: str) -> FinishEvent:
    events = [e async for e in engine.generate(rid, [1, 2, 3], SamplingParams(max_tokens=4))]
    assert isinstance(events[-1], FinishEvent)
    return events[-1]


async def test_a_dead_instance_is_replaced_and_turns_succeed_again() -> None:
    instances: list[MortalEngine] = []
    failures = 2

    async def start() -> MortalEngine:
        nonlocal failures
        if failures:
            failures -= 1
            raise EngineUnavailableError("the core exited before it was ready")
        instances.append(MortalEngine())
        return instances[-1]

    first = MortalEngine()
    engine = SupervisedEngine(first, start, initial_backoff_s=0.01, max_backoff_s=0.05)
    try:
        assert (await turn(engine, "a")).reason in ("stop", "length")
        first.die()
        assert not engine.ready
        with pytest.raises(EngineUnavailableError):  # refused at once while it restarts
            await turn(engine, "b")
        for _ in range(2000):
            if engine.ready:
                break
            await asyncio.sleep(0.005)
        assert engine.ready and engine.current is instances[0]
        assert engine.restarts == 1 and engine.failed_starts == 2
        assert (await turn(engine, "c")).reason in ("stop", "length")
        assert engine.stats()["restarts"] == 1.0
    finally:
        await engine.close()
    assert not engine.ready and instances[0].closed


async def test_close_stops_supervising() -> None:
    starts = 0

    async def start() -> MortalEngine:
        nonlocal starts
        starts += 1
        return MortalEngine()

    first = MortalEngine()
    engine = SupervisedEngine(first, start, initial_backoff_s=0.01)
    await engine.close()
    await asyncio.sleep(0.05)
    assert starts == 0 and first.closed
