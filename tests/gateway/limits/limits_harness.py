"""Helpers for the limits tests: a real ``redis-server`` on a free loopback port, a clock the
in-process store can be given, and a bounded poll."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
START_TIMEOUT_S = 60.0  # a loaded 2-core machine may take a while to start a process


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def eventually(check: Callable[[], Awaitable[bool]], *, within_s: float = 60.0, every_s: float = 0.05) -> None:
    """Poll ``check`` until it is true; fail after ``within_s`` (generous: only a broken store waits that long)."""
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within_s} s")
        await asyncio.sleep(every_s)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process without persistence, in its own directory; ``stop`` and
    ``start`` again keep the port (a gateway's URL stays valid across the restart)."""

    def __init__(self, workdir: Path) -> None:
        assert REDIS_SERVER is not None
        self.workdir = workdir
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self._proc is None
        log = self.workdir / "redis.log"
        self._proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--logfile", str(log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers_ping(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING:\n{tail}")
            time.sleep(0.02)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """The server stops answering but keeps its connections: every call hangs until ``resume``."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)
