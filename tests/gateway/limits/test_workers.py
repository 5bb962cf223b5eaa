"""``server.workers = 2``: one ``python -m gateway serve`` whose two worker processes share the
port (SO_REUSEPORT) and the Redis limits. Connections spread over both workers, a WebSocket
session stays on the one that accepted it, ``/metrics`` from either answers for both, a killed
worker is replaced, SIGTERM drains them all, and the torch engine core is started once for both."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import pytest
import websockets
from gateway_procs import (
    Gateway,
    by_worker,
    chat,
    finish_response,
    gateway_config,
    open_session,
    scrape,
    start_response,
)
from limits_harness import RedisServer

WITHIN_S = 120.0  # a restarted worker loads its tier again: generous on a busy machine


def workers_config(directory: Path, redis: RedisServer, **config: Any) -> Path:
    return gateway_config(directory, "workers", redis_url=redis.url, prefix=f"w-{secrets.token_hex(4)}:",
                          workers=2, **config)


async def until_both_workers_serve(gateway: Gateway, tier: str = "edge") -> None:
    """Until both workers answer the scrape with ``tier`` ready (a worker joins the port, and
    answers its siblings' scrapes, once its tiers are loaded)."""
    deadline = time.monotonic() + WITHIN_S
    while by_worker(await scrape(gateway.url), "engine_ready", tier=tier) != {"0": 1.0, "1": 1.0}:
        assert time.monotonic() < deadline, f"a worker did not come back within {WITHIN_S:.0f} s"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(300)
async def test_two_workers_share_the_port_and_a_session_stays_on_its_worker(redis_server: RedisServer,
                                                                            tmp_path: Path) -> None:
    async with Gateway(workers_config(tmp_path, redis_server)) as gateway:
        assert len(gateway.children()) == 2
        await until_both_workers_serve(gateway)  # the gateway answers once one of them does
        statuses = await asyncio.gather(*(chat(gateway.url) for _ in range(24)))  # a connection each
        assert statuses == [200] * 24
        chats = by_worker(await scrape(gateway.url), "gateway_requests_total", api="chat")
        # The kernel picks a worker per connection: all 24 on one would be a 1 in 8 million chance.
        assert set(chats) == {"0", "1"} and min(chats.values()) > 0 and sum(chats.values()) == 24, chats
        ws = await open_session(gateway)
        assert isinstance(ws, websockets.ClientConnection)
        for _ in range(3):
            assert await start_response(ws, max_tokens=2) is None
            assert (await finish_response(ws))["status"] in ("completed", "incomplete")  # 2 tokens: cut short
        samples = await scrape(gateway.url)  # through another connection: either worker answers for both
        holders = [w for w, n in by_worker(samples, "gateway_sessions_active").items() if n == 1]
        assert len(holders) == 1, samples
        assert by_worker(samples, "gateway_requests_total", api="realtime") == {holders[0]: 3.0}
        await ws.close()


@pytest.mark.timeout(300)
async def test_a_killed_worker_is_replaced_and_sigterm_drains_every_worker(redis_server: RedisServer,
                                                                           tmp_path: Path) -> None:
    async with Gateway(workers_config(tmp_path, redis_server)) as gateway:
        first = gateway.children()
        victim = first[0]
        victim.kill()
        await asyncio.to_thread(victim.wait, WITHIN_S)
        assert await chat(gateway.url) == 200  # the other worker serves meanwhile
        await until_both_workers_serve(gateway)
        now = gateway.children()
        assert len(now) == 2 and victim.pid not in {p.pid for p in now}
        sessions = [await open_session(gateway) for _ in range(6)]  # likely on both workers
        assert all(isinstance(ws, websockets.ClientConnection) for ws in sessions)
        gateway.signal(signal.SIGTERM)
        for ws in sessions:
            assert isinstance(ws, websockets.ClientConnection)
            await asyncio.wait_for(ws.wait_closed(), WITHIN_S)
            assert ws.close_code == 1001  # drained: going away, with a reconnect hint
        assert await gateway.wait_exit(WITHIN_S) == 0
        _, alive = await asyncio.to_thread(psutil.wait_procs, now, WITHIN_S)
        assert not alive


@pytest.mark.timeout(600)
async def test_the_workers_share_one_torch_engine_core(redis_server: RedisServer, tmp_path: Path) -> None:
    """The torch tier is a core process the parent starts once (a tiny random checkpoint here);
    both workers stream from it, and it stops with the gateway."""
    from gateway_harness import tiny_chat_model

    model = tiny_chat_model(tmp_path / "tiny")
    engine = {"model": "tiny", "dtype": "float32", "num_blocks": 128, "max_num_batched_tokens": 128, "threads": 1,
              "speculative": {"method": "off"}}
    models = {"tiny": {k: v for k, v in asdict(model).items() if k != "id" and v}}
    config = workers_config(tmp_path, redis_server, routing="gpu", tables={"engine": engine, "models": models})
    async with Gateway(config) as gateway:
        cores = [p for p in psutil.Process(gateway.pid).children(recursive=True)
                 if "engine_gpu.core_process" in p.cmdline()]
        assert len(cores) == 1 and len(gateway.children()) == 3  # the core and two workers
        await until_both_workers_serve(gateway, tier="gpu")
        statuses = await asyncio.gather(*(chat(gateway.url, model="smollm2-135m-gpu") for _ in range(24)))
        assert statuses == [200] * 24
        served = by_worker(await scrape(gateway.url), "gateway_requests_total", api="chat", tier="gpu")
        assert set(served) == {"0", "1"}, served
    _, alive = await asyncio.to_thread(psutil.wait_procs, cores, WITHIN_S)
    assert not alive


@pytest.mark.timeout(300)
async def test_a_worker_that_cannot_start_stops_the_gateway_with_status_2(redis_server: RedisServer,
                                                                          tmp_path: Path) -> None:
    """A missing model file fails every worker the same way: the parent stops at the first
    instead of restarting it forever, and exits as a single gateway does on a start-up error."""
    missing = {"smollm2-135m": {"source": str(tmp_path / "missing.gguf"), "format": "gguf", "family": "smollm2"}}
    config = workers_config(tmp_path, redis_server, tables={"edge": {"backend": "llama_cpp"}, "models": missing})
    gateway = Gateway(config)
    with pytest.raises(RuntimeError, match="exited with 2"):
        await asyncio.to_thread(gateway.start)
    log = gateway.log_tail()
    assert "could not start" in log and "restarting it" not in log, log
