"""The per-turn confidence cascade over two tiers, as one engine: a drafter that starts every
turn and a target that takes the turns it is not confident of (``route.Tier``; in the shipped
configs the edge tier drafts and the torch tier is the target, as below).

A turn starts on the edge model. Its first ``hold_tokens`` tokens are held back while a scorer
turns their probabilities into a confidence. At or above the (load-aware) threshold the held
tokens are released and the edge streams on. Below it the edge request is aborted and the torch
tier takes the turn with the held tokens as its first draft (decided as soon as no token the edge
could still hold would lift the score to the threshold: ``confidence.best_final_score``) (``Engine.generate(draft_ids=...)``):
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
from gateway.cascade.confidence import ConfidenceScorer, best_final_score
from gateway.cascade.flight import Ask, CascadeEvent, CascadeStream, Flight, Forward
from gateway.cascade.health import HealthMonitor
from gateway.cascade.route import RouteInfo, Tier, with_role
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

    def __init__(self, tiers: Sequence[Tier], config: CascadeConfig, scorer: ConfidenceScorer,
                 health: HealthMonitor, metrics: GatewayMetrics,
                 computing: Callable[[Engine], bool] | None = None) -> None:
        """``tiers``: one drafter and one target (``route.Tier``), by the names health knows them by.
        ``computing(engine)``: whether that tier holds a share of cores it shares with the other
        now (``gateway.tiers.cores``); None where the tiers do not share the host's cores."""
        self.drafter = with_role(tiers, "drafter")
        self.target = with_role(tiers, "target")
        self.config = config
        self.scorer = scorer
        self.health = health
        self._metrics = metrics
        self._flights: dict[str, Flight] = {}
        # Recent waits, smoothed: from a turn's start on the edge to the cascade's decision (its
        # held tokens scored), and from a torch-tier stage's start to its first event.
        self.drafter_decide_s: float | None = None
        self.target_first_s: float | None = None
        # Of the turns decided on the edge lately, the share the torch tier had to take (smoothed):
        # what a turn started on the edge is likely to wait for after its decision.
        self.escalation_share: float | None = None
        self.computing = computing

    @property
    def tokenizer(self) -> Tokenizer:
        return self.drafter.engine.tokenizer  # the same vocabulary as the torch tier's (checked at start-up)

    @property
    def grammar_compiler(self) -> Callable[[], GrammarCompiler] | None:
        """The edge tier's compiler, which the gateway shares (``gateway.shaping``), if it has one."""
        return getattr(self.drafter.engine, "grammar_compiler", None)

    @property
    def ready(self) -> bool:
        return self.health.up(self.drafter.name) or self.health.up(self.target.name)

    def saturated(self) -> bool:
        """Both tiers would refuse a new turn for overload (one with room takes it)."""
        return engine_saturated(self.drafter.engine) and engine_saturated(self.target.engine)

    @property
    def drafter_max_prompt_tokens(self) -> int:
        return int(getattr(self.drafter.engine, "max_prompt_tokens", 1 << 30))

    def threshold(self) -> float:
        """The threshold now: relaxed toward ``min_threshold`` as the torch tier's waiting queue
        or KV use rises, so that more turns stay on the edge instead of queueing there."""
        cfg = self.config
        if not cfg.load_aware:
            return cfg.threshold
        stats = self.target.engine.stats()
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
        for engine in (self.drafter.engine, self.target.engine):
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
        drafter_up, target_up = self.health.up(self.drafter.name), self.health.up(self.target.name)
        rule = self._pre_route(prompt)
        if rule:
            if target_up:
                yield RouteInfo(self.target.name, "pre_routed", reason=rule)
                yield self._stage(flight, self.target.engine, rid, prompt, params, ask)
                return
            if len(prompt) > self.drafter_max_prompt_tokens:
                raise EngineUnavailableError("this prompt is too long for the edge tier and the torch tier is "
                                             "unavailable; retry shortly")
        if not drafter_up and not target_up:
            raise EngineUnavailableError(self.health.unavailable_message())
        if not target_up or rule:  # the torch tier is wanted but down: the edge answers, degraded
            self._may_fall_back(self.drafter)
            info, engine = RouteInfo(self.drafter.name, "fallback", degraded=True,
                                     reason=f"{self.target.name}_unavailable"), self.drafter.engine
        elif not drafter_up:
            self._may_fall_back(self.target)
            info, engine = RouteInfo(self.target.name, "fallback", reason=f"{self.drafter.name}_unavailable"), self.target.engine
        else:
            info, engine = None, None
        spill = self._spill_reason() if info is None and self.config.spill else None
        if spill is not None:
            info, engine = RouteInfo(self.target.name, "spilled", reason=spill), self.target.engine
            self._metrics.cascade_spills.labels(spill).inc()
        if info is not None and engine is not None:
            yield info
            forward = self._stage(flight, engine, rid, prompt, params, ask)
            if engine is self.target.engine and forward.stream is not None:
                forward.on_event = self._first_event_timer(loop_time())
            yield forward
            return

        loop = asyncio.get_running_loop()
        started = loop.time()
        threshold = self.threshold()
        draft_stream = flight.start(self.drafter.engine, rid, prompt, params, ask)
        held: list[TokenEvent] = []
        finish: FinishEvent | None = None
        try:
            while len(held) < self.config.hold_tokens:
                event = await flight.next(draft_stream)
                if isinstance(event, FinishEvent):
                    finish = event
                    break
                held.append(event)
                best = best_final_score(self.scorer, [t.logprob for t in held], self.config.hold_tokens)
                if best is not None and best < threshold:
                    break  # it escalates whatever the edge says next: decided now
            if finish is None:
                self.drafter_decide_s = _smoothed(self.drafter_decide_s, loop.time() - started)
        except (EngineUnavailableError, OverloadedError) as e:
            # The edge could not take the turn (it died, or it is full): the torch tier serves it.
            down = isinstance(e, EngineUnavailableError)
            if down:
                self.health.mark_down(self.drafter.name, e.message)
            self._may_fall_back(self.target)
            yield RouteInfo(self.target.name, "fallback",
                            reason=f"{self.drafter.name}_{'unavailable' if down else 'overloaded'}")
            yield self._stage(flight, self.target.engine, rid, prompt, params, ask)
            return
        if finish is not None and (finish.reason == "abort" or flight.aborted):
            yield finish  # cancelled while held: nothing was shown, nothing more starts
            return

        ok = finish is None or finish.reason != "error"
        confidence = self.scorer.score([t.logprob for t in held]) if held and ok else 0.0
        self._metrics.cascade_confidence.observe(confidence)
        if ok:
            self.escalation_share = _smoothed(self.escalation_share, float(confidence < threshold))
        keep: RouteInfo | None = None
        if confidence >= threshold:
            keep = RouteInfo(self.drafter.name, "confident", confidence, threshold)
        elif ok and self.config.spill and (self._backlog(self.target.engine) or 0.0) > 1.0 and not self._drafter_queued():
            keep = RouteInfo(self.drafter.name, "spilled", confidence, threshold, reason=f"{self.target.name}_busy")
            self._metrics.cascade_spills.labels(f"{self.target.name}_busy").inc()
        if keep is not None:
            yield keep
            if finish is not None:
                yield Forward(None, [*held, finish])
            else:
                yield Forward(draft_stream, held)
            return

        # Escalate: the edge lets go before the torch tier starts, so the two never both hold it.
        await flight.stop()
        self._metrics.cascade_escalation_seconds.observe(loop.time() - started)
        if flight.aborted:
            yield FinishEvent("abort", len(prompt), 0, tier=self.drafter.name)
            return
        drafts = [t.token_id for t in held]
        target_stream = flight.start(self.target.engine, rid, prompt, params, ask, drafts)
        target_started = loop.time()
        try:
            first = await flight.next(target_stream)
            self.target_first_s = _smoothed(self.target_first_s, loop.time() - target_started)
        except (EngineUnavailableError, OverloadedError) as e:
            down = isinstance(e, EngineUnavailableError)
            if down:
                self.health.mark_down(self.target.name, e.message)
            self._may_fall_back(self.drafter)
            reason = f"{self.target.name}_{'unavailable' if down else 'overloaded'}"
            yield RouteInfo(self.drafter.name, "fallback", confidence, threshold, degraded=True, reason=reason)
            # A fresh id: the edge may still be retiring the first request under ``rid``.
            yield self._stage(flight, self.drafter.engine, f"{rid}#{self.drafter.name}", prompt, params, ask)
            return
        yield RouteInfo(self.target.name, "escalated", confidence, threshold)
        agreement = _DraftAgreement(drafts, self._metrics)
        yield Forward(target_stream, [first], on_event=agreement.seen, at_end=agreement.record)

    def _spill_reason(self) -> str | None:
        """Why the turn goes straight to the torch tier, or None: the edge cannot start it now and
        the torch tier is less full (``edge_busy``); or the edge is serving others (``edge_busy``),
        or where the tiers share the host's cores it is idle beside a torch tier that computes
        (``cores_shared``: waking it would take cores from that one), and a turn started there
        would take over ``spill_slack`` times as long to its first token as one the torch tier
        starts: the edge's recent time to decide, scaled by its queue, and for the share of turns
        that escalate lately, the torch tier's start after it."""
        busy = f"{self.drafter.name}_busy"
        edge, gpu = self._backlog(self.drafter.engine), self._backlog(self.target.engine)
        if edge is None or gpu is None:
            return None
        if edge > 1.0 and gpu < edge:
            return busy
        decide, start = self.drafter_decide_s, self.target_first_s
        if decide is None or start is None:
            return None
        if self._in_flight(self.drafter.engine) == 0:
            if not self._wakes_edge_beside_busy_target():
                return None  # an idle edge starts at once (and refreshes its pace)
            busy = "cores_shared"
        torch_start = start * max(1.0, gpu)
        on_edge = decide * max(1.0, edge) + (self.escalation_share or 0.0) * torch_start
        return busy if on_edge > self.config.spill_slack * torch_start else None

    def _wakes_edge_beside_busy_target(self) -> bool:
        """The tiers share the host's cores, the torch tier computes on them and the edge does not:
        a turn started on the edge would claim a share of the torch tier's cores for itself."""
        computing = self.computing
        return (computing is not None and computing(self.target.engine) and not computing(self.drafter.engine))

    def _in_flight(self, engine: Engine) -> int:
        """This cascade's turns on ``engine`` now: known at once, where a tier's stats lag its queue
        (a burst of turns all see the stats of before the burst)."""
        return sum(1 for flight in self._flights.values() if flight.engine is engine and not flight.finished)

    def _backlog(self, engine: Engine) -> float | None:
        """``engine_backlog``, counting this cascade's own turns there if the stats have not yet;
        on the edge, against at most ``spill_edge_turns`` of them."""
        backlog = engine_backlog(engine)
        if backlog is None:
            return None
        limit = engine.stats().get("max_running", 0.0)
        if engine is self.drafter.engine and self.config.spill_edge_turns:
            limit = min(limit, self.config.spill_edge_turns) if limit > 0 else self.config.spill_edge_turns
        return max(backlog, (self._in_flight(engine) + 1) / limit) if limit > 0 else backlog

    def _drafter_queued(self) -> bool:
        """Turns wait for the edge: keeping another one there for its whole answer would hold them up."""
        return self.drafter.engine.stats().get("waiting", 0.0) > 0

    def _first_event_timer(self, started: float) -> Callable[[StreamEvent], None]:
        """An ``on_event`` that records a torch-tier stage's wait for its first event."""
        seen = False

        def on_event(event: StreamEvent) -> None:
            nonlocal seen
            if not seen:
                seen = True
                self.target_first_s = _smoothed(self.target_first_s, loop_time() - started)

        return on_event

    def _may_fall_back(self, tier: Tier) -> None:
        """``tier`` is about to serve a turn meant for the other, which is down: only a fallback may."""
        if "fallback" not in tier.roles:
            raise EngineUnavailableError(self.health.unavailable_message())

    def _pre_route(self, prompt: list[int]) -> str:
        if len(prompt) > self.drafter_max_prompt_tokens:
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
