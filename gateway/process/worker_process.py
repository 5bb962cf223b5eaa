"""One worker of ``server.workers`` (started by gateway/process/workers.py as ``python -m
gateway.process.worker_process``): a whole gateway on the shared port, told what to serve by its parent.

It reads its ``WorkerSpec`` pickled from stdin (a pipe only its parent holds), then keeps
watching that pipe: EOF means the parent died, and the worker drains and exits as on SIGTERM.
Its torch tier, when the parent started the engine core, is a client of that core.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import sys
import time
from functools import partial

import uvloop

from gateway.config import Config
from gateway.http.state import STATE
from gateway.process import worker_metrics
from gateway.process.main import LOG_FORMAT, setup_logging
from gateway.process.server import create_app, serve
from gateway.process.workers import EXIT_START_FAILED, MAX_BACKOFF_S, SPEC_LENGTH, WorkerSpec
from gateway.tiers.build import close_engines, load_engines
from llm_shared.contract import Engine
from llm_shared.errors import ConfigError, EngineError, EngineUnavailableError

log = logging.getLogger("gateway.process.workers")

CORE_START_TIMEOUT_S = 600.0  # how long a worker waits for the parent's engine core (EngineClient.start's bound)
CORE_RETRY_S = 0.5


async def connect_shared_core(config: Config) -> Engine:
    """The torch tier of a worker: a client of the parent's engine core, waited for while it
    loads, reconnected (by ``SupervisedEngine``) when the parent has started it again."""
    from engine_gpu.client import EngineClient
    from gateway.tiers.supervisor import SupervisedEngine
    from llm_shared.models import tokenizer_for

    address, secret = config.engine.listen, os.environ.get(config.engine.secret_env)
    tokenizer = await asyncio.to_thread(tokenizer_for, config.model(config.engine.model))

    async def connect() -> EngineClient:
        return await EngineClient.connect(address, secret=secret, tokenizer=tokenizer)

    deadline = time.monotonic() + CORE_START_TIMEOUT_S
    while True:
        try:
            first = await connect()
            break
        except EngineUnavailableError:
            if time.monotonic() > deadline:
                raise EngineUnavailableError(f"the engine core at {address} did not come up within "
                                             f"{CORE_START_TIMEOUT_S:.0f} s") from None
            await asyncio.sleep(CORE_RETRY_S)  # the parent's core is still loading its model
    return SupervisedEngine(first, connect, initial_backoff_s=CORE_RETRY_S, max_backoff_s=MAX_BACKOFF_S)


def _read_spec(fd: int) -> WorkerSpec:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise SystemExit("gateway worker: the parent closed the pipe before saying what to run")
            data += chunk
        return data

    (length,) = SPEC_LENGTH.unpack(exactly(SPEC_LENGTH.size))
    spec = pickle.loads(exactly(length))  # from our own parent, over a pipe only it holds
    if not isinstance(spec, WorkerSpec):
        raise SystemExit("gateway worker: the parent sent something that is not a WorkerSpec")
    return spec


async def serve_worker(spec: WorkerSpec) -> None:
    """One worker: a whole gateway on the shared port, drained like one on SIGTERM or when the
    parent's pipe closes."""
    loop = asyncio.get_running_loop()

    def parent_gone() -> None:
        if not os.read(0, 4096):  # EOF: the parent died; drain as if it had sent SIGTERM
            loop.remove_reader(0)
            log.error("the parent process is gone: draining")
            os.kill(os.getpid(), signal.SIGTERM)

    loop.add_reader(0, parent_gone)
    # The engines load before the port opens: a worker joins the port once it can serve, so a
    # connection never lands on a worker still loading (or restarting) while a sibling could
    # serve it. Until then its SIGTERM is the default one: there is nothing to drain.
    load = partial(load_engines, build_gpu=connect_shared_core) if spec.shared_core else load_engines
    engines = await load(spec.config)

    async def loaded(config: Config) -> dict[str, Engine]:
        return engines

    app = create_app(spec.config)
    worker_metrics.install(app, spec.run_dir, spec.index, spec.count)
    try:
        await serve(spec.config, app=app, load=loaded)
    except BaseException:
        if not app[STATE].owns_engines:  # the app never took them (the port would not open)
            await close_engines(engines)
        raise


def worker_main() -> int:
    spec = _read_spec(0)
    setup_logging(spec.log_level)
    for handler in logging.getLogger().handlers:  # every line says which worker wrote it
        handler.setFormatter(logging.Formatter(LOG_FORMAT.replace("%(name)s", f"worker-{spec.index} %(name)s")))
    try:
        uvloop.run(serve_worker(spec))
    except (ConfigError, EngineError, OSError) as e:
        print(f"gateway worker {spec.index}: {e}", file=sys.stderr)
        return EXIT_START_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
