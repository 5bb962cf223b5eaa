"""The load benchmarks' cascade: both tiers synthetic (``[edge] backend`` and ``[engine] backend``
= "synthetic"), built from the config as ``serve`` builds them. Turns the edge is sure of stay
there; with a threshold nothing reaches, every turn escalates to the synthetic torch tier, which
takes all the held tokens as verified drafts. Either way the client reads the same answer and no
KV is left in either tier."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import websockets
from gateway_harness import make_config, recv_json, recv_until, send, user_item

from gateway.process.server import STATE, create_app, start_server
from gateway.tiers.build import close_engines, load_engines

pytestmark = pytest.mark.model


@pytest.mark.parametrize(("threshold", "tier", "route", "accepted"),
                         # a threshold of 1.0 escalates from the first token that is not certain
                         [(0.22, "edge", "confident", None), (1.0, "gpu", "escalated", 1.0)])
async def test_a_cascade_over_synthetic_tiers_serves_and_escalates_turns(
        threshold: float, tier: str, route: str, accepted: float | None) -> None:
    config = make_config()
    config = replace(
        config, routing=replace(config.routing, default="cascade"),
        edge=replace(config.edge, backend="synthetic", synthetic_tokens_per_s=200.0),
        engine=replace(config.engine, backend="synthetic", synthetic_tokens_per_s=200.0),
        cascade=replace(config.cascade, threshold=threshold, min_threshold=threshold, load_aware=False))
    engines = await load_engines(config)
    server = await start_server(create_app(config, engines))
    try:
        assert engines["gpu"].tier == "gpu" and engines["edge"].tier == "edge"
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/realtime") as ws:
            await recv_json(ws, timeout=30)  # session.created
            await send(ws, user_item("Tell me about the river."))
            await send(ws, {"type": "response.create", "response": {"max_output_tokens": 24}})
            events = await recv_until(ws, "response.done", timeout=60)
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        response: dict[str, Any] = events[-1]["response"]
        assert response["status"] == "incomplete" and response["usage"]["output_tokens"] == 24
        assert text.startswith("The quick brown fox jumps over the lazy dog")
        meta = response["metadata"]
        assert meta["x_tier"] == tier and meta["x_route"] == route
        registry = server.app[STATE].metrics.registry
        assert registry.get_sample_value("gateway_cascade_held_tokens_total", {"outcome": "accepted"}) == accepted
        for engine in engines.values():
            assert engine.stats()["kv_cells_used"] == 0 and engine.stats()["running"] == 0
    finally:
        await server.stop()
        await close_engines(engines)
