"""The confidence cascade through a real gateway, with controllable fake tiers.

The edge fake gives every token a chosen log-probability, so a test decides the edge's
confidence; token ids derive from the token's text, so the torch fake "agrees" with a held
edge token exactly when it produces the same text.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest
import websockets
from fake_engine import FakeEngine, FakeTokenizer, token_id_of
from gateway_harness import make_config, recv_json, recv_until, send, user_item

from gateway.cascade.confidence import MeanScorer, MinScorer, QuantileScorer, build_scorer
from gateway.cascade.health import HealthMonitor
from gateway.config.cascade import CascadeConfig
from gateway.http.state import STATE, GatewayState
from gateway.limits import InProcessStore, Limits
from gateway.process.server import RunningServer, create_app, start_server
from gateway.turns import Turn
from llm_shared.contract import FinishEvent, Priority, SamplingParams, TokenEvent
from llm_shared.errors import ConfigError, EngineUnavailableError, OverloadedError

CASCADE, EDGE, GPU = "smollm2-135m", "smollm2-135m-edge", "smollm2-135m-gpu"
EDGE_REPLY = [f"e{i} " for i in range(12)]
GPU_REPLY = EDGE_REPLY[:3] + [f"g{i} " for i in range(3, 12)]  # agrees with the first 3 held edge tokens
SURE, UNSURE = math.log(0.95), math.log(0.05)


def edge_reply(prompt: Sequence[int], params: SamplingParams) -> list[str]:
    return EDGE_REPLY


def gpu_reply(prompt: Sequence[int], params: SamplingParams) -> list[str]:
    return GPU_REPLY


def tiers(*, edge_logprob: float = SURE, edge_tps: float | None = None,
          gpu_tps: float | None = None) -> tuple[FakeEngine, FakeEngine]:
    tokenizer = FakeTokenizer()  # one object: the cascade checks that both tiers share a vocabulary
    edge = FakeEngine(tier="edge", tokenizer=tokenizer, reply=edge_reply, logprob=edge_logprob,
                      tokens_per_second=edge_tps, n_ctx=4096)
    gpu = FakeEngine(tier="gpu", tokenizer=tokenizer, reply=gpu_reply, tokens_per_second=gpu_tps)
    return edge, gpu


@dataclass
class Cascade:
    server: RunningServer
    edge: FakeEngine
    gpu: FakeEngine

    @property
    def state(self) -> GatewayState:
        return self.server.app[STATE]

    @property
    def health(self) -> HealthMonitor:
        health = self.state.router.health if self.state.router else None
        assert health is not None
        return health

    def metric(self, name: str, **labels: str) -> float:
        return self.state.metrics.registry.get_sample_value(name, labels) or 0.0

    def ws_url(self, model: str = CASCADE) -> str:
        return f"ws://127.0.0.1:{self.server.port}/v1/realtime?model={model}"


@asynccontextmanager
async def cascade_gateway(edge: FakeEngine, gpu: FakeEngine, **cascade: Any) -> AsyncIterator[Cascade]:
    config = make_config()
    config = replace(config, routing=replace(config.routing, default="cascade"),
                     cascade=replace(config.cascade, **{"probe_interval_s": 0.05,
                                                        "stall_timeout_s": max(5.0, cascade.get("probe_interval_s", 0)),
                                                        **cascade}))
    server = await start_server(create_app(config, {"edge": edge, "gpu": gpu}))
    try:
        yield Cascade(server, edge, gpu)
    finally:
        await server.stop()


async def realtime_turn(ws: websockets.ClientConnection, text: str = "hello") -> tuple[str, dict[str, Any]]:
    """One turn: (the text the client was streamed, the response.done response)."""
    await send(ws, user_item(text))
    await send(ws, {"type": "response.create"})
    events = await recv_until(ws, "response.done", timeout=10)
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    return streamed, events[-1]["response"]


async def one_turn(cascade: Cascade, text: str = "hello", model: str = CASCADE) -> tuple[str, dict[str, Any]]:
    async with websockets.connect(cascade.ws_url(model)) as ws:
        await recv_json(ws)  # session.created
        return await realtime_turn(ws, text)


# ---- the scorers --------------------------------------------------------------------------------

def test_the_quantile_scorer_takes_a_low_quantile_of_token_probabilities() -> None:
    scorer = QuantileScorer(0.1)
    sure = [math.log(0.9)] * 10
    assert scorer.score(sure) == pytest.approx(0.9)
    one_doubt = [math.log(0.1)] + [math.log(0.9)] * 9  # 10th percentile of 10 values: the lowest, 0.9 of the way up
    assert scorer.score(one_doubt) == pytest.approx(0.1 + 0.9 * 0.8)
    two_doubts = [math.log(0.1)] * 2 + [math.log(0.9)] * 8
    assert scorer.score(two_doubts) == pytest.approx(0.1)
    assert MeanScorer().score(two_doubts) == pytest.approx(0.74)
    assert MinScorer().score(one_doubt) == pytest.approx(0.1)
    # A broken backend's NaN or positive logprob never counts as confidence.
    assert MinScorer().score([float("nan"), 0.0]) == 0.0 and QuantileScorer(0.5).score([1.5]) == 0.0


class ProbeScorer:
    """A stand-in for a learned probe, loaded by dotted path."""

    name = "probe"

    def __init__(self, config: CascadeConfig) -> None:
        self.bias = config.quantile

    def score(self, logprobs: Sequence[float]) -> float:
        return self.bias


def test_a_scorer_can_be_plugged_in_by_path_and_a_bad_one_is_a_config_error() -> None:
    scorer = build_scorer(CascadeConfig(scorer="test_cascade:ProbeScorer", quantile=0.42))
    assert scorer.name == "probe" and scorer.score([-5.0]) == 0.42
    for bad in ("nope", "no_such_module_x:f", "test_cascade:missing", "math:sqrt"):
        with pytest.raises((ConfigError, TypeError)):
            build_scorer(CascadeConfig(scorer=bad))


def test_cascade_config_is_validated() -> None:
    for bad in ({"hold_tokens": 0}, {"hold_tokens": 65}, {"threshold": 1.5}, {"min_threshold": 0.5, "threshold": 0.4},
                {"escalate_keywords": ("(unclosed",)}, {"stall_timeout_s": 0.5, "probe_interval_s": 1.0},
                {"probe_interval_s": 0.0}):
        with pytest.raises(ConfigError):
            CascadeConfig(**bad)


# ---- routing by confidence ------------------------------------------------------------------------

async def test_a_confident_turn_stays_on_the_edge() -> None:
    edge, gpu = tiers(edge_logprob=SURE)
    async with cascade_gateway(edge, gpu) as cascade:
        text, response = await one_turn(cascade)
        assert text == "".join(EDGE_REPLY)
        meta = response["metadata"]
        assert meta["x_tier"] == "edge" and meta["x_route"] == "confident"
        assert meta["x_escalated"] == "false" and meta["x_degraded"] == "false"
        assert float(meta["x_confidence"]) == pytest.approx(0.95, abs=1e-3)
        assert gpu.started == []  # the torch tier never saw the turn
        assert cascade.metric("gateway_cascade_turns_total", api="realtime", tier="edge", route="confident") == 1
        assert cascade.metric("gateway_cascade_confidence_count") == 1


async def test_low_confidence_escalates_and_the_client_sees_only_torch_tier_text() -> None:
    # Unsure only at the hold's last token: the first seven could still have made it confident.
    edge, gpu = tiers(edge_logprob=lambda prompt, i: UNSURE if i == 7 else math.log(0.25))
    async with cascade_gateway(edge, gpu) as cascade:
        text, response = await one_turn(cascade)
        assert text == "".join(GPU_REPLY)  # no held edge token reached the client unverified
        meta = response["metadata"]
        assert meta["x_tier"] == "gpu" and meta["x_route"] == "escalated" and meta["x_escalated"] == "true"
        assert float(meta["x_confidence"]) < float(meta["x_threshold"])
        [(rid, _)] = gpu.started
        assert gpu.drafts[rid] == [token_id_of(t) for t in EDGE_REPLY[:8]]  # the held tokens became its draft
        assert edge.aborts == [rid] and edge.blocks_in_use == 0 and gpu.blocks_in_use == 0
        assert cascade.metric("gateway_cascade_held_tokens_total", outcome="accepted") == 3
        assert cascade.metric("gateway_cascade_held_tokens_total", outcome="rejected") == 5
        assert cascade.metric("gateway_cascade_escalation_seconds_count") == 1
        assert cascade.metric("gateway_cascade_turns_total", api="realtime", tier="gpu", route="escalated") == 1


@pytest.mark.parametrize(("scorer", "unsure_from", "held"), [
    ("quantile", 0, 2),  # two tokens under the threshold: the 10th percentile of eight stays under it
    ("quantile", 5, 7),
    ("min", 3, 4),  # one is enough
    ("mean", 0, 7),  # (0.05 * 7 + 1) / 8 = 0.17: under 0.22 after seven
    ("tests.gateway.test_cascade:plugged_min", 3, 8),  # a plug-in that does not say it is monotone
])
async def test_a_turn_sure_to_escalate_is_decided_at_once(scorer: str, unsure_from: int, held: int) -> None:
    """No token the edge could still hold would lift the score to the threshold: the torch tier
    takes the turn now with the tokens so far as its draft, as it would have eight tokens later."""
    edge, gpu = tiers(edge_logprob=lambda prompt, i: UNSURE if i >= unsure_from else SURE)
    async with cascade_gateway(edge, gpu, scorer=scorer) as cascade:
        text, response = await one_turn(cascade)
        assert text == "".join(GPU_REPLY) and response["metadata"]["x_route"] == "escalated"
        [(rid, _)] = gpu.started
        assert gpu.drafts[rid] == [token_id_of(t) for t in EDGE_REPLY[:held]]
        assert edge.aborts == [rid] and edge.blocks_in_use == 0


def plugged_min(config: CascadeConfig) -> MinScorer:
    scorer = MinScorer()
    scorer.monotone = False  # type: ignore[misc]
    return scorer


async def test_a_turn_the_edge_ends_within_the_hold_is_scored_on_what_it_said() -> None:
    edge, gpu = tiers(edge_logprob=SURE)
    async with cascade_gateway(edge, gpu, hold_tokens=20) as cascade:
        text, response = await one_turn(cascade)
        assert text == "".join(EDGE_REPLY) and response["status"] == "completed"
        assert response["metadata"]["x_route"] == "confident" and gpu.started == []


async def test_the_client_picks_a_tier_by_model_id() -> None:
    edge, gpu = tiers(edge_logprob=UNSURE)
    async with cascade_gateway(edge, gpu) as cascade:
        text, response = await one_turn(cascade, model=EDGE)
        assert text == "".join(EDGE_REPLY) and response["metadata"] == {"x_tier": "edge"}  # never escalated
        assert gpu.started == []
        async with websockets.connect(cascade.ws_url(EDGE)) as ws:
            await recv_json(ws)
            await send(ws, {"type": "session.update", "session": {"type": "realtime", "model": GPU}})
            updated = await recv_until(ws, "session.updated")
            assert updated[-1]["session"]["model"] == GPU
            text, response = await realtime_turn(ws)
            assert text == "".join(GPU_REPLY) and response["metadata"]["x_tier"] == "gpu"
            await send(ws, {"type": "session.update", "session": {"type": "realtime", "model": "nope"}})
            error = await recv_until(ws, "error")
            assert error[-1]["error"]["param"] == "session.model"
        async with aiohttp.ClientSession(cascade.server.url) as http:
            models = await (await http.get("/v1/models")).json()
            assert sorted(m["id"] for m in models["data"]) == sorted([CASCADE, EDGE, GPU])
            body = await (await http.post("/v1/chat/completions", json={
                "model": CASCADE, "messages": [{"role": "user", "content": "hi"}]})).json()
            assert body["x_tier"] == "gpu" and body["x_route"]["route"] == "escalated"
            assert body["choices"][0]["message"]["content"] == "".join(GPU_REPLY)
            body = await (await http.post("/v1/chat/completions", json={
                "model": EDGE, "messages": [{"role": "user", "content": "hi"}]})).json()
            assert body["x_tier"] == "edge" and "x_route" not in body


async def test_the_load_aware_threshold_keeps_more_turns_on_the_edge_as_the_torch_queue_grows() -> None:
    middling = math.log(0.25)  # below the 0.35 threshold, above the 0.15 floor
    edge, gpu = tiers(edge_logprob=middling)
    async with cascade_gateway(edge, gpu, threshold=0.35, min_threshold=0.15, queue_full=10) as cascade:
        assert cascade.metric("gateway_cascade_threshold") == pytest.approx(0.35)
        _, idle = await one_turn(cascade)
        assert idle["metadata"]["x_route"] == "escalated"
        gpu.extra_stats = {"waiting": 5.0}  # half the queue: halfway to the floor
        assert cascade.metric("gateway_cascade_threshold") == pytest.approx(0.25)
        gpu.extra_stats = {"waiting": 8.0}
        _, busy = await one_turn(cascade)
        assert busy["metadata"]["x_route"] == "confident" and float(busy["metadata"]["x_threshold"]) < 0.25
        gpu.extra_stats = {"waiting": 0.0, "kv_blocks_in_use": 4096.0}  # a full KV pool relaxes it fully
        assert cascade.metric("gateway_cascade_threshold") == pytest.approx(0.15)


# ---- pre-routing ----------------------------------------------------------------------------------

async def test_prompts_the_edge_cannot_hold_or_that_match_a_rule_go_straight_to_the_torch_tier() -> None:
    edge, gpu = tiers(edge_logprob=SURE)
    async with cascade_gateway(edge, gpu, escalate_keywords=(r"\bprove\b",)) as cascade:
        _, response = await one_turn(cascade, "x" * 5000)  # over the edge's 4096-token context
        assert response["metadata"]["x_route"] == "pre_routed"
        assert response["metadata"]["x_route_reason"] == "prompt_exceeds_edge_context"
        _, response = await one_turn(cascade, "Please PROVE that it halts")
        assert response["metadata"]["x_route"] == "pre_routed" and response["metadata"]["x_route_reason"] == "keyword"
        assert edge.started == [] and len(gpu.started) == 2
        gpu.is_ready = False
        _, response = await one_turn(cascade, "prove it")
        assert response["metadata"]["x_tier"] == "edge" and response["metadata"]["x_degraded"] == "true"


# ---- availability ----------------------------------------------------------------------------------

async def test_with_the_torch_tier_down_the_edge_answers_marked_degraded() -> None:
    edge, gpu = tiers(edge_logprob=UNSURE)
    async with cascade_gateway(edge, gpu) as cascade:
        gpu.is_ready = False
        await cascade.health.wait_rounds(1)
        assert cascade.metric("gateway_tier_up", tier="gpu") == 0
        async with aiohttp.ClientSession(cascade.server.url) as http:
            ready = await http.get("/readyz")
            assert ready.status == 200 and await ready.json() == {
                "status": "ready", "tiers": {"edge": True, "gpu": False}, "degraded": True,
                "down": {"gpu": "not ready (its process is gone or restarting)"},
                "limits": {"backend": "memory", "failure": "fail_open", "degraded": False}}
        text, response = await one_turn(cascade)
        assert text == "".join(EDGE_REPLY)
        meta = response["metadata"]
        assert meta["x_tier"] == "edge" and meta["x_degraded"] == "true" and meta["x_route_reason"] == "gpu_unavailable"
        assert cascade.metric("gateway_cascade_degraded_turns_total", api="realtime", reason="gpu_unavailable") == 1
        gpu.is_ready = True  # back: the next probe says so, and turns escalate again
        await cascade.health.wait_rounds(1)
        _, response = await one_turn(cascade)
        assert response["metadata"]["x_tier"] == "gpu" and cascade.metric("gateway_tier_up", tier="gpu") == 1


@pytest.mark.parametrize("refusal", [OverloadedError("the torch tier is full"),
                                     EngineUnavailableError("the torch core died")])
async def test_an_escalation_the_torch_tier_refuses_is_answered_by_the_edge(refusal: Exception) -> None:
    edge, gpu = tiers(edge_logprob=UNSURE)
    async with cascade_gateway(edge, gpu, probe_interval_s=60.0) as cascade:  # the turn finds out first
        gpu.refuse = refusal
        text, response = await one_turn(cascade)
        assert text == "".join(EDGE_REPLY) and response["status"] == "completed"
        meta = response["metadata"]
        assert meta["x_degraded"] == "true" and meta["x_route"] == "fallback"
        overloaded = isinstance(refusal, OverloadedError)
        assert meta["x_route_reason"] == ("gpu_overloaded" if overloaded else "gpu_unavailable")
        assert cascade.health.up("gpu") is overloaded  # a dead tier is routed around until a probe answers
        assert edge.blocks_in_use == 0 and edge.running == 0


async def test_with_the_edge_down_turns_go_to_the_torch_tier_and_with_both_down_they_fail_clearly() -> None:
    edge, gpu = tiers(edge_logprob=SURE)
    async with cascade_gateway(edge, gpu) as cascade:
        async with websockets.connect(cascade.ws_url()) as ws:
            await recv_json(ws)
            edge.is_ready = False
            await cascade.health.wait_rounds(1)
            text, response = await realtime_turn(ws)
            assert text == "".join(GPU_REPLY)
            meta = response["metadata"]
            assert meta["x_tier"] == "gpu" and meta["x_degraded"] == "false"
            assert meta["x_route_reason"] == "edge_unavailable"
            gpu.is_ready = False
            await cascade.health.wait_rounds(1)
            _, response = await realtime_turn(ws)
            error = response["status_details"]["error"]
            assert response["status"] == "failed" and error["code"] == "engine_unavailable"
            assert "the edge tier is down: not ready" in error["message"] and "the gpu tier is down" in error["message"]
        async with aiohttp.ClientSession(cascade.server.url) as http:
            ready = await http.get("/readyz")
            assert ready.status == 503 and set((await ready.json())["down"]) == {"edge", "gpu"}
            chat = await http.post("/v1/chat/completions", json={"model": CASCADE,
                                                                "messages": [{"role": "user", "content": "hi"}]})
            body = await chat.json()
            assert chat.status == 503 and body["error"]["code"] == "engine_unavailable"
            assert "the edge tier is down" in body["error"]["message"]  # not "loading"


async def until(predicate: Any, monitor: HealthMonitor, timeout_s: float = 30.0) -> None:
    async def wait() -> None:
        while not predicate():
            await monitor.wait_rounds(1)
    await asyncio.wait_for(wait(), timeout_s)


async def test_a_wedged_tier_is_marked_down_when_its_probe_goes_unanswered_and_back_when_one_answers() -> None:
    edge, gpu = tiers()
    async with cascade_gateway(edge, gpu, stall_timeout_s=0.3) as cascade:
        gpu.probe_hangs = True
        await until(lambda: not cascade.health.up("gpu"), cascade.health)
        assert "has not answered a probe" in cascade.health.why_down("gpu")
        gpu.probe_hangs = False
        await until(lambda: cascade.health.up("gpu"), cascade.health)


class SlowProbes(FakeEngine):
    """A busy tier: its probes wait behind steps that take several probe intervals."""

    async def probe(self) -> None:
        await asyncio.sleep(0.25)
        await super().probe()


async def test_a_tier_whose_probes_answer_slowly_is_never_marked_down_and_no_turn_is_refused() -> None:
    tokenizer = FakeTokenizer()
    edge = SlowProbes(tier="edge", tokenizer=tokenizer, reply=edge_reply, logprob=UNSURE, n_ctx=4096)
    gpu = SlowProbes(tier="gpu", tokenizer=tokenizer, reply=gpu_reply, tokens_per_second=200.0)
    async with cascade_gateway(edge, gpu) as cascade:  # probes every 50 ms, each answered after 250
        results = await asyncio.gather(*(one_turn(cascade, f"turn {i}") for i in range(12)))
        await cascade.health.wait_rounds(3)
        assert all(response["status"] == "completed" for _, response in results)
        assert cascade.health.transitions() == 0 and cascade.metric("gateway_tier_transitions_total", tier="gpu") == 0
        assert cascade.metric("gateway_tier_up", tier="gpu") == 1.0


# ---- spilling to the tier that can start the turn now ------------------------------------------

async def test_a_turn_the_edge_cannot_start_now_goes_to_the_torch_tier_that_can() -> None:
    edge, gpu = tiers(edge_logprob=SURE)
    edge.extra_stats.update(running=2.0, max_running=2.0)  # every slot taken: the turn would queue
    gpu.extra_stats.update(max_running=8.0)
    async with cascade_gateway(edge, gpu) as cascade:
        text, response = await one_turn(cascade)
        meta = response["metadata"]
        assert text == "".join(GPU_REPLY) and meta["x_tier"] == "gpu"
        assert (meta["x_route"], meta["x_route_reason"], meta["x_degraded"]) == ("spilled", "edge_busy", "false")
        assert cascade.metric("gateway_cascade_spills_total", reason="edge_busy") == 1
        assert cascade.metric("gateway_cascade_turns_total", api="realtime", tier="gpu", route="spilled") == 1
        _, pinned = await one_turn(cascade, model=EDGE)  # a pinned id stays pinned, busy or not
        assert pinned["metadata"] == {"x_tier": "edge"}
        gpu.extra_stats.update(running=8.0, waiting=8.0)  # the torch tier is fuller still: the turn waits for the edge
        _, response = await one_turn(cascade)
        assert response["metadata"]["x_route"] == "confident"
    async with cascade_gateway(edge, gpu, spill=False) as cascade:
        _, response = await one_turn(cascade)
        assert response["metadata"]["x_route"] == "confident"


async def test_a_burst_counts_the_cascades_own_turns_where_the_tiers_stats_lag() -> None:
    edge, gpu = tiers(edge_logprob=SURE, edge_tps=50.0)
    edge.extra_stats.update(running=0.0, max_running=2.0)  # stats from before the burst
    gpu.extra_stats.update(running=0.0, max_running=8.0)
    async with cascade_gateway(edge, gpu) as cascade:
        turns = await asyncio.gather(*(one_turn(cascade, f"burst {i}") for i in range(6)))
        routes = Counter(response["metadata"]["x_route"] for _, response in turns)
        assert routes["confident"] <= 2 and routes["spilled"] >= 4  # two edge slots, whatever the stats said


async def test_a_wide_edge_counts_as_full_for_the_cascade_at_spill_edge_turns() -> None:
    """An edge with 32 slots (the shipped width, for its pinned model id) takes at most
    ``spill_edge_turns`` of a burst of cascade turns; the rest go to the torch tier, as they did
    when the edge had that many slots. 0: the edge's own slots."""
    edge, gpu = tiers(edge_logprob=SURE, edge_tps=50.0)
    edge.extra_stats.update(running=0.0, max_running=32.0)
    gpu.extra_stats.update(running=0.0, max_running=32.0)
    async with cascade_gateway(edge, gpu, spill_edge_turns=2) as cascade:
        turns = await asyncio.gather(*(one_turn(cascade, f"burst {i}") for i in range(6)))
        routes = Counter(response["metadata"]["x_route"] for _, response in turns)
        assert routes["confident"] <= 2 and routes["spilled"] >= 4
    async with cascade_gateway(edge, gpu, spill_edge_turns=0) as cascade:
        turns = await asyncio.gather(*(one_turn(cascade, f"burst {i}") for i in range(6)))
        assert all(response["metadata"]["x_route"] == "confident" for _, response in turns)


