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
degraded; with the edge down the torch tier serves it. Then load (``spill``): a turn the edge
cannot start now (every sequence slot taken, or others waiting) goes straight to the torch
tier when that one is less full (``engine_backlog``), and a turn that would escalate stays on
the edge while the torch tier cannot start it now: the idle tier serves instead of the queue.
Before its first token the stream yields a ``RouteInfo`` saying which of these happened. ``abort`` frees the request in both
tiers, whichever holds it, including in the gap between aborting the edge and starting the
torch tier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from engine_gpu.client import kv_use
from gateway.cascade.confidence import ConfidenceScorer
from gateway.cascade.flight import Ask, CascadeEvent, CascadeStream, Flight, Forward
from gateway.cascade.health import HealthMonitor
from gateway.cascade.route import RouteInfo
from gateway.config.cascade import CascadeConfig
from gateway.metrics import GatewayMetrics
from llm_shared.channel import EventChannel
from llm_shared.contract import (
    Engine,
    FinishEvent,
    Priority,
    SamplingParams,
    StreamEvent,
    TokenEvent,
    engine_backlog,
    engine_saturated,
)
from llm_shared.errors import DuplicateRequestError, EngineUnavailableError, OverloadedError
from llm_shared.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llm_shared.structured import GrammarCompiler

log = logging.getLogger(__name__)

