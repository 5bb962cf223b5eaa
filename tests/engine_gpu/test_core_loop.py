"""CoreServer's loop in a thread of this process (no spawn), to inject an engine failure."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tiny_engine import write_tiny_model

from engine_gpu.client import EngineClient
from engine_gpu.config import EngineConfig
from engine_gpu.core_process import CoreServer, open_listener
from engine_gpu.engine import LLMEngine
from llm_shared.contract import FinishEvent, SamplingParams

CONFIG = EngineConfig(dtype="float32", num_blocks=32, threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    return LLMEngine.from_config(write_tiny_model(tmp_path_factory.mktemp("tiny")), CONFIG)


@pytest.fixture
def server(engine: LLMEngine, tmp_path: Path) -> Iterator[str]:
    listener, address, _ = open_listener(f"unix:{tmp_path}/core.sock")
    stop_read, stop_write = os.pipe()
    core = CoreServer(engine, listener, stop_fd=stop_read)
    thread = threading.Thread(target=core.serve_forever, daemon=True)
    thread.start()
    yield address
    os.close(stop_write)  # EOF on the stop pipe ends the loop, as a parent's exit does
    thread.join(timeout=30)
    assert not thread.is_alive()
    os.close(stop_read)
    listener.close()


@pytest.fixture
async def client(server: str, engine: LLMEngine) -> AsyncIterator[EngineClient]:
    c = await EngineClient.connect(server, tokenizer=engine.tokenizer)
    yield c
    await c.close()


async def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(
        client: EngineClient, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine.runner.execute
    calls = 0

    def execute_once_broken(batch: list) -> dict:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("simulated device failure")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", execute_once_broken)
    events = [e async for e in client.generate("victim", [5, 6, 7, 8], GREEDY)]
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "error"
    assert events[-1].message and "simulated" not in events[-1].message  # no internals to clients
    assert client.ready and (await client.refresh_stats())["kv_blocks_in_use"] == 0
    events = [e async for e in client.generate("next", [5, 6, 7, 8], GREEDY)]
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "length" and len(events) == 7
