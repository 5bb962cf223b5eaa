"""What every limits store promises, run against each backend (``env``: in-process with a fake
clock, Redis with its own). Limits are chosen so a bucket refills slowly (one request in 20 s,
one token a second): on Redis time runs, and the assertions allow for what refilled meanwhile
(``env.drift``) rather than count on the machine being quick."""

from __future__ import annotations

import time

import pytest
from conftest import Env
from limits_harness import eventually

from gateway.auth import AuthError, RateLimitedError
from gateway.config.limits import Limits
from gateway.limits import LimitsStore

SLOW = Limits(requests_per_minute=3, tokens_per_minute=60, max_running_per_key=2, max_sessions_per_key=2,
              max_sessions=3)


async def remaining_tokens(store: LimitsStore, key: str) -> int:
    return (await store.snapshot(key)).tokens.remaining


async def test_a_keys_request_rate_holds(env: Env) -> None:
    store = env.store(SLOW)
    seen = [(await store.admit("k")).requests.remaining for _ in range(3)]
    with pytest.raises(RateLimitedError) as refused:
        await store.admit("k")
    e = refused.value
    assert (e.code, e.type) == ("rate_limit_exceeded", "requests")
    # One request every 20 s: the next comes 20 s after the bucket emptied, less what refilled since.
    assert 20.0 - env.elapsed() - 1e-6 <= e.retry_after_s <= 20.0 + 1e-6
    for got, want in zip(seen, (2, 1, 0), strict=True):
        assert want <= got <= want + env.drift(3)
    snap = await store.snapshot("k")
    assert snap.requests.limit == 3 and snap.requests.remaining <= env.drift(3)
    assert 60.0 - 20.0 * env.drift(3) - 1e-6 <= snap.requests.reset_seconds <= 60.0 + 1e-6


async def test_tokens_are_reserved_then_refunded_or_charged(env: Env) -> None:
    store = env.store(SLOW)
    first = await store.reserve("k", 50)
    assert first.tokens == 50
    with pytest.raises(RateLimitedError) as refused:
        await store.reserve("k", 50)  # 10 left: 40 short, at a token a second
    assert refused.value.type == "tokens"
    assert 40.0 - env.elapsed() - 1e-6 <= refused.value.retry_after_s <= 40.0 + 1e-6
    assert "50 requested" in refused.value.message

    await store.settle(first, 20)  # 30 unused: refunded
    assert 40 <= await remaining_tokens(store, "k") <= 40 + env.drift(60)
    second = await store.reserve("k", 30)
    await store.settle(second, 35)  # 5 beyond the reservation: charged
    await store.settle(second, 35)  # settled once only
    assert 5 <= await remaining_tokens(store, "k") <= 5 + env.drift(60)


async def test_a_keys_audio_seconds_are_charged_and_refused_past_the_bucket(env: Env) -> None:
    """Speech recognized and spoken is charged to the key's audio bucket (60 s a minute here): a
    long recording is served from what is left and leaves a debt; the next is refused until it is
    repaid; another key is not affected."""
    limits = Limits(requests_per_minute=3, tokens_per_minute=60, audio_seconds_per_minute=60)
    store = env.store(limits)
    await store.spend_audio("k", 50.0)
    await store.spend_audio("k", 30.0)  # 10 s left: served, 20 s of debt
    with pytest.raises(RateLimitedError) as refused:
        await store.spend_audio("k", 1.0)
    e = refused.value
    assert (e.code, e.type) == ("rate_limit_exceeded", "audio") and "60 seconds of audio" in e.message
    # a second a second: 21 s until one second is there again, less what refilled since
    assert 21.0 - env.elapsed() - 1e-6 <= e.retry_after_s <= 21.0 + 1e-6
    await store.spend_audio("other", 5.0)
    assert (await store.snapshot("k")).requests.remaining == 3  # audio is a bucket of its own


async def test_a_debt_refuses_admissions_until_repaid(env: Env) -> None:
    store = env.store(SLOW)
    big = await store.reserve("k", 10_000)  # more than a minute's budget: reserves all of it
    assert big.tokens == 60
    await store.settle(big, 100)  # 40 beyond: the bucket owes 40 tokens
    with pytest.raises(RateLimitedError) as refused:
        await store.admit("k")
    assert refused.value.type == "tokens"
    assert 41.0 - env.elapsed() - 1e-6 <= refused.value.retry_after_s <= 41.0 + 1e-6
    snap = await store.snapshot("k")
    assert snap.tokens.remaining == 0 and snap.tokens.reset_seconds > 60.0


async def test_running_generations_are_capped(env: Env) -> None:
    store = env.store(Limits(tokens_per_minute=100_000, max_running_per_key=2))
    first = await store.reserve("k", 10, holder="resp_1")
    await store.reserve("k", 10, holder="resp_2")
    assert await store.lease_count("running", "k") == 2
    with pytest.raises(RateLimitedError) as refused:
        await store.reserve("k", 10)
    assert (refused.value.type, refused.value.retry_after_s) == ("requests", 1.0)
    assert "2 generations running (limit 2)" in refused.value.message
    await store.settle(first, 3)
    assert await store.lease_count("running", "k") == 1
    await store.reserve("k", 10)


