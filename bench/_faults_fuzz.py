"""Arm ``fuzz`` of bench/faults.py: hostile frames at a gateway on the synthetic edge backend,
while one healthy session keeps taking turns and the HTTP endpoints are probed.

``connections`` fuzzing connections (alternately JSON and msgpack, the
``x-openai-realtime-msgpack`` subprotocol) send frames from ``bench/_faults_frames.py`` as fast
as the server takes them, each with a reader draining what the server answers. A connection
the server closes (1007 for a text frame that is not UTF-8) is reopened; a frame over
``server.max_frame_bytes`` that is not an append is an error event since issue 41. A crash is any of: the server process dying, a
healthy turn that does not complete normally, a connection closed with 1011 (internal
error), a 5xx from an HTTP endpoint. ``server_error`` events (the session's generic internal
error) are counted beside them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench._common import progress
from bench._faults_frames import Encoding, fuzz_frame, random_value
from bench._faults_ws import (
    DELTA,
    DONE,
    Budget,
    connect,
    derive_config,
    kv_held,
    out_of_band,
    recv,
    sample,
    samples_of,
    send,
    start_gateway,
    wait_quiet,
    ws_url,
)
from bench._gateway_clients import BenchError
from bench._gateway_server import GatewayProcess
from gateway.ws.codec import MSGPACK_SUBPROTOCOL

MAX_FRAME_BYTES = 256 * 1024  # the server's default limit, set explicitly so oversized frames know it
TOKENS_PER_S = 50
SEND_TIMEOUT_S = 30.0  # one frame handed to the socket; the server reads every connection
CLOSE_WAIT_S = 10.0  # for a connection's reader to see the close after a frame that ends it
HEALTHY_TOKENS = 8
HEALTHY_EVENT_TIMEOUT_S = 30.0  # between two events of a healthy turn: ~0.2 s when all is well
PROBE_INTERVAL_S = 0.25
PROBE_TIMEOUT_S = 30.0
CRASH_CLOSE = 1011
SAMPLES = 20
CLOSING_KINDS = frozenset({"invalid_utf8_text"})  # 1007 from the server (an oversized frame is an error event)
PROBE_PATHS = ("/healthz", "/readyz", "/metrics", "/v1/models", "/v1/models/smollm2-135m-edge", "/v1/models/%00")


@dataclass
class FuzzStats:
    sent: int = 0
    kinds: Counter[str] = field(default_factory=Counter)  # frames sent, by generator
    events: Counter[str] = field(default_factory=Counter)  # server events received on fuzz connections
    error_codes: Counter[str] = field(default_factory=Counter)
    closes: Counter[str] = field(default_factory=Counter)  # close code -> connections
    closes_after: Counter[str] = field(default_factory=Counter)  # "code after <kind of the last frame sent>"
    reconnects: int = 0
    connect_failures: Counter[str] = field(default_factory=Counter)
    healthy_turns: int = 0
    healthy_failures: int = 0
    http: Counter[str] = field(default_factory=Counter)  # "GET /path 200"
    http_5xx: int = 0
    http_failures: int = 0  # no answer at all (timeout, reset)
    server_deaths: int = 0
    samples: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.samples) < SAMPLES:
            self.samples.append(text[:300])


def server_dead(server: GatewayProcess) -> bool:
    process = server.process
    try:
        return not process.is_running() or process.status() == "zombie"
    except Exception:  # psutil.NoSuchProcess and friends: gone
        return True


async def drain(ws: ClientConnection, stats: FuzzStats) -> None:
    """Read and count everything the server sends until the connection ends."""
    try:
        async for data in ws:
            try:
                event = msgpack.unpackb(data, raw=False) if isinstance(data, bytes) else json.loads(data)
                kind = str(event.get("type"))
            except (ValueError, msgpack.UnpackException, AttributeError):
                stats.events["<undecodable>"] += 1
                stats.note(f"undecodable server frame: {data[:120]!r}")
                continue
            stats.events[kind] += 1
            if kind == "error":
                code = str(event.get("error", {}).get("code"))
                stats.error_codes[code] += 1
                if code == "server_error":
                    stats.note(f"server_error event: {event}")
    except ConnectionClosed:
        pass  # its code is read by the sender, which knows the last frame


async def fuzz_connection(url: str, encoding: Encoding, budget: Budget, stats: FuzzStats, seed: int,
                          stop: asyncio.Event) -> None:
    rng = random.Random(seed)
    protocols = [MSGPACK_SUBPROTOCOL] if encoding == "msgpack" else None
    while not stop.is_set() and budget.left:
        try:
            ws = await connect(url, protocols)
        except (OSError, TimeoutError, InvalidStatus, ConnectionClosed, BenchError) as e:
            stats.connect_failures[type(e).__name__] += 1
            stats.note(f"fuzz connect: {e!r}")
            if sum(stats.connect_failures.values()) > 50:
                raise BenchError("more than 50 fuzz connections failed to open") from e
            await asyncio.sleep(0.5)  # a backoff before trying again, not a wait for some state
            continue
        stats.reconnects += 1
        reader = asyncio.create_task(drain(ws, stats))
        last = "none"
        try:
            while not stop.is_set() and budget.take():
                frame = fuzz_frame(rng, encoding, MAX_FRAME_BYTES)
                try:
                    await asyncio.wait_for(ws.send(frame.data, text=frame.text), SEND_TIMEOUT_S)
                except (ConnectionClosed, TimeoutError) as e:
                    budget.give_back()
                    if isinstance(e, TimeoutError):
                        stats.note(f"a {frame.kind} frame was not taken within {SEND_TIMEOUT_S:.0f} s")
                    break
                stats.sent += 1
                stats.kinds[frame.kind] += 1
                last = frame.kind
                if frame.kind in CLOSING_KINDS:
                    # The server closes on this one: wait for it rather than pipeline frames it
                    # will never read (they would count as sent).
                    await asyncio.wait([reader], timeout=CLOSE_WAIT_S)
                    if not reader.done():
                        stats.note(f"no close within {CLOSE_WAIT_S:.0f} s after a {frame.kind} frame")
                    break
                if reader.done():
                    break
        finally:
            await ws.close()
            try:
                await asyncio.wait_for(reader, CLOSE_WAIT_S)
            except TimeoutError:
                ws.transport.abort()
                stats.note("a fuzz connection did not close in time")
            code = ws.close_code  # the server's when it closed first (1000 when we did), 1006 without a close frame
            stats.closes[str(code)] += 1
            stats.closes_after[f"{code} after {last}"] += 1
            if code == CRASH_CLOSE:
                stats.note(f"connection closed with 1011 after a {last} frame: {ws.close_reason!r}")


async def healthy_session(url: str, stats: FuzzStats, stop: asyncio.Event) -> None:
    """Turns in a loop on one session (a new one after a failure); each must complete with text."""
    while not stop.is_set():
        try:
            ws = await connect(url)
        except (OSError, TimeoutError, InvalidStatus, ConnectionClosed, BenchError) as e:
            stats.healthy_failures += 1
            stats.note(f"healthy session did not open: {e!r}")
            await asyncio.sleep(0.5)  # a backoff before trying again
            continue
        try:
            while not stop.is_set():
                await send(ws, out_of_band("Say hello to the fuzzers.", HEALTHY_TOKENS))
                deltas = 0
                while True:
                    event = await recv(ws, HEALTHY_EVENT_TIMEOUT_S)
                    if event["type"] == DELTA:
                        deltas += 1
                    elif event["type"] == DONE:
                        break
                    elif event["type"] == "error":
                        raise BenchError(f"error event: {event['error']}")
                status = event["response"]["status"]
                if status not in ("completed", "incomplete") or not deltas:
                    raise BenchError(f"healthy turn ended {status} after {deltas} deltas")
                stats.healthy_turns += 1
        except (TimeoutError, ConnectionClosed, BenchError) as e:
            stats.healthy_failures += 1
            stats.note(f"healthy session: {e!r}")
            ws.transport.abort()
            continue
        await ws.close()


def chat_body(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.3:
        return rng.randbytes(rng.choice((0, 1, 50, 2000)))
    if roll < 0.6:
        return json.dumps(random_value(rng, 5, surrogates=True)).encode()
    message = {"role": rng.choice(("user", "system", "assistant", "tool", 1)),
               "content": rng.choice(("hi", "", None, ["a"], {"x": 1}, "\ud800"))}
    body = {"model": rng.choice(("smollm2-135m-edge", "nope", None)), "messages": rng.choice(([message], [], None)),
            "max_tokens": rng.choice((1, 4, 0, -1, 10**30, "4", None)), "stream": rng.choice((True, False, "yes")),
            "temperature": rng.choice((0, 1, 3, None))}
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


async def probe_http(http: aiohttp.ClientSession, server: GatewayProcess, stats: FuzzStats, stop: asyncio.Event,
                     seed: int) -> None:
    """GET the read-only endpoints and POST a hostile chat completion, every PROBE_INTERVAL_S;
    notices the server's death first."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    while not stop.is_set():
        if server_dead(server):
            stats.server_deaths += 1
            stats.note(f"the gateway process died:\n{server.log_tail()}")
            stop.set()
            return
        requests = [("GET", server.url + path, None) for path in PROBE_PATHS]
        requests.append(("POST", server.url + "/v1/chat/completions", chat_body(rng)))
        for method, url, body in requests:
            label = f"{method} {url[len(server.url):]}"
            try:
                async with http.request(method, url, data=body, timeout=timeout,
                                        headers={"Content-Type": "application/json"} if body is not None else None
                                        ) as response:
                    await response.read()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as e:
                stats.http_failures += 1
                stats.note(f"{label}: {e!r}")
                continue
            stats.http[f"{label} {status}"] += 1
            if status >= 500:
                stats.http_5xx += 1
                stats.note(f"{label} answered {status}")
        await asyncio.sleep(PROBE_INTERVAL_S)  # the probing rate, not a wait for some state


