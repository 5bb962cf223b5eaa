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
SECRET = b"core-loop-test-secret-0123456789"  # the shared secret every connection must prove
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    return LLMEngine.from_config(write_tiny_model(tmp_path_factory.mktemp("tiny")), CONFIG)


@pytest.fixture
def server(engine: LLMEngine, tmp_path: Path) -> Iterator[str]:
    listener, address, _ = open_listener(f"unix:{tmp_path}/core.sock")
    stop_read, stop_write = os.pipe()
    core = CoreServer(engine, listener, secret=SECRET, stop_fd=stop_read)
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
    c = await EngineClient.connect(server, secret=SECRET, tokenizer=engine.tokenizer)
    yield c
    await c.close()


async def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(
        client: EngineClient, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine.runner.launch
    calls = 0

    def launch_once_broken(batch: list, *args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("simulated device failure")
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", launch_once_broken)
    events = [e async for e in client.generate("victim", [5, 6, 7, 8], GREEDY)]
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "error"
    assert events[-1].message and "simulated" not in events[-1].message  # no internals to clients
    assert client.ready and (await client.refresh_stats())["kv_blocks_in_use"] == 0
    events = [e async for e in client.generate("next", [5, 6, 7, 8], GREEDY)]
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "length" and len(events) == 7


async def test_a_peer_that_never_authenticates_is_dropped(engine: LLMEngine, tmp_path: Path) -> None:
    import asyncio

    from engine_gpu.protocol import Challenge, decode_core_message, read_frame

    listener, address, _ = open_listener(f"unix:{tmp_path}/slow.sock")
    stop_read, stop_write = os.pipe()
    core = CoreServer(engine, listener, secret=SECRET, stop_fd=stop_read, auth_timeout_s=0.2)
    thread = threading.Thread(target=core.serve_forever, daemon=True)
    thread.start()
    try:
        reader, writer = await asyncio.open_unix_connection(address[len("unix:"):])
        assert isinstance(decode_core_message(await read_frame(reader) or b""), Challenge)
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the core, not by us
        writer.close()
    finally:
        os.close(stop_write)
        thread.join(timeout=30)
        os.close(stop_read)
        listener.close()


def test_the_unix_socket_is_owner_only_and_never_replaces_another_file(tmp_path: Path) -> None:
    import stat

    from llm_shared.errors import ConfigError

    listener, address, _ = open_listener(f"unix:{tmp_path}/core.sock")
    assert stat.S_IMODE(os.stat(address[len("unix:"):]).st_mode) == 0o600
    listener.close()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    with pytest.raises(ConfigError, match="is not a socket"):
        open_listener(f"unix:{precious}")
    assert precious.read_text() == "keep me"
    again, _, _ = open_listener(address)  # a stale socket file from a dead core is replaced
    again.close()
