"""Cores that follow the load: the host's CPU budget moved to the tiers that have work.

The host plan (``gateway.config.host``) splits the budget so that the tiers together never run
more threads than there are cores: on 2 cores, one for the edge and one for the torch core. A
split that holds at every moment leaves a tier's share idle whenever that tier has nothing to
run: the edge alone got half the machine. Here the split holds only while both tiers have work;
a tier that is alone with work computes on the whole budget.

What keeps the cores from being oversubscribed at any moment: a tier that was idle *claims*
before it computes (``llm_shared.cores``: the edge front holds its requests, the torch client
its adds), and the claim returns only after every busy tier that must shrink has confirmed the
change, which it makes between two of its steps; the claimant's own count goes ahead of its
work in the same ordered channel. Growing a busy tier needs no such wait: the tiers it takes
from are idle and must claim before they compute again, and claims are served one at a time. A
tier that goes idle lends its cores after ``lend_after_s``, so that a tier between two requests
(a conversation's turns, the cascade's escalation) does not hand them back and forth.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.config import Config
from gateway.tiers.build import host_plan, threads_follow_load
from llm_shared.cores import SharesCores
from llm_shared.errors import EngineError

log = logging.getLogger(__name__)


@dataclass
class _Pool:
    name: str
    tier: SharesCores
    split: int  # its threads while every pool has work (the static plan's share)
    threads: int  # what it computes with now (the last count set or granted)
    busy: bool = False  # it holds a claim: it may compute


class _Share:
    """One pool's ``CoreShare``, handed to its tier."""

    def __init__(self, arbiter: CoreArbiter, name: str) -> None:
        self._arbiter = arbiter
        self._name = name

    async def claim(self) -> int:
        return await self._arbiter.claim(self._name)

    def release(self) -> None:
        self._arbiter.release(self._name)


