"""Engine replicas on a real local Ray cluster (CPU replicas of the embedded SmolLM2-135M),
seen through the gateway's ReplicaPool with membership read from Ray: autoscaling 1 -> 2 -> 1
under load without a failed request, prefix affinity across two replicas, and a replica killed
mid-stream. Marked ``ray`` (minutes; `make test-cluster`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the cluster extra is not installed (make test-cluster installs it)")

from pool_turns import run_turn  # noqa: E402

from engine_cluster.config import ClusterConfig  # noqa: E402 - after the importorskip
from engine_cluster.local import (  # noqa: E402
    delete_app,
    deploy,
    kill_replica,
    running_replicas,
    start_local,
    stop_local,
    wait_for,
)
from engine_cluster.pool import RayMembership, ReplicaPool  # noqa: E402
from gateway.config import load_config  # noqa: E402
from llm_shared.contract import FinishEvent, Priority, SamplingParams, TokenEvent  # noqa: E402
from llm_shared.models import REPO_ROOT, tokenizer_for  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.model, pytest.mark.timeout(1500)]

SHORT = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
START_S = 300.0


def cluster_toml(tmp: Path, **cluster: object) -> str:
    """configs/cluster.toml with faster autoscaling for a test, under its own app name."""
    text = (REPO_ROOT / "configs" / "cluster.toml").read_text()
    raw = tomllib.loads(text)
    lines = text.splitlines()
    start = lines.index("[cluster]")
    table = {**raw["cluster"], **cluster}
    body = "\n".join(f"{k} = {v!r}".replace("'", '"').replace("True", "true").replace("False", "false")
                     for k, v in table.items())
    path = tmp / "cluster.toml"
    path.write_text("\n".join(lines[:start]) + "\n[cluster]\n" + body + "\n")
    return str(path)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    tmp = tmp_path_factory.mktemp("cluster")
    start_local(cluster_toml(tmp), num_cpus=2)
    yield tmp
    stop_local()


@contextlib.asynccontextmanager
async def deployed(tmp: Path, app_name: str, replicas: int | None = None,
                   **cluster: object) -> AsyncIterator[tuple[ReplicaPool, ClusterConfig]]:
    """The engine replicas deployed as ``app_name`` (a fixed count, or autoscaling) and a pool
    following them (with every fixed replica serving); both gone afterwards."""
    path = cluster_toml(tmp, app_name=app_name, **cluster)
    await asyncio.to_thread(deploy, path, replicas)
    pool, config = await open_pool(path)
    try:
        if replicas is not None:
            await asyncio.wait_for(_until(lambda: len(pool.live()) == replicas), START_S)
        yield pool, config
    finally:
        await pool.close()
        await asyncio.to_thread(delete_app, config.app_name)


async def open_pool(config_path: str) -> tuple[ReplicaPool, ClusterConfig]:
    config = load_config(config_path)
    tokenizer = await asyncio.to_thread(tokenizer_for, config.model(config.engine.model))
    pool = ReplicaPool(config.cluster, tokenizer, RayMembership(config.cluster),
                       secret=os.environ[config.engine.secret_env])
    return await pool.start(wait_s=START_S), config.cluster


async def turn(pool: ReplicaPool, rid: str, prompt: list[int], params: SamplingParams = SHORT,
               ) -> tuple[list[int], FinishEvent, str]:
    return await run_turn(pool, rid, prompt, params)


def prompt_of(pool: ReplicaPool, text: str) -> list[int]:
    return pool.tokenizer.encode_chat([{"role": "system", "content": "You answer briefly."},
                                       {"role": "user", "content": text}])


async def test_replicas_scale_up_under_load_and_back_down_without_a_failure(ray_cluster: Path) -> None:
    async with deployed(ray_cluster, "autoscale", upscale_delay_s=1.0, downscale_delay_s=4.0,
                        look_back_period_s=1.0, metrics_interval_s=0.5) as (pool, cluster):
        await _autoscale(pool, cluster)


async def _autoscale(pool: ReplicaPool, cluster: ClusterConfig) -> None:
    finishes: list[str] = []
    served: set[str] = set()
    stop = asyncio.Event()

    async def client(c: int) -> None:
        i = 0
        while not stop.is_set():
            _, finish, replica = await turn(pool, f"load{c}-{i}", prompt_of(pool, f"Count to {c + i}."))
            finishes.append(finish.reason)
            served.add(replica)
            i += 1

    try:
        assert running_replicas(cluster.app_name) == 1
        clients = [asyncio.create_task(client(c)) for c in range(10)]  # 4 slots: a queue builds
        await asyncio.to_thread(wait_for, lambda: running_replicas(cluster.app_name) == 2, START_S, "scale up")
        await asyncio.wait_for(_until(lambda: len(pool.live()) == 2 and len(served) == 2), START_S)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), START_S)
        # Light load continues while the second replica is removed.
        stop.clear()
        light = asyncio.create_task(client(99))
        await asyncio.to_thread(wait_for, lambda: running_replicas(cluster.app_name) == 1, START_S, "scale down")
        await asyncio.wait_for(_until(lambda: len(pool.live()) == 1), START_S)
        stop.set()
        await asyncio.wait_for(light, START_S)
        assert finishes and set(finishes) == {"length"}, f"failed requests: {[f for f in finishes if f != 'length']}"
    finally:
        stop.set()


async def test_affinity_on_two_replicas_and_a_move_when_one_is_removed(ray_cluster: Path) -> None:
    async with deployed(ray_cluster, "affinity", 2) as (pool, cluster):
        history = prompt_of(pool, "Tell me about the planets of the solar system, one by one, briefly.")
        homes = []
        for t in range(3):
            tokens, finish, replica = await turn(pool, f"aff-{t}", history)
            homes.append(replica)
            if t:
                assert finish.cached_tokens > 0, "a later turn missed the prefix its replica holds"
            history = history + tokens + prompt_of(pool, f"And then {t}?")
        assert len(set(homes)) == 1
        kill_replica(cluster.app_name, homes[0])
        await asyncio.wait_for(_until(lambda: homes[0] not in pool.replicas), 30)
        _, finish, replica = await turn(pool, "aff-moved", history)
        assert replica != homes[0] and finish.reason == "length" and finish.cached_tokens == 0
        # Ray replaces the killed replica; the gateway picks it up from membership.
        await asyncio.wait_for(_until(lambda: len(pool.live()) == 2), START_S)


async def test_a_replica_killed_mid_stream_under_load(ray_cluster: Path) -> None:
    async with deployed(ray_cluster, "kill", 2) as (pool, cluster):
        # Four streams per replica, all running (4 slots each) and all past their first token.
        streams = [pool.generate(f"k{i}", prompt_of(pool, f"Story {i}."), LONG, Priority.REALTIME)
                   for i in range(8)]
        firsts = await asyncio.wait_for(asyncio.gather(*(anext(s) for s in streams)), START_S)
        assert all(isinstance(e, TokenEvent) for e in firsts)
        homes = {pool._streams[f"k{i}"]._replica.replica_id for i in range(8)}
        assert len(homes) == 2, "least-loaded routing spreads the streams over both replicas"
        victim = pool._streams["k0"]._replica.replica_id
        on_victim = {f"k{i}" for i in range(8) if pool._streams[f"k{i}"]._replica.replica_id == victim}
        tasks = {f"k{i}": asyncio.create_task(_collect(s)) for i, s in enumerate(streams)}
        killed_at = asyncio.get_running_loop().time()
        kill_replica(cluster.app_name, victim)
        for rid, task in tasks.items():
            events, ended_at = await asyncio.wait_for(task, START_S)
            if rid in on_victim:
                assert events[-1].reason == "error", f"{rid} on the killed replica"
                assert ended_at - killed_at < 10, f"{rid} hung for {ended_at - killed_at:.1f} s"
            else:
                assert events[-1].reason == "length", f"{rid} on the healthy replica"
        _, finish, replica = await turn(pool, "after-kill", prompt_of(pool, "Hello?"))
        assert finish.reason == "length" and replica != victim
        # Serve replaces the killed replica; the gateway picks the new one up from membership.
        await asyncio.wait_for(_until(lambda: len(pool.live()) == 2), START_S)


async def _collect(stream: object) -> tuple[list, float]:
    events = [e async for e in stream]  # type: ignore[attr-defined]
    return events, asyncio.get_running_loop().time()


async def _until(predicate: object, interval: float = 0.1) -> None:
    while not predicate():  # type: ignore[operator]
        await asyncio.sleep(interval)
