"""What the arms of bench/faults.py share: a gateway subprocess with a derived config, the
Prometheus text of ``/metrics`` read into numbers, and raw Realtime events over ``websockets``
with a timeout on every wait.

Clients speak raw events (JSON, or msgpack where negotiated), not through the openai SDK: the
benchmark aborts sockets, sends frames no SDK would, and reads close codes.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import websockets
from websockets.asyncio.client import ClientConnection

from bench._common import dump_toml, progress
from bench._gateway_clients import BenchError
from bench._gateway_server import GatewayProcess

HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 60.0  # handshake plus session.created, on a busy 2-core machine
HTTP_TIMEOUT_S = 10.0
DELTA = "response.output_text.delta"
DONE = "response.done"
SETTLE_TIMEOUT_S = 60.0  # for every session and engine request to end once the clients are done
SETTLE_POLL_S = 0.5

Metrics = dict[str, float]  # 'name{label="value",...}' (labels as the server wrote them) -> value


class Budget:
    """How many of something (turns, frames) the workers may still take, shared by them all."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.taken = 0

    @property
    def left(self) -> bool:
        return self.taken < self.total

    def take(self) -> bool:
        if self.taken >= self.total:
            return False
        self.taken += 1
        return True

    def give_back(self) -> None:
        self.taken -= 1


def derive_config(base: Path, directory: Path, name: str, changes: Mapping[str, Mapping[str, Any]]) -> Path:
    """A copy of ``base`` with every table in ``changes`` updated key by key (``"engine.speculative"``
    names a nested table), limits raised so that no bench client is ever refused, API keys off."""
    raw = tomllib.loads(base.read_text(encoding="utf-8"))
    server = raw.setdefault("server", {})
    server.update({"api_keys": [], "api_keys_env": "", "max_sessions_per_key": 10_000,
                   "requests_per_minute": 10_000_000, "tokens_per_minute": 1_000_000_000,
                   "max_concurrent_requests_per_key": 10_000})
    for dotted, table in changes.items():
        target = raw
        for part in dotted.split("."):
            target = target.setdefault(part, {})
        target.update(table)
    path = directory / f"{name}.toml"
    path.write_text(dump_toml(raw), encoding="utf-8")
    return path


async def start_gateway(config: Path, directory: Path, name: str) -> GatewayProcess:
    server = GatewayProcess(config, directory / f"{name}.log", HOST)
    started = time.perf_counter()
    server.start()
    try:
        await server.wait_ready()
    except BaseException:
        server.stop()
        raise
    progress(f"{name}: gateway ready on {server.url} after {time.perf_counter() - started:.1f} s")
    return server


def ws_url(server: GatewayProcess, model: str | None = None) -> str:
    url = server.url.replace("http", "ws", 1) + "/v1/realtime"
    return f"{url}?model={model}" if model else url


def parse_metrics(text: str) -> Metrics:
    out: Metrics = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue  # not a sample line
    return out


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def labels_of(key: str) -> dict[str, str]:
    """The labels of a series key or of its label text (``{tier="gpu"}``)."""
    return dict(_LABEL.findall(key.partition("{")[2] if not key.startswith("{") else key))


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """The value of ``name`` with exactly ``labels``; 0.0 when there is no such series (a
    counter never incremented)."""
    for key, value in metrics.items():
        if key.partition("{")[0] == name and labels_of(key) == labels:
            return value
    return 0.0


def samples_of(metrics: Metrics, name: str) -> dict[str, float]:
    """Every series of ``name``, by its label text (e.g. ``{tier="gpu"}``)."""
    return {key[len(name):]: value for key, value in metrics.items()
            if key.startswith(name + "{") or key == name}


