"""The synthetic backend used by the load benchmarks: real tokens, bounded admission, KV cells
held while a stream runs and freed when it ends or is aborted."""

from __future__ import annotations

import asyncio

import pytest

from engine_edge import create_backend
from engine_edge.config import EdgeConfig
from llm_shared.contract import FinishEvent, SamplingParams, TokenEvent
from llm_shared.errors import OverloadedError
from llm_shared.modelfile import default_gguf_path

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
