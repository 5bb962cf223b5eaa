"""The gateway's configuration: TOML files in configs/ loaded into frozen dataclasses.

Validation happens here, at start-up: an unknown key, a wrong type or an impossible value is
a ConfigError naming the key. API keys may come from the file or from the environment
variable named by ``server.api_keys_env``; they are never logged (``repr`` hides them).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from engine_cluster.config import ClusterConfig
from engine_edge.config import EdgeConfig
from engine_gpu.config import EngineConfig, check_engine_models, parse_engine_table
from gateway.cascade.config import CascadeConfig, RoutingConfig
from gateway.host import HostConfig
from gateway.limits.config import LimitsConfig
from llm_shared.configtools import build, read_toml, require
from llm_shared.errors import ConfigError
from llm_shared.models import REPO_ROOT, ModelConfig, parse_models, require_model
from voice.config import VoiceConfig

DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.toml"
MAX_WORKERS = 64


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_env: str = "GATEWAY_API_KEYS"  # comma-separated keys, added to api_keys
    allowed_origins: tuple[str, ...] = ()  # browser Origins allowed; empty = same-host only
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback names and the bind address; "*": any
    max_frame_bytes: int = 256 * 1024
    max_conversation_items: int = 512
    max_conversation_chars: int = 200_000
    max_sessions_per_key: int = 64
    max_sessions: int = 50_000
    idle_timeout_s: float = 600.0
    ping_interval_s: float = 20.0
    ping_timeout_s: float = 20.0
    requests_per_minute: int = 600  # per key; token bucket
    tokens_per_minute: int = 200_000  # per key; output tokens, reserved at admission (max_tokens), refunded at the end
    max_concurrent_requests_per_key: int = 64  # generations running at once per key, both APIs
    send_queue_high: int = 256  # outgoing events queued before deltas are coalesced
    send_queue_limit: int = 4096  # past this the response is cancelled (slow consumer)
    send_queue_max_bytes: int = 4 * 1024 * 1024  # same, in queued bytes (coalesced deltas grow); half pauses the reader
    slow_client_timeout_s: float = 30.0  # a client whose queue stays full this long is closed (1008)
    # Frames written at once while a client keeps up (one write per pump, no writer-task hop);
    # false sends every frame through the writer task (bench/load.py compares both).
    direct_writes: bool = True
    # Full cyclic-GC collections wait for this many young (generation-1) ones, Python's third
    # threshold (default 10), set once the engines are loaded: a full collection stops every
    # stream for ~0.1 s per 100k tracked objects, and streaming leaves no cyclic garbage.
    gc_full_after: int = 100
    # ...and one runs at least this often (0: only when Python's thresholds say), for what does
    # leave cycles: a closed session's aiohttp objects (~28, ~10 KiB), which would otherwise wait.
    gc_full_every_s: float = 30.0
    engine_abort_timeout_s: float = 5.0  # an engine abort that takes longer is given up on (the response ends)
    sse_write_timeout_s: float = 30.0  # an SSE client that takes no data this long is dropped (its turn aborted)
    # The demo page is sent with COOP same-origin and COEP require-corp, which makes it
    # cross-origin isolated: SharedArrayBuffer, and so threads for the in-browser model (wllama).
    # Off, the page works the same and the on-device model runs on one thread.
    cross_origin_isolation: bool = True
    operator_endpoints_need_key: bool = False  # /readyz and /metrics require an API key (when keys are configured)
    # /metrics requires an API key when keys are configured (its series tell other tenants' load,
    # and each scrape costs the event loop); false: open to whoever reaches the port
    metrics_need_key: bool = True
    # Prefix-cache hits only within one API key (a per-key cache salt to every tier); "auto": when
    # more than one key is configured. Off, one tenant's TTFT and cached_tokens tell whether
    # another sent a prompt.
    isolate_prefix_cache: bool | Literal["auto"] = "auto"
    shutdown_grace_s: float = 5.0
    drain_timeout_s: float = 20.0  # on SIGTERM: how long responses in progress may run on before they are cancelled
    drain_reconnect_spread_ms: int = 5000  # drained clients are told to reconnect after 0..this many ms (jitter)
    default_max_output_tokens: int = 512
    max_output_tokens: int = 4096
    # Gateway processes on one port (SO_REUSEPORT), each with its own event loop (gateway/workers.py);
    # more than one needs the limits in Redis (Config checks it).
    workers: int = 1

    def __post_init__(self) -> None:
        require(1 <= self.port <= 65535 or self.port == 0, f"server.port must be 0..65535, got {self.port}")
        require(1 <= self.workers <= MAX_WORKERS, f"server.workers must be in 1..{MAX_WORKERS}, got {self.workers}")
        require(self.max_frame_bytes >= 1024, "server.max_frame_bytes must be >= 1024")
        for name in ("max_conversation_items", "max_conversation_chars", "max_sessions_per_key", "max_sessions",
                     "requests_per_minute", "tokens_per_minute", "max_concurrent_requests_per_key", "send_queue_high", "send_queue_limit", "send_queue_max_bytes",
                     "default_max_output_tokens", "max_output_tokens"):
            require(getattr(self, name) >= 1, f"server.{name} must be >= 1")
        for name in ("idle_timeout_s", "ping_interval_s", "ping_timeout_s", "shutdown_grace_s", "slow_client_timeout_s",
                     "engine_abort_timeout_s", "sse_write_timeout_s"):
            require(getattr(self, name) > 0, f"server.{name} must be > 0")
        require(0 <= self.drain_timeout_s <= 3600, "server.drain_timeout_s must be in 0..3600")
        require(1 <= self.gc_full_after <= 10_000, "server.gc_full_after must be in 1..10000")
        require(0 <= self.gc_full_every_s <= 3600, "server.gc_full_every_s must be in 0..3600")
        require(0 <= self.drain_reconnect_spread_ms <= 600_000, "server.drain_reconnect_spread_ms must be in 0..600000")
        require(self.send_queue_high < self.send_queue_limit, "server.send_queue_high must be below send_queue_limit")
        require(self.default_max_output_tokens <= self.max_output_tokens,
                "server.default_max_output_tokens must be <= max_output_tokens")
        require(isinstance(self.isolate_prefix_cache, bool) or self.isolate_prefix_cache == "auto",
                f'server.isolate_prefix_cache must be true, false or "auto", got {self.isolate_prefix_cache!r}')

    def all_api_keys(self) -> frozenset[str]:
        from_env = os.environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        return frozenset(k.strip() for k in (*self.api_keys, *from_env.split(",")) if k.strip())

    def prefix_cache_isolated(self) -> bool:
        """Whether each API key gets its own prefix cache (``isolate_prefix_cache``; "auto": more
        than one key configured, counting those from the environment)."""
        if self.isolate_prefix_cache == "auto":
            return len(self.all_api_keys()) > 1
        return bool(self.isolate_prefix_cache)

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    models: dict[str, ModelConfig]
    edge: EdgeConfig
    engine: EngineConfig
    routing: RoutingConfig
    cascade: CascadeConfig = field(default_factory=CascadeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # the torch tier on Ray Serve replicas
    host: HostConfig = field(default_factory=HostConfig)  # the CPU budget every compute pool here shares
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # where per-key limits live (this process, or Redis)
    voice: VoiceConfig = field(default_factory=VoiceConfig)  # speech in and out of Realtime sessions
    path: Path | None = None

    def __post_init__(self) -> None:
        check_engine_models(self.engine, self.models)  # the served model, and the drafter's if any
        require(require_model(self.models, self.edge.model, "edge.model").format == "gguf",
                f"the edge tier ({self.edge.backend}) needs a gguf model; edge.model {self.edge.model!r} is "
                f"{self.models[self.edge.model].format}")
        if self.routing.default == "cascade":
            edge, gpu = self.models[self.edge.model], self.models[self.engine.model]
            require(edge.family == gpu.family,
                    f"the cascade hands the edge's tokens to the torch tier as drafts, so both need one tokenizer "
                    f"family; edge.model {edge.id!r} is {edge.family!r}, engine.model {gpu.id!r} is {gpu.family!r}")
        require(not self.cluster.enabled or "gpu" in self.routing.tiers,
                "[cluster] enabled serves the torch tier on Ray, but routing.default uses only the edge tier")
        require(not (self.cluster.enabled and self.engine.backend == "synthetic"),
                "[cluster] enabled serves the torch tier on Ray replicas; engine.backend = 'synthetic' serves it "
                "in the gateway process: choose one")
        # The kernel spreads a client's connections over the workers at random: with each worker's
        # own limits a key would get up to N times them, and which ones applied would be chance.
        require(self.server.workers == 1 or self.limits.backend == "redis",
                f'server.workers = {self.server.workers} needs [limits] backend = "redis": with the in-process '
                "backend every worker would keep its own limits, so a key would get up to "
                f"{self.server.workers} times its rate, token and session limits")

    def model(self, model_id: str) -> ModelConfig:
        return self.models[model_id]

    def with_server(self, **changes: object) -> Config:
        return replace(self, server=replace(self.server, **changes))


def load_config(path: str | Path = DEFAULT_CONFIG) -> Config:
    return parse_config(read_toml(path), Path(path))


def parse_config(raw: dict, path: Path | None = None) -> Config:
    known = {"server", "models", "edge", "engine", "routing", "cascade", "cluster", "host", "limits", "voice"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown}; known sections: {sorted(known)}")
    return Config(
        server=build(ServerConfig, raw.get("server", {}), "server"),
        models=parse_models(raw.get("models")),
        edge=build(EdgeConfig, raw.get("edge", {}), "edge"),
        engine=parse_engine_table(raw.get("engine", {})),
        routing=build(RoutingConfig, raw.get("routing", {}), "routing"),
        cascade=build(CascadeConfig, raw.get("cascade", {}), "cascade"),
        cluster=build(ClusterConfig, raw.get("cluster", {}), "cluster"),
        host=build(HostConfig, raw.get("host", {}), "host"),
        limits=build(LimitsConfig, raw.get("limits", {}), "limits"),
        voice=build(VoiceConfig, raw.get("voice", {}), "voice"),
        path=path,
    )

