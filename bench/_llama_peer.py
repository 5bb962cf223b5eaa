"""llama-cpp-python's own OpenAI server as a peer to measure the edge tier against.

``python -m llama_cpp.server`` on the same GGUF, with ``--interrupt_requests False`` (else every
new request interrupts the running one) and its default threads (half the cores). Its extra
dependencies (uvicorn, fastapi, sse-starlette, starlette-context, pydantic-settings) are not part
of the gateway: ``.venv/bin/pip install -e '.[bench-peer]'`` (``make bench`` does it).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from bench._common import BenchError, free_port

READY_TIMEOUT_S = 180.0
PEER_MODULES = ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")


def peer_missing() -> list[str]:
    """The peer server's modules this environment lacks (empty: it can run)."""
    return [name for name in PEER_MODULES if importlib.util.find_spec(name) is None]


class LlamaCppServer:
    """``python -m llama_cpp.server`` on ``model`` at a free loopback port."""

    def __init__(self, model: Path, log_path: Path, *, n_ctx: int = 4096) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
                      "--port", str(self.port), "--interrupt_requests", "False", "--n_ctx", str(n_ctx)]
        self._log_path = log_path
        self._log: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    async def __aenter__(self) -> LlamaCppServer:
        self._log = self._log_path.open("wb")
        self._proc = subprocess.Popen(self._args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BenchError(f"llama_cpp.server exited with {self._proc.returncode}; see {self._log_path}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            await asyncio.sleep(0.25)
        await self.__aexit__()
        raise BenchError(f"llama_cpp.server was not ready within {READY_TIMEOUT_S:.0f} s")

    async def __aexit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
