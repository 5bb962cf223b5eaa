"""The per-turn confidence cascade over the edge and torch tiers, as one engine.

A turn starts on the edge model. Its first ``hold_tokens`` tokens are held back while a scorer
turns their probabilities into a confidence. At or above the (load-aware) threshold the held
tokens are released and the edge streams on. Below it the edge request is aborted and the torch
tier takes the turn with the held tokens as its first draft (``Engine.generate(draft_ids=...)``):
the prefix it agrees with is verified in the prompt's own pass and streams at once, the rest it
generates itself, drafting with the edge model where speculative decoding is on. The client
never sees a held token the torch tier did not produce or verify.

Availability comes first: a prompt the edge cannot hold (or a pre-routing rule) goes straight
to the torch tier; with the torch tier down or overloaded the edge serves the turn, marked
degraded; with the edge down the torch tier serves it. Before its first token the stream
yields a ``RouteInfo`` saying which of these happened. ``abort`` frees the request in both
tiers, whichever holds it, including in the gap between aborting the edge and starting the
torch tier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine_gpu.client import kv_use
from gateway.cascade.confidence import ConfidenceScorer
from gateway.cascade.config import CascadeConfig
from gateway.cascade.health import HealthMonitor
from gateway.cascade.route import RouteInfo
from gateway.metrics import GatewayMetrics
from llm_shared.contract import (
    Engine,
    FinishEvent,
    Priority,
    SamplingParams,
    StreamEvent,
    TokenEvent,
    engine_saturated,
)
from llm_shared.errors import DuplicateRequestError, EngineError, EngineUnavailableError, OverloadedError
from llm_shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CascadeEvent = StreamEvent | RouteInfo


@dataclass(frozen=True)
class _Ask:
    """What every stage of a turn passes on to the tier it runs on, as the caller gave it."""

    priority: Priority
    session_id: str
    cache_salt: str  # the caller's tenant: each tier reuses cached prefixes only within it


@dataclass
class _Flight:
    """One request while the cascade runs it."""

    aborted: bool = False
    engine: Engine | None = None  # the tier holding the request now
    stage_id: str = ""  # the request id in that tier (a second stage on one tier gets a fresh one)
    stream: AsyncIterator[StreamEvent] | None = None
    finished: bool = True  # the current stage's stream sent its FinishEvent (or never started)


class CascadeEngine:
    tier = "cascade"

    def __init__(self, edge: Engine, gpu: Engine, config: CascadeConfig, scorer: ConfidenceScorer,
                 health: HealthMonitor, metrics: GatewayMetrics) -> None:
        self.edge = edge
        self.gpu = gpu
        self.config = config
        self.scorer = scorer
        self.health = health
        self._metrics = metrics
        self._flights: dict[str, _Flight] = {}

    @property
    def tokenizer(self) -> Tokenizer:
        return self.edge.tokenizer  # the same vocabulary as the torch tier's (checked at start-up)

    @property
    def ready(self) -> bool:
        return self.health.up("edge") or self.health.up("gpu")

    def saturated(self) -> bool:
        """Both tiers would refuse a new turn for overload (one with room takes it)."""
        return engine_saturated(self.edge) and engine_saturated(self.gpu)

    @property
    def edge_max_prompt_tokens(self) -> int:
        return int(getattr(self.edge, "max_prompt_tokens", 1 << 30))

    def threshold(self) -> float:
        """The threshold now: relaxed toward ``min_threshold`` as the torch tier's waiting queue
        or KV use rises, so that more turns stay on the edge instead of queueing there."""
        cfg = self.config
        if not cfg.load_aware:
            return cfg.threshold
        stats = self.gpu.stats()
        queue = min(1.0, stats.get("waiting", 0.0) / cfg.queue_full)
        kv = kv_use(stats)
        kv_load = min(1.0, max(0.0, (kv - cfg.kv_relax_from) / (1.0 - cfg.kv_relax_from)))
        return cfg.threshold - max(queue, kv_load) * (cfg.threshold - cfg.min_threshold)

    # --- the Engine protocol ------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                       priority: Priority = Priority.INTERACTIVE, session_id: str = "",
                       draft_ids: Sequence[int] = (), cache_salt: str = "") -> AsyncIterator[CascadeEvent]:
        """The turn's events, a ``RouteInfo`` first. ``draft_ids`` are not taken: the cascade
        makes its own from the edge. ``cache_salt`` goes to every stage, on either tier."""
        if request_id in self._flights:
            raise DuplicateRequestError(f"request {request_id!r} is already running", param="request_id")
        flight = self._flights[request_id] = _Flight()
        try:
            async for event in self._serve(flight, request_id, list(prompt_ids), params,
                                           _Ask(priority, session_id, cache_salt)):
                yield event
        finally:
            await asyncio.shield(self._stop(flight))
            del self._flights[request_id]

    async def abort(self, request_id: str) -> None:
        """Free the request in whichever tier holds it; a stage not started yet never starts."""
        flight = self._flights.get(request_id)
        if flight is None:
            return
        flight.aborted = True
        if flight.engine is not None and not flight.finished:
            await flight.engine.abort(flight.stage_id)

    async def end_session(self, session_id: str) -> None:
        for engine in (self.edge, self.gpu):
            if engine.ready:
                await engine.end_session(session_id)

    async def probe(self) -> None:
        if not self.ready:
            raise EngineUnavailableError("neither tier is available")

    def stats(self) -> dict[str, float]:
        return {"threshold": self.threshold(), "requests": float(len(self._flights))}

    async def close(self) -> None:
        """The tiers belong to the gateway, which closes them."""

    # --- one turn -------------------------------------------------------------------------------

    async def _serve(self, flight: _Flight, rid: str, prompt: list[int], params: SamplingParams,
                     ask: _Ask) -> AsyncIterator[CascadeEvent]:
        edge_up, gpu_up = self.health.up("edge"), self.health.up("gpu")
        rule = self._pre_route(prompt)
        if rule:
            if gpu_up:
                yield RouteInfo("gpu", "pre_routed", reason=rule)
                async for event in self._stage(flight, self.gpu, rid, prompt, params, ask):
                    yield event
                return
            if len(prompt) > self.edge_max_prompt_tokens:
                raise EngineUnavailableError("this prompt is too long for the edge tier and the torch tier is "
                                             "unavailable; retry shortly")
        if not edge_up and not gpu_up:
            raise EngineUnavailableError("no engine tier is available; retry shortly")
        if not gpu_up or rule:  # the torch tier is wanted but down: the edge answers, degraded
            info, engine = RouteInfo("edge", "fallback", degraded=True, reason="gpu_unavailable"), self.edge
        elif not edge_up:
            info, engine = RouteInfo("gpu", "fallback", reason="edge_unavailable"), self.gpu
        else:
            info, engine = None, None
        if info is not None and engine is not None:
            yield info
            async for event in self._stage(flight, engine, rid, prompt, params, ask):
                yield event
            return

        loop = asyncio.get_running_loop()
        started = loop.time()
        threshold = self.threshold()
        edge_stream = self._start(flight, self.edge, rid, prompt, params, ask)
        held: list[TokenEvent] = []
        finish: FinishEvent | None = None
        try:
            while len(held) < self.config.hold_tokens:
                event = await self._next(flight, edge_stream)
                if isinstance(event, FinishEvent):
                    finish = event
                    break
                held.append(event)
        except (EngineUnavailableError, OverloadedError) as e:
            # The edge could not take the turn (it died, or it is full): the torch tier serves it.
            if isinstance(e, EngineUnavailableError):
                self.health.mark_down("edge", e.message)
            yield RouteInfo("gpu", "fallback", reason="edge_unavailable" if isinstance(e, EngineUnavailableError)
                            else "edge_overloaded")
            async for event in self._stage(flight, self.gpu, rid, prompt, params, ask):
                yield event
            return
        if finish is not None and (finish.reason == "abort" or flight.aborted):
            yield finish  # cancelled while held: nothing was shown, nothing more starts
            return

        ok = finish is None or finish.reason != "error"
        confidence = self.scorer.score([t.logprob for t in held]) if held and ok else 0.0
        self._metrics.cascade_confidence.observe(confidence)
        if confidence >= threshold:
            yield RouteInfo("edge", "confident", confidence, threshold)
            for token in held:
                yield token
            if finish is not None:
                yield finish
                return
            while True:
                event = await self._next(flight, edge_stream)
                yield event
                if isinstance(event, FinishEvent):
                    return

        # Escalate: the edge lets go before the torch tier starts, so the two never both hold it.
        await self._stop(flight)
        self._metrics.cascade_escalation_seconds.observe(loop.time() - started)
        if flight.aborted:
            yield FinishEvent("abort", len(prompt), 0, tier="edge")
            return
        drafts = [t.token_id for t in held]
        gpu_stream = self._start(flight, self.gpu, rid, prompt, params, ask, drafts)
        try:
            first = await self._next(flight, gpu_stream)
        except (EngineUnavailableError, OverloadedError) as e:
            if isinstance(e, EngineUnavailableError):
                self.health.mark_down("gpu", e.message)
            reason = "gpu_unavailable" if isinstance(e, EngineUnavailableError) else "gpu_overloaded"
            yield RouteInfo("edge", "fallback", confidence, threshold, degraded=True, reason=reason)
            # A fresh id: the edge may still be retiring the first request under ``rid``.
            async for event in self._stage(flight, self.edge, f"{rid}#edge", prompt, params, ask):
                yield event
            return
        yield RouteInfo("gpu", "escalated", confidence, threshold)
        accepted, agreeing = 0, True
        event = first
        try:
            while True:
                if isinstance(event, TokenEvent) and agreeing:
                    agreeing = accepted < len(drafts) and event.token_id == drafts[accepted]
                    accepted += agreeing
                yield event
                if isinstance(event, FinishEvent):
                    return
                event = await self._next(flight, gpu_stream)
        finally:
            self._metrics.cascade_held_tokens.labels("accepted").inc(accepted)
            self._metrics.cascade_held_tokens.labels("rejected").inc(len(drafts) - accepted)

    def _pre_route(self, prompt: list[int]) -> str:
        if len(prompt) > self.edge_max_prompt_tokens:
            return "prompt_exceeds_edge_context"
        limit = self.config.escalate_prompt_tokens
        if limit and len(prompt) > limit:
            return "prompt_length"
        return ""

    # --- stages ---------------------------------------------------------------------------------

    def _start(self, flight: _Flight, engine: Engine, rid: str, prompt: list[int], params: SamplingParams,
               ask: _Ask, drafts: Sequence[int] = ()) -> AsyncIterator[StreamEvent]:
        stream = engine.generate(rid, prompt, params, ask.priority, session_id=ask.session_id, draft_ids=drafts,
                                 cache_salt=ask.cache_salt)
        flight.engine, flight.stream, flight.finished, flight.stage_id = engine, stream, False, rid
        return stream

    async def _next(self, flight: _Flight, stream: AsyncIterator[StreamEvent]) -> StreamEvent:
        try:
            event = await anext(stream)
        except EngineError:
            flight.finished = True  # refused before its first event, or broken: nothing to abort
            raise
        except StopAsyncIteration:
            flight.finished = True
            raise EngineError("the engine's stream ended without finishing") from None
        if isinstance(event, FinishEvent):
            flight.finished = True
        return event

    async def _stage(self, flight: _Flight, engine: Engine, rid: str, prompt: list[int], params: SamplingParams,
                     ask: _Ask) -> AsyncIterator[StreamEvent]:
        """One tier serves the whole turn."""
        if flight.aborted:
            yield FinishEvent("abort", len(prompt), 0, tier=engine.tier)
            return
        stream = self._start(flight, engine, rid, prompt, params, ask)
        while True:
            event = await self._next(flight, stream)
            yield event
            if isinstance(event, FinishEvent):
                return

    async def _stop(self, flight: _Flight) -> None:
        """Abort the current stage unless it finished (its KV is free on return), close its stream."""
        engine, stream, rid = flight.engine, flight.stream, flight.stage_id
        flight.engine, flight.stream = None, None
        if engine is not None and not flight.finished:
            try:
                await engine.abort(rid)
            except EngineError as e:
                log.warning("aborting %s on the %s tier failed: %s", rid, engine.tier, e.message)
        flight.finished = True
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except (EngineError, RuntimeError) as e:  # a broken stream has nothing left to free
                log.debug("closing the %s stream of %s: %s", engine.tier if engine else "?", rid, e)

