"""The synthetic engine used by the load benchmarks: real tokens, bounded admission, KV cells
held while a stream runs and freed when it ends or is aborted; as the torch tier, it takes the
cascade's drafts."""

from __future__ import annotations

import asyncio

import pytest

from engine_edge import create_backend
from engine_edge.config import EdgeConfig
from engine_edge.synthetic_backend import ANSWER, SyntheticEngine
from llm_shared.contract import FinishEvent, SamplingParams, TokenEvent
from llm_shared.errors import InvalidRequestError, OverloadedError
from llm_shared.modelfile import default_gguf_path
from llm_shared.textstream import TextStream

pytestmark = pytest.mark.model


async def collect(stream) -> list:  # type: ignore[no-untyped-def]
    return [event async for event in stream]


async def test_streams_run_in_one_batch_and_free_their_cells() -> None:
    backend = create_backend(EdgeConfig(backend="synthetic", synthetic_tokens_per_s=500, synthetic_max_streams=3),
                             default_gguf_path())
    try:
        prompt = backend.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
        runs = [asyncio.create_task(collect(backend.generate(f"r{i}", prompt, SamplingParams(max_tokens=12))))
                for i in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError):  # a fourth is refused at once, not queued behind
            await anext(backend.generate("r3", prompt, SamplingParams(max_tokens=4)))
        for events in await asyncio.gather(*runs):
            tokens = [e for e in events if isinstance(e, TokenEvent)]
            finish = events[-1]
            assert len(tokens) == 12 and isinstance(finish, FinishEvent) and finish.reason == "length"
            assert "".join(t.text for t in tokens) + finish.text  # real text from the real tokenizer
        assert backend.stats()["kv_cells_used"] == 0 and backend.stats()["running"] == 0
        stopped = await collect(backend.generate("s", prompt, SamplingParams(max_tokens=50, stop=("fox",))))
        assert stopped[-1].reason == "stop" and "fox" not in "".join(e.text for e in stopped)
        stream = backend.generate("a", prompt, SamplingParams(max_tokens=10_000))
        await anext(stream)
        assert backend.stats()["kv_cells_used"] > len(prompt)
        await backend.abort("a")
        rest = [e async for e in stream]
        assert rest[-1].reason == "abort" and backend.stats()["kv_cells_used"] == 0
    finally:
        await backend.close()


async def test_as_the_torch_tier_it_streams_the_drafts_it_agrees_with_in_its_first_step() -> None:
    """The cascade hands an escalated turn's held edge tokens on as drafts: the synthetic torch
    tier, like the real one, streams the leading run it agrees with in one step, with one token of
    its own, then a token a step."""
    edge = create_backend(EdgeConfig(backend="synthetic", synthetic_tokens_per_s=200, synthetic_max_streams=4),
                          default_gguf_path())
    gpu = SyntheticEngine(edge.tokenizer, tokens_per_s=200, max_streams=4, tier="gpu")
    try:
        prompt = edge.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
        # What the cascade would hold: the edge's first five tokens (both answer the same text).
        held = [e.token_id for e in await collect(edge.generate("e", prompt, SamplingParams(max_tokens=5)))
                if isinstance(e, TokenEvent)]
        cases = ((held, 6), ([*held[:2], held[2] + 1, *held[3:]], 3), ([], 1))  # all agree, two do, none sent
        for i, (drafts, first_step) in enumerate(cases):
            steps: list[tuple[float, object]] = []
            stream = gpu.generate(f"d{i}", prompt, SamplingParams(max_tokens=9), draft_ids=drafts)
            finished = asyncio.get_running_loop().create_future()

            def seen(event: object, stream_steps: list[tuple[float, object]] = steps,
                     done: asyncio.Future[None] = finished) -> None:
                stream_steps.append((gpu.stats()["steps"], event))  # called inside the engine's step
                if isinstance(event, FinishEvent):
                    done.set_result(None)

            stream.subscribe(seen)
            await asyncio.wait_for(finished, 30)
            tokens = [(step, e) for step, e in steps if isinstance(e, TokenEvent)]
            assert [e.token_id for _, e in tokens[:len(held)]] == held  # the answer either way
            per_step = [sum(1 for step, _ in tokens if step == s) for s in sorted({step for step, _ in tokens})]
            assert per_step[0] == first_step and set(per_step[1:]) == {1} and len(tokens) == 9
            finish = steps[-1][1]
            assert isinstance(finish, FinishEvent) and finish.tier == "gpu" and finish.completion_tokens == 9
        assert gpu.stats()["kv_blocks_in_use"] == 0 and gpu.stats()["kv_cells_used"] == 0
        with pytest.raises(InvalidRequestError, match="draft_ids holds at most"):
            await anext(gpu.generate("long", prompt, SamplingParams(), draft_ids=[held[0]] * 65))
    finally:
        await gpu.close()
        await edge.close()


async def test_a_stream_without_stop_strings_gets_what_its_own_detokenizer_would_give() -> None:
    """Without stop strings a stream is sent the answer's events made once (the engine's own work
    kept off the gateway's figures): the same ids and texts as a stream detokenizing its own, over
    more than one round of the answer."""
    engine = create_backend(EdgeConfig(backend="synthetic", synthetic_tokens_per_s=2000, synthetic_max_streams=2),
                            default_gguf_path())
    try:
        tokenizer = engine.tokenizer
        prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
        rounds = len(tokenizer.encode(ANSWER)) * 2 + 3
        plain, stopped = await asyncio.gather(
            collect(engine.generate("p", prompt, SamplingParams(max_tokens=rounds))),
            collect(engine.generate("s", prompt, SamplingParams(max_tokens=rounds, stop=("\u2603",)))))
        tokens = [e for e in plain if isinstance(e, TokenEvent)]
        assert [(e.token_id, e.text) for e in tokens] == [(e.token_id, e.text) for e in stopped
                                                         if isinstance(e, TokenEvent)]
        own = TextStream(tokenizer)
        assert [e.text for e in tokens] == [own.push(e.token_id)[0] for e in tokens]
        assert "".join(e.text for e in tokens) == tokenizer.decode([e.token_id for e in tokens], skip_special=True)
        assert plain[-1].reason == "length" and plain[-1].completion_tokens == rounds and plain[-1].text == ""
        assert ANSWER.strip() in "".join(e.text for e in tokens)
    finally:
        await engine.close()
