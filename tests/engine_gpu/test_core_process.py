"""The engine core as a real process on a tiny checkpoint, driven through EngineClient:
streaming, abort freeing blocks, typed rejections, bad messages, TCP, and the core dying."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
from greedy_compare import FLOAT32_CLEAR_MARGIN, assert_clear_picks
from tiny_engine import write_tiny_model

from engine_gpu.client import EngineClient
from engine_gpu.config import EngineConfig, SpeculativeConfig
from engine_gpu.core_process import config_args
from engine_gpu.protocol import (
    HEADER,
    AddRequest,
    Authenticate,
    Challenge,
    ErrorReply,
    Hello,
    Rejected,
    Shutdown,
    StatsReply,
    StatsRequest,
    StepOutputs,
    auth_mac,
    decode_core_message,
    encode_frame,
    read_frame,
)
from llm_shared import errors
from llm_shared.contract import Engine, FinishEvent, Priority, SamplingParams, TokenEvent
from llm_shared.models import REPO_ROOT, ModelConfig

CONFIG = EngineConfig(dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=64, threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SECRET = "core-process-test-secret-0123456789"
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [3 + (5 * i + offset) % 90 for i in range(n)]


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients find the core's shared secret in the environment, as an operator would set it."""
    monkeypatch.setenv("ENGINE_CORE_SECRET", SECRET)


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def core_process(model_cfg: ModelConfig) -> Iterator[tuple[str, int]]:
    """One core process for the module (spawned as EngineClient.start does), on a private unix socket."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ENGINE_CORE_SECRET": SECRET}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_gpu.core_process", *config_args(model_cfg, CONFIG), "--exit-on-stdin-eof"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None and proc.stdin is not None
    ready = json.loads(proc.stdout.readline())
    assert ready["address"].startswith("unix:")
    yield ready["address"], proc.pid
    proc.send_signal(signal.SIGTERM)  # (a closed stdin pipe is tested in test_core_loop.py)
    assert proc.wait(timeout=30) == 0
    assert not Path(ready["address"][len("unix:"):]).parent.exists(), "the private socket dir is removed"
    proc.stdin.close()


@pytest.fixture
def core_address(core_process: tuple[str, int]) -> str:
    return core_process[0]


@pytest.fixture
async def client(core_address: str) -> AsyncIterator[EngineClient]:
    c = await EngineClient.connect(core_address)
    yield c
    await c.close()


async def collect(stream: AsyncIterator[object]) -> tuple[list[TokenEvent], FinishEvent]:
    items = [e async for e in stream]
    assert all(isinstance(e, TokenEvent) for e in items[:-1]) and isinstance(items[-1], FinishEvent)
    return items[:-1], items[-1]  # type: ignore[return-value]


async def test_streams_tokens_with_text_and_usage(client: EngineClient) -> None:
    assert isinstance(client, Engine) and client.tier == "gpu" and client.ready
    tokens, finish = await collect(client.generate("a", prompt(30), replace(GREEDY, logprobs=2)))
    assert (finish.reason, finish.prompt_tokens, finish.completion_tokens, finish.tier) == ("length", 30, 8, "gpu")
    ids = [t.token_id for t in tokens]
    assert "".join(t.text for t in tokens) + finish.text == client.tokenizer.decode(ids, skip_special=True)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0][0] == t.token_id for t in tokens)
    # the same prompt again: same tokens (every pick is clear of float32 rounding, so reading the
    # prompt's full blocks from the prefix cache may not change one), the blocks from the cache
    assert_clear_picks(tokens, FLOAT32_CLEAR_MARGIN)
    again, finish2 = await collect(client.generate("b", prompt(30), GREEDY))
    assert [t.token_id for t in again] == ids and finish2.cached_tokens == 16


async def test_concurrent_streams_are_routed_to_their_requests(client: EngineClient) -> None:
    solo = [await collect(client.generate(f"solo{i}", prompt(10 + 9 * i, i), replace(GREEDY, logprobs=2)))
            for i in range(4)]
    for toks, _ in solo:  # batched rows round differently: the picks must be clear of that
        assert_clear_picks(toks, FLOAT32_CLEAR_MARGIN)
    together = await asyncio.gather(*(collect(client.generate(f"t{i}", prompt(10 + 9 * i, i), GREEDY))
                                      for i in range(4)))
    assert [[t.token_id for t in toks] for toks, _ in together] == [[t.token_id for t in toks] for toks, _ in solo]


async def subscribe(stream: AsyncIterator[object]) -> tuple[list[object], asyncio.Future[None]]:
    """The first event by iterating, the rest by callback from the client's dispatch (as ``Turn.run``
    reads it): the events so far, and a future done at the last one."""
    items = [await anext(stream)]
    done = asyncio.get_running_loop().create_future()

    def delivered(item: object) -> None:
        items.append(item)
        if isinstance(item, (FinishEvent, errors.EngineError)) and not done.done():
            done.set_result(None)

    stream.subscribe(delivered)  # type: ignore[attr-defined]
    return items, done


async def subscribed(stream: AsyncIterator[object]) -> list[object]:
    items, done = await subscribe(stream)
    await asyncio.wait_for(done, 60)
    return items


async def test_a_subscribed_stream_gets_what_iterating_gets(client: EngineClient) -> None:
    iterated, _ = await collect(client.generate("it", prompt(25, 3), GREEDY))
    items = await subscribed(client.generate("sub", prompt(25, 3), GREEDY))
    assert [t.token_id for t in items[:-1]] == [t.token_id for t in iterated]  # type: ignore[attr-defined]
    assert isinstance(items[-1], FinishEvent) and items[-1].reason == "length"
    assert (await client.refresh_stats())["running"] == 0


async def test_abort_frees_blocks_before_it_returns(client: EngineClient) -> None:
    stream = client.generate("long", prompt(100), LONG)
    first = await anext(stream)
    assert isinstance(first, TokenEvent)
    assert (await client.refresh_stats())["kv_blocks_in_use"] > 0
    await client.abort("long")
    assert client.stats()["kv_blocks_in_use"] == 0 and client.stats()["running"] == 0
    rest = [e async for e in stream]
    assert isinstance(rest[-1], FinishEvent) and rest[-1].reason == "abort"
    assert rest[-1].completion_tokens < 400
    await client.abort("long")  # idempotent
    await client.abort("never-existed")


async def test_abort_before_the_stream_starts(client: EngineClient) -> None:
    stream = client.generate("lazy", prompt(20), LONG)
    await client.abort("lazy")
    assert [e async for e in stream] == [FinishEvent("abort", 20, 0, tier="gpu")]
    assert (await client.refresh_stats())["running"] == 0


async def test_closing_a_stream_early_aborts_it(client: EngineClient) -> None:
    stream = client.generate("closed", prompt(40), LONG)
    await anext(stream)
    await stream.aclose()
    stats = await client.refresh_stats()
    assert stats["kv_blocks_in_use"] == 0 and stats["running"] == 0


@pytest.mark.parametrize(
    ("prompt_ids", "params", "error"),
    [
        ([], GREEDY, errors.EmptyPromptError),
        ([*prompt(10), 96], GREEDY, errors.InvalidRequestError),
        (prompt(400), replace(GREEDY, max_tokens=200), errors.PromptTooLongError),
    ],
)
async def test_client_side_validation_raises_typed_errors(client: EngineClient, prompt_ids: list[int],
                                                          params: SamplingParams, error: type[Exception]) -> None:
    with pytest.raises(error):
        await anext(client.generate("bad", prompt_ids, params))


async def test_core_rejections_raise_the_typed_error_from_the_first_anext(client: EngineClient) -> None:
    client._max_model_len = 0  # skip the client's own check so the core has to refuse it
    with pytest.raises(errors.PromptTooLongError):
        await anext(client.generate("too-long", prompt(400), replace(GREEDY, max_tokens=200)))
    stream = client.generate("dup", prompt(10), LONG)
    await anext(stream)
    with pytest.raises(errors.DuplicateRequestError):  # refused by the client, which knows it is live
        await anext(client.generate("dup", prompt(10), GREEDY))
    await stream.aclose()


async def raw_connection(address: str, *, authenticate: bool = True
                         ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A bare socket to the core: (reader, writer, the challenge's nonce), authenticated unless told."""
    reader, writer = await asyncio.open_unix_connection(address[len("unix:"):])
    challenge = decode_core_message(await read_frame(reader) or b"")
    assert isinstance(challenge, Challenge)  # nothing about the engine before the peer proves the secret
    if authenticate:
        writer.write(encode_frame(Authenticate(auth_mac(SECRET.encode(), challenge.nonce))))
        assert isinstance(decode_core_message(await read_frame(reader) or b""), Hello)
    return reader, writer, challenge.nonce


