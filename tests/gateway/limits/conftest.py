"""Fixtures for the limits tests: real Redis servers on loopback ports, and ``env``, which runs a
semantic test once per backend (in-process with a fake clock, Redis with its own clock)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from limits_harness import REDIS_SERVER, FakeClock, RedisServer

from gateway.limits import InProcessStore, Limits, LimitsStore

NO_REDIS = "redis-server is not installed (Debian: apt-get install redis-server; `make test` installs it)"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the tests that do not stop it; each test writes under its own key prefix."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server this test alone uses, free to stop, pause and restart."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


class Env:
    """Stores of one backend for one test. In memory, time stands still unless the test moves
    ``clock``; on Redis it runs, and ``drift`` bounds what buckets refilled meanwhile."""

    def __init__(self, backend: str, server: RedisServer | None) -> None:
        self.backend = backend
        self.clock = FakeClock()
        self._server = server
        self._prefix = f"test-{secrets.token_hex(6)}:"
        self._stores: list[LimitsStore] = []
        self._started = time.monotonic()

    def store(self, limits: Limits, *, lease_ttl_s: float = 30.0, auto_renew: bool = True) -> LimitsStore:
        """A store; on Redis, every store of one test shares the keys (two gateways)."""
        store: LimitsStore
        if self._server is None:
            store = InProcessStore(limits, clock=self.clock, lease_ttl_s=lease_ttl_s, auto_renew=auto_renew)
        else:
            from gateway.limits import RedisStore

            store = RedisStore(limits, url=self._server.url, key_prefix=self._prefix, timeout_s=10.0,
                               lease_ttl_s=lease_ttl_s, auto_renew=auto_renew)
        self._stores.append(store)
        return store

    def elapsed(self) -> float:
        """Seconds the store's clock may have moved since the test began."""
        return 0.0 if self._server is None else time.monotonic() - self._started + 1e-3

    def drift(self, per_minute: int) -> float:
        """Tokens a bucket refilling ``per_minute`` may have regained since the test began."""
        return self.elapsed() * per_minute / 60.0

    def short_ttl(self) -> float:
        """A lease TTL worth waiting for: real seconds on Redis; in memory the clock is moved."""
        return 30.0 if self._server is None else 1.0

    def expire(self, ttl: float) -> None:
        """In memory, move past a TTL; on Redis the test then polls until Redis's clock has."""
        if self._server is None:
            self.clock.advance(ttl + 1e-3)

    async def wait(self, seconds: float) -> None:
        """Let time pass: the fake clock moves, or the test waits (what it tests is that time passed)."""
        if self._server is None:
            self.clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)

    async def aclose(self) -> None:
        for store in self._stores:
            await store.aclose()


@pytest.fixture(params=["memory", "redis"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    server = request.getfixturevalue("redis_server") if request.param == "redis" else None
    env = Env(request.param, server)
    yield env
    await env.aclose()
