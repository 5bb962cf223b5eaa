"""Around a spawned engine core process: its ready line, stopping it, the private socket it leaves.

The client (``engine_gpu.client``) spawns a core with ``EngineClient.start``; these are the parts
that deal with the process rather than the socket.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

from engine_gpu.protocol import PRIVATE_SOCKET_PREFIX
from llm_shared import errors

log = logging.getLogger("engine_gpu.client")

SHUTDOWN_TIMEOUT_S = 10.0


async def ready_address(process: asyncio.subprocess.Process) -> str:
    """The address from the core's ready line, or the typed error it reported."""
    assert process.stdout is not None
    line = await process.stdout.readline()
    if not line:
        code = await process.wait()
        raise errors.EngineUnavailableError(f"the engine core exited with code {code} before it was ready (see its log)")
    try:
        report = json.loads(line)
    except json.JSONDecodeError as e:
        raise errors.EngineUnavailableError(f"the engine core wrote an unreadable ready line: {line[:200]!r}") from e
    if "address" in report:
        return str(report["address"])
    message = str(report.get("error", "unknown error"))
    if report.get("code") == errors.ModelFileError.code:
        raise errors.ModelFileError(message)
    if report.get("code") == "config_error":
        raise errors.ConfigError(message)
    raise errors.EngineUnavailableError(f"the engine core failed to start: {message}")


async def stop_process(process: asyncio.subprocess.Process) -> None:
    if process.stdin is not None and not process.stdin.is_closing():
        process.stdin.close()  # the core exits on its own when its stdin closes
    try:
        await asyncio.wait_for(process.wait(), SHUTDOWN_TIMEOUT_S)
    except TimeoutError:
        log.warning("engine core %d did not stop in %.0f s; killing it", process.pid, SHUTDOWN_TIMEOUT_S)
        process.kill()
        await process.wait()


def remove_private_socket_dir(address: str) -> None:
    """The temp dir of a core's private unix socket ('unix:/tmp/engine-core-*/core.sock')."""
    if not address.startswith("unix:"):
        return
    directory = Path(address[len("unix:"):]).parent
    if directory.name.startswith(PRIVATE_SOCKET_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)