async def test_an_unauthenticated_peer_is_refused_before_any_command(core_address: str,
                                                                     client: EngineClient) -> None:
    attempts = [
        encode_frame(AddRequest("sneaky", prompt(10), LONG, Priority.BATCH)),  # a command before the proof
        encode_frame(Shutdown()),
        HEADER.pack(1 << 20),  # a large frame before the proof
    ]
    for attempt in attempts:
        reader, writer, _ = await raw_connection(core_address, authenticate=False)
        writer.write(attempt)
        answer = decode_core_message(await asyncio.wait_for(read_frame(reader), 10) or b"")
        assert isinstance(answer, ErrorReply) and answer.code in ("unauthenticated", "frame_too_large")
        assert await asyncio.wait_for(reader.read(), 10) == b""  # and the core closed the connection
        writer.close()
    reader, writer, nonce = await raw_connection(core_address, authenticate=False)
    writer.write(encode_frame(Authenticate(auth_mac(b"not-the-secret-at-all!", nonce))))
    answer = decode_core_message(await asyncio.wait_for(read_frame(reader), 10) or b"")
    assert isinstance(answer, ErrorReply) and answer.code == "unauthenticated"
    writer.close()
    with pytest.raises(errors.EngineUnavailableError, match="refused our secret"):
        await EngineClient.connect(core_address, secret="a-wrong-secret-of-some-length")
    stats = await client.refresh_stats()
    assert stats["running"] == 0 and stats["waiting"] == 0  # nothing was added, nothing stopped
    _, finish = await collect(client.generate("still-serving", prompt(12), GREEDY))
    assert finish.reason == "length"


