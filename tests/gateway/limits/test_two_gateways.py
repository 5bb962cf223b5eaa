"""Two real gateway processes on one real Redis: a key's limits hold in sum across both, and a
gateway killed mid-stream gives back what it held only when its leases expire.

Each limit is set so that either gateway alone, keeping its own count, would let through about
twice what the pair may: a test fails if the limits are per process."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import websockets
from gateway_procs import Gateway, chat, gateway_config, open_session, start_response
from limits_harness import RedisServer

T = TypeVar("T")
WITHIN_S = 60.0  # how long a freed limit may take to show, at most (only a broken store waits that long)


def pair(directory: Path, redis: RedisServer, *, limits: dict[str, Any] | None = None,
         **server: Any) -> tuple[Gateway, Gateway]:
    """Two gateways on ``redis``, in a key space of this test's own, with the same config."""
    prefix = f"pair-{secrets.token_hex(4)}:"
    a, b = (Gateway(gateway_config(directory, name, redis_url=redis.url, prefix=prefix, limits=limits, **server))
            for name in ("a", "b"))
    return a, b


async def until(attempt: Callable[[], Awaitable[T]], admitted: Callable[[T], bool]) -> tuple[T, float]:
    """Repeat ``attempt`` until ``admitted`` says yes: (its result, when). Bounded by ``WITHIN_S``."""
    deadline = time.monotonic() + WITHIN_S
    while True:
        result = await attempt()
        if admitted(result):
            return result, time.monotonic()
        assert time.monotonic() < deadline, f"still refused after {WITHIN_S:.0f} s: {result!r}"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(300)
async def test_a_keys_request_rate_holds_in_sum_across_two_gateways(redis_server: RedisServer,
                                                                    tmp_path: Path) -> None:
    rpm = 8
    a, b = pair(tmp_path, redis_server, requests_per_minute=rpm)
    async with a, b:
        started = time.monotonic()
        # Each gateway is asked for more than the whole limit, all at once.
        statuses = await asyncio.gather(*(chat(gw.url) for gw in (a, b) for _ in range(rpm + 2)))
        elapsed = time.monotonic() - started
    assert set(statuses) <= {200, 429}, statuses
    admitted = statuses.count(200)
    refilled = math.ceil(elapsed * rpm / 60)  # the bucket refills continuously while the test runs
    assert rpm <= admitted <= rpm + refilled, (admitted, elapsed)


@pytest.mark.timeout(300)
async def test_a_keys_session_cap_holds_in_sum_across_two_gateways(redis_server: RedisServer,
                                                                   tmp_path: Path) -> None:
    a, b = pair(tmp_path, redis_server, max_sessions_per_key=3)
    async with a, b:
        sessions = [await open_session(gw) for gw in (a, b, a)]
        assert all(isinstance(ws, websockets.ClientConnection) for ws in sessions), sessions
        assert await open_session(b) == 429 and await open_session(a) == 429
        first = sessions[0]
        assert isinstance(first, websockets.ClientConnection)
        await first.close()  # released by gateway a; gateway b sees it
        opened, _ = await until(lambda: open_session(b), lambda r: not isinstance(r, int))
        assert isinstance(opened, websockets.ClientConnection)
        assert await open_session(a) == 429  # the freed place was taken again, on the other gateway
        for ws in (*sessions[1:], opened):
            assert isinstance(ws, websockets.ClientConnection)
            await ws.close()


@pytest.mark.timeout(300)
async def test_a_gateway_killed_mid_stream_releases_its_leases_by_expiry(redis_server: RedisServer,
                                                                         tmp_path: Path) -> None:
    """Gateway a holds a session and a running generation of the key (caps 2 and 1) and is
    SIGKILLed mid-stream: b may use them again once a's leases expire, and not before. A lease
    is renewed every third of its TTL, so it outlives its holder by at least two thirds of it."""
    ttl = 3.0
    a, b = pair(tmp_path, redis_server, max_sessions_per_key=2, max_concurrent_requests_per_key=1,
                limits={"lease_ttl_s": ttl}, tokens_per_s=5.0)
    async with a, b:
        streaming = await open_session(a)
        assert isinstance(streaming, websockets.ClientConnection)
        assert await start_response(streaming) is None  # 1,000 tokens at 5 a second: streaming when killed
        waiting = await open_session(b)
        assert isinstance(waiting, websockets.ClientConnection)
        assert await start_response(waiting) == "rate_limit_exceeded"  # a's generation holds the running cap
        assert await open_session(b) == 429  # a's session and b's fill the session cap
        a.kill()
        killed = time.monotonic()
        session, session_at = await until(lambda: open_session(b), lambda r: not isinstance(r, int))
        refused, running_at = await until(lambda: start_response(waiting), lambda r: r is None)
        assert isinstance(session, websockets.ClientConnection) and refused is None
        for freed_at in (session_at, running_at):
            assert freed_at - killed >= ttl * 2 / 3 - 0.2, "freed before the lease could have expired"
        await session.close()
        await waiting.close()
        streaming.transport.abort()
