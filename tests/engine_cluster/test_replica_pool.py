"""The gateway's routing across engine replicas, on real engine cores over TCP (a tiny
checkpoint), with membership given by the test instead of Ray: prefix affinity, moving when a
replica leaves, draining, a replica killed mid-stream, overload and refusals."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from pool_turns import run_turn
from tiny_engine import write_tiny_model

from engine_cluster.config import ClusterConfig
from engine_cluster.pool import ReplicaPool, valid_members
from engine_gpu.block_manager import block_hashes
from engine_gpu.client import EngineClient
from engine_gpu.config import EngineConfig
from llm_shared import errors
from llm_shared.contract import FinishEvent, Priority, SamplingParams, TokenEvent
from llm_shared.models import ModelConfig

SECRET = "replica-pool-test-secret-0123456789"
CORE = EngineConfig(dtype="float32", block_size=16, num_blocks=128, max_num_batched_tokens=128, threads=1,
                    max_num_seqs=2, listen="tcp:127.0.0.1:0")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
CLUSTER = ClusterConfig(membership_poll_s=0.2, membership_ttl_s=1.0)
TIMEOUT_S = 60.0


class Members:
    """Membership the test controls (Ray's directory in production)."""

    def __init__(self, members: dict[str, str]) -> None:
        self.current = dict(members)

    async def members(self) -> dict[str, str]:
        return dict(self.current)


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CORE_SECRET", SECRET)


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


async def start_cores(model_cfg: ModelConfig, n: int, **changes: object) -> list[EngineClient]:
    os.environ["ENGINE_CORE_SECRET"] = SECRET
    return list(await asyncio.wait_for(
        asyncio.gather(*(EngineClient.start(model_cfg, replace(CORE, **changes)) for _ in range(n))), 120))


@pytest.fixture
async def cores(model_cfg: ModelConfig) -> AsyncIterator[list[EngineClient]]:
    owners = await start_cores(model_cfg, 2)
    yield owners
    await asyncio.wait_for(asyncio.gather(*(c.close() for c in owners)), 60)


async def make_pool(owners: list[EngineClient], cfg: ClusterConfig = CLUSTER) -> tuple[ReplicaPool, Members]:
    members = Members({f"r{i}": c.address for i, c in enumerate(owners)})
    pool = await ReplicaPool(cfg, owners[0].tokenizer, members, secret=SECRET).start(wait_s=TIMEOUT_S)
    assert len(pool.live()) == len(owners)
    return pool, members


async def run(pool: ReplicaPool, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
              ) -> tuple[list[int], FinishEvent, str]:
    return await run_turn(pool, rid, prompt, params)


def words(seed: int, n: int) -> list[int]:
    return [3 + (7 * i + 13 * seed) % 90 for i in range(n)]


async def test_later_turns_return_to_the_replica_holding_their_prefix(cores: list[EngineClient]) -> None:
    pool, _ = await make_pool(cores)
    try:
        assert pool.max_model_len == cores[0].max_model_len > 0  # what prompts are checked against early
        conversations = {c: words(c, 40) for c in range(4)}
        homes: dict[int, set[str]] = {c: set() for c in conversations}
        for turn in range(3):
            for c, history in conversations.items():
                tokens, finish, replica = await asyncio.wait_for(run(pool, f"c{c}t{turn}", history), TIMEOUT_S)
                assert finish.reason == "length"
                homes[c].add(replica)
                if turn > 0:
                    assert finish.cached_tokens >= 32, f"turn {turn} of conversation {c} missed its prefix"
                conversations[c] = history + tokens + words(100 + turn, 12)
        assert all(len(h) == 1 for h in homes.values()), f"a conversation changed replica: {homes}"
        assert {next(iter(h)) for h in homes.values()} == {"r0", "r1"}, "new conversations spread over both"
        assert pool.routed["affine"] == 8 and pool.routed["least_loaded"] == 4
    finally:
        await pool.close()


async def test_round_robin_misses_the_cache_that_affinity_hits(cores: list[EngineClient]) -> None:
    pool, _ = await make_pool(cores, replace(CLUSTER, route="round_robin"))
    try:
        history = words(7, 40)
        tokens, _, first = await asyncio.wait_for(run(pool, "rr-1", history), TIMEOUT_S)
        _, finish, second = await asyncio.wait_for(run(pool, "rr-2", history + tokens + words(9, 12)), TIMEOUT_S)
        assert first != second and finish.cached_tokens == 0
    finally:
        await pool.close()


async def test_a_conversation_moves_with_a_cache_miss_when_its_replica_leaves(cores: list[EngineClient]) -> None:
    pool, members = await make_pool(cores)
    try:
        history = words(3, 40)
        tokens, _, home = await asyncio.wait_for(run(pool, "m-1", history), TIMEOUT_S)
        del members.current[home]
        await pool.sync()
        assert home not in pool.replicas, "an idle replica that left is disconnected at once"
        _, finish, other = await asyncio.wait_for(run(pool, "m-2", history + tokens + words(4, 12)), TIMEOUT_S)
        assert other != home and finish.reason == "length" and finish.cached_tokens == 0
    finally:
        await pool.close()


async def test_a_leaving_replica_finishes_what_it_runs(cores: list[EngineClient]) -> None:
    pool, members = await make_pool(cores)
    try:
        stream = pool.generate("drain-1", words(5, 20), LONG, Priority.REALTIME)
        first = await asyncio.wait_for(anext(stream), TIMEOUT_S)
        assert isinstance(first, TokenEvent)
        home = pool._streams["drain-1"]._replica.replica_id
        del members.current[home]
        await pool.sync()
        assert home not in {r.replica_id for r in pool.live()}, "no new requests go to a leaving replica"
        _, _, other = await asyncio.wait_for(run(pool, "drain-2", words(6, 20)), TIMEOUT_S)
        assert other != home
        events = [e async for e in stream]
        assert isinstance(events[-1], FinishEvent) and events[-1].reason == "length"
        assert 1 + len(events) - 1 == LONG.max_tokens
        await asyncio.wait_for(_until(lambda: home not in pool.replicas), TIMEOUT_S)
    finally:
        await pool.close()


async def test_a_replica_killed_mid_stream(model_cfg: ModelConfig) -> None:
    """Streams that had produced tokens end at once with an error; those still waiting for their
    first token are retried on the other replica and complete; the next turns succeed."""
    owners = await start_cores(model_cfg, 2, max_num_seqs=1)
    pool, _ = await make_pool(owners)
    try:
        victim = owners[0]
        prompt = words(11, 20)
        pool.replicas["r0"].remember(block_hashes(prompt, 16), 100)  # steer them all to r0
        streams = [pool.generate(f"k{i}", prompt, LONG, Priority.REALTIME) for i in range(3)]
        firsts = await asyncio.wait_for(asyncio.gather(*(anext(s) for s in streams[:1])), TIMEOUT_S)
        assert isinstance(firsts[0], TokenEvent)
        waiting = [asyncio.create_task(_drain(s)) for s in streams[1:]]
        await asyncio.wait_for(_until(lambda: pool.replicas["r0"].client.stats().get("waiting", 0) >= 1), TIMEOUT_S)
        os.kill(victim._process.pid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        killed_at = loop.time()
        rest = await asyncio.wait_for(_drain(streams[0]), TIMEOUT_S)
        assert rest[-1].reason == "error" and "stopped" in rest[-1].message
        ended_after = loop.time() - killed_at
        assert ended_after < 10, f"the broken stream took {ended_after:.1f} s to end"
        for task in waiting:
            events = await asyncio.wait_for(task, TIMEOUT_S * 2)
            assert events[-1].reason == "length", "a request without tokens is retried elsewhere"
            assert sum(isinstance(e, TokenEvent) for e in events) == LONG.max_tokens
        assert pool.routed["retried"] >= 1
        assert [r.replica_id for r in pool.live()] == ["r1"]
        _, finish, replica = await asyncio.wait_for(run(pool, "after", words(12, 20)), TIMEOUT_S)
        assert finish.reason == "length" and replica == "r1"
    finally:
        await pool.close()
        await asyncio.wait_for(asyncio.gather(*(c.close() for c in owners)), 60)


async def test_an_overloaded_affine_replica_is_skipped(model_cfg: ModelConfig) -> None:
    owners = await start_cores(model_cfg, 2, max_num_seqs=1)
    pool, _ = await make_pool(owners, replace(CLUSTER, overload_queue=1))
    try:
        prompt = words(21, 40)
        busy = [pool.generate(f"busy{i}", words(30 + i, 20), LONG, Priority.REALTIME) for i in range(2)]
        pool.replicas["r0"].remember(block_hashes(prompt, 16), 100)
        for rid in ("busy0", "busy1"):  # both on r0: one runs, one waits
            pool.replicas["r0"].remember(block_hashes(words(30 + int(rid[-1]), 20), 16), 100)
        tasks = [asyncio.create_task(_drain(s)) for s in busy]
        await asyncio.wait_for(_until(lambda: pool.replicas["r0"].client.stats().get("waiting", 0) >= 1), TIMEOUT_S)
        _, finish, replica = await asyncio.wait_for(run(pool, "affine", prompt), TIMEOUT_S)
        assert replica == "r1" and pool.routed["overloaded"] == 1 and finish.reason == "length"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await pool.close()
        await asyncio.wait_for(asyncio.gather(*(c.close() for c in owners)), 60)


async def test_a_refusal_before_the_first_token_is_retried_elsewhere(model_cfg: ModelConfig) -> None:
    owners = await start_cores(model_cfg, 2, max_num_seqs=1, max_waiting=1)
    pool, _ = await make_pool(owners, replace(CLUSTER, overload_queue=100))
    try:
        prompt = words(40, 20)
        pool.replicas["r0"].remember(block_hashes(prompt, 16), 100)  # all three prefer r0
        running = pool.generate("q0", prompt, LONG, Priority.REALTIME)
        assert isinstance(await asyncio.wait_for(anext(running), TIMEOUT_S), TokenEvent)
        queued = asyncio.create_task(_drain(pool.generate("q1", prompt, LONG, Priority.REALTIME)))
        await asyncio.wait_for(_until(lambda: pool.replicas["r0"].client.stats().get("waiting", 0) >= 1), TIMEOUT_S)
        # r0 has one running and one waiting: it refuses the third, which r1 then serves.
        _, finish, replica = await asyncio.wait_for(run(pool, "q2", prompt, GREEDY), TIMEOUT_S)
        assert finish.reason == "length" and replica == "r1" and pool.routed["retried"] == 1
        await pool.abort("q0")
        await pool.abort("q1")
        assert (await asyncio.wait_for(queued, TIMEOUT_S))[-1].reason == "abort"
    finally:
        await pool.close()
        await asyncio.wait_for(asyncio.gather(*(c.close() for c in owners)), 60)


async def test_no_replica_means_unavailable(model_cfg: ModelConfig) -> None:
    pool = await ReplicaPool(CLUSTER, None, Members({}), secret=SECRET).start()  # type: ignore[arg-type]
    try:
        assert not pool.ready and pool.max_model_len == 0
        with pytest.raises(errors.EngineUnavailableError, match="no engine replica"):
            await anext(pool.generate("none", [5, 6, 7], GREEDY))
        with pytest.raises(errors.EngineUnavailableError):
            await pool.probe()
    finally:
        await pool.close()


async def _drain(stream: object) -> list:
    return [event async for event in stream]  # type: ignore[attr-defined]


async def _until(predicate: object, interval: float = 0.02) -> None:
    while not predicate():  # type: ignore[operator]
        await asyncio.sleep(interval)


async def test_malformed_membership_is_ignored_not_trusted(cores: list[EngineClient]) -> None:
    assert valid_members({"r0": {"address": "tcp:10.0.0.1:5"}, "r1": {"address": "http://x"}, "r2": "tcp:a:1",
                          7: {"address": "tcp:b:1"}, "r3": {"address": "tcp:" + "9" * 300}}) == {"r0": "tcp:10.0.0.1:5"}
    assert valid_members(["not", "a", "mapping"]) == {}
    members = Members({"r0": cores[0].address, "bad": "unix:/nonexistent/core.sock", "worse": "tcp:no-port"})
    pool = await ReplicaPool(CLUSTER, cores[0].tokenizer, members, secret=SECRET).start(wait_s=TIMEOUT_S)
    try:
        assert [r.replica_id for r in pool.live()] == ["r0"]
        await pool.sync()  # the unreachable and unparsable entries fail alone, every poll
        _, finish, replica = await asyncio.wait_for(run(pool, "ok", words(50, 20)), TIMEOUT_S)
        assert finish.reason == "length" and replica == "r0"
    finally:
        await pool.close()

