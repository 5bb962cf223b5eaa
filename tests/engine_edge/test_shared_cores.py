"""The llama.cpp edge under a moving CPU budget (llm_shared.cores): a request to the idle tier
waits for its claim and runs on the threads granted; the tier releases when its last request
ends; a request taken back while it waited never reaches the worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from gated_share import GatedShare

from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_backend import LlamaCppBackend
from llm_shared.contract import FinishEvent, SamplingParams, TokenEvent
from llm_shared.modelfile import default_gguf_path

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
async def edge() -> AsyncIterator[LlamaCppBackend]:
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=23, n_seq_max=2, n_threads=1))
    yield engine
    await engine.close()


def prompt(engine: LlamaCppBackend) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])


async def test_a_request_to_the_idle_edge_waits_for_its_claim_and_runs_on_the_granted_threads(
        edge: LlamaCppBackend) -> None:
    share = GatedShare(threads=2)
    assert edge.share_cores(share)
    stream = edge.generate("a", prompt(edge), GREEDY)
    first = asyncio.create_task(anext(stream))
    for _ in range(20):
        await edge.probe()  # the worker went round its loop: it has not seen the request
    assert not first.done() and edge.stats()["running"] == 0 and edge.stats()["waiting"] == 0
    second = [e async for e in _after(edge, share)]  # a second request joins the same claim
    assert share.claims == 1
    assert isinstance(await asyncio.wait_for(first, 60), TokenEvent)
    events = [e async for e in stream]
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "length"
    assert isinstance(second[-1], FinishEvent) and second[-1].reason == "length"
    assert edge.stats()["threads"] == 2 and edge.stats()["thread_changes"] == 1
    assert share.releases == 1  # both ended: the tier released its claim once


async def _after(edge: LlamaCppBackend, share: GatedShare) -> AsyncIterator[object]:
    stream = edge.generate("b", prompt(edge), GREEDY)
    share.open.set()
    async for event in stream:
        yield event


async def test_a_request_taken_back_while_it_waited_never_reaches_the_worker(edge: LlamaCppBackend) -> None:
    share = GatedShare(threads=1)
    assert edge.share_cores(share)
    stream = edge.generate("gone", prompt(edge), GREEDY)
    await edge.abort("gone")
    events = [e async for e in stream]
    assert len(events) == 1 and isinstance(events[0], FinishEvent) and events[0].reason == "abort"
    share.open.set()
    await asyncio.sleep(0)
    await edge.probe()
    assert edge.stats()["prompt_tokens"] == 0 and edge.stats()["running"] == 0
    assert share.claims == share.releases == 1


async def test_set_threads_is_in_force_from_the_next_step(edge: LlamaCppBackend) -> None:
    await edge.set_threads(2)
    assert edge.stats()["threads"] == 2
    await edge.set_threads(1)
    events = [e async for e in edge.generate("c", prompt(edge), GREEDY)]
    assert isinstance(events[-1], FinishEvent) and edge.stats()["threads"] == 1


async def test_a_draft_waits_for_the_claim_too_and_releases_it(edge: LlamaCppBackend) -> None:
    share = GatedShare(threads=2)
    assert edge.share_cores(share)
    draft = asyncio.create_task(edge.propose(prompt(edge), 3))
    await edge.probe()
    assert not draft.done() and edge.stats()["draft_prefill_tokens"] == 0  # the worker has not seen it
    share.open.set()
    assert len((await asyncio.wait_for(draft, 60)).token_ids) == 3
    assert share.claims == share.releases == 1 and edge.stats()["threads"] == 2