def test_a_core_without_a_secret_refuses_to_start(model_cfg: ModelConfig) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_CORE_SECRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "engine_gpu.core_process", *config_args(model_cfg, replace(CONFIG, listen="tcp:0.0.0.0:0"))],
        capture_output=True, env=env, timeout=120, check=False)
    assert proc.returncode == 1
    report = json.loads(proc.stdout.decode().splitlines()[-1])
    assert report["code"] == "config_error" and "$ENGINE_CORE_SECRET" in report["error"]


async def reply(reader: asyncio.StreamReader) -> object:
    """The next message that is not a step's outputs (those stream in between for live requests)."""
    while isinstance(answer := decode_core_message(await asyncio.wait_for(read_frame(reader), 10) or b""),
                     StepOutputs):
        pass
    return answer


async def test_bad_messages_get_error_replies_and_the_loop_goes_on(core_address: str, client: EngineClient) -> None:
    reader, writer, _ = await raw_connection(core_address)
    for junk in (b"\xc1\xc1", msgpack.packb([1, 2]), msgpack.packb({"t": "launch", "seq": 4}),
                 msgpack.packb({"t": "abort", "id": 7, "seq": 5})):
        writer.write(HEADER.pack(len(junk)) + junk)
        answer = await reply(reader)
        assert isinstance(answer, ErrorReply) and answer.code == "bad_message"
    assert answer.seq == 5  # type: ignore[union-attr]
    writer.write(encode_frame(StatsRequest(9)))
    assert isinstance(await reply(reader), StatsReply)  # the same connection still works
    add = AddRequest("twice", prompt(10), LONG, Priority.BATCH)
    writer.write(encode_frame(add) + encode_frame(add))  # both arrive before the next step
    answer = await reply(reader)
    assert isinstance(answer, Rejected) and (answer.request_id, answer.code) == ("twice", "duplicate_request_id")
    writer.write(HEADER.pack(1 << 30))  # an oversized frame cannot be skipped: error, then close
    answer = await reply(reader)
    assert isinstance(answer, ErrorReply) and answer.code == "frame_too_large"
    while await reader.read(1 << 16):  # outputs already queued for "twice", then the end
        pass
    writer.close()
    _, finish = await collect(client.generate("after", prompt(12), GREEDY))  # others are unaffected
    assert finish.reason == "length"