async def report_progress(stats: FuzzStats, total: int, stop: asyncio.Event) -> None:
    step = max(1, total // 10)
    mark = step
    while not stop.is_set():
        await asyncio.sleep(1.0)
        if stats.sent >= mark:
            progress(f"fuzz: {stats.sent}/{total} frames, {stats.reconnects} connections, {stats.healthy_turns} "
                     f"healthy turns ({stats.healthy_failures} failed), closes {dict(stats.closes)}")
            mark = (stats.sent // step + 1) * step


async def run_fuzz(base: Path, tmp: Path, frames: int, connections: int, seed: int, *,
                   real: bool = False) -> dict[str, Any]:
    """``real``: the base config's own route and models (the shipped cascade over the real
    tiers: fuzzing while the healthy session's turns compute); else the synthetic edge alone."""
    changes: dict[str, dict[str, Any]] = {"server": {"max_frame_bytes": MAX_FRAME_BYTES}}
    if not real:
        changes |= {"routing": {"default": "edge"},
                    "edge": {"backend": "synthetic", "synthetic_tokens_per_s": TOKENS_PER_S}}
    name = "fuzz_real" if real else "fuzz"
    config = derive_config(base, tmp, name, changes)
    server = await start_gateway(config, tmp, name)
    stats = FuzzStats()
    stop = asyncio.Event()
    url = ws_url(server)
    try:
        async with aiohttp.ClientSession() as http:
            budget = Budget(frames)
            started = time.perf_counter()
            background = [asyncio.create_task(healthy_session(url, stats, stop)),
                          asyncio.create_task(probe_http(http, server, stats, stop, seed)),
                          asyncio.create_task(report_progress(stats, frames, stop))]
            try:
                async with asyncio.TaskGroup() as senders:  # one that fails stops the others
                    for c in range(connections):
                        senders.create_task(fuzz_connection(url, "msgpack" if c % 2 else "json", budget, stats,
                                                            seed * 1000 + c, stop))
            finally:
                stop.set()
                await asyncio.wait(background, timeout=HEALTHY_EVENT_TIMEOUT_S + PROBE_TIMEOUT_S)
                for task in background:
                    task.cancel()
                await asyncio.gather(*background, return_exceptions=True)
            wall_s = time.perf_counter() - started
            if server_dead(server):
                stats.server_deaths = max(stats.server_deaths, 1)
                after, settle_s, settled = {}, 0.0, False
            else:
                after, settle_s, settled = await wait_quiet(http, server)
    finally:
        exit_code = server.stop()
        problems = server.log_problems()
    crashes = stats.server_deaths + stats.healthy_failures + stats.closes.get(str(CRASH_CLOSE), 0) + stats.http_5xx
    return {
        "fuzz_cases": stats.sent, "fuzz_crashes": crashes,
        "crashes": {"server_deaths": stats.server_deaths, "healthy_failures": stats.healthy_failures,
                    "closes_1011": stats.closes.get(str(CRASH_CLOSE), 0), "http_5xx": stats.http_5xx},
        "server_error_events": stats.error_codes.get("server_error", 0),
        "frames_per_s": stats.sent / wall_s if wall_s else 0.0, "wall_s": wall_s, "connections": connections,
        "frames_by_kind": dict(stats.kinds.most_common()), "close_codes": dict(stats.closes),
        "close_codes_after": dict(stats.closes_after.most_common()),
        "connections_opened": stats.reconnects, "connect_failures": dict(stats.connect_failures),
        "server_events": dict(stats.events.most_common()), "error_codes": dict(stats.error_codes.most_common()),
        "healthy_turns": stats.healthy_turns, "http": dict(sorted(stats.http.items())),
        "http_failures": stats.http_failures, "samples": stats.samples,
        "settled": settled, "settle_s": settle_s, "kv_held_after": kv_held(after),
        "edge_running_after": sample(after, "engine_running_requests", tier="edge"),
        "sessions_active_after": sample(after, "gateway_sessions_active"),
        "server_errors_metric": samples_of(after, "gateway_errors_total"),
        "server_exit_code": exit_code, "server_log_warnings_and_errors": problems[:50],
        "server_log_problem_lines": len(problems), "config_changes": changes,
    }
