"""One generation turn against the fake engine: metering, charging, and aborting when left early."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from fake_engine import FakeEngine

from gateway.cascade.router import Router
from gateway.limits import InProcessStore, Limits
from gateway.metrics import GatewayMetrics
from gateway.turns import Turn
from llm_shared.contract import FinishEvent, Priority, SamplingParams, StreamEvent, TokenEvent
from llm_shared.errors import EngineUnavailableError, PromptTooLongError

MESSAGES = [{"role": "user", "content": "hello there"}]


def make(engine: FakeEngine, *, max_tokens: int = 5) -> tuple[Turn, GatewayMetrics, InProcessStore]:
    metrics = GatewayMetrics(lambda: {"edge": engine})
    # A stopped clock: the buckets refill with time, and a busy machine must not turn 995 into 996.
    limiter = InProcessStore(Limits(requests_per_minute=60, tokens_per_minute=1000), clock=lambda: 0.0)
    turn = Turn(router=Router({"edge-model": "edge"}, {"edge": engine}), model="edge-model", messages=MESSAGES, params=SamplingParams(max_tokens=max_tokens),
                priority=Priority.INTERACTIVE, request_id="req-1", api="chat", metrics=metrics, limits=limiter,
                key_id="k")
    return turn, metrics, limiter


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_a_whole_turn_is_metered_and_charged_and_not_aborted() -> None:
    engine = FakeEngine()
    turn, metrics, limiter = make(engine, max_tokens=5)
    assert (await turn.prepare()) is engine
    events: list[StreamEvent] = [event async for event in turn]
    await turn.aclose()
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    finish = events[-1]
    assert isinstance(finish, FinishEvent) and turn.finished
    assert sample(metrics, "gateway_requests_total", api="chat", tier="edge") == 1
    assert sample(metrics, "gateway_output_tokens_total", api="chat") == len(tokens)
    assert sample(metrics, "gateway_prompt_tokens_total", api="chat") == finish.prompt_tokens
    assert sample(metrics, "gateway_ttft_seconds_count", api="chat") == 1
    assert sample(metrics, "gateway_inter_token_latency_seconds_count", api="chat") == len(tokens) - 1
    assert limiter.peek("k").rate_limits()[1]["remaining"] == 1000 - finish.completion_tokens
    assert engine.aborts == []


async def test_a_turn_left_early_aborts_its_engine_request() -> None:
    engine = FakeEngine(tokens_per_second=50)
    turn, _, _ = make(engine, max_tokens=50)
    await turn.prepare()
    assert isinstance(await anext(turn), TokenEvent)
    await turn.aclose()
    assert engine.aborts == ["req-1"] and not turn.finished
    await turn.aclose()  # once is enough
    assert engine.aborts == ["req-1"]


async def test_a_refused_turn_has_nothing_to_abort() -> None:
    engine = FakeEngine(n_ctx=40)  # the prompt (30 tokens) fits, not with 50 output tokens: the engine refuses
    turn, metrics, _ = make(engine, max_tokens=50)
    await turn.prepare()
    with pytest.raises(PromptTooLongError):
        await anext(turn)
    assert turn.finished
    await turn.aclose()
    assert engine.aborts == []
    assert sample(metrics, "gateway_ttft_seconds_count", api="chat") is None


async def test_a_turn_never_started_sends_nothing_to_the_engine() -> None:
    engine = FakeEngine()
    turn, metrics, _ = make(engine)
    await turn.prepare()
    await turn.abort()  # before the stream starts: the engine knows no such request, a no-op
    await turn.aclose()
    assert engine.started == [] and engine.aborts == []
    assert sample(metrics, "gateway_requests_total", api="chat", tier="edge") is None


class IteratedOnly(FakeEngine):
    """The same engine behind a plain async generator, as the cascade's stream is: no push path."""

    async def _iterate(self, *args: object, **kwargs: object) -> AsyncIterator[StreamEvent]:
        stream = super().generate(*args, **kwargs)  # type: ignore[arg-type]
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    def generate(self, *args: object, **kwargs: object) -> AsyncIterator[StreamEvent]:  # type: ignore[override]
        return self._iterate(*args, **kwargs)


@pytest.mark.parametrize("engine_class", [FakeEngine, IteratedOnly])
async def test_run_passes_every_event_and_meters_as_iterating_does(engine_class: type[FakeEngine]) -> None:
    engine = engine_class(tokens_per_second=200)
    turn, metrics, limiter = make(engine, max_tokens=5)
    await turn.prepare()
    events: list[StreamEvent] = []
    delivered_by: set[asyncio.Task[object] | None] = set()

    def on_event(event: StreamEvent) -> None:
        events.append(event)
        delivered_by.add(asyncio.current_task())

    await asyncio.wait_for(turn.run(on_event), 30)
    await turn.aclose()
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert len(tokens) == 5 and isinstance(events[-1], FinishEvent) and turn.finished
    assert sample(metrics, "gateway_output_tokens_total", api="chat") == 5
    assert sample(metrics, "gateway_inter_token_latency_seconds_count", api="chat") == 4
    assert limiter.peek("k").rate_limits()[1]["remaining"] == 1000 - 5
    assert engine.aborts == []
    if engine_class is FakeEngine:
        # The first event is awaited by run's task; the rest come by call from the engine's own step.
        assert len(delivered_by) == 2, delivered_by
    else:
        assert len(delivered_by) == 1, delivered_by  # iterated: every event through run's task


def adapter_bug(engine: FakeEngine) -> None:
    raise ValueError("a bug in the adapter")


def engine_lost(engine: FakeEngine) -> None:
    engine.channel_of("req-1").fail(EngineUnavailableError("the core went away"))


@pytest.mark.parametrize(("breaks", "error"), [(adapter_bug, ValueError), (engine_lost, EngineUnavailableError)])
async def test_a_turn_broken_mid_stream_raises_from_run_and_ends_alone(
        breaks: Callable[[FakeEngine], None], error: type[Exception]) -> None:
    """The callback raises, or the engine fails the stream, at the third event: ``run`` raises
    that, the request is freed, and the engine's step goes on serving others."""
    engine = FakeEngine(tokens_per_second=200)
    turn, _, _ = make(engine, max_tokens=50)
    await turn.prepare()
    seen: list[StreamEvent] = []

    def on_event(event: StreamEvent) -> None:
        seen.append(event)
        if len(seen) == 3:
            breaks(engine)

    with pytest.raises(error):
        await asyncio.wait_for(turn.run(on_event), 30)
    await turn.aclose()
    assert len(seen) == 3 and engine.aborts == ["req-1"] and engine.blocks_of("req-1") == 0
    other, _, _ = make(engine, max_tokens=3)
    await other.prepare()
    finished: list[StreamEvent] = []
    await asyncio.wait_for(other.run(finished.append), 30)
    assert isinstance(finished[-1], FinishEvent) and finished[-1].reason == "length"
