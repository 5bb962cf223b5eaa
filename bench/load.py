"""How much one gateway process carries, and how it behaves past that (issue 14).

Every arm runs a ``python -m gateway serve`` subprocess with the synthetic edge backend
(``[edge] backend = "synthetic"``: real tokens from the embedded model's tokenizer at 20 tokens/s
per stream, one step loop for all streams, no model arithmetic), so the figures are the
gateway's own. The clients are raw ``websockets`` sessions in this process, on the same 2 cores:
what a stream costs the client side is part of what is measured (the report gives both
processes' CPU).

- ``streams``: sessions are added in steps (50, 100, 200, 300, 400, 500, 1000, 1500, 2000, 3000); at each step
  every session streams one response of 60 tokens at once; the gaps between a session's
  consecutive deltas are its inter-token latencies (nominal 50 ms). ``max_streams_itl_p99_under_100ms``
  is the largest step whose ITL p99 stayed under 100 ms.
- ``overload``: the engine admits 100 streams (``synthetic_max_streams``). Baseline: 100 sessions
  start a response at once (TTFT p99). Overload: 1,000 sessions (10x) at once: the excess must be
  refused fast with a clear error (``response.done`` failed, code ``overloaded``;
  ``overload_reject_p99_ms`` from ``response.create`` sent to that), and the admitted ones' TTFT
  p99 over the baseline's is ``overload_accepted_ttft_p99_ratio`` (goal under 2).
- ``slow_readers``: 100 sessions that stop reading: each creates a 100 KB item, then floods
  ``conversation.item.retrieve`` and starts a long response, with a 4 KB receive buffer.
  ``slow_reader_rss_mib`` is the server's RSS growth at its peak over 20 s (every session's queue is
  bounded in bytes; the server closes the ones that stay behind after ``slow_client_timeout_s``).

Progress on stderr; a summary and, as the last line, one JSON object with
``max_streams_itl_p99_under_100ms``, ``overload_reject_p99_ms``, ``overload_accepted_ttft_p99_ratio``,
``slow_reader_rss_mib`` and ``cpu``. Everything goes to bench/out/load.json.

Run: ``.venv/bin/python bench/load.py`` (about 6 minutes on a 2-core machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder leads sys.path and bench/gateway.py would shadow the `gateway` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import tomllib  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402
import uvloop  # noqa: E402
import websockets  # noqa: E402

from bench._common import (  # noqa: E402
    OUT_DIR,
    REPO_ROOT,
    cpu_facts,
    dump_toml,
    percentile,
    progress,
    raise_nofile_limit,
    write_json,
)
from bench._gateway_server import GatewayProcess  # noqa: E402

STEPS = (50, 100, 200, 300, 400, 500, 1000, 1500, 2000, 3000)
TOKENS_PER_S = 20.0
STREAM_TOKENS = 60
ITL_GOAL_S = 0.100
EVENT_TIMEOUT_S = 60.0


def synthetic_config(directory: Path, name: str, *, max_streams: int, rate: float = TOKENS_PER_S,
                     slow_client_timeout_s: float = 30.0) -> Path:
    raw = tomllib.loads((REPO_ROOT / "configs" / "default.toml").read_text(encoding="utf-8"))
    raw["routing"]["default"] = "edge"
    raw["edge"].update(backend="synthetic", synthetic_tokens_per_s=rate, synthetic_max_streams=max_streams)
    raw["server"].update(
        max_sessions_per_key=20_000, max_sessions=20_000, requests_per_minute=10_000_000,
        tokens_per_minute=1_000_000_000, max_concurrent_requests_per_key=20_000, idle_timeout_s=3600.0,
        slow_client_timeout_s=slow_client_timeout_s, api_keys=[], api_keys_env="")
    path = directory / f"{name}.toml"
    path.write_text(dump_toml(raw), encoding="utf-8")
    return path


@dataclass
class Stream:
    """One response as a client saw it."""

    sent: float = 0.0
    first: float | None = None
    deltas: list[float] = field(default_factory=list)
    status: str = ""
    code: str | None = None
    done: float | None = None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.deltas, self.deltas[1:], strict=False)]


async def open_sessions(url: str, n: int) -> list[Any]:
    sessions = []
    for start in range(0, n, 100):  # in waves: a burst of thousands of handshakes is not the load measured here
        batch = await asyncio.gather(*(websockets.connect(url, max_size=None, open_timeout=EVENT_TIMEOUT_S,
                                                          ping_interval=None)
                                       for _ in range(min(100, n - start))))
        for ws in batch:
            await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S)  # session.created
        sessions += batch
    return sessions


async def stream_once(ws: Any, max_tokens: int) -> Stream:
    result = Stream()
    await ws.send(json.dumps({"type": "response.create", "response": {
        "conversation": "none", "max_output_tokens": max_tokens,
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}]}}))
    result.sent = time.perf_counter()
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S))
        now = time.perf_counter()
        if event["type"] == "response.output_text.delta":
            result.first = result.first or now
            result.deltas.append(now)
        elif event["type"] == "response.done":
            result.done = now
            response = event["response"]
            result.status = response["status"]
            error = (response.get("status_details") or {}).get("error") or {}
            result.code = error.get("code")
            return result


async def close_all(sessions: list[Any]) -> None:
    await asyncio.gather(*(ws.close() for ws in sessions), return_exceptions=True)


class CpuWatch:
    def __init__(self, server: GatewayProcess) -> None:
        self.server = server
        self.me = psutil.Process()

    def read(self) -> tuple[float, float, float]:
        mine = self.me.cpu_times()
        return time.perf_counter(), self.server.cpu_s(), mine.user + mine.system

    @staticmethod
    def share(before: tuple[float, float, float], after: tuple[float, float, float]) -> dict[str, float]:
        wall = after[0] - before[0]
        return {"server_cores": (after[1] - before[1]) / wall, "clients_cores": (after[2] - before[2]) / wall}


async def arm_streams(directory: Path, steps: tuple[int, ...]) -> dict[str, Any]:
    server = GatewayProcess(synthetic_config(directory, "streams", max_streams=20_000), directory / "streams.log",
                            "127.0.0.1")
    server.start()
    levels = []
    sessions: list[Any] = []
    try:
        await server.wait_ready()
        url = f"ws://127.0.0.1:{server.port}/v1/realtime"
        watch = CpuWatch(server)
        for n in steps:
            sessions += await open_sessions(url, n - len(sessions))
            before = watch.read()
            streams = await asyncio.gather(*(stream_once(ws, STREAM_TOKENS) for ws in sessions))
            cpu = CpuWatch.share(before, watch.read())
            gaps = [g for s in streams for g in s.gaps]
            ttfts = [s.first - s.sent for s in streams if s.first is not None]
            level = {"streams": n, "itl_p50_ms": percentile(gaps, 50) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3,
                     "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
                     "completed": sum(s.status in ("completed", "incomplete") for s in streams),
                     "rss_mib": server.rss() / 2**20, **cpu}
            levels.append(level)
            progress(f"streams {n:5d}: ITL p50 {level['itl_p50_ms']:.0f} ms, p99 {level['itl_p99_ms']:.0f} ms, "
                     f"TTFT p99 {level['ttft_p99_ms']:.0f} ms, server {cpu['server_cores']:.2f} cores, "
                     f"clients {cpu['clients_cores']:.2f} cores, RSS {level['rss_mib']:.0f} MiB")
            if level["itl_p99_ms"] >= ITL_GOAL_S * 1e3 * 3:
                break  # far past the goal: the next step only measures a saturated machine
    finally:
        await close_all(sessions)
        server.stop()
    passing = [lv["streams"] for lv in levels if lv["itl_p99_ms"] < ITL_GOAL_S * 1e3 and lv["completed"] == lv["streams"]]
    return {"levels": levels, "max_streams_itl_p99_under_100ms": max(passing, default=0)}


async def arm_overload(directory: Path, capacity: int) -> dict[str, Any]:
    server = GatewayProcess(synthetic_config(directory, "overload", max_streams=capacity), directory / "overload.log",
                            "127.0.0.1")
    server.start()
    sessions: list[Any] = []
    try:
        await server.wait_ready()
        url = f"ws://127.0.0.1:{server.port}/v1/realtime"
        sessions = await open_sessions(url, capacity * 10)
        baseline = await asyncio.gather(*(stream_once(ws, 20) for ws in sessions[:capacity]))
        base_ttft = [s.first - s.sent for s in baseline if s.first is not None]
        progress(f"overload baseline: {capacity} streams, TTFT p99 {percentile(base_ttft, 99) * 1e3:.0f} ms")
        burst = await asyncio.gather(*(stream_once(ws, 20) for ws in sessions))
        accepted = [s for s in burst if s.status in ("completed", "incomplete")]
        refused = [s for s in burst if s.status == "failed"]
        reject_ms = [(s.done - s.sent) * 1e3 for s in refused if s.done is not None]
        accepted_ttft = [s.first - s.sent for s in accepted if s.first is not None]
        codes = sorted({str(s.code) for s in refused})
        result = {
            "capacity": capacity, "clients": len(sessions), "accepted": len(accepted), "refused": len(refused),
            "refused_codes": codes, "baseline_ttft_p99_ms": percentile(base_ttft, 99) * 1e3,
            "accepted_ttft_p99_ms": percentile(accepted_ttft, 99) * 1e3,
            "overload_reject_p99_ms": percentile(reject_ms, 99),
            "overload_accepted_ttft_p99_ratio": percentile(accepted_ttft, 99) / percentile(base_ttft, 99),
        }
        progress(f"overload 10x: {len(accepted)} admitted, {len(refused)} refused ({codes}) with p99 "
                 f"{result['overload_reject_p99_ms']:.0f} ms; admitted TTFT p99 {result['accepted_ttft_p99_ms']:.0f} ms")
        return result
    finally:
        await close_all(sessions)
        server.stop()


async def slow_reader(url: str) -> Any:
    host, port = "127.0.0.1", int(url.split(":")[2].split("/")[0])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return await websockets.connect(url, sock=sock, max_queue=1, max_size=None, ping_interval=None)


async def arm_slow_readers(directory: Path, clients: int, seconds: float) -> dict[str, Any]:
    server = GatewayProcess(synthetic_config(directory, "slow", max_streams=20_000, rate=200.0,
                                             slow_client_timeout_s=seconds * 2), directory / "slow.log", "127.0.0.1")
    server.start()
    sessions: list[Any] = []
    try:
        await server.wait_ready()
        url = f"ws://127.0.0.1:{server.port}/v1/realtime"
        baseline = await server.settled_rss()
        sessions = [await slow_reader(url) for _ in range(clients)]
        big = "y" * 100_000
        retrieve = json.dumps({"type": "conversation.item.retrieve", "item_id": "big"})

        async def flood(ws: Any) -> int:
            sent = 0
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "id": "big", "type": "message", "role": "user", "content": [{"type": "input_text", "text": big}]}}))
            await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 4096}}))
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(ws.send(retrieve), 0.5)
                    sent += 1
                except TimeoutError:
                    await asyncio.sleep(0.5)  # our socket is full too: the server stopped reading us
                except websockets.ConnectionClosed:
                    break
            return sent

        peak = baseline
        flooding = asyncio.gather(*(flood(ws) for ws in sessions))
        while not flooding.done():
            peak = max(peak, server.rss())
            await asyncio.sleep(0.25)
        sent = sum(await flooding)
        growth = (peak - baseline) / 2**20
        progress(f"slow readers: {clients} clients sent {sent} retrieves of a 100 KB item without reading; "
                 f"server RSS {baseline / 2**20:.0f} MiB -> peak {peak / 2**20:.0f} MiB (+{growth:.0f} MiB)")
        return {"clients": clients, "seconds": seconds, "retrieves_sent": sent, "baseline_rss_mib": baseline / 2**20,
                "peak_rss_mib": peak / 2**20, "slow_reader_rss_mib": growth,
                "unbounded_would_be_mib": sent * len(big) / 2**20}
    finally:
        for ws in sessions:
            ws.transport.abort()
        server.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    raise_nofile_limit(4 * max(args.steps) + 1000)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        directory = Path(tmp)
        if "streams" in args.arms:
            result["streams"] = await arm_streams(directory, tuple(args.steps))
        if "overload" in args.arms:
            result["overload"] = await arm_overload(directory, args.capacity)
        if "slow_readers" in args.arms:
            result["slow_readers"] = await arm_slow_readers(directory, args.slow_clients, args.slow_seconds)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=["streams", "overload", "slow_readers"])
    parser.add_argument("--steps", nargs="+", type=int, default=list(STEPS))
    parser.add_argument("--capacity", type=int, default=100)
    parser.add_argument("--slow-clients", type=int, default=100)
    parser.add_argument("--slow-seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=OUT_DIR / "load.json")
    args = parser.parse_args(argv)
    result = uvloop.run(run(args))
    result["cpu"] = cpu_facts()
    write_json(args.out, result)
    streams, overload, slow = result.get("streams", {}), result.get("overload", {}), result.get("slow_readers", {})
    figures = {
        "max_streams_itl_p99_under_100ms": streams.get("max_streams_itl_p99_under_100ms"),
        "overload_reject_p99_ms": overload.get("overload_reject_p99_ms"),
        "overload_accepted_ttft_p99_ratio": overload.get("overload_accepted_ttft_p99_ratio"),
        "slow_reader_rss_mib": slow.get("slow_reader_rss_mib"),
    }
    for level in streams.get("levels", []):
        print(f"{level['streams']:5d} streams: ITL p99 {level['itl_p99_ms']:.0f} ms, server "
              f"{level['server_cores']:.2f} cores, clients {level['clients_cores']:.2f} cores")
    if overload:
        print(f"overload: {overload['refused']} of {overload['clients']} refused ({overload['refused_codes']}), "
              f"reject p99 {overload['overload_reject_p99_ms']:.0f} ms, admitted TTFT p99 ratio "
              f"{overload['overload_accepted_ttft_p99_ratio']:.2f}")
    if slow:
        print(f"slow readers: +{slow['slow_reader_rss_mib']:.0f} MiB at peak "
              f"({slow['unbounded_would_be_mib']:.0f} MiB of replies were asked for)")
    rounded = {k: None if v is None else round(v, 3) for k, v in figures.items()}
    print(json.dumps({**rounded, "cpu": result["cpu"]["model"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
