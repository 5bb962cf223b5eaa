"""Several gateway processes on one port (``server.workers`` > 1): a parent that starts them,
keeps them running and stops them; each worker is a whole gateway on its own event loop.

- **The port.** Every worker binds it with SO_REUSEPORT, once its tiers are loaded, and the
  kernel spreads new connections over the workers listening; a WebSocket session is one TCP
  connection, so it stays on the worker that accepted it. The parent holds a bound (not
  listening) socket on the port for its whole life: the port (also one ``--port 0`` picked)
  stays this gateway's while a worker restarts.
- **What they share.** Per-key limits live in Redis (``Config`` refuses more than one worker with
  the in-process backend). The torch engine core is started once, by the parent, on a socket in
  its private run directory; every worker connects to it (its requests are namespaced per
  connection) and reconnects when the parent has restarted it, so the host keeps one model, one
  KV pool and one continuous batch. The edge tier (llama.cpp in-process) is each worker's own:
  two one-thread contexts decoded 1.6x the tokens/s of one two-thread context on the dev
  machine, for ~350 MiB more a worker (docs/architecture.md, "Worker processes"). Its threads
  are the edge's share of the host budget divided among the workers.
- **Signals.** SIGTERM or SIGINT to the parent is forwarded to every worker as SIGTERM: each
  drains (gateway/process/drain.py) and exits; a second signal is forwarded too and cuts the drains
  short. The parent waits for them (bounded; stragglers are killed), then stops the engine core.
- **A worker that dies** is restarted on the same index after a backoff; a worker that exits
  with status 2 (it could not start: a bad config, a model file, the port) stops the gateway
  with status 2, and more than ``MAX_RESTARTS`` deaths within ``RESTART_WINDOW_S`` stop it with
  status 1, so that whatever supervises the host (systemd, the kubelet) sees a broken gateway
  instead of one that keeps restarting parts of itself.
- **The parent's death** closes every worker's stdin pipe: the worker drains and exits as on
  SIGTERM (and the engine core, whose stdin is the parent's pipe too, exits).

A worker (gateway/process/worker_process.py) reads what it is (``WorkerSpec``: the parent's config, its
index...) pickled from its stdin, then keeps watching that pipe. ``/metrics``:
gateway/process/worker_metrics.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import secrets
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from gateway.config import Config
from gateway.tiers.build import build_gpu_engine, host_plan, needed_tiers, with_host_plan
from llm_shared.contract import Engine
from llm_shared.errors import ConfigError, EngineError

log = logging.getLogger("gateway.process.workers")

EXIT_START_FAILED = 2  # what `python -m gateway` returns for a start-up error: restarting will not help
MAX_RESTARTS = 5  # worker deaths tolerated within RESTART_WINDOW_S, all workers together
RESTART_WINDOW_S = 60.0
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
STOP_SLACK_S = 30.0  # beyond a worker's own drain and shutdown bounds, before it is killed
SPEC_LENGTH = struct.Struct("!Q")  # the pickled WorkerSpec's length, before it on the worker's stdin


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is told by its parent, over its stdin."""

    config: Config  # the parent's, with this worker's edge threads and the shared core's address
    index: int  # 0..count-1, kept across restarts: the `worker` label of its metrics
    count: int
    run_dir: Path  # the parent's private directory: the engine core's and the workers' metrics sockets
    shared_core: bool  # the torch tier is the parent's engine core at config.engine.listen
    log_level: str


def shares_core(config: Config) -> bool:
    """Whether the parent starts the torch engine core for every worker: a real core on this host
    (a synthetic torch tier lives in each worker; on a cluster each worker joins Ray)."""
    return "gpu" in needed_tiers(config) and config.engine.backend == "torch" and not config.cluster.enabled


