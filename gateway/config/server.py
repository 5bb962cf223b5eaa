"""The ``[server]`` table: the port, API keys, per-key limits, frame and queue bounds, timeouts."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from typing import Literal

from llm_shared.configtools import require

MAX_WORKERS = 64


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_env: str = "GATEWAY_API_KEYS"  # comma-separated keys, added to api_keys
    allowed_origins: tuple[str, ...] = ()  # browser Origins allowed; empty = same-host only
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback names and the bind address; "*": any
    max_frame_bytes: int = 256 * 1024  # any client event (gateway/ws/frame_gate.py)
    # ...and an input_audio_buffer.append, up to this (15 MiB of base64 audio, the API's limit, and its
    # JSON around it), while this process holds fewer than large_frames_budget_bytes of such frames;
    # past the budget a large append is dropped with an error event and the session goes on.
    max_large_frame_bytes: int = 16 * 1024 * 1024
    large_frames_budget_bytes: int = 64 * 1024 * 1024
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
    # per key; token bucket of voice work: each utterance recognized (its length) and each phrase
    # spoken (its estimated length) is charged when asked for; past it, it is refused (the
    # transcription or the spoken answer fails with rate_limit_exceeded). 3600: sixty sessions
    # talking without a pause, all minute long.
    audio_seconds_per_minute: int = 3600
    # Per key and process: CPU seconds of grammar compile a minute (tools, response_format), 5% of
    # the compile thread, ten seconds' worth at once; past it, requests needing a compile are
    # refused (429) until it refills. A new schema costs 1-35 ms, a known one is a cache hit; 0: no budget.
    grammar_compile_s_per_minute: float = 3.0
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
    # Gateway processes on one port (SO_REUSEPORT), each with its own event loop (gateway/process/workers.py);
    # more than one needs the limits in Redis (Config checks it).
    workers: int = 1

    def __post_init__(self) -> None:
        require(1 <= self.port <= 65535 or self.port == 0, f"server.port must be 0..65535, got {self.port}")
        require(1 <= self.workers <= MAX_WORKERS, f"server.workers must be in 1..{MAX_WORKERS}, got {self.workers}")
        require(self.max_frame_bytes >= 1024, "server.max_frame_bytes must be >= 1024")
        require(self.max_frame_bytes <= self.max_large_frame_bytes <= 256 * 2**20,
                "need server.max_frame_bytes <= server.max_large_frame_bytes <= 268435456")
        require(self.large_frames_budget_bytes >= 0, "server.large_frames_budget_bytes must be >= 0 (0: none)")
        for name in ("max_conversation_items", "max_conversation_chars", "max_sessions_per_key", "max_sessions",
                     "requests_per_minute", "tokens_per_minute", "audio_seconds_per_minute",
                     "max_concurrent_requests_per_key", "send_queue_high", "send_queue_limit", "send_queue_max_bytes",
                     "default_max_output_tokens", "max_output_tokens"):
            require(getattr(self, name) >= 1, f"server.{name} must be >= 1")
        for name in ("idle_timeout_s", "ping_interval_s", "ping_timeout_s", "shutdown_grace_s", "slow_client_timeout_s",
                     "engine_abort_timeout_s", "sse_write_timeout_s"):
            require(getattr(self, name) > 0, f"server.{name} must be > 0")
        require(0 <= self.drain_timeout_s <= 3600, "server.drain_timeout_s must be in 0..3600")
        require(0 <= self.grammar_compile_s_per_minute <= 3600,
                "server.grammar_compile_s_per_minute must be in 0..3600 (0: no budget)")
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
