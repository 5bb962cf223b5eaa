"""Who may connect and how much they may ask: API keys, the Origin allow-list, per-key
token buckets for requests and tokens, and per-key session counts.

API keys are secrets: they are compared through their SHA-256 digests and only a short
fingerprint of a key (``key_id``) ever reaches logs, metrics or error messages. With no keys
configured (allowed only on a loopback bind) every client is the one key id ``"anonymous"``.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.config import ServerConfig
from llm_shared.errors import APIError, ConfigError, EngineError

ANONYMOUS = "anonymous"
BROWSER_KEY_PREFIX = "openai-insecure-api-key."
CACHE_SALT_CONTEXT = b"rt-llm-gateway prefix-cache salt v1\x00"  # keeps the salt apart from any other digest of a key
CACHE_SALT_HEX_CHARS = 32

Clock = Callable[[], float]


class AuthError(APIError):
    """A handshake or request that is refused before any work starts."""

    def __init__(self, status: int, code: str, message: str, type_: str = "invalid_request_error") -> None:
        super().__init__(message, code=code, type=type_)
        self.status = status


class RateLimitedError(EngineError):
    """A key ran out of requests or tokens; retry after ``retry_after_s``."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, bucket: str, retry_after_s: float) -> None:
        # OpenAI reports which limit was hit ("requests" or "tokens") as the type.
        super().__init__(message, type=bucket)
        self.retry_after_s = retry_after_s


def key_fingerprint(key: str) -> str:
    """A non-secret name for a key: enough to tell keys apart in logs, useless to an attacker."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:10]


def cache_salt(key: str) -> str:
    """The prefix-cache salt of an API key (``Engine.generate(cache_salt=...)``): 32 hex digits
    of a domain-separated SHA-256 of the key. Deterministic, so every gateway process sends the
    same salt for a key to the engine replicas they share; reveals nothing of the key, and is
    unrelated to the key's fingerprint in logs."""
    return hashlib.sha256(CACHE_SALT_CONTEXT + key.encode("utf-8")).hexdigest()[:CACHE_SALT_HEX_CHARS]


def cache_salts(server: ServerConfig) -> dict[str, str]:
    """Key id -> cache salt for every configured key when ``server.prefix_cache_isolated()``;
    empty otherwise (every turn sends "", and all callers share one prefix cache)."""
    if not server.prefix_cache_isolated():
        return {}
    salts: dict[str, str] = {}
    for key in server.all_api_keys():
        key_id = key_fingerprint(key)
        if key_id in salts:  # two keys would share one salt (and one rate limit): refuse rather than mix
            raise ConfigError(f"two API keys share the fingerprint {key_id}; replace one of them")
        salts[key_id] = cache_salt(key)
    return salts


def parse_subprotocols(header: str | None) -> list[str]:
    if not header:
        return []
    return [p.strip() for p in header.split(",") if p.strip()]