async def test_a_turn_spills_while_the_busy_edge_decides_slower_than_the_torch_tier_starts() -> None:
    edge, gpu = tiers(edge_logprob=SURE, edge_tps=20.0)  # a held window takes 400 ms
    edge.extra_stats.update(max_running=8.0)
    gpu.extra_stats.update(max_running=8.0)
    async with cascade_gateway(edge, gpu) as cascade:
        engine = cascade.state.router.cascade
        assert engine is not None
        first = asyncio.create_task(one_turn(cascade, "keeps the edge busy"))
        async with edge.admitted:
            await edge.admitted.wait_for(lambda: edge.running > 0)
        engine.drafter_decide_s, engine.target_first_s = 2.0, 0.1  # as measured on a loaded host
        _, response = await one_turn(cascade)
        assert (response["metadata"]["x_route"], response["metadata"]["x_route_reason"]) == ("spilled", "edge_busy")
        await first
        busy = asyncio.create_task(one_turn(cascade, "keeps the edge busy"))
        async with edge.admitted:
            await edge.admitted.wait_for(lambda: edge.running > 0)
        engine.drafter_decide_s, engine.target_first_s = 0.05, 0.1  # the edge decides faster: cascade again
        _, response = await one_turn(cascade)
        assert response["metadata"]["x_route"] == "confident"
        await busy