async def http_get(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as response:
        return response.status, await response.read()


async def read_metrics(http: aiohttp.ClientSession, server: GatewayProcess) -> Metrics:
    status, body = await http_get(http, server.url + "/metrics")
    if status != 200:
        raise BenchError(f"/metrics answered {status}")
    return parse_metrics(body.decode())


async def served_models(http: aiohttp.ClientSession, server: GatewayProcess) -> list[str]:
    status, body = await http_get(http, server.url + "/v1/models")
    if status != 200:
        raise BenchError(f"/v1/models answered {status}")
    return sorted(card["id"] for card in json.loads(body)["data"])


async def connect(url: str, subprotocols: list[str] | None = None) -> ClientConnection:
    """A session, once ``session.created`` has been read."""
    async def opened() -> ClientConnection:
        ws = await websockets.connect(url, subprotocols=subprotocols, max_size=None, ping_interval=None,
                                      proxy=None, open_timeout=CONNECT_TIMEOUT_S, close_timeout=5)
        try:
            first = await recv(ws, CONNECT_TIMEOUT_S)
            if first["type"] != "session.created":
                raise BenchError(f"expected session.created, got {first['type']}")
        except BaseException:
            ws.transport.abort()
            raise
        return ws

    return await asyncio.wait_for(opened(), CONNECT_TIMEOUT_S)


async def recv(ws: ClientConnection, timeout: float) -> dict[str, Any]:
    """The next event (JSON text, or msgpack binary on a msgpack session); TimeoutError after
    ``timeout`` seconds."""
    data = await asyncio.wait_for(ws.recv(), timeout)
    event = msgpack.unpackb(data, raw=False) if isinstance(data, bytes) else json.loads(data)
    if not isinstance(event, dict) or "type" not in event:
        raise BenchError(f"the server sent something that is not an event: {str(data)[:120]}")
    return event


async def send(ws: ClientConnection, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


def user_item(text: str) -> dict[str, Any]:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


def out_of_band(text: str, max_tokens: int, *, ignore_eos: bool = False) -> dict[str, Any]:
    """A greedy response to one user message, outside the conversation (``conversation: "none"``);
    ``ignore_eos`` (our ``x_ignore_eos``): it runs to ``max_tokens`` whatever the model would answer."""
    return {"type": "response.create", "response": {
        "conversation": "none", "max_output_tokens": max_tokens, "temperature": 0, "x_ignore_eos": ignore_eos,
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]}}


async def complete_turn(url: str, text: str, max_tokens: int, timeout: float) -> dict[str, Any]:
    """One out-of-band turn in a new session, to its ``response.done`` (returned); raises
    BenchError unless it completed with some text."""
    ws = await connect(url)
    try:
        await send(ws, out_of_band(text, max_tokens))
        deltas = 0
        deadline = time.monotonic() + timeout
        while True:
            event = await recv(ws, max(0.01, deadline - time.monotonic()))
            if event["type"] == DELTA:
                deltas += 1
            elif event["type"] == DONE:
                status = event["response"]["status"]
                if status not in ("completed", "incomplete") or not deltas:
                    raise BenchError(f"turn ended {status} after {deltas} deltas: "
                                     f"{event['response'].get('status_details')}")
                return event
            elif event["type"] == "error":
                raise BenchError(f"error event: {event['error']}")
    finally:
        await ws.close()


def kv_held(m: Metrics) -> dict[str, float]:
    """KV the tiers hold: the torch tier's blocks in use, the edge's cells of running work
    (``kv_cells_used``, exported as ``engine_kv_blocks_in_use{tier="edge"}``) and of finished
    turns kept for their sessions' next turn (``kv_cells_cached``), the drafter's cells."""
    return {
        "gpu_kv_blocks_in_use": sample(m, "engine_kv_blocks_in_use", tier="gpu"),
        "edge_kv_cells_used": sample(m, "engine_kv_blocks_in_use", tier="edge"),
        "edge_kv_cells_cached": sample(m, "engine_kv_cells_cached", tier="edge"),
        "gpu_drafter_kv_cells_used": sample(m, "engine_drafter_kv_cells_used", tier="gpu"),
    }


async def wait_quiet(http: aiohttp.ClientSession, server: GatewayProcess,
                     timeout: float = SETTLE_TIMEOUT_S) -> tuple[Metrics, float, bool]:
    """Poll /metrics until no session is open, no engine request runs or waits and no KV is
    held, or ``timeout`` passes: (the last metrics, seconds waited, whether it got quiet)."""
    started = time.monotonic()
    while True:
        m = await read_metrics(http, server)
        busy = (sample(m, "gateway_sessions_active") + sum(samples_of(m, "engine_running_requests").values())
                + sum(samples_of(m, "engine_waiting_requests").values()) + sum(kv_held(m).values()))
        if busy == 0:
            return m, time.monotonic() - started, True
        if time.monotonic() - started > timeout:
            return m, time.monotonic() - started, False
        await asyncio.sleep(SETTLE_POLL_S)  # the server's teardown is not observable otherwise
