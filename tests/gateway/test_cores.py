"""Cores that follow the load (gateway/tiers/cores.py): a tier alone with work computes on every
core, two busy tiers share as planned, and at no moment do the tiers that may compute hold more
threads than the budget, however their work comes and goes."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.tiers.cores import CoreArbiter
from llm_shared.cores import ClaimOnWork, CoreShare
from llm_shared.errors import EngineUnavailableError


class Tier:
    """A compute loop: jobs of a few steps; a thread count changes between two steps."""

    def __init__(self, name: str, threads: int, computing: dict[str, int], cpus: int) -> None:
        self.name = name
        self.threads = threads
        self.jobs = 0
        self.changes: list[int] = []
        self.cores: ClaimOnWork | None = None
        self.broken = False
        self._computing = computing  # every tier's threads while it computes: the shared ledger
        self._cpus = cpus
        self.peak = 0

    def share_cores(self, share: CoreShare) -> bool:
        self.cores = ClaimOnWork(share, self._apply, lambda: self.jobs > 0)
        return True

    def _apply(self, threads: int) -> None:  # ahead of the claimant's work, which has not started
        self.threads = threads

    async def set_threads(self, threads: int) -> None:
        if self.broken:
            raise EngineUnavailableError("gone")
        await asyncio.sleep(0)  # the step under way ends first
        self.threads = threads
        self.changes.append(threads)
        if self.name in self._computing:
            self._computing[self.name] = threads

    async def job(self, steps: int, until: asyncio.Event | None = None) -> None:
        """``steps`` steps, or as many as it takes until ``until`` is set."""
        assert self.cores is not None
        self.jobs += 1
        try:
            await self.cores.ready()
            step = 0
            while step < steps or (until is not None and not until.is_set()):
                step += 1
                self._computing[self.name] = self.threads
                total = sum(self._computing.values())
                self.peak = max(self.peak, total)
                assert total <= self._cpus, f"{self._computing} on {self._cpus} cores"
                await asyncio.sleep(0)
        finally:
            self.jobs -= 1
            if self.jobs == 0:
                self._computing.pop(self.name, None)
            self.cores.settle()


def two_tiers(cpus: int = 2, lend_after_s: float = 0.0) -> tuple[CoreArbiter, Tier, Tier]:
    computing: dict[str, int] = {}
    arbiter = CoreArbiter(cpus, lend_after_s=lend_after_s)
    edge, torch = Tier("edge", 1, computing, cpus), Tier("torch", 1, computing, cpus)
    assert arbiter.add("edge", edge, split=cpus // 2, threads=1)
    assert arbiter.add("torch", torch, split=cpus - cpus // 2, threads=1)
    return arbiter, edge, torch


async def test_a_tier_is_computing_from_its_claim_to_its_release() -> None:
    """What the cascade asks before it wakes an idle edge beside a busy torch tier."""
    arbiter, edge, torch = two_tiers(cpus=2)
    assert not arbiter.computing(edge) and not arbiter.computing(torch)
    until = asyncio.Event()
    job = asyncio.create_task(torch.job(1, until))
    while torch.cores is None or not torch.cores.claimed:
        await asyncio.sleep(0)
    assert arbiter.computing(torch) and not arbiter.computing(edge)
    assert not arbiter.computing(object())  # not one of its tiers
    until.set()
    await job
    assert not arbiter.computing(torch)


async def test_a_tier_alone_with_work_computes_on_every_core() -> None:
    arbiter, edge, torch = two_tiers(cpus=2)
    await edge.job(3)
    assert edge.threads == 2 and arbiter.pools == {"edge": 2, "torch": 1}
    await torch.job(3)  # the edge is idle: nothing to shrink, the core takes both
    assert torch.threads == 2 and edge.changes == []


async def test_two_busy_tiers_share_as_planned_and_the_survivor_grows_after_the_other_ends() -> None:
    arbiter, edge, torch = two_tiers(cpus=4, lend_after_s=0.01)
    stop = asyncio.Event()
    long_edge = asyncio.create_task(edge.job(1, until=stop))
    while edge.threads != 4:
        await asyncio.sleep(0)
    await torch.job(5)  # the edge shrinks to its share before the core computes
    assert edge.changes == [2] and torch.threads == 2
    while edge.threads != 4:  # the core went idle: after lend_after_s the edge grows back into its cores
        await asyncio.sleep(0.005)
    stop.set()
    await asyncio.wait_for(long_edge, 30)
    assert edge.changes == [2, 4]
    assert arbiter.reassignments == 4 and arbiter.claims == 2  # edge 1->4, 4->2, torch 1->2, edge 2->4


async def test_a_pause_shorter_than_lend_after_keeps_the_cores_where_they_are() -> None:
    arbiter, edge, torch = two_tiers(cpus=2, lend_after_s=30.0)
    long_edge = asyncio.create_task(edge.job(1, until=asyncio.Event()))
    while edge.threads != 2:
        await asyncio.sleep(0)
    await torch.job(2)
    await torch.job(2)  # its cores were still its own: no claim had to shrink anything again
    long_edge.cancel()
    await asyncio.gather(long_edge, return_exceptions=True)
    assert edge.changes == [1]
    await arbiter.close()


@pytest.mark.parametrize("seed", range(6))
async def test_random_traffic_never_oversubscribes(seed: int) -> None:
    arbiter, edge, torch = two_tiers(cpus=random.Random(seed).choice([2, 3, 4, 8]), lend_after_s=0.0)
    rng = random.Random(seed)
    jobs = []
    for _ in range(60):
        tier = rng.choice([edge, torch])
        jobs.append(asyncio.create_task(tier.job(rng.randint(1, 6))))
        for _ in range(rng.randint(0, 4)):
            await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(*jobs), 30)  # Tier.job asserts the budget at every step
    assert max(edge.peak, torch.peak) <= arbiter.cpus
    assert edge.jobs == torch.jobs == 0


async def test_a_tier_that_cannot_shrink_leaves_the_claimant_what_is_left() -> None:
    arbiter, edge, torch = two_tiers(cpus=4, lend_after_s=30.0)
    long_edge = asyncio.create_task(edge.job(1, until=asyncio.Event()))
    while edge.threads != 4:
        await asyncio.sleep(0)
    edge.broken = True  # its loop died: it cannot confirm anything
    claimed = asyncio.create_task(torch.cores.ready())  # type: ignore[union-attr]
    torch.jobs += 1
    await asyncio.wait_for(claimed, 30)
    assert torch.threads == 1  # 4 cores, 4 still counted to the edge: the floor of one thread
    torch.jobs -= 1
    long_edge.cancel()
    await asyncio.gather(long_edge, return_exceptions=True)
    await arbiter.close()


def test_the_budget_must_hold_a_thread() -> None:
    with pytest.raises(ValueError):
        CoreArbiter(0)
