"""CoreServer's loop in a thread of this process (no spawn), to inject an engine failure."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from gated_share import GatedShare
from tiny_engine import write_tiny_model

from engine_gpu.client import EngineClient
from engine_gpu.config import EngineConfig
from engine_gpu.core_process import open_listener
from engine_gpu.core_server import CoreServer
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


@pytest.fixture(scope="module")
def json_engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    # 98 ids: the three specials, then every printable ASCII character once (a JSON grammar compiles)
    return LLMEngine.from_config(write_tiny_model(tmp_path_factory.mktemp("tiny98"), seed=5, vocab_size=98), CONFIG)


@pytest.fixture
async def json_client(json_engine: LLMEngine, tmp_path: Path) -> AsyncIterator[EngineClient]:
    listener, address, _ = open_listener(f"unix:{tmp_path}/json.sock")
    stop_read, stop_write = os.pipe()
    core = CoreServer(json_engine, listener, secret=SECRET, stop_fd=stop_read)
    thread = threading.Thread(target=core.serve_forever, daemon=True)
    thread.start()
    c = await EngineClient.connect(address, secret=SECRET, tokenizer=json_engine.tokenizer)
    try:
        yield c
    finally:
        await c.close()
        os.close(stop_write)
        thread.join(timeout=30)
        assert not thread.is_alive()
        os.close(stop_read)
        listener.close()


def json_grammar() -> str:
    import json

    from llm_shared.structured import ResponseFormat, build_grammar
    from llm_shared.structured.spec import OutputConstraints

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    source = build_grammar(OutputConstraints(response_format=ResponseFormat("json_schema", "a", json.dumps(schema),
                                                                            strict=True)), None)
    assert source is not None
    return source.text


async def test_a_grammar_compiles_off_the_step_loop_while_the_batch_streams(
        json_client: EngineClient, json_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new grammar never pauses the batch (issue 39, item 4): its compile runs on the core's
    compile thread while other requests step to their end; the constrained request then runs; one
    aborted while it compiles is never added; a grammar that cannot compile is rejected."""
    import asyncio

    from llm_shared.errors import EngineError

    release = threading.Event()
    compiling = threading.Event()
    real = json_engine.compile_matcher

    def slow(params: SamplingParams) -> object:
        compiling.set()
        release.wait(60)
        return real(params)

    monkeypatch.setattr(json_engine, "compile_matcher", slow)
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=60, grammar=json_grammar())
    held = asyncio.ensure_future(_collect(json_client, "constrained", constrained))
    await asyncio.to_thread(compiling.wait, 30)
    free = [e async for e in json_client.generate("free", [5, 6, 7, 8], GREEDY)]  # while the compile is stuck
    assert isinstance(free[-1], FinishEvent) and free[-1].reason == "length" and len(free) == 7
    assert not held.done()
    release.set()
    events = await asyncio.wait_for(held, 60)
    assert isinstance(events[-1], FinishEvent) and events[-1].reason in ("stop", "length")

    release.clear()
    compiling.clear()
    stream = json_client.generate("dropped", [5, 6], constrained)
    aborted = asyncio.ensure_future(_collect_stream(stream))
    await asyncio.to_thread(compiling.wait, 30)
    await json_client.abort("dropped")
    release.set()
    await asyncio.wait_for(aborted, 60)
    assert (await json_client.refresh_stats())["kv_blocks_in_use"] == 0 and not json_engine.has_unfinished()

    monkeypatch.setattr(json_engine, "compile_matcher", real)
    with pytest.raises(EngineError, match="cannot be compiled") as refused:
        await _collect(json_client, "bad", SamplingParams(grammar="start: %json {\"type\": \"nope\"}"))
    assert "Invalid type: nope" in refused.value.message


async def _collect(client: EngineClient, rid: str, params: SamplingParams) -> list[object]:
    return [e async for e in client.generate(rid, [5, 6, 7], params)]


async def _collect_stream(stream: object) -> list[object]:
    return [e async for e in stream]  # type: ignore[attr-defined]


async def test_a_request_to_the_idle_core_waits_for_its_claim_and_runs_on_the_granted_threads(
        client: EngineClient, engine: LLMEngine) -> None:
    import asyncio

    import torch

    before = torch.get_num_threads()
    share = GatedShare(threads=2)
    assert client.share_cores(share)
    try:
        held = client.generate("held", [5, 6, 7, 8], GREEDY)
        first = asyncio.create_task(anext(held))
        for _ in range(5):
            stats = await client.refresh_stats()
            assert not first.done() and stats["running"] + stats["waiting"] == 0  # nothing reached the core
        share.open.set()
        await asyncio.wait_for(first, 60)
        assert (await client.refresh_stats())["threads"] == 2  # set ahead of the request, in order
        await client.set_threads(1)  # a busy core's threads change between steps, confirmed
        assert (await client.refresh_stats())["threads"] == 1 and torch.get_num_threads() == 1
        assert share.claims == 1
        assert isinstance([e async for e in held][-1], FinishEvent)
    finally:
        torch.set_num_threads(before)
    assert share.releases == 1
    events = [e async for e in client.generate("next", [5, 6, 7, 8], GREEDY)]
    assert isinstance(events[-1], FinishEvent)
    assert share.claims == 2 and share.releases == 2  # each time the core went idle, it released