async def test_on_shared_cores_an_idle_edge_is_not_woken_beside_a_busy_torch_tier_when_turns_escalate() -> None:
    """Where the tiers share the host's cores, a turn started on the idle edge claims cores the torch
    tier computes on; when most turns escalate lately it would also wait for the torch tier after
    its decision, so it goes there at once (``cores_shared``). Not where the edge's turns are
    confident, not when the torch tier is idle, and not where the tiers do not share cores."""
    edge, gpu = tiers(edge_logprob=UNSURE)
    edge.extra_stats.update(max_running=8.0)
    gpu.extra_stats.update(max_running=8.0)
    async with cascade_gateway(edge, gpu) as cascade:
        engine = cascade.state.router.cascade
        assert engine is not None and engine.computing is None  # fakes: no shared cores
        _, response = await one_turn(cascade)
        assert response["metadata"]["x_route"] == "escalated" and engine.escalation_share == 1.0
        engine.drafter_decide_s, engine.target_first_s = 0.05, 0.1  # the edge decides faster than torch starts
        _, response = await one_turn(cascade)
        assert response["metadata"]["x_route"] == "escalated"  # no shared cores: the idle edge starts at once
        engine.computing = lambda tier: tier is gpu  # the torch tier computes on the shared cores
        engine.drafter_decide_s, engine.target_first_s = 0.05, 0.1
        _, response = await one_turn(cascade)
        meta = response["metadata"]
        assert (meta["x_tier"], meta["x_route"], meta["x_route_reason"]) == ("gpu", "spilled", "cores_shared")
        assert cascade.metric("gateway_cascade_spills_total", reason="cores_shared") == 1
        engine.computing = lambda tier: False  # the torch tier idle: the edge takes the turn
        _, response = await one_turn(cascade)
        assert response["metadata"]["x_route"] == "escalated"
    edge, gpu = tiers(edge_logprob=SURE)  # turns the edge keeps: waking it costs no torch start after
    edge.extra_stats.update(max_running=8.0)
    gpu.extra_stats.update(max_running=8.0)
    async with cascade_gateway(edge, gpu) as cascade:
        engine = cascade.state.router.cascade
        assert engine is not None
        _, response = await one_turn(cascade)
        assert response["metadata"]["x_route"] == "confident" and engine.escalation_share == 0.0
        engine.computing = lambda tier: tier is gpu
        engine.drafter_decide_s, engine.target_first_s = 0.05, 0.1
        _, response = await one_turn(cascade)
        assert response["metadata"]["x_route"] == "confident"


