"""Per-key limits behind one interface: in this process's memory (the default) or in a Redis every
gateway process shares, with a failure policy for when it is away.

``store_from_config`` builds the store ``[limits]`` names; ``redis`` is imported only for the
Redis backend (``RedisStore`` loads on first use).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.config.limits import FailurePolicy, LeaseKind, Limits, LimitsConfig
from gateway.limits.base import BucketView, Lease, LimitsStore, LimitsUnavailableError, Reservation, Snapshot
from gateway.limits.failover import FailoverStore
from gateway.limits.memory import InProcessStore

if TYPE_CHECKING:
    from gateway.limits.redis_store import RedisStore

__all__ = [
    "BucketView", "FailoverStore", "FailurePolicy", "InProcessStore", "Lease", "LeaseKind", "Limits", "LimitsConfig",
    "LimitsStore", "LimitsUnavailableError", "RedisStore", "Reservation", "Snapshot", "store_from_config",
]


def store_from_config(config: LimitsConfig, limits: Limits, *, clock: Callable[[], float] = time.monotonic,
                      on_degraded: Callable[[bool], None] | None = None) -> LimitsStore:
    """The store ``[limits]`` names: an ``InProcessStore``, or a ``RedisStore`` behind a
    ``FailoverStore`` whose local limits are an ``InProcessStore`` of the same numbers.
    ``on_degraded(True/False)`` is called as Redis goes away and comes back. Connects to nothing
    yet: a gateway starts while its Redis is still coming up."""
    local = InProcessStore(limits, clock=clock, lease_ttl_s=config.lease_ttl_s)
    if config.backend == "memory":
        return local
    from gateway.limits.redis_store import RedisStore  # (imports redis)

    shared = RedisStore(limits, url=config.url, key_prefix=config.key_prefix, timeout_s=config.timeout_s,
                        lease_ttl_s=config.lease_ttl_s, retry_after_s=config.retry_interval_s)
    return FailoverStore(shared, local, policy=config.failure, retry_interval_s=config.retry_interval_s,
                         on_degraded=on_degraded)


def __getattr__(name: str) -> Any:
    if name != "RedisStore":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module("gateway.limits.redis_store").RedisStore
