"""The shipped cascade's two tiers on one host of two cores, served: the threads go where the work
is (gateway/tiers/cores.py) through the real edge worker and the real torch core process."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import pytest
from gateway_harness import make_config, serving

from llm_shared.contract import FinishEvent, SamplingParams, TokenEvent

pytestmark = pytest.mark.model

LONG = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)  # runs until the test aborts it
SHORT = SamplingParams(temperature=0.0, max_tokens=4)


async def test_the_threads_follow_the_work_between_the_edge_and_the_torch_core() -> None:
    config = make_config()
    config = replace(config, routing=replace(config.routing, default="cascade"),  # both tiers on this host
                     host=replace(config.host, cpus=2),
                     engine=replace(config.engine, speculative=replace(config.engine.speculative, method="off")))
    async with serving(config) as (server, state):
        cores = state.cores
        assert cores is not None
        edge, gpu = state.engines["edge"], state.engines["gpu"]
        prompt = edge.tokenizer.encode_chat([{"role": "user", "content": "Tell me a long story."}])

        long = edge.generate("long", prompt, LONG)
        assert isinstance(await anext(long), TokenEvent)
        assert edge.stats()["threads"] == 2  # alone with work: both cores

        short = [e async for e in gpu.generate("short", prompt, SHORT)]
        assert isinstance(short[-1], FinishEvent) and short[-1].reason == "length"
        # the core claimed: the edge shrank (confirmed between two of its steps) before the core computed
        assert edge.stats()["running"] == 1 and edge.stats()["threads"] == 1
        assert (await gpu.refresh_stats())["threads"] == 1

        await asyncio.wait_for(cores.settled(), 60)  # the core went idle: its cores go back to the edge
        assert edge.stats()["threads"] == 2 and cores.pools == {"edge": 2, "torch": 1}
        await long.aclose()

        async with aiohttp.ClientSession() as http:
            metrics = await (await http.get(f"{server.url}/metrics")).text()
        assert sample(metrics, 'gateway_host_threads{pool="edge"}') == 2
        assert sample(metrics, "gateway_thread_reassignments_total") >= 3  # edge 1->2, 2->1, 1->2
        assert sample(metrics, 'gateway_thread_claim_wait_seconds_count{pool="torch"}') >= 1


def sample(metrics: str, series: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(series + " "))
