"""What one gateway app holds: its config, engines, limits, metrics and live sessions.

One ``GatewayState`` per ``web.Application`` (under the ``STATE`` app key), never a module
global, so tests can run several apps in one process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import Gauge

from gateway.auth import Authenticator, Clock
from gateway.cascade.router import Router
from gateway.config import Config
from gateway.http.model_files import DeviceModels
from gateway.limits import Limits, LimitsStore, store_from_config
from gateway.metrics import GatewayMetrics
from gateway.shaping import Grammars
from gateway.tiers.build import build_router, host_plan
from gateway.tiers.cores import CoreArbiter, arbiter_for
from gateway.ws.frame_gate import LargeFrameBudget
from llm_shared.contract import Engine

if TYPE_CHECKING:
    from gateway.ws.connection import RealtimeConnection
    from gateway.ws.voice_service import GatewayVoice

log = logging.getLogger(__name__)


@dataclass(eq=False)
class GatewayState:
    config: Config
    auth: Authenticator
    limits: LimitsStore  # per-key request and token buckets, running and session caps ([limits])
    metrics: GatewayMetrics = field(init=False)
    grammars: Grammars = field(init=False)  # tools and response_format, compiled per tokenizer
    device_models: DeviceModels = field(init=False)  # model files served for on-device fallbacks
    engines: dict[str, Engine] = field(default_factory=dict)
    router: Router | None = None
    cores: CoreArbiter | None = None  # moves the host's threads to the tiers with work ([host] follow_load)
    _drafter_follows_torch: bool = field(default=False, init=False)  # its gauge moves with torch's threads
    models: dict[str, str] = field(default_factory=dict)  # served model id -> route (cascade, edge, gpu)
    owns_engines: bool = False  # close the engines at cleanup (False when a test passed them in)
    connections: set[RealtimeConnection] = field(default_factory=set)  # live WebSocket sessions
    http_requests: dict[str, Engine] = field(default_factory=dict)  # in-flight chat completions
    shutting_down: bool = False
    # Draining (gateway/process/drain.py): no new sessions or completions; live ones finish, then close.
    draining: bool = False
    chats_in_flight: int = 0  # chat completion handlers running, counted from the request (the drain waits)
    work_ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when a session or a completion ends
    created: int = field(default_factory=lambda: int(time.time()))
    voice: GatewayVoice | None = None  # speech in and out ([voice]); None: text-only sessions
    large_frames: LargeFrameBudget = field(init=False)  # large appends held at once, all sessions

    def __post_init__(self) -> None:
        self.metrics = GatewayMetrics(lambda: self.engines)
        # The tiers of one gateway share a tokenizer family (Config checks it): one tool-call syntax.
        self.grammars = Grammars(self.config.models[self.config.edge.model].family,
                                 compile_s_per_minute=self.config.server.grammar_compile_s_per_minute)
        self.device_models = DeviceModels(self.config.models)
        self.large_frames = LargeFrameBudget(self.config.server.large_frames_budget_bytes)
        self.metrics.large_frames_bytes.set_function(lambda: float(self.large_frames.in_flight))
        Gauge("gateway_voice_sessions", "Sessions holding a voice seat now (at most [voice] max_sessions)",
              registry=self.metrics.registry).set_function(
            lambda: float(seats.in_use) if (seats := getattr(self.voice, "seats", None)) is not None else 0.0)
        Gauge("gateway_limits_degraded", "1 while the shared limits store is unreachable and this process "
              "applies its own limits (fail_open) or refuses (fail_closed)", registry=self.metrics.registry
              ).set_function(lambda: float(self.limits.degraded))

    def load_voice(self) -> GatewayVoice | None:
        """The voice pipeline of ``[voice]`` (seconds: models load), its jobs counted in the metrics;
        None when voice is off. Blocking: call it off the event loop."""
        if not self.config.voice.enabled:
            return None
        from voice.errors import VoiceModelError

        metrics = self.metrics
        try:
            from gateway.ws.voice_service import GatewayVoice  # lazy: onnxruntime, CTranslate2

            return GatewayVoice(self.config.voice, lambda job: metrics.voice_job(job.kind, job.outcome, job.audio_s,
                                                                                 job.compute_s, job.wait_s))
        except VoiceModelError as e:
            # A missing model or synthesizer must not take text service down with it.
            log.error("voice is off: %s (sessions refuse audio until it is fixed)", e.message)
        except ImportError as e:  # an install without the voice packages (onnxruntime, faster-whisper)
            log.error("voice is off: %s is not installed (make install installs it; or set [voice] "
                      "enabled = false)", e.name or e)
        return None

    @classmethod
    def from_config(cls, config: Config, clock: Clock = time.monotonic) -> GatewayState:
        server = config.server
        return cls(
            config=config,
            auth=Authenticator(server.all_api_keys()),
            limits=store_from_config(config.limits, Limits.from_server(server), clock=clock),
        )

    def set_engines(self, engines: Mapping[str, Engine], *, owned: bool) -> None:
        """Route over ``engines``; inside a running loop the router's probes start now, else
        when the app starts (``start_router``)."""
        self.engines = dict(engines)
        plan = host_plan(self.config)
        for pool, threads in (("cpus", plan.cpus), ("edge", plan.edge), ("torch", plan.engine),
                              ("drafter", plan.drafter)):
            self.metrics.host_threads.labels(pool).set(threads)
        self._drafter_follows_torch = plan.drafter > 0  # the drafter takes turns with torch's threads
        self.cores = arbiter_for(self.config, self.engines, self._threads_moved,
                                 lambda pool, seconds: self.metrics.thread_claim_wait.labels(pool).observe(seconds))
        self.router = build_router(self.config, self.engines, self.metrics,
                                   self.cores.computing if self.cores is not None else None)
        self.models = dict(self.router.routes)
        self.owns_engines = owned
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self.router.start()

    def _threads_moved(self, pool: str, threads: int) -> None:
        self.metrics.thread_reassignments.inc()
        self.metrics.host_threads.labels(pool).set(threads)
        if pool == "torch" and self._drafter_follows_torch:
            self.metrics.host_threads.labels("drafter").set(threads)

    def start_router(self) -> None:
        if self.router is not None:
            self.router.start()

    async def close_router(self) -> None:
        """The router's probes and the cores' arbiter stop (before the engines close)."""
        if self.router is not None:
            await self.router.close()
        if self.cores is not None:
            await self.cores.close()

    async def close_limits(self) -> None:
        """Release this process's leases and the store's connection (a Redis store's)."""
        await self.limits.aclose()

    @property
    def default_model(self) -> str:
        return self.config.routing.default_model

    @property
    def ready(self) -> bool:
        return not self.shutting_down and not self.draining and self.router is not None and self.router.ready

    def unavailable_message(self) -> str:
        """Why a new turn cannot be served now (call when ``ready`` is False)."""
        if self.shutting_down or self.draining:
            return "the server is shutting down; retry shortly"
        if self.router is None:
            return "the models are still loading; retry shortly"
        return self.router.unavailable_message()

    @property
    def busy(self) -> bool:
        """Sessions or chat completions are still running."""
        return bool(self.connections) or self.chats_in_flight > 0

    async def wait_idle(self) -> None:
        """Return once no session and no chat completion is left."""
        while self.busy:
            self.work_ended.clear()
            await self.work_ended.wait()


STATE: web.AppKey[GatewayState] = web.AppKey("gateway_state", GatewayState)
