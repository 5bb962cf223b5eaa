"""The limits of one process, in its memory: gateway/auth.py's ``RateLimiter`` and
``SessionSlots`` behind the ``LimitsStore`` contract. The default backend, and the local limits a
``fail_open`` gateway serves under while Redis is away.

Leases expire like Redis ones (the semantic tests run against both), but the store renews every
lease it holds, so in one process a lease ends only when it is released.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.auth import Clock, MinuteBucket
from gateway.config.limits import LeaseKind, Limits
from gateway.limits.base import (
    BucketView,
    Lease,
    LimitsStore,
    Reservation,
    Snapshot,
    audio_refused,
    budget_refused,
    lease_refused,
    process_full,
    requests_refused,
    reserved_tokens,
    tokens_refused,
)
from gateway.limits.leases import LeaseBook


@dataclass
class _KeyBuckets:
    requests: MinuteBucket
    tokens: MinuteBucket
    audio: MinuteBucket


class InProcessStore(LimitsStore):
    backend = "memory"

    def __init__(self, limits: Limits, *, clock: Clock = time.monotonic, lease_ttl_s: float = 30.0,
                 auto_renew: bool = True) -> None:
        super().__init__()
        self.limits = limits
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._buckets: dict[str, _KeyBuckets] = {}  # keys are authenticated first: one entry per configured key
        self._leases: dict[tuple[LeaseKind, str], dict[str, float]] = {}  # (kind, key) -> member -> expiry
        self._book = LeaseBook(lease_ttl_s, self._renew_many, auto_renew=auto_renew)

    def _get(self, key_id: str) -> _KeyBuckets:
        buckets = self._buckets.get(key_id)
        if buckets is None:
            buckets = _KeyBuckets(MinuteBucket(self.limits.requests_per_minute, self._clock),
                                  MinuteBucket(self.limits.tokens_per_minute, self._clock),
                                  MinuteBucket(self.limits.audio_seconds_per_minute, self._clock))
            self._buckets[key_id] = buckets
        return buckets

    def _live(self, kind: LeaseKind, key_id: str) -> dict[str, float]:
        """The key's unexpired leases of ``kind`` (expired ones dropped now)."""
        members = self._leases.setdefault((kind, key_id), {})
        now = self._clock()
        for member in [m for m, expiry in members.items() if expiry <= now]:
            del members[member]
        return members

    def _prune(self, kind: LeaseKind, key_id: str) -> None:
        if not self._leases.get((kind, key_id)):  # keeps the table as small as the set of keys holding leases
            self._leases.pop((kind, key_id), None)

    def _grant(self, kind: LeaseKind, key_id: str, holder: str, members: dict[str, float]) -> Lease:
        lease = Lease(kind, key_id, self._book.new_member(holder), self.backend)
        members[lease.member] = self._clock() + self.lease_ttl_s
        self._book.add(lease)
        return lease

    def _end(self, lease: Lease) -> bool:
        if not self._book.drop(lease):
            return False
        self._leases.get((lease.kind, lease.key_id), {}).pop(lease.member, None)
        self._prune(lease.kind, lease.key_id)
        return True

    async def admit(self, key_id: str) -> Snapshot:
        b = self._get(key_id)
        if b.tokens.remaining() < 1:
            raise tokens_refused(self.limits, b.tokens.seconds_until(1))
        if not b.requests.take(1):
            raise requests_refused(self.limits, b.requests.seconds_until(1))
        return self.peek(key_id)

    async def spend_audio(self, key_id: str, seconds: float) -> None:
        audio = self._get(key_id).audio
        if audio.remaining() < 1:
            raise audio_refused(self.limits, audio.seconds_until(1))
        audio.charge(seconds)

    async def reserve(self, key_id: str, max_tokens: int, holder: str = "") -> Reservation:
        b = self._get(key_id)
        running = self._live("running", key_id)
        if len(running) >= self.limits.max_running_per_key:
            raise lease_refused(self.limits, "running", len(running))
        n = reserved_tokens(self.limits, max_tokens)
        if not b.tokens.take(n):
            self._prune("running", key_id)
            raise budget_refused(self.limits, max_tokens, b.tokens.remaining(), b.tokens.seconds_until(n))
        return Reservation(key_id, n, self._grant("running", key_id, holder, running))

    def settle_nowait(self, reservation: Reservation, used: int) -> None:
        """At once: nothing to wait for in this process."""
        if not reservation.settled:
            reservation.settled = True
            self._apply_settle(reservation, used)

    async def _settle(self, reservation: Reservation, used: int) -> None:
        self._apply_settle(reservation, used)

    def _apply_settle(self, reservation: Reservation, used: int) -> None:
        self._end(reservation.lease)
        # Negative: a refund, capped at the bucket's capacity.
        self._get(reservation.key_id).tokens.charge(used - reservation.tokens)

    async def acquire_lease(self, kind: LeaseKind, key_id: str, holder: str = "") -> Lease:
        cap = self.limits.process_cap(kind)
        if cap is not None and self._book.count(kind) >= cap:
            raise process_full()
        members = self._live(kind, key_id)
        if len(members) >= self.limits.per_key_cap(kind):
            raise lease_refused(self.limits, kind, len(members))
        return self._grant(kind, key_id, holder, members)

    async def renew(self, lease: Lease) -> None:
        await self._renew_many([lease])

    async def _renew_many(self, leases: list[Lease]) -> None:
        expiry = self._clock() + self.lease_ttl_s
        for lease in leases:
            if not lease.released:
                self._leases.setdefault((lease.kind, lease.key_id), {})[lease.member] = expiry

    async def release(self, lease: Lease) -> None:
        self._end(lease)

    async def snapshot(self, key_id: str) -> Snapshot:
        return self.peek(key_id)

    def peek(self, key_id: str) -> Snapshot:
        b = self._get(key_id)
        limits = self.limits
        return Snapshot(
            BucketView("requests", limits.requests_per_minute, b.requests.remaining(), b.requests.reset_seconds()),
            BucketView("tokens", limits.tokens_per_minute, b.tokens.remaining(), b.tokens.reset_seconds()))

    async def lease_count(self, kind: LeaseKind, key_id: str) -> int:
        n = len(self._live(kind, key_id))
        self._prune(kind, key_id)
        return n

    def held(self, kind: LeaseKind) -> int:
        return self._book.count(kind)

    async def aclose(self) -> None:
        await super().aclose()
        await self._book.stop()