async def test_an_unsure_turn_stays_on_the_edge_while_the_torch_tier_cannot_start_it() -> None:
    edge, gpu = tiers(edge_logprob=UNSURE)
    gpu.extra_stats.update(running=4.0, max_running=4.0)
    async with cascade_gateway(edge, gpu) as cascade:
        text, response = await one_turn(cascade)
        meta = response["metadata"]
        assert text == "".join(EDGE_REPLY) and meta["x_tier"] == "edge" and gpu.started == []
        assert (meta["x_route"], meta["x_route_reason"]) == ("spilled", "gpu_busy")
        assert float(meta["x_confidence"]) < float(meta["x_threshold"])
        assert cascade.metric("gateway_cascade_spills_total", reason="gpu_busy") == 1
        async with aiohttp.ClientSession(cascade.server.url) as http:
            chat = await (await http.post("/v1/chat/completions", json={
                "model": CASCADE, "messages": [{"role": "user", "content": "hi"}]})).json()
        assert chat["x_route"]["route"] == "spilled" and chat["x_route"]["reason"] == "gpu_busy"


# ---- cancel frees both tiers -------------------------------------------------------------------

async def cancel_after(ws: websockets.ClientConnection, until: asyncio.Event | None) -> list[dict[str, Any]]:
    await send(ws, user_item("hello"))
    await send(ws, {"type": "response.create"})
    if until is not None:
        await asyncio.wait_for(until.wait(), 10)
    await send(ws, {"type": "response.cancel"})
    return await recv_until(ws, "response.done", timeout=10)


