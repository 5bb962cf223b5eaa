"""What a gateway does while its shared limits store is away: ``fail_open`` serves under this
process's own limits (an ``InProcessStore``; N gateways then allow up to N times a key's
limits), ``fail_closed`` refuses with ``limits_unavailable``. Either way nothing waits longer
than the store's timeout, and it recovers by itself.

After a failure the shared store is left alone for ``retry_interval_s``; then one call probes
it (the others keep to the policy meanwhile) and its success ends the outage. Settlements,
renewals and releases go back to the store that granted the lease or reservation; those of the
shared store that fail are dropped (its leases expire, a charge is lost), never raised.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.auth import AuthError, Clock, RateLimitedError
from gateway.config.limits import FailurePolicy, LeaseKind
from gateway.limits.base import (
    Lease,
    LimitsStore,
    LimitsUnavailableError,
    Reservation,
    Snapshot,
    process_full,
)
from gateway.limits.memory import InProcessStore

log = logging.getLogger("gateway.limits")

T = TypeVar("T")


class FailoverStore(LimitsStore):
    """A shared store, with this process's ``local`` one for when it is away (``policy``)."""

    backend = "failover"

    def __init__(self, shared: LimitsStore, local: InProcessStore, *, policy: FailurePolicy,
                 retry_interval_s: float = 1.0, on_degraded: Callable[[bool], None] | None = None,
                 clock: Clock = time.monotonic) -> None:
        super().__init__()
        assert shared.limits == local.limits, "the local limits are the shared ones, kept by one process"
        assert shared.backend != local.backend, "grants are sent back to their store by backend name"
        self.limits = shared.limits
        self.lease_ttl_s = shared.lease_ttl_s
        self.policy = policy
        self.shared = shared
        self.local = local
        self._retry_interval_s = retry_interval_s
        self._on_degraded = on_degraded  # e.g. a gauge's set, and what /readyz reports
        self._clock = clock
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._probing = False

    @property
    def degraded(self) -> bool:
        return self._down_since is not None

    def _mark_down(self, error: LimitsUnavailableError) -> None:
        self._retry_at = self._clock() + self._retry_interval_s
        if self._down_since is None:
            self._down_since = self._clock()
            action = "serving under this process's own limits" if self.policy == "fail_open" else "refusing admissions"
            log.warning("limits store unavailable, %s (%s): %s", action, self.policy, error.message)
            if self._on_degraded is not None:
                self._on_degraded(True)

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.warning("limits store back after %.1f s", self._clock() - self._down_since)
            self._down_since = None
            if self._on_degraded is not None:
                self._on_degraded(False)

    def _claim(self) -> bool | None:
        """Whether this call may go to the shared store: always while it is up (False: not a
        probe); while it is down, one call at a time once the retry interval has passed (True)."""
        if self._down_since is None:
            return False
        if self._probing or self._clock() < self._retry_at:
            return None
        self._probing = True
        return True

    async def _via_shared(self, op: Callable[[], Awaitable[T]], probe: bool) -> T:
        try:
            result = await op()
        except LimitsUnavailableError as e:
            self._mark_down(e)
            raise
        except (RateLimitedError, AuthError):
            self._mark_up()  # a refusal is an answer
            raise
        finally:
            if probe:
                self._probing = False
        self._mark_up()
        return result

    def _closed(self) -> LimitsUnavailableError:
        wait = max(self._retry_at - self._clock(), 0.0) or self._retry_interval_s
        return LimitsUnavailableError("the rate-limit store is unavailable; retry shortly", retry_after_s=wait)

    async def _answer(self, shared: Callable[[], Awaitable[T]], local: Callable[[], Awaitable[T]], *,
                      refuse: bool) -> T:
        """The shared store's answer when it gives one; else the local store's, or (``refuse``)
        ``LimitsUnavailableError``."""
        probe = self._claim()
        if probe is not None:
            try:
                return await self._via_shared(shared, probe)
            except LimitsUnavailableError:
                pass
        if refuse:
            raise self._closed()
        return await local()

    async def _admission(self, shared: Callable[[], Awaitable[T]], local: Callable[[], Awaitable[T]]) -> T:
        return await self._answer(shared, local, refuse=self.policy == "fail_closed")

    async def _cleanup(self, op: Callable[[], Awaitable[None]]) -> None:
        """Settling, renewing or releasing what the shared store granted: tried even while it is
        away (a lease released now need not linger for its TTL), bounded by its timeout, and a
        failure neither raised nor postponing the next probe."""
        try:
            await op()
        except LimitsUnavailableError as e:
            if self._down_since is None:
                self._mark_down(e)
            log.info("limits store: %s", e.message)
            return
        self._mark_up()

    async def admit(self, key_id: str) -> Snapshot:
        return await self._admission(lambda: self.shared.admit(key_id), lambda: self.local.admit(key_id))

    async def spend_audio(self, key_id: str, seconds: float) -> None:
        await self._admission(lambda: self.shared.spend_audio(key_id, seconds),
                              lambda: self.local.spend_audio(key_id, seconds))

    async def reserve(self, key_id: str, max_tokens: int, holder: str = "") -> Reservation:
        return await self._admission(lambda: self.shared.reserve(key_id, max_tokens, holder),
                                     lambda: self.local.reserve(key_id, max_tokens, holder))

    def settle_nowait(self, reservation: Reservation, used: int) -> None:
        if reservation.backend == self.local.backend:
            self.local.settle_nowait(reservation, used)  # at once, no task
        else:
            super().settle_nowait(reservation, used)

    async def _settle(self, reservation: Reservation, used: int) -> None:
        # ``_settle``: the reservation is marked settled already, and ``settle`` would stop there.
        if reservation.backend == self.local.backend:
            await self.local._settle(reservation, used)
        else:
            await self._cleanup(lambda: self.shared._settle(reservation, used))

    async def acquire_lease(self, kind: LeaseKind, key_id: str, holder: str = "") -> Lease:
        cap = self.limits.process_cap(kind)
        if cap is not None and self.held(kind) >= cap:  # this process's leases, wherever they were granted
            raise process_full()
        return await self._admission(lambda: self.shared.acquire_lease(kind, key_id, holder),
                                     lambda: self.local.acquire_lease(kind, key_id, holder))

    async def renew(self, lease: Lease) -> None:
        if lease.backend == self.local.backend:
            await self.local.renew(lease)
        elif not lease.released:
            await self._cleanup(lambda: self.shared.renew(lease))

    async def release(self, lease: Lease) -> None:
        if lease.backend == self.local.backend:
            await self.local.release(lease)
        elif not lease.released:
            await self._cleanup(lambda: self.shared.release(lease))

    async def recover(self) -> bool:
        """While the shared store is away, probe it if a probe is due (one round trip, bounded by
        its timeout) and end the outage if it answers; whether it is up. ``/readyz`` calls this,
        so an idle gateway (no admission to probe with) reports the store back as soon as it is."""
        probe = self._claim()
        if probe:
            with contextlib.suppress(LimitsUnavailableError):
                await self._via_shared(self.shared.ping, probe)
        return not self.degraded

    async def snapshot(self, key_id: str) -> Snapshot:
        """The shared store's view; this process's while it is away (whatever the policy)."""
        return await self._answer(lambda: self.shared.snapshot(key_id), lambda: self.local.snapshot(key_id),
                                  refuse=False)

    def peek(self, key_id: str) -> Snapshot:
        return self.local.peek(key_id) if self.degraded else self.shared.peek(key_id)

    async def lease_count(self, kind: LeaseKind, key_id: str) -> int:
        """Across every process while the shared store answers; this process's alone otherwise."""
        return await self._answer(lambda: self.shared.lease_count(kind, key_id),
                                  lambda: self.local.lease_count(kind, key_id), refuse=False)

    def held(self, kind: LeaseKind) -> int:
        return self.shared.held(kind) + self.local.held(kind)

    async def aclose(self) -> None:
        await super().aclose()
        await self.shared.aclose()
        await self.local.aclose()
