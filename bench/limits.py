"""Per-key limits in Redis shared by gateway processes, and several workers on one port (issue 31).

Each arm starts what it needs: a ``redis-server`` of its own on a free loopback port, and
``python -m gateway serve`` processes on the synthetic edge tier (real tokens, no model
arithmetic: the figures are the gateway's and the store's, bench/load.py's set-up).

- ``admission``: what the Redis backend adds to a turn's admission: the two awaited calls before
  its first token (``admit``, then ``reserve`` of its token budget and running lease; the
  settlement is not awaited), timed one at a time, in this process against the store the
  gateway builds (``store_from_config``: Redis behind the failover wrapper) and against the
  in-process store, same run: ``redis_admission_p50_ms``, ``redis_admission_p99_ms`` (and the
  in-process ``memory_admission_*``; under 16 concurrent callers in ``admission``'s details).
- ``overshoot``: two gateways on one Redis, one key at ``requests_per_minute`` = 600 (the smoke
  form: 60), each offered 160 chat completions a second (8 clients, 20 a second each) for 20 s:
  ``limit_overshoot_ratio`` = admitted / allowed, where allowed is the full bucket plus its
  refill over the run (1.0: exactly the limit; a per-process limit would give ~2).
- ``failover``: for each policy, one gateway offered 160 chat completions a second while its
  Redis is paused (SIGSTOP: connections stay open, nothing answers), resumed, stopped, started
  again, 4 s each. ``failover_hangs`` counts requests without an answer after 5 s, both policies
  together (goal 0); the details give each phase's answers (fail_open: 200 throughout; fail_closed:
  503 ``limits_unavailable`` while Redis is away), the seconds until ``/readyz`` said the store
  was back, Realtime sessions that did not survive, and whether the gateway was still running.
- ``streams``: bench/load.py's ``streams`` arm with the limits in Redis and ``server.workers`` 1,
  then 2: the most streams at 20 tokens/s with ITL p99 under 100 ms (the steps kept their 50 ms
  pace, every response completed): ``streams_2_workers_over_1``. The clients run in this
  process, on the same cores: on 2 cores the workers and the clients share them, so the ratio
  says what the cores allow there; the goal (>= 1.6) is for a host with cores to spare.
- ``per_delta``: the streams arm at one level with the in-process and the Redis backend:
  ``redis_us_per_delta_over_memory``, the gateway's CPU a streamed delta with Redis over without
  (a turn costs one admission, one reservation and one settlement, never one per token).
- ``edge``: one llama.cpp context of the embedded model on all cores against one per worker on
  half of them, the same 8 streams (bench/_limits_edge.py): ``edge_own_over_shared_tok_s`` and
  ``edge_extra_worker_mib``, the figures behind giving each worker its own edge tier.

Progress on stderr; the last stdout line is one JSON object with the keys above and ``cpu``;
everything goes to bench/out/limits.json. Run: ``.venv/bin/python bench/limits.py`` (about 10
minutes on the dev machine); ``--smoke``: every arm at tiny sizes, in about a minute (figures
meaningless, results in bench/out/smoke/).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import json
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from bench import load
from bench._common import SMOKE_HELP, cpu_facts, percentile, progress, raise_nofile_limit, result_path, write_json
from bench._gateway_server import GatewayProcess
from bench._limits_edge import arm_edge
from bench._load_setup import synthetic_config
from bench._redis import Redis
from bench._ws_lean import LeanSession
from gateway.limits import Limits, LimitsConfig, LimitsStore, store_from_config

HANG_S = 5.0  # a request unanswered this long hangs (the store's own bound is 100 ms)
FAILOVER_PHASES = ("up", "paused", "resumed", "stopped", "restarted")
RECOVER_WITHIN_S = 30.0
# Chat clients per gateway, each at most one request per PACE_S: 160 requests/s a gateway, 16x
# the overshoot arm's limit. Unpaced, the clients saturate the gateway's event loop on 2 cores,
# and a Redis answer that waits behind the loop's queue counts as the store's timeout.
CLIENTS = 8
PACE_S = 0.05
KEY = "bench-key"


@dataclass(frozen=True)
class Sizes:
    admissions: int = 2000
    overshoot_s: float = 20.0
    overshoot_rpm: int = 600
    phase_s: float = 4.0
    steps: tuple[int, ...] = (*load.STEPS, 2500, 3000, 4000)
    per_delta_streams: int = 500
    edge_streams: int = 8
    edge_tokens: int = 128


SMOKE_SIZES = Sizes(admissions=100, overshoot_s=1.5, overshoot_rpm=60, phase_s=1.0, steps=(20,), per_delta_streams=20,
                    edge_streams=4, edge_tokens=16)


def limits_table(redis: Redis, **more: Any) -> dict[str, Any]:
    """``[limits]`` in ``redis``, in a key space of this arm's own."""
    return {"backend": "redis", "url": redis.url, "key_prefix": f"bench-{secrets.token_hex(4)}:", **more}


