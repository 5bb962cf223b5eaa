"""Prometheus metrics of one gateway app.

Every app owns a ``CollectorRegistry`` of its own (never prometheus-client's global default),
so tests can build several apps in one process. Engine numbers are not copied into gauges
as they change: a custom collector calls ``Engine.stats()`` of each engine at scrape time.
"""

from __future__ import annotations

import gc
import re
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from llm_shared.contract import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Time to first token spans queueing and prefill; inter-token latency one decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
CONFIDENCE_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
GC_PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CLAIM_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
VOICE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)

_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")
# The tiers name a few numbers differently; these become one series each. The edge tier counts
# KV in llama.cpp cells (a "block" of one token).
STAT_ALIASES = {
    "running": "running_requests",
    "waiting": "waiting_requests",
    "kv_cells_used": "kv_blocks_in_use",
    "kv_cells_total": "kv_blocks_total",
}


class EngineStatsCollector(Collector):
    """Exports each numeric ``Engine.stats()`` key ``k`` as gauge ``engine_<k>{tier=...}`` (after
    ``STAT_ALIASES``), e.g. ``engine_kv_blocks_in_use``, ``engine_running_requests``,
    ``engine_prefix_cache_hits``."""

    def __init__(self, engines: Callable[[], Mapping[str, Engine]]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily] = {}
        ready = GaugeMetricFamily("engine_ready", "1 when the engine tier accepts requests", labels=["tier"])
        for tier, engine in sorted(self._engines().items()):
            ready.add_metric([tier], 1.0 if engine.ready else 0.0)
            for key, value in sorted(engine.stats().items()):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                name = "engine_" + _NAME_UNSAFE.sub("_", STAT_ALIASES.get(key, key))
                family = families.get(name)
                if family is None:
                    family = families[name] = GaugeMetricFamily(name, f"Engine.stats()['{key}']", labels=["tier"])
                family.add_metric([tier], float(value))
        yield ready
        yield from families.values()


class TokenSeries:
    """``gateway_inter_token_latency_seconds`` and ``gateway_output_tokens_total`` of one API label,
    touched once per token of every stream. A prometheus-client child takes a lock and walks its
    buckets on each call (~3 µs a token); these are plain counts bumped on the event loop, the only
    writer, and read whole when ``/metrics`` is scraped (``TokenCollector``)."""

    __slots__ = ("bucket_counts", "gap_count", "gap_sum", "tokens")

    def __init__(self) -> None:
        self.bucket_counts = [0] * (len(ITL_BUCKETS) + 1)  # the last one is +Inf
        self.gap_sum = 0.0
        self.gap_count = 0
        self.tokens = 0

    def observe_gap(self, seconds: float) -> None:
        self.bucket_counts[bisect_left(ITL_BUCKETS, seconds)] += 1
        self.gap_sum += seconds
        self.gap_count += 1


class TokenCollector(Collector):
    def __init__(self, series: Mapping[str, TokenSeries]) -> None:
        self._series = series

    def collect(self) -> Iterator[Metric]:
        itl = HistogramMetricFamily("gateway_inter_token_latency_seconds", "Time between consecutive tokens",
                                    labels=["api"])
        tokens = CounterMetricFamily("gateway_output_tokens", "Tokens generated", labels=["api"])
        for api, series in sorted(self._series.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, ITL_BUCKETS), "+Inf"), series.bucket_counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            itl.add_metric([api], buckets, series.gap_sum)
            tokens.add_metric([api], series.tokens)
        yield itl
        yield tokens


