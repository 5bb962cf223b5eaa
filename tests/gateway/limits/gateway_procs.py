"""Real ``python -m gateway serve`` processes sharing one Redis, for the tests of limits across
gateways and of ``server.workers``: the synthetic edge tier (real tokens, no model arithmetic:
these tests are about limits and processes, not models), one API key, and small clients that
say whether a request or a session was admitted."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client_sdk"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gateway_harness import recv_json, send, user_item
from gateway_process import GatewayProcess, write_config

KEY = "sk-limits-procs-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "smollm2-135m-edge"
EVENT_TIMEOUT_S = 60.0  # generous: a busy 2-core machine; only a broken gateway waits this long
# Everything a test does not itself limit is far out of reach.
OPEN_LIMITS = {"requests_per_minute": 100_000, "tokens_per_minute": 100_000_000, "max_sessions_per_key": 1000,
               "max_concurrent_requests_per_key": 1000}


def gateway_config(directory: Path, name: str, *, redis_url: str, prefix: str, tokens_per_s: float = 200.0,
                   limits: dict[str, Any] | None = None, routing: str = "edge",
                   tables: dict[str, dict[str, Any]] | None = None, **server: Any) -> Path:
    """The shipped config on the synthetic edge tier, its limits in Redis under ``prefix``;
    ``server`` sets [server] keys (the limits' numbers, ``workers``), ``tables`` others."""
    return write_config(directory, api_keys=(KEY,), name=f"{name}.toml", routing=routing,
                        server={**OPEN_LIMITS, **server}, tables={
        "edge": {"backend": "synthetic", "synthetic_tokens_per_s": tokens_per_s},
        "limits": {"backend": "redis", "url": redis_url, "key_prefix": prefix, **(limits or {})}, **(tables or {})})


class Gateway(GatewayProcess):
    """A started gateway (``async with``), with its process id and SIGKILL."""

    def __init__(self, config: Path) -> None:
        super().__init__(config, config.with_suffix(".log"))

    async def __aenter__(self) -> Gateway:
        await asyncio.to_thread(self.start)  # returns once /readyz answers 200 (bounded)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def kill(self) -> None:
        """SIGKILL: no drain, no release of anything it holds."""
        self.signal(signal.SIGKILL)

    def signal(self, sig: int) -> None:
        assert self._proc is not None, "not started"
        self._proc.send_signal(sig)

    async def wait_exit(self, timeout: float = 120.0) -> int:
        assert self._proc is not None, "not started"
        return await asyncio.to_thread(self._proc.wait, timeout)

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.pid).children()


async def chat(url: str, model: str = MODEL) -> int:
    """One chat completion of one token, on a connection of its own (with several workers the
    kernel picks one per connection): its HTTP status (200 admitted, 429 refused)."""
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=EVENT_TIMEOUT_S)) as http, \
            http.post(f"{url}/v1/chat/completions", json=body, headers=AUTH) as response:
        await response.read()
        return response.status


async def open_session(gateway: GatewayProcess) -> websockets.ClientConnection | int:
    """A Realtime session past ``session.created``, or the handshake's HTTP status if refused."""
    try:
        ws = await websockets.connect(f"{gateway.ws_url}?model={MODEL}", additional_headers=AUTH,
                                      open_timeout=EVENT_TIMEOUT_S)
    except websockets.InvalidStatus as e:
        return e.response.status_code
    assert (await recv_json(ws, EVENT_TIMEOUT_S))["type"] == "session.created"
    return ws


async def start_response(ws: websockets.ClientConnection, max_tokens: int = 1000) -> str | None:
    """Ask for a response: None once its first delta arrived (admitted and streaming), else the
    code it was refused with."""
    await send(ws, user_item("hello"))
    await send(ws, {"type": "response.create", "response": {"max_output_tokens": max_tokens}})
    while True:
        event = await recv_json(ws, EVENT_TIMEOUT_S)
        if event["type"] == "response.output_text.delta":
            return None
        if event["type"] == "error":
            return str(event["error"]["code"])
        if event["type"] == "response.done" and event["response"]["status"] == "failed":
            return str(event["response"]["status_details"]["error"]["code"])


async def finish_response(ws: websockets.ClientConnection) -> dict[str, Any]:
    """Read up to the response's ``response.done``; its response."""
    while True:
        event = await recv_json(ws, EVENT_TIMEOUT_S)
        if event["type"] == "response.done":
            return event["response"]


async def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``/metrics`` as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=EVENT_TIMEOUT_S)) as http, \
            http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status == 200
        text = await response.text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def by_worker(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
              **labels: str) -> dict[str, float]:
    """The samples of ``name`` matching ``labels``, summed per ``worker`` label."""
    out: dict[str, float] = {}
    for (sample, sample_labels), value in samples.items():
        found = dict(sample_labels)
        if sample == name and all(found.get(k) == v for k, v in labels.items()):
            out[found.get("worker", "")] = out.get(found.get("worker", ""), 0.0) + value
    return out
