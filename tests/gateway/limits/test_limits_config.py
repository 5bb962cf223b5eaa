"""``[limits]``: defaults that need nothing, validation that names the key, and the store each
backend builds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ServerConfig
from gateway.limits import FailoverStore, InProcessStore, Limits, LimitsConfig, store_from_config
from llm_shared.configtools import build
from llm_shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def test_the_default_is_this_processs_memory() -> None:
    config = build(LimitsConfig, {}, "limits")
    assert config.backend == "memory" and config.failure == "fail_open"
    assert isinstance(store_from_config(config, Limits()), InProcessStore)


def test_a_redis_table_builds() -> None:
    config = build(LimitsConfig, {"backend": "redis", "url": "redis://:s3cret@redis.internal:6380/2",
                                  "key_prefix": "prod:", "timeout_ms": 50, "failure": "fail_closed",
                                  "lease_ttl_s": 15, "retry_interval_ms": 500}, "limits")
    assert (config.timeout_s, config.retry_interval_s, config.lease_ttl_s) == (0.05, 0.5, 15)
    assert "s3cret" not in repr(config)
    assert config.safe_url == "redis://:***@redis.internal:6380/2"


@pytest.mark.parametrize(("table", "names"), [
    ({"backend": "mongo"}, "limits.backend"),
    ({"failure": "retry"}, "limits.failure"),
    ({"url": "http://127.0.0.1:6379"}, "limits.url"),
    ({"key_prefix": ""}, "limits.key_prefix"),
    ({"key_prefix": "a b"}, "limits.key_prefix"),
    ({"key_prefix": "{tag}"}, "limits.key_prefix"),
    ({"timeout_ms": 0}, "limits.timeout_ms"),
    ({"timeout_ms": "100"}, "limits.timeout_ms"),
    ({"retry_interval_ms": 1}, "limits.retry_interval_ms"),
    ({"lease_ttl_s": 0}, "limits.lease_ttl_s"),
    ({"lease_ttl_s": 0.2, "timeout_ms": 100}, "limits.lease_ttl_s"),
    ({"backend": "redis", "urls": "redis://x"}, "unknown key(s) ['urls'] in [limits]"),
])
def test_a_bad_value_is_named(table: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(names)):
        build(LimitsConfig, table, "limits")


def test_limits_come_from_the_server_table() -> None:
    server = ServerConfig(requests_per_minute=7, tokens_per_minute=900, max_concurrent_requests_per_key=3,
                          max_sessions_per_key=4, max_sessions=50)
    assert Limits.from_server(server) == Limits(7, 900, 3, 4, 50)
    with pytest.raises(ConfigError, match="requests_per_minute"):
        Limits(requests_per_minute=0)


def test_the_config_is_the_bottom_floor() -> None:
    """Loading the whole config (``[limits]`` included) loads nothing else of the gateway: the
    stores import ``gateway.auth``, which reads the config, so the config must come without them."""
    code = ("import sys\n"
            "import gateway.config\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('gateway.'))\n"
            "assert all(m.startswith('gateway.config') for m in loaded), loaded\n"
            "assert 'gateway.config.limits' in loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_the_redis_backend_is_imported_only_when_named() -> None:
    code = ("import sys\n"
            "from gateway.limits import Limits, LimitsConfig, store_from_config\n"
            "store_from_config(LimitsConfig(), Limits())\n"
            "assert 'redis' not in sys.modules, 'redis imported by the memory backend'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


async def test_the_redis_backend_sits_behind_its_failure_policy() -> None:
    """Building it connects to nothing: a gateway starts while Redis is still coming up."""
    store = store_from_config(LimitsConfig(backend="redis", url="redis://127.0.0.1:1/0", failure="fail_closed"),
                              Limits())
    assert isinstance(store, FailoverStore)
    assert store.policy == "fail_closed" and not store.degraded
    assert isinstance(store.local, InProcessStore) and store.shared.backend == "redis"
    await store.aclose()
