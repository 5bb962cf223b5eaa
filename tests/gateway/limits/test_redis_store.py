"""What only a shared store can show, on a real ``redis-server``: two gateways share a key's
limits, a dead gateway's leases expire, and a Redis that goes away (stopped, or hung) under load
neither hangs a call nor stops the gateway, under either failure policy; both recover by
themselves when it returns."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from limits_harness import FakeClock, RedisServer, eventually
from redis.asyncio import Redis

from gateway.auth import AuthError, Clock, RateLimitedError
from gateway.config.limits import FailurePolicy
from gateway.limits import (
    FailoverStore,
    InProcessStore,
    Limits,
    LimitsStore,
    LimitsUnavailableError,
    RedisStore,
)

T = TypeVar("T")
BOUND_S = 15.0  # no call may take this long; the stores' own timeouts are far below it


async def bounded(call: Awaitable[T]) -> T:
    return await asyncio.wait_for(call, BOUND_S)


def gateway(server: RedisServer, limits: Limits, prefix: str, *, timeout_s: float = 10.0, lease_ttl_s: float = 30.0,
            auto_renew: bool = True) -> RedisStore:
    return RedisStore(limits, url=server.url, key_prefix=prefix, timeout_s=timeout_s, lease_ttl_s=lease_ttl_s,
                      auto_renew=auto_renew)


def failover(server: RedisServer, limits: Limits, policy: FailurePolicy, flips: list[bool],
             local_clock: Clock = time.monotonic) -> FailoverStore:
    shared = gateway(server, limits, "fo:", timeout_s=0.3, lease_ttl_s=5.0)
    local = InProcessStore(limits, clock=local_clock, lease_ttl_s=5.0)
    return FailoverStore(shared, local, policy=policy, retry_interval_s=0.1, on_degraded=flips.append)


def recovered(store: FailoverStore) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        await bounded(store.snapshot("k"))  # probes the shared store once the retry interval has passed
        return not store.degraded
    return check


def prefix() -> str:
    return f"test-{secrets.token_hex(6)}:"


async def succeeded(calls: list[Awaitable[object]]) -> int:
    results = await bounded(asyncio.gather(*calls, return_exceptions=True))
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, (RateLimitedError, AuthError)):
            raise r
    return sum(not isinstance(r, BaseException) for r in results)


async def test_two_gateways_share_a_keys_limits(redis_server: RedisServer) -> None:
    limits = Limits(requests_per_minute=10, tokens_per_minute=60, max_running_per_key=3, max_sessions_per_key=4)
    keys = prefix()
    a, b = gateway(redis_server, limits, keys), gateway(redis_server, limits, keys)
    started = time.monotonic()

    admitted = await succeeded([s.admit("req") for s in (a, b) for _ in range(15)])
    # One request every 6 s refills while they run; nothing else may pass.
    assert 10 <= admitted <= 10 + (time.monotonic() - started) / 6

    async def spend(store: LimitsStore) -> int:
        n = 0
        for _ in range(8):
            try:
                r = await store.reserve("tok", 10)
            except RateLimitedError:
                continue
            await store.settle(r, 10)
            n += 1
        return n

    spent = sum(await bounded(asyncio.gather(spend(a), spend(b))))
    assert 6 <= spent <= 6 + (time.monotonic() - started) / 10  # 60 tokens, 10 at a time, a token a second

    assert await succeeded([s.reserve("run", 1) for s in (a, b) for _ in range(5)]) == 3
    assert await succeeded([s.acquire_lease("session", "ses") for s in (a, b) for _ in range(5)]) == 4
    assert (await a.lease_count("running", "run"), await b.lease_count("session", "ses")) == (3, 4)
    assert (a.held("session") + b.held("session"), a.held("running") + b.held("running")) == (4, 3)
    await a.aclose()
    await b.aclose()


async def test_a_dead_gateways_leases_expire(redis_server: RedisServer) -> None:
    limits = Limits(max_sessions_per_key=2, max_running_per_key=1)
    keys, ttl = prefix(), 1.0
    dying, survivor = gateway(redis_server, limits, keys, lease_ttl_s=ttl), gateway(redis_server, limits, keys)
    await dying.acquire_lease("session", "k")
    await dying.acquire_lease("session", "k")
    await dying.reserve("k", 10)
    stopped = time.monotonic()
    await dying.aclose()  # as a killed process: no more renewals, nothing released
    for attempt in (survivor.acquire_lease("session", "k"), survivor.reserve("k", 10)):
        try:
            await attempt
        except (AuthError, RateLimitedError):
            pass
        else:
            assert time.monotonic() - stopped >= ttl

    async def freed() -> bool:
        return (await survivor.lease_count("session", "k"), await survivor.lease_count("running", "k")) == (0, 0)

    await eventually(freed)
    await survivor.reserve("k", 10)
    await survivor.aclose()


async def test_a_live_gateway_keeps_its_leases(redis_server: RedisServer) -> None:
    keys, ttl = prefix(), 1.0
    store = gateway(redis_server, Limits(), keys, lease_ttl_s=ttl)
    lease = await store.acquire_lease("session", "k")
    raw = Redis.from_url(redis_server.url)
    set_key = f"{keys}{{k}}:lease:session"
    before = await raw.zscore(set_key, lease.member)
    await asyncio.sleep(3 * ttl)  # what is tested is that time passed: three TTLs, renewed by the store's keeper

    async def counted() -> bool:
        return await store.lease_count("session", "k") == 1

    await eventually(counted)
    assert (await raw.zscore(set_key, lease.member) or 0) > (before or 0) + ttl
    await store.release(lease)
    assert await raw.zscore(set_key, lease.member) is None
    await raw.aclose()
    await store.aclose()


async def test_leases_come_back_after_redis_restarts_empty(own_redis: RedisServer) -> None:
    store = gateway(own_redis, Limits(max_sessions_per_key=1), prefix(), timeout_s=1.0, auto_renew=False)
    lease = await store.acquire_lease("session", "k")
    await store.admit("k")
    own_redis.restart()  # no persistence: every key is gone, and every loaded script

    async def renewed() -> bool:
        try:
            await store.renew(lease)  # what the keeper does every third of the TTL
            return await store.lease_count("session", "k") == 1
        except LimitsUnavailableError:  # the pool's old connections fail once each
            return False

    await eventually(renewed)
    with pytest.raises(AuthError):
        await store.acquire_lease("session", "k")
    assert (await store.admit("k")).requests.remaining == 599  # a fresh bucket, through a reloaded script
    await store.aclose()


async def test_fail_open_serves_under_local_limits_while_redis_is_away(own_redis: RedisServer) -> None:
    limits = Limits(requests_per_minute=6)
    flips: list[bool] = []
    store = failover(own_redis, limits, "fail_open", flips, local_clock=FakeClock())  # local buckets never refill
    await bounded(store.admit("k"))
    assert not store.degraded
    own_redis.stop()

    outcomes = []
    for _ in range(7):
        try:
            await bounded(store.admit("k"))
            outcomes.append("admitted")
        except RateLimitedError as e:
            outcomes.append(e.type)
    assert outcomes == ["admitted"] * 6 + ["requests"]  # this process's own bucket of 6
    assert store.degraded and flips == [True]
    lease = await bounded(store.acquire_lease("session", "k"))
    reservation = await bounded(store.reserve("k", 10))
    assert (lease.backend, reservation.backend) == ("memory", "memory")

    own_redis.start()
    await eventually(recovered(store))
    assert flips == [True, False]
    await store.release(lease)
    await store.settle(reservation, 5)
    assert store.held("session") == store.held("running") == 0
    assert (await bounded(store.admit("k"))).requests.remaining == 5  # Redis's bucket, new since its restart
    await store.aclose()


async def test_fail_closed_refuses_while_redis_is_away(own_redis: RedisServer) -> None:
    flips: list[bool] = []
    store = failover(own_redis, Limits(), "fail_closed", flips)
    reservation = await bounded(store.reserve("k", 10))
    lease = await bounded(store.acquire_lease("session", "k"))
    own_redis.stop()

    for call in (store.admit("k"), store.reserve("k", 10), store.acquire_lease("session", "k")):
        with pytest.raises(LimitsUnavailableError) as refused:
            await bounded(call)
        assert refused.value.code == "limits_unavailable" and refused.value.type == "server_error"
        assert 0 < refused.value.retry_after_s <= 0.1 + 1e-9
    assert store.degraded and flips == [True]
    await bounded(store.settle(reservation, 3))  # refuses nothing: the lease expires, the refund is lost
    await bounded(store.release(lease))
    assert store.held("session") == store.held("running") == 0
    assert (await bounded(store.snapshot("k"))).requests.limit == 600  # this process's view meanwhile

    own_redis.start()

    async def admitted() -> bool:
        try:
            await bounded(store.admit("k"))
        except LimitsUnavailableError:
            return False
        return True

    await eventually(admitted)
    assert not store.degraded and flips == [True, False]
    await store.aclose()


@pytest.mark.parametrize("outage", ["stopped", "hung"])
@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
async def test_an_outage_under_load_stalls_nothing_and_heals(own_redis: RedisServer, policy: FailurePolicy,
                                                            outage: str) -> None:
    """Eight clients reserve and settle in a loop while Redis is stopped (then started) or hung
    (SIGSTOP, then SIGCONT): every call returns within the bound, the clients are served locally
    (fail_open) or refused (fail_closed) meanwhile, and served by Redis again after."""
    limits = Limits(requests_per_minute=10**6, tokens_per_minute=10**9, max_running_per_key=10**6)
    flips: list[bool] = []
    store = failover(own_redis, limits, policy, flips)
    counts: Counter[str] = Counter()
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            try:
                reservation = await bounded(store.reserve("k", 1))
                await bounded(store.settle(reservation, 1))
                counts[reservation.backend] += 1
            except LimitsUnavailableError:
                counts["refused"] += 1
            await asyncio.sleep(0.005)

    clients = [asyncio.create_task(client()) for _ in range(8)]

    def at_least(name: str, n: int) -> Awaitable[bool]:
        async def check() -> bool:
            for task in clients:  # a client that failed (a call past the bound) fails the test now
                if task.done():
                    task.result()
            return counts[name] >= n
        return check()

    await eventually(lambda: at_least("redis", 20))
    own_redis.stop() if outage == "stopped" else own_redis.pause()
    await eventually(lambda: at_least("memory" if policy == "fail_open" else "refused", 20))
    assert store.degraded
    own_redis.start() if outage == "stopped" else own_redis.resume()
    served = counts["redis"]
    await eventually(lambda: at_least("redis", served + 20))
    stop.set()
    await bounded(asyncio.gather(*clients))
    await eventually(recovered(store))
    assert flips[:2] == [True, False]
    await store.aclose()


async def test_a_lease_whose_answer_was_lost_is_taken_back_not_left_for_its_ttl(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An acquire whose script ran in Redis but whose answer came too late (a timeout: a loaded
    event loop reads it after ``timeout_ms``) leaves a member nobody holds; the store takes it
    back at once instead of leaving the key a slot short for the lease's TTL (issue 39, item 6)."""
    limits = Limits(max_sessions_per_key=1)
    store = gateway(redis_server, limits, prefix(), timeout_s=10.0, lease_ttl_s=30.0, auto_renew=False)
    call = store._call

    async def answer_lost(what: str, op: Awaitable[T]) -> T:
        result = await call(what, op)  # it ran in Redis...
        if what == "acquire":
            raise store._unavailable(what, "no answer within 100 ms")  # ...and its answer was lost
        return result

    try:
        monkeypatch.setattr(store, "_call", answer_lost)
        with pytest.raises(LimitsUnavailableError):
            await store.acquire_lease("session", "k", "s1")
        monkeypatch.setattr(store, "_call", call)
        await eventually(lambda: _count_is(store, "k", 0), within_s=10.0)
        lease = await bounded(store.acquire_lease("session", "k", "s2"))  # the key's one slot is free
        await bounded(store.release(lease))
    finally:
        await store.aclose()


async def _count_is(store: RedisStore, key: str, n: int) -> bool:
    return await bounded(store.lease_count("session", key)) == n