class Authenticator:
    """Checks the key a client presents: ``Authorization: Bearer <key>`` or, for browsers,
    which cannot set headers on a WebSocket, the subprotocol ``openai-insecure-api-key.<key>``."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._ids = {hashlib.sha256(k.encode("utf-8")).digest(): key_fingerprint(k) for k in keys}

    @property
    def required(self) -> bool:
        return bool(self._ids)

    def authenticate(self, authorization: str | None, subprotocols: Iterable[str] = ()) -> str:
        """The key id of the presented key, or AuthError(401)."""
        if not self.required:
            return ANONYMOUS
        presented: str | None = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                presented = value.strip()
        if presented is None:
            for proto in subprotocols:
                if proto.startswith(BROWSER_KEY_PREFIX) and len(proto) > len(BROWSER_KEY_PREFIX):
                    presented = proto[len(BROWSER_KEY_PREFIX):]
                    break
        if presented is None:
            raise AuthError(401, "missing_api_key",
                            "no API key: send 'Authorization: Bearer <key>' "
                            f"(browsers: the subprotocol '{BROWSER_KEY_PREFIX}<key>')")
        # Looking up a digest of the presented key does not leak timing about stored keys.
        key_id = self._ids.get(hashlib.sha256(presented.encode("utf-8")).digest())
        if key_id is None:
            raise AuthError(401, "invalid_api_key", "the API key is not valid")
        return key_id


def _origin_tuple(origin: str) -> tuple[str, str, int | None] | None:
    try:
        parts = urlsplit(origin.strip().lower())
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname:
        return None
    default = {"http": 80, "https": 443, "ws": 80, "wss": 443}.get(parts.scheme)
    return parts.scheme, parts.hostname, port if port is not None else default


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def host_allowed(host: str | None, allowed: Iterable[str], bind_host: str = "") -> bool:
    """The ``Host`` a request names must be one this server answers to: a loopback name, the
    address it is bound to, or a configured host (``*``: any). A DNS-rebinding page reaches a
    loopback server under its own name (``evil.example``), so the name is checked, not the peer."""
    allowed = list(allowed)
    if "*" in allowed:
        return True
    if not host:
        return False
    parsed = _origin_tuple(f"http://{host}")
    if parsed is None:
        return False
    name = parsed[1]
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    names = {a.strip().lower().strip("[]") for a in allowed} | LOOPBACK_HOSTS
    if bind_host and bind_host not in ("0.0.0.0", "::"):
        names.add(bind_host.lower().strip("[]"))
    return name in names


def origin_allowed(origin: str | None, host: str | None, allowed: Iterable[str]) -> bool:
    """Browsers send Origin; other clients usually don't, and are not limited by this check.
    An Origin is allowed when it is in the allow-list (or the list holds ``*``) or when it names
    the host the request was sent to (a page served by this gateway)."""
    if origin is None:
        return True
    allowed = list(allowed)
    if "*" in allowed:
        return True
    parsed = _origin_tuple(origin)
    if parsed is None:
        return False
    if any(_origin_tuple(a) == parsed for a in allowed):
        return True
    if host:
        scheme, hostname, port = parsed
        same = _origin_tuple(f"{scheme}://{host}")
        return same is not None and same[1:] == (hostname, port)
    return False


@dataclass
class TokenBucket:
    """Refills ``capacity`` per minute, continuously. ``charge`` may go below zero: tokens are
    counted after they are generated, and a debt blocks new requests until it is repaid."""

    capacity: float
    clock: Clock = time.monotonic
    level: float = field(init=False)
    _stamp: float = field(init=False)

    def __post_init__(self) -> None:
        self.level = self.capacity
        self._stamp = self.clock()

    @property
    def rate_per_s(self) -> float:
        return self.capacity / 60.0

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._stamp) * self.rate_per_s)
        self._stamp = now

    def take(self, n: float = 1.0) -> bool:
        self._refill()
        if self.level < n:
            return False
        self.level -= n
        return True

    def charge(self, n: float) -> None:
        """Spend ``n`` (negative: give back, never above capacity)."""
        self._refill()
        self.level = min(self.capacity, self.level - n)

    def remaining(self) -> int:
        self._refill()
        return max(0, math.floor(self.level))

    def seconds_until(self, n: float) -> float:
        """Seconds until ``n`` is available (0 if it is now)."""
        self._refill()
        return max(0.0, (n - self.level) / self.rate_per_s)

    def reset_seconds(self) -> float:
        return self.seconds_until(self.capacity)


@dataclass
class _KeyBuckets:
    requests: TokenBucket
    tokens: TokenBucket
    in_flight: int = 0  # generations admitted and not settled yet


@dataclass
class Reservation:
    """Output tokens set aside for one generation when it was admitted; ``RateLimiter.settle``
    gives back what it did not use (or charges what it used beyond)."""

    key_id: str
    tokens: int
    settled: bool = False


class RateLimiter:
    """Per-key request and token buckets. Keys are authenticated first, so the table holds at
    most one entry per configured key (plus ``anonymous``)."""

    def __init__(self, requests_per_minute: int, tokens_per_minute: int, clock: Clock = time.monotonic,
                 max_concurrent: int = 1 << 30) -> None:
        self._rpm = requests_per_minute
        self._tpm = tokens_per_minute
        self._clock = clock
        self._max_concurrent = max_concurrent
        self._buckets: dict[str, _KeyBuckets] = {}

    def _get(self, key_id: str) -> _KeyBuckets:
        buckets = self._buckets.get(key_id)
        if buckets is None:
            buckets = _KeyBuckets(TokenBucket(self._rpm, self._clock), TokenBucket(self._tpm, self._clock))
            self._buckets[key_id] = buckets
        return buckets

    def admit(self, key_id: str) -> None:
        """Take one request, or raise RateLimitedError saying which limit and when to retry."""
        b = self._get(key_id)
        if b.tokens.remaining() < 1:
            wait = b.tokens.seconds_until(1)
            raise RateLimitedError(
                f"rate limit reached: {self._tpm} tokens per minute; retry in {wait:.1f}s",
                bucket="tokens", retry_after_s=wait,
            )
        if not b.requests.take(1):
            wait = b.requests.seconds_until(1)
            raise RateLimitedError(
                f"rate limit reached: {self._rpm} requests per minute; retry in {wait:.1f}s",
                bucket="requests", retry_after_s=wait,
            )

    def charge_tokens(self, key_id: str, n: int) -> None:
        if n > 0:
            self._get(key_id).tokens.charge(n)

    def reserve(self, key_id: str, max_tokens: int) -> Reservation:
        """Set aside a generation's output tokens now, before any is made, so that a burst of
        concurrent requests cannot spend more than the key's budget; or raise RateLimitedError.
        A request may ask for more than a minute's budget: it reserves all of it (and is charged
        the rest when it settles)."""
        b = self._get(key_id)
        if b.in_flight >= self._max_concurrent:
            raise RateLimitedError(
                f"this key already has {b.in_flight} generations running (limit {self._max_concurrent}); "
                "retry when one ends", bucket="requests", retry_after_s=1.0)
        n = max(1, min(max_tokens, self._tpm))
        if not b.tokens.take(n):
            wait = b.tokens.seconds_until(n)
            raise RateLimitedError(
                f"rate limit reached: {self._tpm} tokens per minute, {max_tokens} requested with "
                f"{b.tokens.remaining()} left; retry in {wait:.1f}s", bucket="tokens", retry_after_s=wait)
        b.in_flight += 1
        return Reservation(key_id, n)

    def settle(self, reservation: Reservation, used: int) -> None:
        """The generation ended having made ``used`` tokens: refund the rest (idempotent)."""
        if reservation.settled:
            return
        reservation.settled = True
        b = self._get(reservation.key_id)
        b.in_flight -= 1
        b.tokens.charge(used - reservation.tokens)  # negative: a refund, capped at the bucket's capacity

    def snapshot(self, key_id: str) -> list[dict[str, object]]:
        """The Realtime ``rate_limits.updated`` list for this key."""
        b = self._get(key_id)
        return [
            {"name": "requests", "limit": self._rpm, "remaining": b.requests.remaining(),
             "reset_seconds": round(b.requests.reset_seconds(), 3)},
            {"name": "tokens", "limit": self._tpm, "remaining": b.tokens.remaining(),
             "reset_seconds": round(b.tokens.reset_seconds(), 3)},
        ]

    def headers(self, key_id: str) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` response headers."""
        b = self._get(key_id)
        return {
            "x-ratelimit-limit-requests": str(self._rpm),
            "x-ratelimit-remaining-requests": str(b.requests.remaining()),
            "x-ratelimit-reset-requests": f"{b.requests.reset_seconds():.3f}s",
            "x-ratelimit-limit-tokens": str(self._tpm),
            "x-ratelimit-remaining-tokens": str(b.tokens.remaining()),
            "x-ratelimit-reset-tokens": f"{b.tokens.reset_seconds():.3f}s",
        }


