"""Arm ``core_kill`` of bench/faults.py: SIGKILL the torch engine's core process under load.

A gateway serving the torch tier alone (``[routing] default = "gpu"``, speculation off) gets
``streams`` concurrent out-of-band responses of ``MAX_TOKENS`` tokens (``x_ignore_eos``: none
ends before the kill, whatever the model would answer). Once every one has
streamed its first delta, the core process (the gateway's child whose command line holds
``engine_gpu.core_process``) is killed. Measured from the kill: each stream's ``response.done``
(it must come, status ``failed``, goal under a second; one that does not come within
``END_TIMEOUT_S`` is a hang), ``/readyz`` answering 200 again (the supervisor has started a new
core), and a new turn completing on it (``core_restore_s``).
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench._common import progress
from bench._faults_ws import (
    DELTA,
    DONE,
    complete_turn,
    connect,
    derive_config,
    http_get,
    out_of_band,
    read_metrics,
    recv,
    sample,
    send,
    start_gateway,
    ws_url,
)
from bench._gateway_clients import BenchError, prompts
from bench._gateway_server import GatewayProcess

MAX_TOKENS = 400
STREAM_START_TIMEOUT_S = 300.0  # every stream's first delta: prefills queue on a busy 2-core machine
END_TIMEOUT_S = 60.0  # a stream with no response.done this long after the kill hangs
RESTORE_TIMEOUT_S = 300.0  # a new core loads torch and the model
READY_POLL_S = 0.05
CORE_MARKER = "engine_gpu.core_process"


@dataclass
class Stream:
    index: int
    first_delta: asyncio.Event = field(default_factory=asyncio.Event)
    deltas: int = 0
    done_at: float | None = None  # time.perf_counter() when response.done was read
    status: str = ""
    details: Any = None
    failure: str = ""  # the connection broke or the reader timed out instead


def find_core(server: GatewayProcess) -> psutil.Process:
    for child in server.process.children(recursive=True):
        try:
            if any(CORE_MARKER in part for part in child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise BenchError(f"no child of the gateway runs {CORE_MARKER}")


async def read_stream(ws: ClientConnection, stream: Stream, timeout: float) -> None:
    try:
        while True:
            event = await recv(ws, timeout)
            if event["type"] == DELTA:
                stream.deltas += 1
                stream.first_delta.set()
            elif event["type"] == DONE:
                stream.done_at = time.perf_counter()
                stream.status = event["response"]["status"]
                stream.details = event["response"].get("status_details")
                return
    except (TimeoutError, ConnectionClosed, BenchError) as e:
        stream.failure = repr(e)
    finally:
        stream.first_delta.set()  # a stream that ended early does not hold up the kill


async def wait_ready_again(http: aiohttp.ClientSession, server: GatewayProcess, deadline: float) -> None:
    while time.perf_counter() < deadline:
        try:
            status, _ = await http_get(http, server.url + "/readyz")
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        if status == 200:
            return
        await asyncio.sleep(READY_POLL_S)  # polling /readyz: the supervisor's restart is not observable otherwise
    raise BenchError(f"/readyz was not 200 within {RESTORE_TIMEOUT_S:.0f} s of the kill:\n{server.log_tail()}")


async def turn_after_restart(url: str, deadline: float) -> tuple[dict[str, Any], int]:
    """A turn that completes on the new core; refusals while it settles are retried.
    Returns its response.done and the number of tries that failed first."""
    failed = 0
    while True:
        try:
            done = await complete_turn(url, "Say something after the restart.", 8,
                                       max(1.0, deadline - time.perf_counter()))
            return done, failed
        except (BenchError, InvalidStatus, ConnectionClosed, OSError, TimeoutError) as e:
            failed += 1
            if time.perf_counter() >= deadline:
                raise BenchError(f"no turn completed within {RESTORE_TIMEOUT_S:.0f} s of the kill: {e!r}") from e
            await asyncio.sleep(READY_POLL_S)  # a short backoff before the next try


async def run_core_kill(base: Path, tmp: Path, streams: int) -> dict[str, Any]:
    changes = {"routing": {"default": "gpu"}, "engine.speculative": {"method": "off"}}
    config = derive_config(base, tmp, "core_kill", changes)
    server = await start_gateway(config, tmp, "core_kill")
    sockets: list[ClientConnection] = []
    try:
        async with aiohttp.ClientSession() as http:
            url = ws_url(server)
            await complete_turn(url, "Hello, who are you?", 8, STREAM_START_TIMEOUT_S)  # warm-up
            old_core = find_core(server)
            state = [Stream(i) for i in range(streams)]
            for prompt in prompts(streams):
                ws = await connect(url)
                sockets.append(ws)
                # ignoring the end-of-sequence token: every stream is still running at the kill
                await send(ws, out_of_band(prompt, MAX_TOKENS, ignore_eos=True))
            readers = [asyncio.create_task(read_stream(ws, s, STREAM_START_TIMEOUT_S + END_TIMEOUT_S))
                       for ws, s in zip(sockets, state, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(s.first_delta.wait() for s in state)), STREAM_START_TIMEOUT_S)
            streaming = sum(1 for s in state if s.done_at is None and not s.failure)
            progress(f"core_kill: {streaming}/{streams} streams running ({sum(s.deltas for s in state)} deltas); "
                     f"SIGKILL to the engine core (pid {old_core.pid})")
            killed_at = time.perf_counter()
            old_core.send_signal(signal.SIGKILL)
            _, pending = await asyncio.wait(readers, timeout=END_TIMEOUT_S)
            for task in pending:
                task.cancel()
            ends = [s.done_at - killed_at for s in state if s.done_at is not None and s.done_at >= killed_at]
            hangs = sum(1 for s in state if s.done_at is None)
            progress(f"core_kill: {len(ends)} streams ended after the kill, the last after "
                     f"{max(ends, default=float('nan')):.3f} s; {hangs} hung")
            deadline = killed_at + RESTORE_TIMEOUT_S
            await wait_ready_again(http, server, deadline)
            ready_s = time.perf_counter() - killed_at
            done, retries = await turn_after_restart(url, deadline)
            restore_s = time.perf_counter() - killed_at
            new_core = find_core(server)
            progress(f"core_kill: /readyz 200 after {ready_s:.1f} s, a new turn completed after {restore_s:.1f} s")
            after = await read_metrics(http, server)
    finally:
        for ws in sockets:
            ws.transport.abort()
        exit_code = server.stop()
        problems = server.log_problems()
    statuses: dict[str, int] = {}
    for s in state:
        key = s.status or ("hang" if s.done_at is None else "?")
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "core_kill_max_end_s": max(ends) if ends and not hangs else None,
        "core_restore_s": restore_s, "readyz_s": ready_s, "turn_retries_after_restart": retries,
        "streams": streams, "streaming_at_kill": streaming, "ended_after_kill": len(ends), "hangs": hangs,
        "end_s": sorted(ends), "statuses": statuses,
        "all_failed": all(s.status == "failed" for s in state),
        "stream_details": [{"deltas": s.deltas, "status": s.status, "details": s.details, "failure": s.failure,
                            "end_s": None if s.done_at is None else s.done_at - killed_at} for s in state],
        "old_core_pid": old_core.pid, "new_core_pid": new_core.pid,
        "turn_after_restart_tokens": done["response"].get("usage", {}).get("output_tokens"),
        "gpu_restarts_metric": sample(after, "engine_restarts", tier="gpu"),
        "gpu_kv_blocks_in_use_after": sample(after, "engine_kv_blocks_in_use", tier="gpu"),
        "server_exit_code": exit_code, "server_log_warnings_and_errors": problems[:50],
        "config_changes": changes,
    }