async def test_a_cancel_during_the_hold_window_frees_the_edge_and_never_starts_the_torch_tier() -> None:
    edge, gpu = tiers(edge_logprob=UNSURE, edge_tps=20.0)  # 8 held tokens take 400 ms
    async with cascade_gateway(edge, gpu) as cascade:
        async with websockets.connect(cascade.ws_url()) as ws:
            await recv_json(ws)
            admitted = asyncio.Event()

            async def watch() -> None:
                async with edge.admitted:
                    await edge.admitted.wait_for(lambda: bool(edge.started))
                admitted.set()

            watcher = asyncio.create_task(watch())
            events = await cancel_after(ws, admitted)
            await watcher
            assert events[-1]["response"]["status"] == "cancelled"
            assert not any(e["type"] == "response.output_text.delta" for e in events)
            assert edge.blocks_in_use == 0 and edge.running == 0
            assert gpu.started == [] and gpu.blocks_in_use == 0


async def test_a_cancel_after_escalation_frees_both_tiers() -> None:
    edge, gpu = tiers(edge_logprob=UNSURE, gpu_tps=20.0)
    async with cascade_gateway(edge, gpu) as cascade:
        async with websockets.connect(cascade.ws_url()) as ws:
            await recv_json(ws)
            await send(ws, user_item("hello"))
            await send(ws, {"type": "response.create"})
            first = [e async for e in _until_delta(ws)]
            assert first[-1]["delta"] == GPU_REPLY[0]
            await send(ws, {"type": "response.cancel"})
            events = await recv_until(ws, "response.done", timeout=10)
            assert events[-1]["response"]["status"] == "cancelled"
            [(rid, _)] = gpu.started
            assert rid in gpu.aborts and gpu.blocks_in_use == 0 and gpu.running == 0
            assert edge.blocks_in_use == 0 and edge.running == 0


