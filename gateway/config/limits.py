"""The ``[limits]`` table (where the per-key limits are kept) and ``Limits`` (how large they are).

``LimitsConfig`` says which store holds the limits: this process's memory (the default) or a
Redis shared by every gateway process. ``Limits`` holds the numbers, which stay in
``[server]`` (``requests_per_minute`` and the rest): every backend enforces the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit, urlunsplit

from llm_shared.configtools import require

if TYPE_CHECKING:
    from gateway.config.server import ServerConfig

Backend = Literal["memory", "redis"]
FailurePolicy = Literal["fail_open", "fail_closed"]
LeaseKind = Literal["session", "running"]
REDIS_SCHEMES = ("redis", "rediss", "unix")
MAX_PREFIX_CHARS = 64


@dataclass(frozen=True)
class LimitsConfig:
    backend: Backend = "memory"  # "redis": one Redis holds every gateway process's limits
    url: str = field(default="redis://127.0.0.1:6379/0", repr=False)  # may hold a password: see ``safe_url``
    key_prefix: str = "rtgw:limits:"  # every key this gateway writes starts with it (several deployments, one Redis)
    timeout_ms: int = 100  # bound on every Redis call, connecting included; past it the failure policy applies
    failure: FailurePolicy = "fail_open"  # Redis away: serve under this process's own limits, or refuse
    lease_ttl_s: float = 30.0  # a dead gateway's sessions and generations stop counting after this long
    retry_interval_ms: int = 1000  # after a failure, calls skip Redis this long before one probes it again

    def __post_init__(self) -> None:
        require(self.backend in ("memory", "redis"), f'limits.backend must be "memory" or "redis", got {self.backend!r}')
        require(self.failure in ("fail_open", "fail_closed"),
                f'limits.failure must be "fail_open" or "fail_closed", got {self.failure!r}')
        scheme = urlsplit(self.url).scheme
        require(scheme in REDIS_SCHEMES,
                f"limits.url must be a redis://, rediss:// or unix:// URL, got one with scheme {scheme!r}")
        require(0 < len(self.key_prefix) <= MAX_PREFIX_CHARS and self.key_prefix.isprintable()
                and not any(c.isspace() or c in "{}" for c in self.key_prefix),
                f"limits.key_prefix must be 1..{MAX_PREFIX_CHARS} printable characters without spaces or braces, "
                f"got {self.key_prefix!r}")
        require(1 <= self.timeout_ms <= 60_000, f"limits.timeout_ms must be in 1..60000, got {self.timeout_ms}")
        require(10 <= self.retry_interval_ms <= 600_000,
                f"limits.retry_interval_ms must be in 10..600000, got {self.retry_interval_ms}")
        require(0 < self.lease_ttl_s <= 3600, f"limits.lease_ttl_s must be in (0, 3600], got {self.lease_ttl_s}")
        # Leases are renewed every third of their TTL; each renewal may take up to one timeout.
        require(self.lease_ttl_s * 1000 >= 3 * self.timeout_ms,
                f"limits.lease_ttl_s ({self.lease_ttl_s}) must be at least 3 x limits.timeout_ms "
                f"({self.timeout_ms} ms): a lease is renewed every third of its TTL")

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000.0

    @property
    def retry_interval_s(self) -> float:
        return self.retry_interval_ms / 1000.0

    @property
    def safe_url(self) -> str:
        """``url`` without its password, for logs and errors."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        host = parts.hostname or ""
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True)
class Limits:
    """The numbers every backend enforces, per API key unless said otherwise."""

    requests_per_minute: int = 600  # token bucket of requests, refilled continuously
    tokens_per_minute: int = 200_000  # output tokens: reserved at admission, settled at the end
    max_running_per_key: int = 64  # generations running at once
    max_sessions_per_key: int = 64  # open Realtime sessions
    max_sessions: int = 50_000  # this process's capacity (all keys), counted locally by every backend
    audio_seconds_per_minute: int = 3600  # speech recognized and spoken: charged as it is asked for

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_running_per_key", "max_sessions_per_key",
                     "max_sessions", "audio_seconds_per_minute"):
            require(getattr(self, name) >= 1, f"limits: {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_server(cls, server: ServerConfig) -> Limits:
        return cls(requests_per_minute=server.requests_per_minute, tokens_per_minute=server.tokens_per_minute,
                   max_running_per_key=server.max_concurrent_requests_per_key,
                   max_sessions_per_key=server.max_sessions_per_key, max_sessions=server.max_sessions,
                   audio_seconds_per_minute=server.audio_seconds_per_minute)

    def per_key_cap(self, kind: LeaseKind) -> int:
        return self.max_sessions_per_key if kind == "session" else self.max_running_per_key

    def process_cap(self, kind: LeaseKind) -> int | None:
        """How many leases of ``kind`` one process may hold over all keys (None: no such cap)."""
        return self.max_sessions if kind == "session" else None
