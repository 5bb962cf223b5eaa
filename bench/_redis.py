"""A ``redis-server`` for the limits benchmark and tests (tests/gateway/limits): its own process on a free loopback port, no
persistence, which the benchmark may pause (every call then hangs) or stop, and start again on
the same port (a gateway's URL stays valid)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from bench._common import BenchError, free_port

START_TIMEOUT_S = 60.0


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise BenchError("redis-server is not installed (Debian: apt-get install redis-server; `make test` installs it)")
    return found


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class Redis:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--logfile", str(self.workdir / f"redis-{self.port}.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                log = self.workdir / f"redis-{self.port}.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                self.stop()
                raise BenchError(f"redis-server on port {self.port} did not answer PING:\n{tail}")
            time.sleep(0.02)

    def restart(self) -> None:
        """Stopped and started again on the same port (its data gone: no persistence)."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers, the worst way for a store to fail."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