async def test_prefix_cache_hits_stay_within_a_cache_salt(client: EngineClient) -> None:
    shared = prompt(40, offset=7)  # 2 full blocks of 16 reusable
    salt_a, salt_b = "a" * 32, "b" * 32
    first, finish_a = await collect(client.generate("salt-a1", shared, GREEDY, cache_salt=salt_a))
    _, finish_b = await collect(client.generate("salt-b", shared, GREEDY, cache_salt=salt_b))
    _, finish_plain = await collect(client.generate("no-salt", shared, GREEDY))
    again, finish_a2 = await collect(client.generate("salt-a2", shared, GREEDY, cache_salt=salt_a))
    assert (finish_a.cached_tokens, finish_b.cached_tokens, finish_plain.cached_tokens) == (0, 0, 0)
    assert finish_a2.cached_tokens == 32 and [t.token_id for t in again] == [t.token_id for t in first]
    with pytest.raises(errors.InvalidRequestError, match="cache_salt"):  # the client checks before sending
        await anext(client.generate("long-salt", shared, GREEDY, cache_salt="s" * 65))


async def test_a_bad_cache_salt_on_the_socket_rejects_that_request_only(core_address: str,
                                                                       client: EngineClient) -> None:
    reader, writer, _ = await raw_connection(core_address)
    live = client.generate("bystander", prompt(20), LONG)  # another client's request runs meanwhile
    await anext(live)
    wire = msgpack.unpackb(encode_frame(AddRequest("x", prompt(20), GREEDY, Priority.BATCH))[HEADER.size:])
    for request_id, salt in (("too-long", "s" * 65), ("not-a-string", 12345), ("bytes", b"salt"),
                             ("not-ascii", "sel\u00e9"), ("list", ["a"])):
        frame = msgpack.packb({**wire, "id": request_id, "salt": salt}, use_bin_type=True)
        writer.write(HEADER.pack(len(frame)) + frame)
        answer = await reply(reader)
        assert isinstance(answer, Rejected)
        assert (answer.request_id, answer.code, answer.param) == (request_id, "invalid_request", "cache_salt")
    frame = msgpack.packb({**wire, "id": "good", "salt": "a-fine-salt"}, use_bin_type=True)
    writer.write(HEADER.pack(len(frame)) + frame)  # the same connection goes on serving
    outputs: list[StepOutputs] = []
    while not any(o.request_id == "good" and o.finish is not None for out in outputs for o in out.outputs):
        answer = decode_core_message(await asyncio.wait_for(read_frame(reader), 10) or b"")
        assert isinstance(answer, StepOutputs)
        outputs.append(answer)
    writer.close()
    assert isinstance(await anext(live), TokenEvent)  # and the other client's stream was never touched
    await live.aclose()


