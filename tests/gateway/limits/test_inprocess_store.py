"""The in-process store is today's ``RateLimiter`` and ``SessionSlots``: the same random sequences
of admissions, reservations, settlements, sessions and time steps give the same answers, the same
refusals (code, type, retry-after, message) and the same headers."""

from __future__ import annotations

import random

import pytest
from limits_harness import FakeClock

from gateway.auth import AuthError, RateLimitedError, RateLimiter, SessionSlots
from gateway.limits import InProcessStore, Lease, Limits, Reservation

LIMITS = Limits(requests_per_minute=5, tokens_per_minute=100, max_running_per_key=2, max_sessions_per_key=2,
                max_sessions=3)
KEYS = ("a", "b", "c")


def outcome(error: Exception | None) -> tuple[object, ...] | None:
    if error is None:
        return None
    if isinstance(error, RateLimitedError):
        return ("rate", error.code, error.type, round(error.retry_after_s, 9), error.message)
    assert isinstance(error, AuthError)
    return ("auth", error.status, error.code, error.type, error.message)


@pytest.mark.parametrize("seed", range(8))
async def test_same_answers_as_ratelimiter_and_sessionslots(seed: int) -> None:
    rng = random.Random(seed)
    old_clock, new_clock = FakeClock(), FakeClock()
    limiter = RateLimiter(LIMITS.requests_per_minute, LIMITS.tokens_per_minute, old_clock,
                          max_concurrent=LIMITS.max_running_per_key)
    slots = SessionSlots(LIMITS.max_sessions_per_key, LIMITS.max_sessions)
    # A TTL longer than the run stands for the renewals a live store makes.
    store = InProcessStore(LIMITS, clock=new_clock, lease_ttl_s=1e9, auto_renew=False)
    running: list[tuple[object, Reservation]] = []
    sessions: list[tuple[str, Lease]] = []
    seen: set[object] = set()

    for _ in range(400):
        op = rng.choice(("admit", "admit", "admit", "reserve", "settle", "open", "close", "wait"))
        key = rng.choice(KEYS)
        old: Exception | None = None
        new: Exception | None = None
        if op == "admit":
            try:
                limiter.admit(key)
            except RateLimitedError as e:
                old = e
            try:
                await store.admit(key)
            except RateLimitedError as e:
                new = e
        elif op == "reserve":
            max_tokens = rng.choice((1, 10, 40, 150))
            mine = theirs = None
            try:
                theirs = limiter.reserve(key, max_tokens)
            except RateLimitedError as e:
                old = e
            try:
                mine = await store.reserve(key, max_tokens)
            except RateLimitedError as e:
                new = e
            if theirs is not None and mine is not None:
                running.append((theirs, mine))
        elif op == "settle" and running:
            theirs, mine = running.pop(rng.randrange(len(running)))
            used = rng.randrange(0, 2 * mine.tokens + 1)
            limiter.settle(theirs, used)  # type: ignore[arg-type]
            await store.settle(mine, used)
        elif op == "open":
            lease = None
            try:
                slots.acquire(key)
            except AuthError as e:
                old = e
            try:
                lease = await store.acquire_lease("session", key)
            except AuthError as e:
                new = e
            if lease is not None and old is None:
                sessions.append((key, lease))
        elif op == "close" and sessions:
            key, lease = sessions.pop(rng.randrange(len(sessions)))
            slots.release(key)
            await store.release(lease)
        elif op == "wait":
            dt = rng.choice((0.5, 3.0, 12.0, 30.0))
            old_clock.advance(dt)
            new_clock.advance(dt)
        assert outcome(new) == outcome(old), op
        if new is not None:
            seen.add("running" if "generations running" in str(new) else getattr(new, "type", None) if
                     isinstance(new, RateLimitedError) else new.code)
        for k in KEYS:
            snap = store.peek(k)
            assert snap.headers() == limiter.headers(k)
            assert snap.rate_limits() == limiter.snapshot(k)
            assert await store.lease_count("session", k) == slots.count(k)
        assert store.held("session") == slots.total
    assert {"requests", "tokens", "running"} <= seen and seen & {"too_many_sessions", "server_busy"}, seen
    await store.aclose()
