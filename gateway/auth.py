"""Who may connect: API keys, the Origin and Host allow-lists, and the token bucket the per-key
limits are made of (how much a key may ask lives in ``gateway.limits``).

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
from llm_shared.token_bucket import TokenBucket

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
class MinuteBucket:
    """A key's bucket as the per-key limits count it: refills ``capacity`` per minute,
    continuously, on its own clock (``llm_shared.token_bucket.TokenBucket`` underneath). ``charge``
    may go below zero: tokens are counted after they are generated, and a debt blocks new requests
    until it is repaid."""

    capacity: float
    clock: Clock = time.monotonic
    _bucket: TokenBucket = field(init=False)

    def __post_init__(self) -> None:
        self._bucket = TokenBucket(self.capacity / 60.0, self.capacity, self.clock())

    @property
    def rate_per_s(self) -> float:
        return self._bucket.rate_per_s

    def take(self, n: float = 1.0) -> bool:
        return self._bucket.take(n, self.clock())

    def charge(self, n: float) -> None:
        """Spend ``n`` (negative: give back, never above capacity)."""
        self._bucket.debit(n, self.clock())

    def remaining(self) -> int:
        return max(0, math.floor(self._bucket.level(self.clock())))

    def seconds_until(self, n: float) -> float:
        """Seconds until ``n`` is available (0 if it is now)."""
        self._bucket.level(self.clock())
        return self._bucket.retry_after_s(n)

    def reset_seconds(self) -> float:
        return self.seconds_until(self.capacity)
