"""Two arms of bench/load.py: the floor (a server that only writes frames, what the machine allows) and slow readers (clients that stop reading, and what the gateway does about them)."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import uvloop
import websockets

from bench._common import (
    free_port,
    percentile,
    progress,
)
from bench._gateway_server import GatewayProcess
from bench._load_setup import TOKENS_PER_S, synthetic_config

FLOOR_FRAME = 190  # bytes of a delta's JSON as the gateway sends it


def _bare_writer(port: int, n: int, steps: int, ready: Any, report: Any) -> None:
    """A server that does nothing but write: one unmasked text frame to each of ``n`` connections
    every 50 ms, from one step loop (what the synthetic engine's step asks of the gateway)."""

    async def main() -> None:
        transports: list[asyncio.Transport] = []

        class Sink(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                transports.append(transport)  # type: ignore[arg-type]

        loop = asyncio.get_running_loop()
        server = await loop.create_server(Sink, "127.0.0.1", port, backlog=4096)
        ready.set()
        while len(transports) < n:
            await asyncio.sleep(0.01)
        frame = bytes((0x81, 126)) + FLOOR_FRAME.to_bytes(2, "big") + b"x" * FLOOR_FRAME
        start, cpu = time.perf_counter(), time.process_time()
        for step in range(steps):
            for transport in transports:
                transport.write(frame)
            await asyncio.sleep(max(0.0, start + (step + 1) / TOKENS_PER_S - time.perf_counter()))
        report.put((time.process_time() - cpu) / (time.perf_counter() - start))
        await asyncio.sleep(1.0)
        server.close()

    uvloop.run(main())


async def arm_floor(n: int, seconds: float = 5.0) -> dict[str, Any]:
    """What ``n`` streams cost on this machine before any gateway code: a bare uvloop process
    writing ``n`` frames per 50 ms step, and this process receiving them (raw reads, one timestamp
    per read, no parsing). The gateway's per-delta work comes on top of this."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    ready, report = context.Event(), context.Queue()
    port = free_port("127.0.0.1")
    steps = int(seconds * TOKENS_PER_S)
    writer = context.Process(target=_bare_writer, args=(port, n, steps, ready, report), daemon=True)
    writer.start()
    try:
        await asyncio.to_thread(ready.wait, 30)
        stamps: list[list[float]] = []

        class Reader(asyncio.Protocol):
            def __init__(self) -> None:
                self.times: list[float] = []
                stamps.append(self.times)

            def data_received(self, data: bytes) -> None:
                self.times.append(time.perf_counter())

        loop = asyncio.get_running_loop()
        transports = [(await loop.create_connection(Reader, "127.0.0.1", port))[0] for _ in range(n)]
        me = psutil.Process()
        before, wall = me.cpu_times(), time.perf_counter()
        server_cores = await asyncio.to_thread(report.get, True, seconds + 60)
        after, wall = me.cpu_times(), time.perf_counter() - wall
        gaps = [b - a for times in stamps for a, b in itertools.pairwise(times)]
        for transport in transports:
            transport.close()
        result = {"streams": n, "writer_cores": server_cores,
                  "reader_cores": (after.user + after.system - before.user - before.system) / wall,
                  "gap_p99_ms": percentile(gaps, 99) * 1e3,
                  "writer_us_per_frame": server_cores / (n * TOKENS_PER_S) * 1e6}
        progress(f"floor at {n} streams: a bare writer {result['writer_cores']:.2f} cores "
                 f"({result['writer_us_per_frame']:.0f} µs a frame), a bare reader {result['reader_cores']:.2f} cores, "
                 f"gap p99 {result['gap_p99_ms']:.0f} ms")
        return result
    finally:
        writer.join(10)
        if writer.is_alive():
            writer.kill()


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
