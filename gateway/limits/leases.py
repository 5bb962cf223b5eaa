"""The leases one store holds, and the task that keeps them alive.

A lease lives in the store (Redis, or the in-process table) until its expiry; the store's
``LeaseBook`` renews all it holds every third of the TTL, so leases outlive their TTL exactly as
long as the process holding them runs. The book also counts them per kind, for the process cap.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable

from gateway.config.limits import LeaseKind
from gateway.limits.base import Lease, LimitsUnavailableError

log = logging.getLogger("gateway.limits")


class LeaseBook:
    """What one store holds: its leases by member, counted per kind for the process cap, and the
    task that renews them every third of their TTL while the store runs."""

    def __init__(self, ttl_s: float, renew: Callable[[list[Lease]], Awaitable[None]], *, auto_renew: bool) -> None:
        self.ttl_s = ttl_s
        self.instance = secrets.token_hex(6)  # tells this store's members from another process's
        self._renew = renew
        self._auto_renew = auto_renew
        self._seq = itertools.count()
        self._held: dict[str, Lease] = {}
        self._counts: dict[str, int] = {"session": 0, "running": 0}
        self._keeper: asyncio.Task[None] | None = None

    def new_member(self, holder: str) -> str:
        return f"{self.instance}:{holder}:{next(self._seq)}"

    def count(self, kind: LeaseKind) -> int:
        return self._counts[kind]

    def add(self, lease: Lease) -> None:
        self._held[lease.member] = lease
        self._counts[lease.kind] += 1
        if self._auto_renew and self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep(), name="limits-lease-keeper")

    def drop(self, lease: Lease) -> bool:
        """Forget ``lease``; False if it was already released."""
        if lease.released:
            return False
        lease.released = True
        if self._held.pop(lease.member, None) is not None:
            self._counts[lease.kind] -= 1
        if not self._held and self._keeper is not None:  # nothing to renew: no task left behind
            self._keeper.cancel()
            self._keeper = None
        return True

    def leases(self) -> list[Lease]:
        return list(self._held.values())

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            leases = self.leases()
            if not leases:
                continue
            try:
                await self._renew(leases)
            except LimitsUnavailableError as e:
                # The next round tries again; a lease expires only after a whole TTL without one.
                log.warning("renewing %d leases failed: %s", len(leases), e.message)

    async def stop(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None