async def _until_delta(ws: websockets.ClientConnection) -> AsyncIterator[dict[str, Any]]:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 10))
        yield event
        if event["type"] == "response.output_text.delta":
            return


# ---- a decided cascade turn streams by callback, as a direct one does ------------------------------

@pytest.mark.parametrize(("edge_logprob", "tier", "route"), [(SURE, "edge", "confident"), (UNSURE, "gpu", "escalated")])
async def test_a_decided_turn_is_pushed_from_the_serving_tiers_step(edge_logprob: float, tier: str, route: str) -> None:
    edge, gpu = tiers(edge_logprob=edge_logprob, edge_tps=200.0, gpu_tps=200.0)
    async with cascade_gateway(edge, gpu) as cascade:
        metrics = cascade.state.metrics
        turn = Turn(router=cascade.state.router, model=CASCADE, messages=[{"role": "user", "content": "hello"}],
                    params=SamplingParams(max_tokens=64), priority=Priority.INTERACTIVE, request_id="push-1",
                    api="chat", metrics=metrics, limits=InProcessStore(Limits(requests_per_minute=60, tokens_per_minute=10_000)),
                    key_id="k")
        await turn.prepare()
        events: list[object] = []
        tasks: list[asyncio.Task[object] | None] = []

        def on_event(event: object) -> None:
            events.append(event)
            tasks.append(asyncio.current_task())

        await asyncio.wait_for(turn.run(on_event), 30)
        await turn.aclose()
        reply = EDGE_REPLY if tier == "edge" else GPU_REPLY
        assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "".join(reply)
        finish = events[-1]
        assert isinstance(finish, FinishEvent) and finish.tier == tier
        assert (turn.route.tier, turn.route.route) == (tier, route)
        # The first event (and the rest of the held tokens, released in one go) came through run's
        # task; everything the tier made after that, by call from the tier's own step.
        assert len(set(tasks)) == 2 and tasks[-1] is not tasks[0]
        assert not edge.running and not gpu.running and edge.blocks_in_use == 0 and gpu.blocks_in_use == 0
        assert cascade.state.router.cascade is not None and cascade.state.router.cascade.stats()["requests"] == 0
        if route == "escalated":  # decided at the second unsure token: both agree with the torch tier
            assert cascade.metric("gateway_cascade_held_tokens_total", outcome="accepted") == 2
            assert cascade.metric("gateway_cascade_held_tokens_total", outcome="rejected") == 0


