"""One generation turn, the same for a Realtime response and a chat completion.

A ``Turn`` routes the chat to an engine tier or the cascade (``prepare``: the router, then the
tokenizer), then streams the engine's events (``async for``, or ``run`` with a callback, which a tier's
``EventChannel`` serves from the engine's own step; the cascade's ``RouteInfo`` is taken in as
``turn.route`` and not passed on), metering each one under its API label. The
caller's key reserves the turn's output budget at ``prepare`` and is refunded what the turn did
not use when it finishes (or charged what it streamed, when it is left early). ``aclose`` aborts the engine request
unless it finished, so a turn that its caller leaves early (a client gone, a cancel, a bug)
never keeps engine work alive. What the events become (session events, SSE chunks, a JSON
body) is the adapters' business, not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Literal

from gateway.cascade.route import RouteInfo
from gateway.cascade.router import Router, prompt_token_limit
from gateway.context_fit import PromptCuts, fit
from gateway.limits import LimitsStore, Reservation
from gateway.metrics import GatewayMetrics
from gateway.shaping import Grammars
from gateway.tiers.build import encode_chat
from llm_shared.channel import EventChannel, as_pushing
from llm_shared.contract import (
    Engine,
    FinishEvent,
    Priority,
    SamplingParams,
    StreamEvent,
    TokenEvent,
    engine_saturated,
)
from llm_shared.errors import EngineError, OverloadedError
from llm_shared.structured import CompiledGrammar, OutputConstraints

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0  # the longest a turn waits for an engine to confirm an abort

Api = Literal["realtime", "chat"]  # the ``api`` label of every metric a turn touches


class Turn:
    """The engine side of one turn: ``await prepare()``, iterate, then ``await aclose()``.

    ``finished`` is True once the engine holds nothing more for the request: it sent the
    ``FinishEvent``, or it refused the request before any event (``generate`` validates
    before yielding, so there is no request to abort then).
    """

    def __init__(
        self,
        *,
        router: Router,
        model: str,
        messages: Sequence[Mapping[str, str]],
        params: SamplingParams,
        priority: Priority,
        request_id: str,
        api: Api,
        metrics: GatewayMetrics,
        limits: LimitsStore,
        key_id: str,
        session_id: str = "",
        abort_timeout_s: float = ABORT_TIMEOUT_S,
        grammars: Grammars | None = None,
        constraints: OutputConstraints | None = None,
        cuts: PromptCuts | None = None,
    ) -> None:
        """``session_id`` names the conversation (a Realtime session) so a tier can keep its
        state for the next turn; chat completions name none. ``constraints`` (tools, tool_choice,
        response_format; ``messages`` already list the tools, ``gateway.shaping``) are compiled by
        ``grammars`` for the chosen engine's tokenizer at ``prepare``. ``cuts``: how the prompt
        may shrink when it would not fit the chosen engine's context (the Realtime session's
        ``truncation``; ``dropped`` says what was left out); without them such a prompt is refused."""
        self.request_id = request_id
        self.session_id = session_id
        self.finished = False
        self._router = router
        self._model = model
        self._messages = messages
        self._params = params
        self._priority = priority
        self._api = api
        self._metrics = metrics
        self._token_series = metrics.token_series(api)
        self._limits = limits
        self._key_id = key_id
        self._engine: Engine | None = None
        self._route: RouteInfo | None = None
        self._route_counted = False
        self._reservation: Reservation | None = None  # the output budget taken at prepare
        self._tokens = 0  # tokens streamed so far
        self._prompt_ids: list[int] = []
        self._stream: AsyncIterator[StreamEvent] | None = None
        self._aborted = False  # an abort was sent; closing need not send another
        self._abort_timeout = abort_timeout_s
        self._started = 0.0  # loop time when the engine stream started, for time to first token
        self._last: float | None = None  # loop time of the latest token; None before the first
        self._grammars = grammars
        self._constraints = constraints
        self.grammar: CompiledGrammar | None = None  # the output's grammar, after prepare (None: free)
        self._cuts = cuts
        self.dropped: tuple[str, ...] = ()  # item ids a cut left out of the prompt, after prepare

    @property
    def aborted(self) -> bool:
        """``abort`` was called (an abort before the stream started leaves nothing to abort: the
        caller must not start it then)."""
        return self._aborted

    @property
    def sticky_cut(self) -> bool:
        """The prompt was the session's conversation: what ``dropped`` left out stays out of later turns."""
        return self._cuts is not None and self._cuts.sticky

    @property
    def engine(self) -> Engine:
        """The engine the router chose (only after ``prepare``): a tier, or the cascade."""
        assert self._engine is not None, "Turn.prepare() picks the engine"
        return self._engine

    @property
    def route(self) -> RouteInfo:
        """How the turn is served: the router's answer, refined by the cascade before the first token."""
        assert self._route is not None, "Turn.prepare() picks the route"
        return self._route

    def choose(self) -> Engine:
        """Choose the route, without awaiting anything; raises the EngineError that refused it
        (no engine ready, or the chosen one at capacity). Under overload every refusal is paid on
        the event loop and the admitted streams wait behind them, so this runs before the chat
        template and the tokenizer, and a caller can refuse in the same step that asked."""
        if self._engine is None:
            route = self._router.choose(self._model, self._messages, self._params)
            self._engine, self._route = route.engine, route.info
        if engine_saturated(self._engine):
            raise OverloadedError(f"the {self._engine.tier} tier is at capacity; retry shortly")
        return self._engine

    async def prepare(self) -> Engine:
        """``choose`` (unless done), then encode the prompt and reserve the output budget; raises
        the EngineError that refused it. A prompt that certainly exceeds every context that could
        serve it is refused before tokenizing."""
        engine = self.choose()
        if self._constraints is not None and self._grammars is not None:
            # A schema that cannot be enforced is refused here, naming its field, before any work.
            self.grammar = await self._grammars.compile(engine.tokenizer, self._constraints, engine, self._key_id)
            if self.grammar is not None:
                self._params = replace(self._params, grammar=self.grammar.text)
        limit = prompt_token_limit(engine, self._params.max_tokens)
        if self._cuts is not None and limit is not None:
            room = prompt_token_limit(engine, self._params.max_tokens, with_answer=True)
            fitted = await fit(engine, self._messages, self._cuts, room or limit)
            self._prompt_ids, self._messages, self.dropped = fitted.prompt_ids, fitted.messages, fitted.dropped
        else:
            self._prompt_ids = await encode_chat(engine, self._messages, limit)
        # The output budget is taken now, before any token: a burst cannot overspend the key.
        self._reservation = await self._limits.reserve(self._key_id, self._params.max_tokens, holder=self.request_id)
        return engine

    def __aiter__(self) -> Turn:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._stream is None:
            self._start()
        assert self._stream is not None
        try:
            event = await anext(self._stream)
            while isinstance(event, RouteInfo):  # the cascade's decision, before the first token
                self._route = event
                event = await anext(self._stream)
        except EngineError:
            if self._last is None:
                self.finished = True  # refused: the engine never took the request
            raise
        self._meter(event)
        return event

    async def run(self, on_event: Callable[[StreamEvent], None]) -> None:
        """Pass every event to ``on_event`` up to and with the ``FinishEvent`` (after ``prepare``).

        The first event is awaited as iterating would (a refusal raises here; the cascade's route
        comes before it). After it, a stream that can push (``Pushing``: an ``EventChannel``, the
        torch tier's client, a decided cascade turn) calls back from the engine's own step, so a
        token costs no task wake and no coroutine chain; any other stream is iterated. Raises the
        engine's ``EngineError``, and whatever ``on_event`` raises (the stream is left then;
        ``aclose`` aborts the request)."""
        on_event(await self.__anext__())
        stream = as_pushing(self._stream)
        if self.finished:
            return
        if stream is None or not stream.can_subscribe():
            async for event in self:
                on_event(event)
                if self.finished:
                    return
            return
        done = asyncio.get_running_loop().create_future()

        def pushed(item: StreamEvent | EngineError) -> None:
            if done.done():
                return
            try:
                if isinstance(item, EngineError):
                    raise item
                self._meter(item)
                on_event(item)
            except Exception as e:  # it must not reach the engine's step: it ends this turn alone
                stream.unsubscribe()
                done.set_exception(e)
                return
            if self.finished:
                done.set_result(None)

        stream.subscribe(pushed)
        try:
            await done
        finally:
            stream.unsubscribe()

    def _meter(self, event: StreamEvent) -> None:
        if not self._route_counted:
            self._route_counted = True
            self._count_route()
        if isinstance(event, TokenEvent):
            now = asyncio.get_running_loop().time()
            series = self._token_series
            if self._last is None:
                self._metrics.ttft.labels(self._api).observe(now - self._started)
            else:
                series.observe_gap(now - self._last)
            self._last = now
            self._tokens += 1
            series.tokens += 1
        elif isinstance(event, FinishEvent):
            self.finished = True
            metrics, api = self._metrics, self._api
            metrics.prompt_tokens.labels(api).inc(event.prompt_tokens)
            metrics.cached_tokens.labels(api).inc(event.cached_tokens)
            self._settle(event.completion_tokens)

    def _count_route(self) -> None:
        route, metrics, api = self.route, self._metrics, self._api
        metrics.cascade_turns.labels(api, route.tier, route.route).inc()
        if route.degraded:
            metrics.cascade_degraded.labels(api, route.reason or "gpu_unavailable").inc()

    def _start(self) -> None:
        engine = self.engine
        self._metrics.requests.labels(self._api, engine.tier).inc()
        self._started = asyncio.get_running_loop().time()
        # The key's salt: the tiers reuse cached prefixes only among this key's turns (when isolated).
        self._stream = engine.generate(self.request_id, self._prompt_ids, self._params, self._priority,
                                       session_id=self.session_id, cache_salt=self._router.cache_salt(self._key_id))

    async def abort(self) -> None:
        """Ask the engine to stop now (its stream then ends with ``reason="abort"``). Safe
        before the stream starts: aborting an unknown request is a no-op in the engine."""
        if self._engine is None or self.finished:
            return
        self._aborted = True
        try:
            await asyncio.wait_for(self._engine.abort(self.request_id), self._abort_timeout)
        except EngineError as e:
            log.warning("engine abort of %s failed: %s", self.request_id, e.message)
        except TimeoutError:
            # A wedged engine must not freeze the session or shutdown: the response ends anyway;
            # the tier's health probe (and its supervisor) deal with the engine.
            log.warning("engine abort of %s did not return within %.1f s", self.request_id, self._abort_timeout)

    async def aclose(self) -> None:
        """Abort the request unless it finished or was aborted, then close the engine's stream
        (its clean-up runs now rather than whenever the generator is collected). Shielded: a
        caller cancelled because its client left must still free the engine's work. Most turns
        end on a channel that ended, which holds nothing more (``EventChannel``'s doc): those close
        at once, without a task."""
        if self.finished and isinstance(self._stream, EventChannel) and self._stream.ended:
            self._settle(self._tokens)
            return
        await asyncio.shield(self._close())

    def _settle(self, used: int) -> None:
        if self._reservation is not None:
            self._limits.settle_nowait(self._reservation, used)

    async def _close(self) -> None:
        self._settle(self._tokens)  # a turn left early pays for what it streamed (no-op once settled)
        stream = self._stream
        if stream is None:
            return  # never started: the engine has no request under this id
        if not self._aborted:
            await self.abort()
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            # An engine whose stream breaks while closing has nothing more to free; a stream
            # still running in another task (RuntimeError) is closed by that task.
            with contextlib.suppress(EngineError, RuntimeError, TimeoutError):
                await asyncio.wait_for(aclose(), self._abort_timeout)
