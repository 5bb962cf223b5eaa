"""The gateway under test for bench/gateway_overhead.py: a ``python -m gateway serve`` subprocess with a
config derived from a base one, observed from outside (RSS and CPU with psutil, /metrics).

A separate process, so that its memory is measured alone and the benchmark's clients do not
share its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

import psutil

from bench._common import REPO_ROOT, BenchError, dump_toml, free_port, median

# KV memory per sequence: ~540 cells of the embedded model, where a prompt of ~40 tokens plus
# up to 256 generated fit with room to spare.
KV_MIB_PER_SEQUENCE = 12
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
RSS_SETTLE_S = 1.0
RSS_SAMPLES = 5
LOG_MARKERS = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback", "too slow")
_WORKER_LABEL = re.compile(r',?worker="\d+"')  # gateway/process/worker_metrics.py's label on every series


def derive_config(base: Path, directory: Path, clients: int, idle_sessions: int) -> Path:
    """Write a copy of ``base`` sized for the benchmark and return its path.

    Only the edge tier is served (its own model id, ``routing.edge_model``); it batches
    ``clients`` sequences so every throughput client is served at once; session and rate limits are raised so that no client is refused (the limiter still
    runs on every request, it just never says no).
    """
    raw = tomllib.loads(base.read_text(encoding="utf-8"))
    # The edge tier alone: what the in-process arm serves too. The default route, the cascade,
    # would also start the torch tier's engine core on the same two cores.
    raw.setdefault("routing", {})["default"] = "edge"
    edge = raw.setdefault("edge", {})
    edge["n_seq_max"] = clients
    edge["kv_cache_mib"] = (clients + 1) * KV_MIB_PER_SEQUENCE  # every sequence, plus the drafter
    # Every round sends the same prompts: with the edge tier's prefix reuse the in-process arm
    # (no session, its KV kept) would skip prefills that the WebSocket arms (whose closed
    # sessions release theirs) pay again. This bench measures the gateway, so reuse is off in
    # every arm; bench/conversation.py measures reuse.
    edge["prefix_reuse"] = False
    server = raw.setdefault("server", {})
    server["max_sessions_per_key"] = idle_sessions + 4 * clients + 64  # all bench clients share one key
    server["requests_per_minute"] = 1_000_000
    server["tokens_per_minute"] = 100_000_000
    path = directory / "gateway-bench.toml"
    path.write_text(dump_toml(raw), encoding="utf-8")
    return path


class GatewayProcess:
    def __init__(self, config_path: Path, log_path: Path, host: str, *, tree: bool = False) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.host = host
        self.tree = tree  # CPU and RSS of its child processes too (``server.workers``' workers)
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._ps: psutil.Process | None = None
        self._log: IO[bytes] | None = None
        # its first API key, for /metrics (behind the key when keys are configured)
        keys = tomllib.loads(config_path.read_text(encoding="utf-8")).get("server", {}).get("api_keys", [])
        self._headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def start(self) -> None:
        self._log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(self.config_path), "--host", self.host,
             "--port", str(self.port), "--log-level", "info"],
            cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self._ps = psutil.Process(self._proc.pid)

    @property
    def process(self) -> psutil.Process:
        if self._ps is None:
            raise BenchError("the gateway process has not been started")
        return self._ps

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        try:
            request = urllib.request.Request(self.url + path, headers=self._headers)
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    async def wait_ready(self) -> None:
        """Until ``/readyz`` answers 200; a gateway that exits meanwhile is a BenchError."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise BenchError(f"the gateway exited during start-up:\n{self.log_tail()}")
            try:
                status, _ = await asyncio.to_thread(self._get, "/readyz", 2.0)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                status = 0  # not listening yet
            if status == 200 and (not self.tree or await asyncio.to_thread(self._every_worker_up)):
                return
            await asyncio.sleep(0.25)
        raise BenchError(f"the gateway was not ready after {READY_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def _every_worker_up(self) -> bool:
        """No worker of ``server.workers`` still loading (a single process has no such series)."""
        status, body = self._get("/metrics")
        return status == 200 and not [line for line in body.decode().splitlines()
                                      if line.startswith("gateway_worker_up{") and not line.endswith(" 1.0")]

    def metric(self, name: str, default: float | None = None) -> float:
        """The value of a metric in ``/metrics``: ``name`` as it appears there, labels included
        (``'x_count{generation="2"}'``); with several workers, their sum (their ``worker`` label
        left out of the comparison). A series not there is an error, or ``default`` where given
        (a labelled counter appears with its first count)."""
        status, body = self._get("/metrics")
        if status != 200:
            raise BenchError(f"/metrics answered {status}")
        values = [float(value) for series, value in (line.rsplit(" ", 1) for line in body.decode().splitlines()
                                                     if line and not line.startswith("#"))
                  if _WORKER_LABEL.sub("", series).replace("{}", "") == name]
        if not values:
            if default is not None:
                return default
            raise BenchError(f"/metrics has no {name}")
        return sum(values)

    def gc_pauses(self) -> dict[str, float]:
        """The gateway's full collections so far (``gateway_gc_pause_seconds``, generation 2):
        how many, their total, and how many stopped the event loop for over 50 ms."""
        series = 'gateway_gc_pause_seconds{}{{generation="2"{}}}'
        count = self.metric(series.format("_count", ""))
        return {"full_collections": count, "full_collection_s": self.metric(series.format("_sum", "")),
                "over_50ms": count - self.metric(series.format("_bucket", ',le="0.05"'))}

    def _processes(self) -> list[psutil.Process]:
        return [self.process, *(self.process.children(recursive=True) if self.tree else ())]

    def rss(self) -> int:
        total = 0
        for process in self._processes():
            with contextlib.suppress(psutil.NoSuchProcess):  # a worker restarting
                total += int(process.memory_info().rss)
        return total

    def cpu_s(self) -> float:
        total = 0.0
        for process in self._processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                times = process.cpu_times()
                total += times.user + times.system
        return total

    async def settled_rss(self) -> int:
        """Median RSS over a second, after letting the server finish what it was doing."""
        await asyncio.sleep(RSS_SETTLE_S)
        samples = []
        for _ in range(RSS_SAMPLES):
            samples.append(self.rss())
            await asyncio.sleep(0.2)
        return int(median(samples))

    def stop(self) -> int | None:
        """SIGTERM (graceful shutdown), then SIGKILL if it hangs. Returns the exit status."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
        return self._proc.returncode

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_problems(self) -> list[str]:
        """Log lines worth reporting: warnings, errors, tracebacks, slow-client cancels."""
        if not self.log_path.exists():
            return []
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if any(marker in line for marker in LOG_MARKERS)]