# ---- tiers by the parts they play ----------------------------------------------------------------

async def test_the_cascade_takes_tiers_by_role_and_falls_back_only_to_a_fallback() -> None:
    from gateway.cascade.engine import CascadeEngine
    from gateway.cascade.route import Tier, with_role
    from gateway.metrics import GatewayMetrics

    small, large = tiers()
    named = {"small": small, "large": large}
    health = HealthMonitor(named, interval_s=60, stall_timeout_s=60)
    drafter = Tier("small", small, frozenset({"drafter"}))  # no fallback: never serves the target's turns
    target = Tier("large", large, frozenset({"target", "fallback"}))
    with pytest.raises(ValueError, match="exactly one target"):
        with_role([drafter], "target")
    cascade = CascadeEngine([drafter, target], CascadeConfig(hold_tokens=2), build_scorer(CascadeConfig()), health,
                            GatewayMetrics(dict))
    events = [e async for e in cascade.generate("r1", [1, 2], SamplingParams(max_tokens=4))]
    assert (events[0].tier, events[0].route) == ("small", "confident")  # the names are the tiers' own
    health.mark_down("large", "stopped for the test")
    with pytest.raises(EngineUnavailableError):
        [e async for e in cascade.generate("r2", [1, 2], SamplingParams(max_tokens=4))]
    assert [rid for rid, _ in small.started] == ["r1"]  # the drafter was not asked to stand in