def worker_config(config: Config, run_dir: Path) -> Config:
    """Each worker's config: the edge's share of the host's CPU budget divided among the workers
    (unless configured), and the engine core at the parent's address."""
    workers = config.server.workers
    plan = host_plan(config)
    if plan.edge and not config.edge.n_threads:
        config = replace(config, edge=replace(config.edge, n_threads=max(1, plan.edge // workers)))
        log.info("each of %d workers runs the edge tier on %d thread(s) of a CPU budget of %d", workers,
                 config.edge.n_threads, plan.cpus)
        if workers * config.edge.n_threads + max(plan.engine, plan.drafter) > plan.cpus:
            log.warning("%d workers with an edge tier each compute more threads at once than the CPU budget of %d: "
                        "the tiers will slow each other down", workers, plan.cpus)
    if shares_core(config) and not config.engine.listen:
        config = replace(config, engine=replace(config.engine, listen=f"unix:{run_dir / 'engine.sock'}"))
    return config


class RestartPolicy:
    """When a dead worker is started again: after a backoff that doubles with the deaths of the
    last window, and not at all past ``max_restarts`` of them (a crash loop)."""

    def __init__(self, *, max_restarts: int = MAX_RESTARTS, window_s: float = RESTART_WINDOW_S,
                 initial_s: float = INITIAL_BACKOFF_S, max_s: float = MAX_BACKOFF_S) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.initial_s = initial_s
        self.max_s = max_s
        self._deaths: deque[float] = deque()

    def died(self, now: float) -> float | None:
        """Seconds to wait before the restart, or None: give up."""
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - self.window_s:
            self._deaths.popleft()
        if len(self._deaths) > self.max_restarts:
            return None
        return min(self.max_s, self.initial_s * 2 ** (len(self._deaths) - 1))


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, not listening SO_REUSEPORT socket on ``host``:``port`` (0: a free port): it keeps
    the port this gateway's; listening sockets alone receive connections."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot bind {host}:{port} for the workers: {e}") from e
    return sock


class WorkerParent:
    """Starts ``server.workers`` workers (and the shared engine core), keeps them running,
    forwards signals, reaps them; ``run`` returns the process's exit status."""

    def __init__(self, config: Config, *, log_level: str = "info", policy: RestartPolicy | None = None) -> None:
        self.count = config.server.workers
        self._log_level = log_level
        self._policy = policy or RestartPolicy()
        self._run_dir = Path(tempfile.mkdtemp(prefix="rtgw-workers-"))  # 0700: the sockets in it are ours
        self._port_holder = reserve_port(config.server.host, config.server.port)
        port = self._port_holder.getsockname()[1]
        self.config = worker_config(config.with_server(port=port), self._run_dir)
        self.port = port
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._stop = asyncio.Event()
        self._signals = 0
        self._exit_code = 0
        self._core: Engine | None = None

    @property
    def pids(self) -> dict[int, int]:
        return {index: proc.pid for index, proc in self._procs.items()}

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        core = asyncio.create_task(self._start_core(), name="engine-core") if shares_core(self.config) else None
        slots = [asyncio.create_task(self._keep(index), name=f"worker-{index}") for index in range(self.count)]
        for slot in slots:
            slot.add_done_callback(self._slot_ended)
        log.info("%d workers on %s:%d (SO_REUSEPORT)%s", self.count, self.config.server.host, self.port,
                 "; the torch engine core shared at " + self.config.engine.listen if core else "")
        try:
            await self._stop.wait()
            await self._stop_workers(slots)
        finally:
            if core is not None:
                core.cancel()
                await asyncio.gather(core, return_exceptions=True)
            if self._core is not None:
                await self._core.close()
            self._port_holder.close()
            shutil.rmtree(self._run_dir, ignore_errors=True)
        return self._exit_code

    async def _start_core(self) -> None:
        """The torch engine core every worker connects to, restarted by its supervisor when it dies."""
        try:
            self._core = await build_gpu_engine(with_host_plan(self.config))
        except (EngineError, ConfigError, OSError) as e:
            self._fail(EXIT_START_FAILED, f"the torch engine core did not start: {e}")

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        spec = WorkerSpec(self.config, index, self.count, self._run_dir, shares_core(self.config), self._log_level)
        payload = pickle.dumps(spec)
        # Its own session: a terminal's Ctrl-C reaches the parent alone, which forwards one signal.
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.process.worker_process",
                                                    stdin=asyncio.subprocess.PIPE, start_new_session=True)
        assert proc.stdin is not None
        proc.stdin.write(SPEC_LENGTH.pack(len(payload)) + payload)  # the pipe stays open: its EOF is our death
        await proc.stdin.drain()
        log.info("worker %d started (pid %d)", index, proc.pid)
        return proc

    async def _keep(self, index: int) -> None:
        """Worker ``index``, restarted when it dies until the gateway stops."""
        while not self._stop.is_set():
            try:
                proc = self._procs[index] = await self._spawn(index)
            except OSError as e:
                self._fail(EXIT_START_FAILED, f"worker {index} could not be started: {e}")
                return
            if self._stop.is_set():  # stopped while it was starting: it missed the forwarded signal
                proc.send_signal(signal.SIGTERM)
            code = await proc.wait()
            del self._procs[index]
            if self._stop.is_set():
                log.info("worker %d exited (%s)", index, code)
                return
            if code == EXIT_START_FAILED:
                self._fail(EXIT_START_FAILED, f"worker {index} could not start (exit status {code}); stopping")
                return
            delay = self._policy.died(time.monotonic())
            if delay is None:
                self._fail(1, f"worker {index} exited ({code}): more than {self._policy.max_restarts} worker deaths "
                              f"within {self._policy.window_s:.0f} s; stopping so that the host's supervisor restarts "
                              "the gateway")
                return
            log.error("worker %d (pid %d) exited (%s); restarting it in %.1f s", index, proc.pid, code, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)

    def _slot_ended(self, slot: asyncio.Task[None]) -> None:
        """A slot's loop ends only when stopping; one that failed must not leave its worker unkept."""
        if not slot.cancelled() and slot.exception() is not None:
            self._fail(1, f"keeping {slot.get_name()} failed: {slot.exception()!r}")

    def _forward(self, sig: int) -> None:
        for proc in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("stopping: draining %d workers", len(self._procs))
        else:
            log.info("second signal: the workers end their drains now")
        self._forward(signal.SIGTERM)
        self._stop.set()

    def _fail(self, code: int, message: str) -> None:
        if self._stop.is_set():
            return
        log.error("%s", message)
        self._exit_code = code
        self._on_signal()

    async def _stop_workers(self, slots: list[asyncio.Task[None]]) -> None:
        server = self.config.server
        bound = server.drain_timeout_s + server.shutdown_grace_s + server.engine_abort_timeout_s + STOP_SLACK_S
        _, late = await asyncio.wait(slots, timeout=bound)
        if late:
            log.error("%d workers still running %.0f s after the signal: killing them", len(self._procs), bound)
            self._forward(signal.SIGKILL)
        await asyncio.gather(*slots, return_exceptions=True)


def run_workers(config: Config, log_level: str | None = None) -> None:
    """Serve ``config`` with ``server.workers`` worker processes until SIGTERM/SIGINT (blocking),
    the workers logging at ``log_level`` (default: this process's level). A start-up failure is
    raised as ``ConfigError``; a crash loop exits with status 1."""
    import uvloop

    log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    if shares_core(config):
        # Workers authenticate to the shared engine core with the secret its environment names; one
        # is made up (and inherited by the core and every worker) when the operator gave none.
        os.environ.setdefault(config.engine.secret_env, secrets.token_urlsafe(32))

    async def main() -> int:
        return await WorkerParent(config, log_level=log_level).run()

    code = uvloop.run(main())
    if code == EXIT_START_FAILED:
        raise ConfigError("the workers could not start (their log says why)")
    if code:
        raise SystemExit(code)
