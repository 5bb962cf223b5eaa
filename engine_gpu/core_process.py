"""The engine core process: LLMEngine's step loop (engine_gpu.core_server) in a process of its own.

It reads its configs, opens the listening socket, loads the engine, prints one ready line on
stdout and serves until stopped. Every connection proves it knows the shared secret
(``protocol.Challenge``/``Authenticate``) before anything else; the secret comes from the
environment variable ``engine.secret_env`` names (``ENGINE_CORE_SECRET``), and the core refuses
to start without one.

Run by ``EngineClient.start`` (``--model-json/--engine-json``, a fresh secret in the
environment, ready line on stdout, exits when its parent's stdin pipe closes), or by hand as a
worker other machines connect to::

    ENGINE_CORE_SECRET=... python -m engine_gpu.core_process --config configs/default.toml --listen tcp:0.0.0.0:7100
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
from dataclasses import asdict, replace

from engine_gpu.config import EngineConfig, load_engine_config, parse_engine_table
from engine_gpu.core_server import CoreServer
from engine_gpu.protocol import PRIVATE_SOCKET_PREFIX, parse_listen, secret_bytes
from llm_shared.configtools import build
from llm_shared.errors import ConfigError, EngineError
from llm_shared.models import ModelConfig

log = logging.getLogger("engine_gpu.core")


def open_listener(listen: str) -> tuple[socket.socket, str, str | None]:
    """Bound, listening, non-blocking socket; its actual address; a temp dir to remove at exit."""
    tmpdir = None
    if not listen:
        tmpdir = tempfile.mkdtemp(prefix=PRIVATE_SOCKET_PREFIX)
        listen = f"unix:{tmpdir}/core.sock"
    family, addr = parse_listen(listen)
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_UNIX:
        assert isinstance(addr, str)
        try:
            mode = os.lstat(addr).st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(mode):
                sock.close()
                raise ConfigError(f"engine.listen: {addr!r} exists and is not a socket; refusing to replace it")
            os.unlink(addr)  # a stale socket file from a core that died
        old_umask = os.umask(0o177)  # the socket file is created owner-only (0600), never briefly wider
        try:
            sock.bind(addr)
        finally:
            os.umask(old_umask)
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    sock.listen(64)
    sock.setblocking(False)
    if family == socket.AF_UNIX:
        return sock, listen, tmpdir
    host, port = sock.getsockname()[:2]
    return sock, f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}", tmpdir


def _configs(args: argparse.Namespace) -> tuple[ModelConfig, EngineConfig, ModelConfig | None]:
    if args.config:
        model_cfg, engine_cfg, draft_cfg = load_engine_config(args.config)
    else:
        model_cfg = build(ModelConfig, json.loads(args.model_json), "model")
        engine_cfg = parse_engine_table(json.loads(args.engine_json))
        draft_cfg = build(ModelConfig, json.loads(args.draft_model_json), "draft_model") if args.draft_model_json else None
        if engine_cfg.speculative.method == "edge" and draft_cfg is None:
            raise ConfigError("engine.speculative.method = 'edge' needs --draft-model-json")
    if args.listen is not None:
        engine_cfg = replace(engine_cfg, listen=args.listen)
    return model_cfg, engine_cfg, draft_cfg


def config_args(model_cfg: ModelConfig, engine_cfg: EngineConfig, draft_cfg: ModelConfig | None = None) -> list[str]:
    """Command-line arguments that hand the configs to a core process (used by EngineClient.start)."""
    args = ["--model-json", json.dumps(asdict(model_cfg)), "--engine-json", json.dumps(asdict(engine_cfg))]
    if draft_cfg is not None:
        args += ["--draft-model-json", json.dumps(asdict(draft_cfg))]
    return args


def _exit_on_signal(signum: int, _frame: object) -> None:
    log.info("engine core got signal %d", signum)
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_gpu.core_process", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="TOML config; serves its [engine] table and the [models] entry it names")
    source.add_argument("--model-json", help="ModelConfig as JSON (with --engine-json)")
    parser.add_argument("--engine-json", default="{}", help="EngineConfig as JSON")
    parser.add_argument("--draft-model-json", default="", help="ModelConfig of the edge drafter as JSON")
    parser.add_argument("--listen", default=None, help="override engine.listen: unix:/path or tcp:host:port")
    parser.add_argument("--exit-on-stdin-eof", action="store_true", help="stop when the parent closes our stdin")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="engine-core %(asctime)s %(levelname)s %(message)s")
    # The ready line is the only thing on the real stdout; anything a library prints goes to stderr.
    ready_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def report(**fields: object) -> None:
        ready_out.write(json.dumps(fields) + "\n")
        ready_out.flush()

    tmpdir = None
    try:
        model_cfg, engine_cfg, draft_cfg = _configs(args)
        secret = secret_bytes(os.environ.get(engine_cfg.secret_env), f"${engine_cfg.secret_env}")
        listener, address, tmpdir = open_listener(engine_cfg.listen)
        from engine_gpu.engine import LLMEngine  # torch is imported only once the configs are valid

        engine = LLMEngine.from_config(model_cfg, engine_cfg, draft_cfg)
    except (EngineError, ConfigError, OSError) as e:
        log.error("engine core failed to start: %s", e)
        report(error=str(e), code="config_error" if isinstance(e, ConfigError) else getattr(e, "code", "start_failed"))
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        return 1
    log.info("engine core ready on %s", address)
    report(address=address)
    # SIGTERM unwinds like an exception (out of a blocking select), so the finally below cleans up.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    server = CoreServer(engine, listener, secret=secret,
                        stop_fd=sys.stdin.fileno() if args.exit_on_stdin_eof else None)
    try:
        server.serve_forever()
    finally:
        engine.close()
        listener.close()
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        elif address.startswith("unix:"):
            os.unlink(address[len("unix:"):])
    return 0


if __name__ == "__main__":
    code = main()
    # Everything main() owns is closed by now; what is left is the interpreter's teardown of torch
    # and the model (frozen out of the collector, see CoreServer.serve_forever): 0.3 s of a core
    # that a gateway restarting beside it, or a browser taking over its users, needs more.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