class CoreArbiter:
    """Moves ``cpus`` threads between pools (``add``); runs on the gateway's event loop.

    ``on_threads(pool, threads)`` is told each pool's new count (the gateway's gauge),
    ``on_claim(pool, seconds)`` how long each claim waited for the busy pools to make room."""

    def __init__(self, cpus: int, *, lend_after_s: float = 0.05, change_timeout_s: float = 10.0,
                 on_threads: Callable[[str, int], None] | None = None,
                 on_claim: Callable[[str, float], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if cpus < 1:
            raise ValueError(f"cpus must be >= 1, got {cpus}")
        self.cpus = cpus
        self.lend_after_s = lend_after_s
        self.change_timeout_s = change_timeout_s
        self._on_threads = on_threads
        self._on_claim = on_claim
        self._clock = clock
        self._pools: dict[str, _Pool] = {}
        self._lock = asyncio.Lock()
        self._lend_task: asyncio.Task[None] | None = None
        self.reassignments = 0  # pool thread counts changed (claims and lends)
        self.claims = 0

    def add(self, name: str, tier: SharesCores, split: int, threads: int) -> bool:
        """Move ``tier``'s threads from now on; it computes on ``threads`` now and on ``split``
        whenever every pool has work. False where the tier's threads are fixed (left as they are)."""
        if name in self._pools:
            raise ValueError(f"pool {name!r} is already shared")
        if not tier.share_cores(_Share(self, name)):
            return False
        self._pools[name] = _Pool(name, tier, split, threads)
        return True

    def computing(self, tier: object) -> bool:
        """Whether ``tier`` (a pool's tier, by identity) holds a claim: it has work and computes on
        its share of the cores now."""
        return any(pool.busy for pool in self._pools.values() if pool.tier is tier)

    @property
    def pools(self) -> dict[str, int]:
        """Each pool's threads now."""
        return {name: pool.threads for name, pool in self._pools.items()}

    def _wanted(self) -> dict[str, int]:
        """The busy pools' threads: the whole budget for one alone, the static split for several."""
        busy = [pool for pool in self._pools.values() if pool.busy]
        if len(busy) == 1:
            return {busy[0].name: self.cpus}
        return {pool.name: pool.split for pool in busy}

    async def claim(self, name: str) -> int:
        """``name``'s threads, once the busy pools have made room for them."""
        pool = self._pools[name]
        started = self._clock()
        async with self._lock:
            pool.busy = True
            try:
                wanted = self._wanted()
                for other in self._pools.values():
                    if other is not pool and other.busy and other.threads > wanted[other.name]:
                        await self._change(other, wanted[other.name])
            except BaseException:  # cancelled (the tier is closing): it computes nothing
                pool.busy = False
                raise
            room = self.cpus - sum(p.threads for p in self._pools.values() if p is not pool and p.busy)
            self._set(pool, max(1, min(wanted[name], room)))
        self.claims += 1
        if self._on_claim is not None:
            self._on_claim(name, self._clock() - started)
        return pool.threads

    def release(self, name: str) -> None:
        """``name`` has no work left: after ``lend_after_s`` the busy pools grow into its cores."""
        self._pools[name].busy = False
        if self._lend_task is None and any(pool.busy for pool in self._pools.values()):
            self._lend_task = asyncio.get_running_loop().create_task(self._lend(), name="lend-cores")

    async def _lend(self) -> None:
        try:
            await asyncio.sleep(self.lend_after_s)  # a pause between two requests keeps the cores where they are
        finally:
            self._lend_task = None
        async with self._lock:
            wanted = self._wanted()
            for pool in self._pools.values():
                if pool.busy and pool.threads < wanted[pool.name]:
                    await self._change(pool, wanted[pool.name])

    async def _change(self, pool: _Pool, threads: int) -> None:
        """Set a busy pool's threads and wait until it computes on them."""
        try:
            await asyncio.wait_for(pool.tier.set_threads(threads), self.change_timeout_s)
        except (EngineError, TimeoutError, OSError) as e:
            # A tier that cannot answer computes nothing (it is gone) or is wedged: either way it
            # keeps the count it had, and the claimant gets what is left.
            log.warning("the %s pool did not take %d threads: %s", pool.name, threads, e)
            return
        self._set(pool, threads)

    def _set(self, pool: _Pool, threads: int) -> None:
        if threads == pool.threads:
            return
        pool.threads = threads
        self.reassignments += 1
        if self._on_threads is not None:
            self._on_threads(pool.name, threads)

    async def settled(self) -> None:
        """Returns once a lend under way (a tier that went idle) has been made."""
        task = self._lend_task
        if task is not None:
            await asyncio.shield(task)

    async def close(self) -> None:
        task, self._lend_task = self._lend_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def arbiter_for(config: Config, engines: Mapping[str, object],
                on_threads: Callable[[str, int], None] | None = None,
                on_claim: Callable[[str, float], None] | None = None) -> CoreArbiter | None:
    """The arbiter that moves the host plan's threads between the edge and the torch core, or
    None where they stay as planned (``threads_follow_load``)."""
    if not threads_follow_load(config):
        return None
    plan = host_plan(config)
    edge, torch = engines.get("edge"), engines.get("gpu")
    if not isinstance(edge, SharesCores) or not isinstance(torch, SharesCores):
        return None
    core = max(plan.engine, plan.drafter)  # the core's torch threads and its drafter take turns
    arbiter = CoreArbiter(plan.cpus, lend_after_s=config.host.lend_after_ms / 1000.0, on_threads=on_threads,
                          on_claim=on_claim)
    if not arbiter.add("edge", edge, plan.edge, plan.edge):
        log.info("threads: the %s edge's threads are fixed at load; both tiers keep the plan's", config.edge.backend)
        return None
    if not arbiter.add("torch", torch, core, core):
        arbiter.cpus -= core  # the edge alone moves, within what the core leaves
    log.info("threads follow the load: a tier alone with work computes on all %d, both share them as planned",
             plan.cpus)
    return arbiter