async def test_a_vanished_client_has_its_requests_aborted(core_address: str, client: EngineClient) -> None:
    other = await EngineClient.connect(core_address)
    stream = other.generate("orphan", prompt(60), LONG)
    await anext(stream)
    other._writer.transport.abort()  # drop the socket without a word
    await asyncio.sleep(0)
    for _ in range(100):  # the core notices between steps; poll its stats, not the clock
        if (await client.refresh_stats())["running"] == 0:
            break
    stats = await client.refresh_stats()
    assert stats["running"] == 0 and stats["kv_blocks_in_use"] == 0
    await other.close()


async def test_start_over_tcp_then_the_core_dies(model_cfg: ModelConfig) -> None:
    c = await EngineClient.start(model_cfg, replace(CONFIG, listen="tcp:127.0.0.1:0"))
    try:
        assert c.address.startswith("tcp:127.0.0.1:") and not c.address.endswith(":0")
        second = await EngineClient.connect(c.address, tokenizer=c.tokenizer)  # another machine would do this
        _, finish = await collect(second.generate("over-tcp", prompt(20), GREEDY))
        assert finish.reason == "length"
        await second.close()

        streams = [c.generate(f"doomed{i}", prompt(30, i), LONG) for i in range(3)]
        for s in streams:
            await anext(s)
        pushed, pushed_done = await subscribe(c.generate("doomed-pushed", prompt(30, 7), LONG))
        assert c._process is not None
        os.kill(c._process.pid, signal.SIGKILL)
        for s in streams:
            events = [e async for e in s]
            assert isinstance(events[-1], FinishEvent) and events[-1].reason == "error"
        await asyncio.wait_for(pushed_done, 60)
        assert isinstance(pushed[-1], FinishEvent) and pushed[-1].reason == "error"  # a subscriber hears of it too
        assert not c.ready
        with pytest.raises(errors.EngineUnavailableError):
            await anext(c.generate("late", prompt(5), GREEDY))
        await c.abort("doomed0")  # returns: nothing is left to free
    finally:
        await c.close()


async def test_start_reports_a_missing_model_as_a_typed_error(tmp_path: Path) -> None:
    bad = ModelConfig(id="gone", source=str(tmp_path / "nope"), format="safetensors")
    with pytest.raises(errors.ModelFileError):
        await EngineClient.start(bad, CONFIG)


async def test_an_idle_core_blocks_instead_of_spinning(core_process: tuple[str, int], client: EngineClient) -> None:
    psutil = pytest.importorskip("psutil")
    await collect(client.generate("warm", prompt(10), GREEDY))
    proc = psutil.Process(core_process[1])
    before = proc.cpu_times()
    await asyncio.sleep(1.0)  # measuring idle CPU over a wall-clock interval, not waiting for an event
    after = proc.cpu_times()
    assert (after.user + after.system) - (before.user + before.system) < 0.1


async def test_a_core_with_speculation_reports_its_drafts(model_cfg: ModelConfig) -> None:
    """[engine.speculative] reaches the core process (the nested table through --engine-json), and
    its figures reach the client's stats, from where /metrics exports them."""
    spec = SpeculativeConfig(method="ngram", ngram_min=1, adaptive=False)
    c = await EngineClient.start(model_cfg, replace(CONFIG, speculative=spec))
    try:
        repeating = [5, 6, 7, 8] * 12  # a prompt that n-gram lookup can draft from
        _, finish = await collect(c.generate("spec", repeating, SamplingParams(temperature=0.0, max_tokens=40,
                                                                               ignore_eos=True)))
        assert finish.reason == "length" and finish.completion_tokens == 40
        stats = await c.refresh_stats()
        assert stats["spec_draft_tokens"] > 0 and stats["spec_enabled"] == 1.0
        assert 0.0 <= stats["spec_acceptance_rate"] <= 1.0 and "spec_mean_accepted_len" in stats
    finally:
        await c.close()


async def test_an_edge_drafter_without_its_model_is_a_config_error(model_cfg: ModelConfig) -> None:
    spec = SpeculativeConfig(method="edge", draft_model="smollm2")
    with pytest.raises(errors.ConfigError, match="draft-model"):
        await EngineClient.start(model_cfg, replace(CONFIG, speculative=spec))