class _DraftAgreement:
    """How many of the held edge tokens an escalated torch stage produced too (its leading run)."""

    def __init__(self, drafts: Sequence[int], metrics: GatewayMetrics) -> None:
        self._drafts = drafts
        self._metrics = metrics
        self.accepted = 0
        self._agreeing = True

    def seen(self, event: StreamEvent) -> None:
        if isinstance(event, TokenEvent) and self._agreeing:
            self._agreeing = self.accepted < len(self._drafts) and event.token_id == self._drafts[self.accepted]
            self.accepted += self._agreeing

    def record(self) -> None:
        self._metrics.cascade_held_tokens.labels("accepted").inc(self.accepted)
        self._metrics.cascade_held_tokens.labels("rejected").inc(len(self._drafts) - self.accepted)


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
        self._flights: dict[str, Flight] = {}
        # Recent waits, smoothed: from a turn's start on the edge to the cascade's decision (its
        # held tokens scored), and from a torch-tier stage's start to its first event.
        self.edge_decide_s: float | None = None
        self.gpu_first_s: float | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        return self.edge.tokenizer  # the same vocabulary as the torch tier's (checked at start-up)

    @property
    def grammar_compiler(self) -> Callable[[], GrammarCompiler] | None:
        """The edge tier's compiler, which the gateway shares (``gateway.shaping``), if it has one."""
        return getattr(self.edge, "grammar_compiler", None)

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

    def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 priority: Priority = Priority.INTERACTIVE, session_id: str = "",
                 draft_ids: Sequence[int] = (), cache_salt: str = "") -> AsyncIterator[CascadeEvent]:
        """The turn's events, a ``RouteInfo`` first. ``draft_ids`` are not taken: the cascade
        makes its own from the edge. ``cache_salt`` goes to every stage, on either tier."""
        if request_id in self._flights:
            return EventChannel.refused(DuplicateRequestError(f"request {request_id!r} is already running",
                                                              param="request_id"))
        flight = self._flights[request_id] = Flight()
        decide = self._serve(flight, request_id, list(prompt_ids), params, Ask(priority, session_id, cache_salt))
        return CascadeStream(flight, decide, lambda: self._forget(request_id, flight))

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

    def _forget(self, request_id: str, flight: Flight) -> None:
        if self._flights.get(request_id) is flight:  # (a new turn may reuse the id once this one is over)
            del self._flights[request_id]

    async def close(self) -> None:
        """The tiers belong to the gateway, which closes them."""

    # --- one turn -------------------------------------------------------------------------------

    async def _serve(self, flight: Flight, rid: str, prompt: list[int], params: SamplingParams,
                     ask: Ask) -> AsyncIterator[CascadeEvent | Forward]:
        """The decision: ``RouteInfo`` (and, for a turn cancelled while held, its finish), then a
        ``Forward`` naming the stage that serves the rest, as its last item."""
        edge_up, gpu_up = self.health.up("edge"), self.health.up("gpu")
        rule = self._pre_route(prompt)
        if rule:
            if gpu_up:
                yield RouteInfo("gpu", "pre_routed", reason=rule)
                yield self._stage(flight, self.gpu, rid, prompt, params, ask)
                return
            if len(prompt) > self.edge_max_prompt_tokens:
                raise EngineUnavailableError("this prompt is too long for the edge tier and the torch tier is "
                                             "unavailable; retry shortly")
        if not edge_up and not gpu_up:
            raise EngineUnavailableError(self.health.unavailable_message())
        if not gpu_up or rule:  # the torch tier is wanted but down: the edge answers, degraded
            info, engine = RouteInfo("edge", "fallback", degraded=True, reason="gpu_unavailable"), self.edge
        elif not edge_up:
            info, engine = RouteInfo("gpu", "fallback", reason="edge_unavailable"), self.gpu
        else:
            info, engine = None, None
        if info is None and self.config.spill and self._edge_busy():
            info, engine = RouteInfo("gpu", "spilled", reason="edge_busy"), self.gpu
            self._metrics.cascade_spills.labels("edge_busy").inc()
        if info is not None and engine is not None:
            yield info
            forward = self._stage(flight, engine, rid, prompt, params, ask)
            if engine is self.gpu and forward.stream is not None:
                forward.on_event = self._first_event_timer(loop_time())
            yield forward
            return

        loop = asyncio.get_running_loop()
        started = loop.time()
        threshold = self.threshold()
        edge_stream = flight.start(self.edge, rid, prompt, params, ask)
        held: list[TokenEvent] = []
        finish: FinishEvent | None = None
        try:
            while len(held) < self.config.hold_tokens:
                event = await flight.next(edge_stream)
                if isinstance(event, FinishEvent):
                    finish = event
                    break
                held.append(event)
            if finish is None:
                self.edge_decide_s = _smoothed(self.edge_decide_s, loop.time() - started)
        except (EngineUnavailableError, OverloadedError) as e:
            # The edge could not take the turn (it died, or it is full): the torch tier serves it.
            if isinstance(e, EngineUnavailableError):
                self.health.mark_down("edge", e.message)
            yield RouteInfo("gpu", "fallback", reason="edge_unavailable" if isinstance(e, EngineUnavailableError)
                            else "edge_overloaded")
            yield self._stage(flight, self.gpu, rid, prompt, params, ask)
            return
        if finish is not None and (finish.reason == "abort" or flight.aborted):
            yield finish  # cancelled while held: nothing was shown, nothing more starts
            return

        ok = finish is None or finish.reason != "error"
        confidence = self.scorer.score([t.logprob for t in held]) if held and ok else 0.0
        self._metrics.cascade_confidence.observe(confidence)
        keep: RouteInfo | None = None
        if confidence >= threshold:
            keep = RouteInfo("edge", "confident", confidence, threshold)
        elif ok and self.config.spill and (self._backlog(self.gpu) or 0.0) > 1.0 and not self._edge_queued():
            keep = RouteInfo("edge", "spilled", confidence, threshold, reason="gpu_busy")
            self._metrics.cascade_spills.labels("gpu_busy").inc()
        if keep is not None:
            yield keep
            if finish is not None:
                yield Forward(None, [*held, finish])
            else:
                yield Forward(edge_stream, held)
            return

        # Escalate: the edge lets go before the torch tier starts, so the two never both hold it.
        await flight.stop()
        self._metrics.cascade_escalation_seconds.observe(loop.time() - started)
        if flight.aborted:
            yield FinishEvent("abort", len(prompt), 0, tier="edge")
            return
        drafts = [t.token_id for t in held]
        gpu_stream = flight.start(self.gpu, rid, prompt, params, ask, drafts)
        gpu_started = loop.time()
        try:
            first = await flight.next(gpu_stream)
            self.gpu_first_s = _smoothed(self.gpu_first_s, loop.time() - gpu_started)
        except (EngineUnavailableError, OverloadedError) as e:
            if isinstance(e, EngineUnavailableError):
                self.health.mark_down("gpu", e.message)
            reason = "gpu_unavailable" if isinstance(e, EngineUnavailableError) else "gpu_overloaded"
            yield RouteInfo("edge", "fallback", confidence, threshold, degraded=True, reason=reason)
            # A fresh id: the edge may still be retiring the first request under ``rid``.
            yield self._stage(flight, self.edge, f"{rid}#edge", prompt, params, ask)
            return
        yield RouteInfo("gpu", "escalated", confidence, threshold)
        agreement = _DraftAgreement(drafts, self._metrics)
        yield Forward(gpu_stream, [first], on_event=agreement.seen, at_end=agreement.record)

    def _edge_busy(self) -> bool:
        """Spill to the torch tier: the edge cannot start the turn now and the torch tier is less
        full; or the edge is serving others and, at its recent pace and queue, would take over
        ``spill_slack`` times as long to decide the turn as the torch tier at its own to start one."""
        edge, gpu = self._backlog(self.edge), self._backlog(self.gpu)
        if edge is None or gpu is None:
            return False
        if edge > 1.0 and gpu < edge:
            return True
        if self._in_flight(self.edge) == 0 or self.edge_decide_s is None or self.gpu_first_s is None:
            return False  # an idle edge starts at once (and refreshes its pace)
        return self.edge_decide_s * max(1.0, edge) > self.config.spill_slack * self.gpu_first_s * max(1.0, gpu)

    def _in_flight(self, engine: Engine) -> int:
        """This cascade's turns on ``engine`` now: known at once, where a tier's stats lag its queue
        (a burst of turns all see the stats of before the burst)."""
        return sum(1 for flight in self._flights.values() if flight.engine is engine and not flight.finished)

    def _backlog(self, engine: Engine) -> float | None:
        """``engine_backlog``, counting this cascade's own turns there if the stats have not yet."""
        backlog = engine_backlog(engine)
        if backlog is None:
            return None
        limit = engine.stats().get("max_running", 0.0)
        return max(backlog, (self._in_flight(engine) + 1) / limit) if limit > 0 else backlog

    def _edge_queued(self) -> bool:
        """Turns wait for the edge: keeping another one there for its whole answer would hold them up."""
        return self.edge.stats().get("waiting", 0.0) > 0

    def _first_event_timer(self, started: float) -> Callable[[StreamEvent], None]:
        """An ``on_event`` that records a torch-tier stage's wait for its first event."""
        seen = False

        def on_event(event: StreamEvent) -> None:
            nonlocal seen
            if not seen:
                seen = True
                self.gpu_first_s = _smoothed(self.gpu_first_s, loop_time() - started)

        return on_event

    def _pre_route(self, prompt: list[int]) -> str:
        if len(prompt) > self.edge_max_prompt_tokens:
            return "prompt_exceeds_edge_context"
        limit = self.config.escalate_prompt_tokens
        if limit and len(prompt) > limit:
            return "prompt_length"
        return ""

    # --- stages ---------------------------------------------------------------------------------

    def _stage(self, flight: Flight, engine: Engine, rid: str, prompt: list[int], params: SamplingParams,
               ask: Ask) -> Forward:
        """One tier serves the whole turn."""
        if flight.aborted:
            return Forward(None, [FinishEvent("abort", len(prompt), 0, tier=engine.tier)])
        return Forward(flight.start(engine, rid, prompt, params, ask), [])

WAIT_EMA = 0.2  # weight of the newest wait in a smoothed one


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else old + WAIT_EMA * (new - old)


def loop_time() -> float:
    return asyncio.get_running_loop().time()
