"""The contract of a limits store, whatever keeps the numbers: admissions against a key's request
and token buckets, token budgets reserved and settled, and capped leases (sessions, running
generations) that expire unless their holder keeps renewing them.

Every method that may talk to a shared store is async and takes at most one round trip; the
refusals are the gateway's usual errors (``RateLimitedError``, ``AuthError``), and a store that
cannot answer raises ``LimitsUnavailableError``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

from gateway.auth import AuthError, RateLimitedError
from gateway.config.limits import LeaseKind, Limits
from llm_shared.errors import EngineError

log = logging.getLogger("gateway.limits")

RUNNING_RETRY_AFTER_S = 1.0  # a running generation's end cannot be predicted; today's RateLimiter says 1 s


class LimitsUnavailableError(EngineError):
    """The shared limits store did not answer in time and the policy is ``fail_closed``."""

    code = "limits_unavailable"
    type = "server_error"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class BucketView:
    """One bucket as a client sees it (``x-ratelimit-*``, Realtime ``rate_limits.updated``)."""

    name: Literal["requests", "tokens"]
    limit: int
    remaining: int
    reset_seconds: float  # until the bucket is full again

    @classmethod
    def at_level(cls, name: Literal["requests", "tokens"], limit: int, level: float) -> BucketView:
        """The view of a bucket holding ``level`` (may be negative: a debt), refilled at ``limit`` a minute."""
        return cls(name, limit, max(0, math.floor(level)), max(0.0, (limit - level) / (limit / 60.0)))


@dataclass(frozen=True)
class Snapshot:
    requests: BucketView
    tokens: BucketView

    def rate_limits(self) -> list[dict[str, object]]:
        """The Realtime ``rate_limits.updated`` list (``RateLimiter.snapshot``'s format)."""
        return [{"name": b.name, "limit": b.limit, "remaining": b.remaining, "reset_seconds": round(b.reset_seconds, 3)}
                for b in (self.requests, self.tokens)]

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` response headers (``RateLimiter.headers``'s format)."""
        out: dict[str, str] = {}
        for b in (self.requests, self.tokens):
            out[f"x-ratelimit-limit-{b.name}"] = str(b.limit)
            out[f"x-ratelimit-remaining-{b.name}"] = str(b.remaining)
            out[f"x-ratelimit-reset-{b.name}"] = f"{b.reset_seconds:.3f}s"
        return out


def full_snapshot(limits: Limits) -> Snapshot:
    """A key this process has not heard about: both buckets full."""
    return Snapshot(BucketView.at_level("requests", limits.requests_per_minute, limits.requests_per_minute),
                    BucketView.at_level("tokens", limits.tokens_per_minute, limits.tokens_per_minute))


@dataclass(eq=False)
class Lease:
    """A counted slot (an open session, a running generation) of one key. It lives while its
    store renews it; a store that stops (its process died) lets it expire after the TTL."""

    kind: LeaseKind
    key_id: str
    member: str  # unique in the store: "<store instance>:<holder>:<n>"
    backend: str  # the store that granted it; a failover wrapper sends it back there
    released: bool = False


@dataclass(eq=False)
class Reservation:
    """Output tokens set aside when a generation was admitted, and its running lease; ``settle``
    refunds what it did not use (or charges what it used beyond) and ends the lease."""

    key_id: str
    tokens: int
    lease: Lease
    settled: bool = False

    @property
    def backend(self) -> str:
        return self.lease.backend


# The refusals, worded as gateway/auth.py's RateLimiter and SessionSlots word them.

def requests_refused(limits: Limits, wait_s: float) -> RateLimitedError:
    return RateLimitedError(f"rate limit reached: {limits.requests_per_minute} requests per minute; "
                            f"retry in {wait_s:.1f}s", bucket="requests", retry_after_s=wait_s)


def tokens_refused(limits: Limits, wait_s: float) -> RateLimitedError:
    return RateLimitedError(f"rate limit reached: {limits.tokens_per_minute} tokens per minute; "
                            f"retry in {wait_s:.1f}s", bucket="tokens", retry_after_s=wait_s)


def audio_refused(limits: Limits, wait_s: float) -> RateLimitedError:
    return RateLimitedError(f"rate limit reached: {limits.audio_seconds_per_minute} seconds of audio (speech "
                            f"recognized and spoken) per minute; retry in {wait_s:.1f}s", bucket="audio",
                            retry_after_s=wait_s)


def budget_refused(limits: Limits, max_tokens: int, remaining: int, wait_s: float) -> RateLimitedError:
    return RateLimitedError(
        f"rate limit reached: {limits.tokens_per_minute} tokens per minute, {max_tokens} requested with "
        f"{remaining} left; retry in {wait_s:.1f}s", bucket="tokens", retry_after_s=wait_s)


def lease_refused(limits: Limits, kind: LeaseKind, held: int) -> RateLimitedError | AuthError:
    if kind == "running":
        return RateLimitedError(f"this key already has {held} generations running (limit "
                                f"{limits.max_running_per_key}); retry when one ends", bucket="requests",
                                retry_after_s=RUNNING_RETRY_AFTER_S)
    return AuthError(429, "too_many_sessions",
                     f"this key already has {limits.max_sessions_per_key} open sessions; close one first", "requests")


def process_full() -> AuthError:
    return AuthError(503, "server_busy", "the server has too many open sessions; retry later", "server_error")


def reserved_tokens(limits: Limits, max_tokens: int) -> int:
    """A request may ask for more than a minute's budget: it reserves all of it (and is charged
    the rest when it settles)."""
    return max(1, min(max_tokens, limits.tokens_per_minute))


class LimitsStore(ABC):
    """Per-key limits, shared or not. Refusals raise ``RateLimitedError`` (requests, tokens,
    running generations) or ``AuthError`` (sessions); ``LimitsUnavailableError`` when a shared
    store cannot answer and the policy is to refuse."""

    backend: ClassVar[str]  # names the store on what it grants (``Lease.backend``)
    limits: Limits
    lease_ttl_s: float

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()  # settlements in flight (settle_nowait)

    @property
    def degraded(self) -> bool:
        """True while a shared store is away and this process serves under its own limits (or refuses)."""
        return False

    @abstractmethod
    async def admit(self, key_id: str) -> Snapshot:
        """Take one request from the key's bucket (refused while its token bucket is empty or in
        debt); the key's buckets after it, for the response headers."""

    @abstractmethod
    async def spend_audio(self, key_id: str, seconds: float) -> None:
        """Charge ``seconds`` of speech work (an utterance to recognize, a phrase to speak) to the
        key's audio bucket: refused while it holds less than a second (empty or in debt), else
        charged whole (a long recording may leave a debt that refuses the next until repaid)."""

    @abstractmethod
    async def reserve(self, key_id: str, max_tokens: int, holder: str = "") -> Reservation:
        """Set aside a generation's output tokens and take a running lease, in one step."""

    async def settle(self, reservation: Reservation, used: int) -> None:
        """The generation ended having made ``used`` tokens: refund or charge the difference and end
        its running lease. Idempotent; marked settled before any round trip. Refuses nothing: a
        shared store may raise ``LimitsUnavailableError``, which ``FailoverStore`` (in front of every
        Redis store) swallows, the lease then expiring and the difference lost."""
        if reservation.settled:
            return
        reservation.settled = True
        await self._settle(reservation, used)

    def settle_nowait(self, reservation: Reservation, used: int) -> None:
        """``settle`` from code that cannot await (a stream's last event): marked settled now, the
        store told in the background; ``aclose`` waits for what is still in flight."""
        if reservation.settled:
            return
        reservation.settled = True
        task = asyncio.get_running_loop().create_task(self._settle(reservation, used))
        self._tasks.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and isinstance(task.exception(), LimitsUnavailableError):
            log.warning("a settlement was lost: %s", task.exception())

    @abstractmethod
    async def _settle(self, reservation: Reservation, used: int) -> None:
        """Apply a settlement (``reservation`` is already marked settled)."""

    @abstractmethod
    async def acquire_lease(self, kind: LeaseKind, key_id: str, holder: str = "") -> Lease:
        """A slot under the key's cap for ``kind`` (and, for sessions, this process's cap)."""

    @abstractmethod
    async def renew(self, lease: Lease) -> None:
        """Push the lease's expiry ``lease_ttl_s`` ahead, re-adding it if it had lapsed (a store
        renews what it holds by itself unless made with ``auto_renew=False``). Refuses nothing;
        ``LimitsUnavailableError`` as ``settle``."""

    @abstractmethod
    async def release(self, lease: Lease) -> None:
        """Give the slot back. Idempotent; forgotten here before any round trip, so a lease that
        could not be released expires. ``LimitsUnavailableError`` as ``settle``."""

    @abstractmethod
    async def snapshot(self, key_id: str) -> Snapshot:
        """The key's buckets now."""

    @abstractmethod
    def peek(self, key_id: str) -> Snapshot:
        """The key's buckets as this process last saw them, without a round trip (exact in-process;
        for Redis, as of this process's last call for the key)."""

    @abstractmethod
    async def lease_count(self, kind: LeaseKind, key_id: str) -> int:
        """Unexpired leases of ``kind`` the key holds, across every process sharing the store."""

    @abstractmethod
    def held(self, kind: LeaseKind) -> int:
        """Leases of ``kind`` this process holds (all keys)."""

    async def ping(self) -> None:  # noqa: B027  # optional: a store in this process is always there
        """One round trip to the store (``LimitsUnavailableError`` if none); in-process: nothing."""

    async def recover(self) -> bool:
        """Probe a store that is away if a probe is due; whether it is up (``FailoverStore``)."""
        return not self.degraded

    async def aclose(self) -> None:
        """Stop renewing (leases still held then expire) after the settlements in flight."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