async def test_sessions_are_capped_per_key_and_per_process(env: Env) -> None:
    store = env.store(SLOW)  # 2 sessions per key, 3 in this process
    a1 = await store.acquire_lease("session", "a", holder="sess_a1")
    await store.acquire_lease("session", "a")
    with pytest.raises(AuthError) as per_key:
        await store.acquire_lease("session", "a")
    assert (per_key.value.status, per_key.value.code) == (429, "too_many_sessions")
    await store.acquire_lease("session", "b")
    with pytest.raises(AuthError) as process:
        await store.acquire_lease("session", "b")
    assert (process.value.status, process.value.code) == (503, "server_busy")
    assert store.held("session") == 3

    await store.release(a1)
    await store.release(a1)  # released once only: frees one slot, not two
    assert store.held("session") == 2
    assert await store.lease_count("session", "a") == 1
    await store.acquire_lease("session", "b")
    with pytest.raises(AuthError):
        await store.acquire_lease("session", "a")


async def test_an_abandoned_lease_expires_and_frees_its_cap(env: Env) -> None:
    """A gateway that died holds leases nobody renews: after the TTL they stop counting."""
    ttl = env.short_ttl()
    store = env.store(Limits(max_sessions_per_key=1, max_running_per_key=1), lease_ttl_s=ttl, auto_renew=False)
    started = time.monotonic()
    await store.acquire_lease("session", "k")
    await store.reserve("k", 10)
    for attempt in (store.acquire_lease("session", "k"), store.reserve("k", 10)):
        try:
            await attempt
        except (AuthError, RateLimitedError):
            pass
        else:  # only once the TTL has gone by (a very slow machine)
            assert time.monotonic() - started >= ttl

    env.expire(ttl)

    async def both_free() -> bool:
        return (await store.lease_count("session", "k"), await store.lease_count("running", "k")) == (0, 0)

    await eventually(both_free)
    await store.acquire_lease("session", "k")
    await store.reserve("k", 10)


async def test_a_renewed_lease_outlives_its_ttl(env: Env) -> None:
    ttl = env.short_ttl()
    store = env.store(Limits(max_sessions_per_key=1), lease_ttl_s=ttl, auto_renew=False)
    lease = await store.acquire_lease("session", "k")
    for _ in range(3):  # 1.8 TTLs in all: alive only by renewal
        await env.wait(ttl * 0.6)
        renewed = time.monotonic()
        await store.renew(lease)
        # Counted, unless a stall longer than the TTL came between (possible on Redis only).
        assert await store.lease_count("session", "k") == 1 or time.monotonic() - renewed >= ttl
    env.expire(ttl)

    async def expired() -> bool:
        return await store.lease_count("session", "k") == 0

    await eventually(expired)
    await store.release(lease)  # a lapsed lease released: harmless
    await store.renew(lease)  # and a released one is not brought back
    assert await store.lease_count("session", "k") == 0


async def test_keys_are_independent(env: Env) -> None:
    store = env.store(Limits(requests_per_minute=1, tokens_per_minute=10, max_running_per_key=1,
                             max_sessions_per_key=1))
    await store.admit("a")
    await store.reserve("a", 100)
    await store.acquire_lease("session", "a")
    with pytest.raises(RateLimitedError):
        await store.admit("a")
    await store.admit("b")
    await store.reserve("b", 100)
    await store.acquire_lease("session", "b")
    snap = await store.snapshot("c")
    assert (snap.requests.remaining, snap.tokens.remaining) == (1, 10)


async def test_settle_nowait_settles_in_the_background(env: Env) -> None:
    store = env.store(Limits(tokens_per_minute=60, max_running_per_key=1))
    reservation = await store.reserve("k", 50)
    store.settle_nowait(reservation, 0)
    store.settle_nowait(reservation, 0)
    assert reservation.settled

    async def settled() -> bool:
        return await store.lease_count("running", "k") == 0

    await eventually(settled)
    assert 60 - 1 <= await remaining_tokens(store, "k") <= 60


async def test_the_snapshot_renders_the_openai_headers(env: Env) -> None:
    store = env.store(SLOW)
    fresh = await store.snapshot("k")
    assert fresh.headers() == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "0.000s",
        "x-ratelimit-limit-tokens": "60", "x-ratelimit-remaining-tokens": "60", "x-ratelimit-reset-tokens": "0.000s",
    }
    assert fresh.rate_limits() == [{"name": "requests", "limit": 3, "remaining": 3, "reset_seconds": 0.0},
                                   {"name": "tokens", "limit": 60, "remaining": 60, "reset_seconds": 0.0}]
    after = await store.admit("k")
    assert after.requests.remaining == 2 and 20.0 - env.elapsed() <= after.requests.reset_seconds <= 20.0 + 1e-6
    assert store.peek("k").requests.remaining == 2
