"""The failure policy's bookkeeping, with no Redis: a shared store that fails (or hangs) on demand
and a fake clock. While the shared store is away, calls leave it alone for the retry interval,
then one call at a time probes it; what it granted goes back to it; the process cap counts
leases from both stores."""

from __future__ import annotations

import asyncio

import pytest
from limits_harness import FakeClock

from gateway.auth import AuthError, RateLimitedError
from gateway.config.limits import FailurePolicy, LeaseKind
from gateway.limits import FailoverStore, InProcessStore, Lease, Limits, LimitsUnavailableError, Snapshot

LIMITS = Limits(requests_per_minute=100, max_sessions=3)
INTERVAL = 1.0


class FlakyStore(InProcessStore):
    """A shared store stand-in: down (raises) or hung (waits for ``hang``) on demand."""

    backend = "flaky"

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(LIMITS, clock=clock, auto_renew=False)
        self.down = False
        self.refuse = False
        self.hang: asyncio.Event | None = None
        self.calls = 0
        self.pings = 0

    async def _reach(self) -> None:
        self.calls += 1
        if self.hang is not None:
            await self.hang.wait()
        if self.down:
            raise LimitsUnavailableError("the flaky store is down", retry_after_s=INTERVAL)
        if self.refuse:
            raise RateLimitedError("no", bucket="requests", retry_after_s=1.0)

    async def admit(self, key_id: str) -> Snapshot:
        await self._reach()
        return await super().admit(key_id)

    async def ping(self) -> None:
        self.pings += 1
        await self._reach()

    async def acquire_lease(self, kind: LeaseKind, key_id: str, holder: str = "") -> Lease:
        await self._reach()
        return await super().acquire_lease(kind, key_id, holder)

    async def release(self, lease: Lease) -> None:
        self._end(lease)  # forgotten first, as RedisStore does
        await self._reach()


def build(policy: FailurePolicy = "fail_open") -> tuple[FailoverStore, FlakyStore, FakeClock, list[bool]]:
    clock = FakeClock()
    shared = FlakyStore(clock)
    flips: list[bool] = []
    store = FailoverStore(shared, InProcessStore(LIMITS, clock=clock), policy=policy, retry_interval_s=INTERVAL,
                          on_degraded=flips.append, clock=clock)
    return store, shared, clock, flips


async def test_the_shared_store_is_left_alone_then_probed_one_call_at_a_time() -> None:
    store, shared, clock, flips = build()
    await store.admit("k")
    shared.down = True
    await store.admit("k")  # tried, failed, served locally
    for _ in range(5):
        await store.admit("k")
    assert (shared.calls, store.degraded, flips) == (2, True, [True])

    clock.advance(INTERVAL)
    shared.hang = asyncio.Event()
    probe = asyncio.create_task(store.admit("k"))
    await asyncio.sleep(0)
    others = [await store.admit("k") for _ in range(4)]  # served locally while the probe waits
    assert shared.calls == 3 and len(others) == 4
    shared.down = False
    shared.hang.set()
    await probe
    assert (store.degraded, flips) == (False, [True, False])
    await store.admit("k")
    assert shared.calls == 4
    await store.aclose()


async def test_a_refusal_is_an_answer_that_ends_the_outage() -> None:
    store, shared, clock, flips = build()
    shared.down = True
    await store.admit("k")
    clock.advance(INTERVAL)
    shared.down, shared.refuse = False, True
    with pytest.raises(RateLimitedError):
        await store.admit("k")
    assert (store.degraded, flips) == (False, [True, False])
    await store.aclose()


async def test_a_failed_cleanup_does_not_postpone_the_probe() -> None:
    store, shared, clock, _ = build()
    lease = await store.acquire_lease("session", "k")
    shared.down = True
    await store.admit("k")
    clock.advance(0.9 * INTERVAL)
    await store.release(lease)  # fails, is not raised, and leaves the retry time as it was
    assert shared.held("session") == 0
    clock.advance(0.2 * INTERVAL)
    calls = shared.calls
    await store.admit("k")
    assert shared.calls == calls + 1
    await store.aclose()


async def test_fail_closed_says_when_to_retry() -> None:
    store, shared, clock, _ = build("fail_closed")
    shared.down = True
    with pytest.raises(LimitsUnavailableError):
        await store.admit("k")
    clock.advance(0.4 * INTERVAL)
    with pytest.raises(LimitsUnavailableError) as refused:
        await store.admit("k")
    assert refused.value.retry_after_s == pytest.approx(0.6 * INTERVAL)
    assert shared.calls == 1
    await store.aclose()


async def test_the_process_cap_counts_leases_from_both_stores() -> None:
    store, shared, _, _ = build()
    granted = [await store.acquire_lease("session", key) for key in ("a", "b")]
    shared.down = True
    granted.append(await store.acquire_lease("session", "c"))
    assert [lease.backend for lease in granted] == ["flaky", "flaky", "memory"]
    with pytest.raises(AuthError) as full:
        await store.acquire_lease("session", "d")
    assert full.value.code == "server_busy"
    await store.release(granted[2])  # back to the local store that granted it
    assert (store.local.held("session"), store.held("session")) == (0, 2)
    await store.aclose()


async def test_an_idle_gateway_learns_its_store_is_back_from_recover() -> None:
    store, shared, clock, flips = build()
    shared.down = True
    await store.admit("k")
    assert store.degraded
    shared.down = False
    assert await store.recover() is False and shared.pings == 0  # not due yet: left alone
    clock.advance(INTERVAL)
    shared.down = True
    assert await store.recover() is False and shared.pings == 1  # due, still down
    clock.advance(INTERVAL)
    shared.down = False
    assert await store.recover() is True and flips == [True, False]  # back, with no admission at all
    assert shared.pings == 2
