"""Helpers for the limits tests: a real ``redis-server`` on a free loopback port (the limits
benchmark's launcher, ``bench/_redis.py``), a clock the in-process store can be given, and a
bounded poll."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable

from bench._redis import Redis as RedisServer  # noqa: F401  # re-exported for the tests

REDIS_SERVER = shutil.which("redis-server")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def eventually(check: Callable[[], Awaitable[bool]], *, within_s: float = 60.0, every_s: float = 0.05) -> None:
    """Poll ``check`` until it is true; fail after ``within_s`` (generous: only a broken store waits that long)."""
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within_s} s")
        await asyncio.sleep(every_s)