class SessionSlots:
    """Counts open WebSocket sessions per key and in total."""

    def __init__(self, max_per_key: int, max_total: int) -> None:
        self._max_per_key = max_per_key
        self._max_total = max_total
        self._per_key: dict[str, int] = {}
        self._total = 0

    @property
    def total(self) -> int:
        return self._total

    def count(self, key_id: str) -> int:
        return self._per_key.get(key_id, 0)

    def acquire(self, key_id: str) -> None:
        if self._total >= self._max_total:
            raise AuthError(503, "server_busy", "the server has too many open sessions; retry later", "server_error")
        if self.count(key_id) >= self._max_per_key:
            raise AuthError(429, "too_many_sessions",
                            f"this key already has {self._max_per_key} open sessions; close one first", "requests")
        self._per_key[key_id] = self.count(key_id) + 1
        self._total += 1

    def release(self, key_id: str) -> None:
        n = self.count(key_id)
        if n <= 0:
            raise RuntimeError(f"session slot released twice for {key_id}")
        if n == 1:
            del self._per_key[key_id]  # keeps the table as small as the set of connected keys
        else:
            self._per_key[key_id] = n - 1
        self._total -= 1


def limiter_from_config(config: ServerConfig, clock: Clock = time.monotonic) -> RateLimiter:
    return RateLimiter(config.requests_per_minute, config.tokens_per_minute, clock,
                       max_concurrent=config.max_concurrent_requests_per_key)