class GatewayMetrics:
    """The gateway's own series. ``api`` labels are ``realtime`` or ``chat``."""

    def __init__(self, engines: Callable[[], Mapping[str, Engine]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.sessions_active = Gauge("gateway_sessions_active", "Open WebSocket sessions", registry=r)
        self.sessions_total = Counter("gateway_sessions", "WebSocket sessions accepted", registry=r)
        self.handshakes_rejected = Counter(
            "gateway_handshakes_rejected", "WebSocket handshakes refused before a session", ["code"], registry=r)
        self.requests = Counter("gateway_requests", "Generation requests started", ["api", "tier"], registry=r)
        self.ttft = Histogram("gateway_ttft_seconds", "Time from request to first token", ["api"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("gateway_prompt_tokens", "Prompt tokens processed", ["api"], registry=r)
        self.cached_tokens = Counter("gateway_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     ["api"], registry=r)
        self.cancels = Counter("gateway_cancels", "Generations aborted before they finished", ["api", "reason"],
                               registry=r)
        self.errors = Counter("gateway_errors", "Errors reported to clients", ["api", "code"], registry=r)
        self.rate_limited = Counter("gateway_rate_limited", "Requests refused by a rate limit", ["api"], registry=r)
        self.coalesced = Counter("gateway_coalesced_deltas", "Text deltas merged for slow clients", registry=r)
        # Large frames (an input_audio_buffer.append over server.max_frame_bytes; gateway/ws/frame_gate.py).
        self.large_frames_refused = Counter(
            "gateway_large_frames_refused", "Large frames dropped: large_frames_busy (the server's budget was held) "
            "or frame_too_large (over server.max_large_frame_bytes)", ["code"], registry=r)
        self.large_frames_bytes = Gauge(
            "gateway_large_frames_bytes", "Bytes of large frames this process holds now (within "
            "server.large_frames_budget_bytes)", registry=r)
        # The cascade (gateway/cascade): how turns reach their tier, and what escalation costs.
        self.cascade_turns = Counter(
            "gateway_cascade_turns", "Turns by serving tier and route (model, confident, escalated, pre_routed, "
            "fallback, spilled)", ["api", "tier", "route"], registry=r)
        self.cascade_spills = Counter(
            "gateway_cascade_spills", "Turns the cascade sent to the tier that could start them now: edge_busy (to "
            "the torch tier), cores_shared (to the torch tier, not waking the edge beside it on shared cores), "
            "gpu_busy (kept on the edge)", ["reason"], registry=r)
        self.cascade_degraded = Counter(
            "gateway_cascade_degraded_turns", "Turns the edge served because the torch tier was down or full",
            ["api", "reason"], registry=r)
        self.cascade_confidence = Histogram(
            "gateway_cascade_confidence", "The edge's confidence in a turn's first tokens", buckets=CONFIDENCE_BUCKETS,
            registry=r)
        self.cascade_escalation_seconds = Histogram(
            "gateway_cascade_escalation_seconds", "Time an escalated turn spent on the edge before the torch tier "
            "started (what escalation adds to its time to first token)", buckets=TTFT_BUCKETS, registry=r)
        self.cascade_held_tokens = Counter(
            "gateway_cascade_held_tokens", "Held edge tokens the torch tier accepted or rejected on escalation",
            ["outcome"], registry=r)
        self.cascade_threshold = Gauge(
            "gateway_cascade_threshold", "The cascade's effective (load-aware) confidence threshold", registry=r)
        self.tier_up = Gauge("gateway_tier_up", "1 while the tier is up (down: not ready, refusing, or stalled with "
                             "work)", ["tier"], registry=r)
        self.host_threads = Gauge("gateway_host_threads", "Threads of each compute pool on this host, from its CPU "
                                  "budget (gateway.config.host)", ["pool"], registry=r)
        self.thread_reassignments = Counter(
            "gateway_thread_reassignments", "Changes of a compute pool's threads as the load moved between the "
            "tiers ([host] follow_load)", registry=r)
        self.thread_claim_wait = Histogram(
            "gateway_thread_claim_wait_seconds", "What a tier that was idle waited for its threads before computing "
            "(the busy tier shrinking at its next step)", ["pool"], buckets=CLAIM_BUCKETS, registry=r)
        self.tier_transitions = Counter("gateway_tier_transitions", "Up/down changes of a tier's health", ["tier"],
                                        registry=r)
        self.gc_pause = Histogram(
            "gateway_gc_pause_seconds", "Event-loop pauses of Python's cyclic garbage collector (every stream "
            "waits them out)", ["generation"], buckets=GC_PAUSE_BUCKETS, registry=r)
        self.voice_first_audio = Histogram(
            "gateway_voice_speech_to_first_audio_seconds", "From the end of the user's speech (server VAD) to the "
            "first audio of the answer", buckets=VOICE_BUCKETS, registry=r)
        self.voice_vad = Counter("gateway_voice_vad_events", "Server VAD decisions", ["event"], registry=r)
        self.voice_jobs = Counter("gateway_voice_jobs", "Recognition and synthesis jobs, by outcome",
                                  ["kind", "outcome"], registry=r)
        self.voice_audio = Counter("gateway_voice_audio_seconds", "Audio recognized (asr) or made (tts)", ["kind"],
                                   registry=r)
        self.voice_compute = Counter("gateway_voice_compute_seconds", "Worker time of recognition and synthesis "
                                     "(divided by gateway_voice_audio_seconds: the real-time factor)", ["kind"],
                                     registry=r)
        self.voice_wait = Histogram("gateway_voice_queue_wait_seconds", "Time a voice job queued for a worker",
                                    ["kind"], buckets=VOICE_BUCKETS, registry=r)
        self.foresight = Counter("gateway_voice_answers_ahead", "Answers started at a pause before the turn ended: "
                                 "adopted by the turn's response, dropped (the user went on), refused (no room), "
                                 "failed", ["outcome"], registry=r)
        r.register(EngineStatsCollector(engines))
        self._token_series: dict[str, TokenSeries] = {}
        r.register(TokenCollector(self._token_series))

    def token_series(self, api: str) -> TokenSeries:
        """The per-token metrics of ``api`` (inter-token latency, output tokens)."""
        series = self._token_series.get(api)
        if series is None:
            series = self._token_series[api] = TokenSeries()
        return series

    def voice_job(self, kind: str, outcome: str, audio_s: float, compute_s: float, wait_s: float) -> None:
        """One recognition or synthesis job of the voice pool (its observer)."""
        self.voice_jobs.labels(kind, outcome).inc()
        if compute_s > 0:
            self.voice_audio.labels(kind).inc(audio_s)
            self.voice_compute.labels(kind).inc(compute_s)
        self.voice_wait.labels(kind).observe(wait_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GcPauses:
    """While installed (``with``), every run of the cyclic garbage collector is timed into
    ``gateway_gc_pause_seconds``: the collector stops the event loop, so a full collection over
    many sessions shows up in every stream's inter-token latency. Process-wide: one per served app."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._histogram = metrics.gc_pause
        self._started: float | None = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._histogram.labels(str(info["generation"])).observe(time.perf_counter() - self._started)
            self._started = None