def gateway(directory: Path, name: str, *, tree: bool = False, **tables: dict[str, Any]) -> GatewayProcess:
    """A gateway on the synthetic edge at 1,000 tokens/s (a one-token answer takes ~1 ms)."""
    config = synthetic_config(directory, name, max_streams=20_000, rate=1000.0, tables=tables)
    return GatewayProcess(config, directory / f"{name}.log", "127.0.0.1", tree=tree)


async def started(*servers: GatewayProcess) -> None:
    for server in servers:
        server.start()
    for server in servers:
        await server.wait_ready()


async def chat(http: aiohttp.ClientSession, url: str) -> int | str:
    """One chat completion of one token: its status, or "hang" past ``HANG_S``."""
    body = {"model": "smollm2-135m-edge", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with asyncio.timeout(HANG_S), http.post(f"{url}/v1/chat/completions", json=body) as response:
            await response.read()
            return response.status
    except TimeoutError:
        return "hang"
    except aiohttp.ClientError as e:
        return type(e).__name__


# --- admission --------------------------------------------------------------------------------


async def time_admissions(store: LimitsStore, n: int, callers: int) -> list[float]:
    """Seconds of each turn's awaited admission (admit, reserve), ``callers`` at a time."""
    times: list[float] = []

    async def caller(c: int) -> None:
        for i in range(n // callers):
            t0 = time.perf_counter()
            await store.admit(KEY)
            reservation = await store.reserve(KEY, 16, holder=f"b{c}-{i}")
            times.append(time.perf_counter() - t0)
            await store.settle(reservation, 16)

    await asyncio.gather(*(caller(c) for c in range(callers)))
    return times


async def arm_admission(redis: Redis, sizes: Sizes) -> dict[str, Any]:
    limits = Limits(requests_per_minute=10**9, tokens_per_minute=10**12, max_running_per_key=10**6)
    result: dict[str, Any] = {}
    for name, config in (("memory", LimitsConfig()), ("redis", LimitsConfig(**limits_table(redis)))):
        store = store_from_config(config, limits)
        try:
            await time_admissions(store, min(200, sizes.admissions), 1)  # warm-up: connections, scripts loaded
            for callers in (1, 16):
                ms = [t * 1e3 for t in await time_admissions(store, sizes.admissions, callers)]
                result[f"{name}_c{callers}"] = {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
                                                "n": len(ms)}
        finally:
            await store.aclose()
        progress(f"admission, {name}: p50 {result[f'{name}_c1']['p50_ms']:.3f} ms, p99 "
                 f"{result[f'{name}_c1']['p99_ms']:.3f} ms; 16 at once: p99 {result[f'{name}_c16']['p99_ms']:.3f} ms")
    return result


# --- overshoot ----------------------------------------------------------------------------------


async def offer(urls: list[str], seconds: float) -> list[tuple[float, int | str]]:
    """``CLIENTS`` loops per URL asking for chat completions, each at most one per ``PACE_S``,
    for ``seconds``: (time sent, outcome) of each."""
    out: list[tuple[float, int | str]] = []
    stop_at = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        async def loop(url: str) -> None:
            while (sent := time.perf_counter()) < stop_at:
                out.append((sent, await chat(http, url)))
                await asyncio.sleep(max(0.0, sent + PACE_S - time.perf_counter()))

        await asyncio.gather(*(loop(url) for url in urls for _ in range(CLIENTS)))
    return out


async def arm_overshoot(directory: Path, redis: Redis, sizes: Sizes) -> dict[str, Any]:
    rpm = sizes.overshoot_rpm
    tables = {"server": {"requests_per_minute": rpm}, "limits": limits_table(redis)}
    servers = [gateway(directory, f"overshoot-{name}", **tables) for name in ("a", "b")]
    try:
        await started(*servers)
        begin = time.perf_counter()
        results = await offer([s.url for s in servers], sizes.overshoot_s)
        elapsed = time.perf_counter() - begin
    finally:
        for server in servers:
            server.stop()
    outcomes = collections.Counter(str(outcome) for _, outcome in results)
    allowed = rpm + rpm * elapsed / 60
    ratio = outcomes["200"] / allowed
    progress(f"overshoot: {outcomes['200']} admitted of {len(results)} asked in {elapsed:.1f} s across two gateways, "
             f"{allowed:.0f} allowed: ratio {ratio:.3f} ({dict(outcomes)})")
    return {"rpm": rpm, "seconds": elapsed, "outcomes": dict(outcomes), "allowed": allowed,
            "limit_overshoot_ratio": ratio}


# --- failover -----------------------------------------------------------------------------------


async def until_store_back(server: GatewayProcess, within_s: float) -> float | None:
    """When ``/readyz`` first said the store was back, polled for ``within_s`` (each poll may probe
    the store, as a readiness probe does); None if it did not."""
    deadline = time.perf_counter() + within_s
    while time.perf_counter() < deadline:
        if not await store_degraded(server):
            return time.perf_counter()
        await asyncio.sleep(0.1)
    return None


async def store_degraded(server: GatewayProcess) -> bool:
    """What the gateway's ``/readyz`` says of its limits store (True also when it does not answer)."""
    try:
        _, body = await asyncio.to_thread(server._get, "/readyz")
        return bool(json.loads(body).get("limits", {}).get("degraded", True))
    except (OSError, ValueError):
        return True


def phase_counts(results: list[tuple[float, int | str]], starts: list[float]) -> dict[str, collections.Counter[str]]:
    """Each phase's outcomes, by when each request was sent (``starts``: each phase's start)."""
    phases: dict[str, collections.Counter[str]] = {p: collections.Counter() for p in FAILOVER_PHASES}
    for sent, outcome in results:
        phases[FAILOVER_PHASES[max(0, bisect.bisect_right(starts, sent) - 1)]][str(outcome)] += 1
    return phases


async def failover_policy(directory: Path, policy: str, sizes: Sizes) -> dict[str, Any]:
    redis = Redis(directory)
    await asyncio.to_thread(redis.start)
    server = gateway(directory, f"failover-{policy}", limits=limits_table(redis, failure=policy))
    sessions: list[LeanSession] = []
    starts: list[float] = []
    try:
        await started(server)
        sessions = await load.open_sessions(f"ws://127.0.0.1:{server.port}/v1/realtime", 4)
        actions = {"paused": redis.pause, "resumed": redis.resume, "stopped": redis.stop, "restarted": redis.start}
        load_task = asyncio.create_task(offer([server.url], sizes.phase_s * len(FAILOVER_PHASES)))
        for phase in FAILOVER_PHASES:
            if phase in actions:
                await asyncio.to_thread(actions[phase])
            starts.append(time.perf_counter())
            if phase != "restarted":
                await asyncio.sleep(sizes.phase_s)
        back = await until_store_back(server, sizes.phase_s)  # under the load
        results = await load_task
        back = back or await until_store_back(server, RECOVER_WITHIN_S)  # idle: readiness probes alone
        recover_s = None if back is None else back - starts[-1]  # from Redis answering again
        survived = 0
        for session in sessions:
            try:
                survived += (await load.stream_once(session, 2)).status in ("completed", "incomplete")
            except Exception as e:  # a session the outage closed: counted below, never raised
                progress(f"failover, {policy}: a session did not survive ({type(e).__name__}: {e})")
        crashed = not server.running
    finally:
        await load.close_all(sessions)
        server.stop()
        redis.stop()
    phases = phase_counts(results, starts)
    hangs = sum(c["hang"] for c in phases.values())
    progress(f"failover, {policy}: {hangs} hung; " + "; ".join(f"{p} {dict(c)}" for p, c in phases.items())
             + (f"; store back in /readyz after {recover_s:.1f} s" if recover_s is not None
                else f"; THE STORE WAS NOT BACK {RECOVER_WITHIN_S:.0f} s after Redis was")
             + f"; {len(sessions) - survived} sessions lost"
             + ("; THE GATEWAY CRASHED" if crashed else ""))
    return {"phases": {p: dict(c) for p, c in phases.items()}, "hangs": hangs, "recover_s": recover_s,
            "sessions_lost": len(sessions) - survived, "crashed": crashed}


async def arm_failover(directory: Path, sizes: Sizes) -> dict[str, Any]:
    result = {policy: await failover_policy(directory, policy, sizes) for policy in ("fail_open", "fail_closed")}
    result["failover_hangs"] = sum(r["hangs"] for r in result.values())
    return result


# --- streams ------------------------------------------------------------------------------------


async def arm_streams(directory: Path, redis: Redis, sizes: Sizes, load_sizes: load.Sizes) -> dict[str, Any]:
    slo = load.parse_goodput(list(load.DEFAULT_GOODPUT))
    result: dict[str, Any] = {}
    for workers in (1, 2):
        tables = {"server": {"workers": workers}, "limits": limits_table(redis)}
        result[f"workers_{workers}"] = await load.arm_streams(directory, sizes.steps, slo, load_sizes, tables=tables,
                                                              label=f", {workers} worker(s)")
    one, two = (result[f"workers_{w}"]["max_streams_itl_p99_under_100ms"] for w in (1, 2))
    result["streams_2_workers_over_1"] = two / one if one else None
    progress(f"streams sustained: {one} with one worker, {two} with two")
    return result


async def arm_per_delta(directory: Path, redis: Redis, sizes: Sizes, load_sizes: load.Sizes) -> dict[str, Any]:
    slo = load.parse_goodput(list(load.DEFAULT_GOODPUT))
    levels = {}
    for name, limits in (("memory", {"backend": "memory"}), ("redis", limits_table(redis))):
        arm = await load.arm_streams(directory, (sizes.per_delta_streams,), slo, load_sizes, tables={"limits": limits},
                                     label=f", limits in {name}")
        levels[name] = arm["levels"][0]
    ratio = levels["redis"]["server_us_per_delta"] / levels["memory"]["server_us_per_delta"]
    progress(f"gateway CPU a delta at {sizes.per_delta_streams} streams: redis {levels['redis']['server_us_per_delta']:.1f} "
             f"µs, in-process {levels['memory']['server_us_per_delta']:.1f} µs (ratio {ratio:.2f})")
    return {"levels": levels, "redis_us_per_delta_over_memory": ratio}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes: Sizes = args.sizes
    raise_nofile_limit(4 * max(sizes.steps) + 1000)
    result: dict[str, Any] = {"sizes": asdict(sizes), "smoke": args.smoke}
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as tmp:
        directory = Path(tmp)
        redis = Redis(directory)
        redis.start()
        try:
            if "admission" in args.arms:
                result["admission"] = await arm_admission(redis, sizes)
            if "overshoot" in args.arms:
                result["overshoot"] = await arm_overshoot(directory, redis, sizes)
            if "failover" in args.arms:
                result["failover"] = await arm_failover(directory, sizes)
            if "streams" in args.arms:
                result["streams"] = await arm_streams(directory, redis, sizes, args.load_sizes)
            if "per_delta" in args.arms:
                result["per_delta"] = await arm_per_delta(directory, redis, sizes, args.load_sizes)
        finally:
            redis.stop()
    if "edge" in args.arms:
        result["edge"] = await asyncio.to_thread(arm_edge, result_cores(), sizes.edge_streams, sizes.edge_tokens)
    return result


def result_cores() -> int:
    from gateway.config.host import usable_cpus

    return max(2, usable_cpus())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=["admission", "overshoot", "failover", "streams", "per_delta", "edge"])
    parser.add_argument("--out", type=Path, help="results (default: bench/out/limits.json)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: SMOKE_SIZES and load.py's")
    args = parser.parse_args(argv)
    args.sizes = SMOKE_SIZES if args.smoke else Sizes()
    args.load_sizes = load.SMOKE_SIZES if args.smoke else load.Sizes()
    args.out = args.out or result_path("limits.json", args.smoke)
    result = uvloop.run(run(args))
    result["cpu"] = cpu_facts()
    write_json(args.out, result)
    admission = result.get("admission", {})
    figures = {
        "redis_admission_p50_ms": admission.get("redis_c1", {}).get("p50_ms"),
        "redis_admission_p99_ms": admission.get("redis_c1", {}).get("p99_ms"),
        "memory_admission_p50_ms": admission.get("memory_c1", {}).get("p50_ms"),
        "memory_admission_p99_ms": admission.get("memory_c1", {}).get("p99_ms"),
        "limit_overshoot_ratio": result.get("overshoot", {}).get("limit_overshoot_ratio"),
        "failover_hangs": result.get("failover", {}).get("failover_hangs"),
        "streams_2_workers_over_1": result.get("streams", {}).get("streams_2_workers_over_1"),
        "redis_us_per_delta_over_memory": result.get("per_delta", {}).get("redis_us_per_delta_over_memory"),
        "edge_own_over_shared_tok_s": result.get("edge", {}).get("edge_own_over_shared_tok_s"),
        "edge_extra_worker_mib": result.get("edge", {}).get("edge_extra_worker_mib"),
    }
    rounded = {k: None if v is None else round(v, 3) for k, v in figures.items()}
    print(json.dumps({**rounded, "cpu": result["cpu"]["model"], "python_ref_ms": result["cpu"]["python_ref_ms"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
