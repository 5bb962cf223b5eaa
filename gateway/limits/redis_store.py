"""The limits of every gateway process in one Redis (``redis.asyncio``): each operation one atomic
Lua script (gateway/limits/redis_lua.py), one round trip, bounded by a timeout.

Every failure (refused connection, timeout, an error reply) is a ``LimitsUnavailableError``;
``FailoverStore``, which sits in front of every Redis store the gateway builds, turns that into
the configured policy. The client never retries by itself (a retry would stretch the bound);
its pool reconnects on the next call after a connection broke.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from gateway.config.limits import LeaseKind, Limits
from gateway.limits import redis_lua
from gateway.limits.base import (
    BucketView,
    Lease,
    LimitsStore,
    LimitsUnavailableError,
    Reservation,
    Snapshot,
    audio_refused,
    budget_refused,
    full_snapshot,
    lease_refused,
    process_full,
    requests_refused,
    reserved_tokens,
    tokens_refused,
)
from gateway.limits.leases import LeaseBook

T = TypeVar("T")
RENEW_BATCH = 500  # leases per renewal script: a long script would stall Redis for every gateway


class RedisStore(LimitsStore):
    backend = "redis"

    def __init__(self, limits: Limits, *, url: str, key_prefix: str = "rtgw:limits:", timeout_s: float = 0.1,
                 lease_ttl_s: float = 30.0, auto_renew: bool = True, max_connections: int = 64,
                 retry_after_s: float = 1.0) -> None:
        super().__init__()
        self.limits = limits
        self.lease_ttl_s = lease_ttl_s
        self._prefix = key_prefix
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s  # what a refusal for unavailability tells the client
        # A blocking pool: a burst beyond max_connections waits (within the timeout) for a free one.
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._redis = Redis(connection_pool=pool)
        self._lua_admit = self._redis.register_script(redis_lua.ADMIT)
        self._lua_reserve = self._redis.register_script(redis_lua.RESERVE)
        self._lua_spend = self._redis.register_script(redis_lua.SPEND)
        self._lua_settle = self._redis.register_script(redis_lua.SETTLE)
        self._lua_snapshot = self._redis.register_script(redis_lua.SNAPSHOT)
        self._lua_acquire = self._redis.register_script(redis_lua.ACQUIRE)
        self._lua_renew = self._redis.register_script(redis_lua.RENEW)
        self._lua_count = self._redis.register_script(redis_lua.COUNT)
        self._book = LeaseBook(lease_ttl_s, self._renew_many, auto_renew=auto_renew)
        self._seen: dict[str, Snapshot] = {}  # key -> its buckets at this process's last call (``peek``)
        self._taking_back: set[asyncio.Task[None]] = set()  # removals of members whose acquire's answer was lost

    def _key(self, key_id: str, part: str) -> str:
        return f"{self._prefix}{{{key_id}}}:{part}"

    def _buckets(self, key_id: str) -> list[str]:
        return [self._key(key_id, "req"), self._key(key_id, "tok")]

    def _lease_set(self, kind: LeaseKind, key_id: str) -> str:
        return self._key(key_id, f"lease:{kind}")

    async def _call(self, what: str, op: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(op, self._timeout_s)
        except TimeoutError as e:
            raise self._unavailable(what, f"no answer within {self._timeout_s * 1000:.0f} ms") from e
        except (RedisError, OSError) as e:
            raise self._unavailable(what, f"{type(e).__name__}: {e}") from e

    def _unavailable(self, what: str, why: str) -> LimitsUnavailableError:
        return LimitsUnavailableError(f"the rate-limit store is unavailable ({what}: {why}); retry shortly",
                                      retry_after_s=self._retry_after_s)

    def _saw(self, key_id: str, req: Any, tok: Any) -> Snapshot:
        limits = self.limits
        snap = Snapshot(BucketView.at_level("requests", limits.requests_per_minute, float(req)),
                        BucketView.at_level("tokens", limits.tokens_per_minute, float(tok)))
        self._seen[key_id] = snap
        return snap

    def _wait(self, cap: int, need: float, level: float) -> float:
        return max(0.0, (need - level) / (cap / 60.0))

    async def admit(self, key_id: str) -> Snapshot:
        limits = self.limits
        ok, bucket, req, tok = await self._call("admit", self._lua_admit(
            keys=self._buckets(key_id), args=[limits.requests_per_minute, limits.tokens_per_minute]))
        snap = self._saw(key_id, req, tok)
        if not ok:
            if bucket == "tokens":
                raise tokens_refused(limits, self._wait(limits.tokens_per_minute, 1, float(tok)))
            raise requests_refused(limits, self._wait(limits.requests_per_minute, 1, float(req)))
        return snap

    async def spend_audio(self, key_id: str, seconds: float) -> None:
        cap = self.limits.audio_seconds_per_minute
        ok, aud = await self._call("spend", self._lua_spend(keys=[self._key(key_id, "aud")], args=[cap, seconds]))
        if not ok:
            raise audio_refused(self.limits, self._wait(cap, 1, float(aud)))

    async def reserve(self, key_id: str, max_tokens: int, holder: str = "") -> Reservation:
        limits = self.limits
        n = reserved_tokens(limits, max_tokens)
        lease = Lease("running", key_id, self._book.new_member(holder), self.backend)
        ok, refused, running, req, tok = await self._call("reserve", self._lua_reserve(
            keys=[*self._buckets(key_id), self._lease_set("running", key_id)],
            args=[limits.requests_per_minute, limits.tokens_per_minute, limits.max_running_per_key, n,
                  lease.member, self.lease_ttl_s]))
        self._saw(key_id, req, tok)
        if not ok:
            if refused == "running":
                raise lease_refused(limits, "running", int(running))
            level = float(tok)
            raise budget_refused(limits, max_tokens, max(0, math.floor(level)),
                                 self._wait(limits.tokens_per_minute, n, level))
        self._book.add(lease)
        return Reservation(key_id, n, lease)

    async def _settle(self, reservation: Reservation, used: int) -> None:
        self._book.drop(reservation.lease)  # no longer renewed, whatever Redis answers
        key_id, limits = reservation.key_id, self.limits
        req, tok = await self._call("settle", self._lua_settle(
            keys=[*self._buckets(key_id), self._lease_set("running", key_id)],
            args=[limits.requests_per_minute, limits.tokens_per_minute, used - reservation.tokens,
                  reservation.lease.member]))
        self._saw(key_id, req, tok)

    async def acquire_lease(self, kind: LeaseKind, key_id: str, holder: str = "") -> Lease:
        cap = self.limits.process_cap(kind)
        if cap is not None and self._book.count(kind) >= cap:
            raise process_full()
        lease = Lease(kind, key_id, self._book.new_member(holder), self.backend)
        try:
            ok, count = await self._call("acquire", self._lua_acquire(
                keys=[self._lease_set(kind, key_id)],
                args=[self.limits.per_key_cap(kind), lease.member, self.lease_ttl_s]))
        except LimitsUnavailableError:
            # The script may have run and only its answer been lost (late, past the timeout): take
            # the member back, in the background, so the key is not a slot short for the TTL.
            self._take_back(lease)
            raise
        if not ok:
            raise lease_refused(self.limits, kind, int(count))
        self._book.add(lease)
        return lease

    async def renew(self, lease: Lease) -> None:
        if not lease.released:
            await self._renew_many([lease])

    async def _renew_many(self, leases: Sequence[Lease]) -> None:
        for i in range(0, len(leases), RENEW_BATCH):
            batch = leases[i:i + RENEW_BATCH]
            await self._call("renew", self._lua_renew(
                keys=[self._lease_set(lease.kind, lease.key_id) for lease in batch],
                args=[self.lease_ttl_s, *(lease.member for lease in batch)]))

    async def release(self, lease: Lease) -> None:
        if self._book.drop(lease):
            await self._call("release", self._redis.zrem(self._lease_set(lease.kind, lease.key_id), lease.member))

    async def snapshot(self, key_id: str) -> Snapshot:
        limits = self.limits
        req, tok = await self._call("snapshot", self._lua_snapshot(
            keys=self._buckets(key_id), args=[limits.requests_per_minute, limits.tokens_per_minute]))
        return self._saw(key_id, req, tok)

    def peek(self, key_id: str) -> Snapshot:
        return self._seen.get(key_id) or full_snapshot(self.limits)

    async def lease_count(self, kind: LeaseKind, key_id: str) -> int:
        return int(await self._call("count", self._lua_count(keys=[self._lease_set(kind, key_id)])))

    def held(self, kind: LeaseKind) -> int:
        return self._book.count(kind)

    async def ping(self) -> None:
        """One round trip (readiness probes, start-up checks); ``LimitsUnavailableError`` if none."""
        await self._call("ping", self._redis.ping())

    def _take_back(self, lease: Lease) -> None:
        async def remove() -> None:
            with contextlib.suppress(LimitsUnavailableError):
                await self._call("release", self._redis.zrem(self._lease_set(lease.kind, lease.key_id), lease.member))

        task = asyncio.ensure_future(remove())
        self._taking_back.add(task)
        task.add_done_callback(self._taking_back.discard)

    async def aclose(self) -> None:
        for task in list(self._taking_back):
            task.cancel()
        await super().aclose()
        await self._book.stop()
        await self._redis.aclose(close_connection_pool=True)
