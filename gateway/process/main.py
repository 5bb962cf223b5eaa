"""Command line: ``python -m gateway serve --config configs/default.toml [--host H] [--port P]``.

Start-up problems (a bad config, a missing model file, an unsafe bind) end the process with a
one-line message and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from gateway.config import DEFAULT_CONFIG, Config, load_config
from llm_shared.errors import ConfigError, EngineError

log = logging.getLogger("gateway")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    # One line per HTTP request is noise at INFO; keep it for DEBUG runs.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description="Real-time LLM gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the WebSocket and HTTP API on one port")
    serve.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config file (default: %(default)s)")
    serve.add_argument("--host", help="override server.host")
    serve.add_argument("--port", type=int, help="override server.port (0: any free port)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--local-cluster", action="store_true",
                       help="start a Ray cluster on this machine in this process and deploy the [cluster] engine "
                            "replicas before serving (make cluster)")
    return parser


def start_local_cluster(config: Config, path: str) -> None:
    """A single-machine Ray cluster running the same code as production: the engine replicas
    deployed with their autoscaling policy, before the gateway joins it as a driver."""
    if not config.cluster.enabled:
        raise ConfigError(f"--local-cluster needs [cluster] enabled = true in {path}")
    from engine_cluster.local import deploy, start_local  # Ray only here

    log.info("starting a local Ray cluster and the engine replicas (%s)", config.cluster.app_name)
    start_local(path)
    deploy(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    from gateway.process.server import check_bind_safety, run  # after logging: imports may log

    try:
        config = load_config(args.config)
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        if overrides:
            config = config.with_server(**overrides)
        check_bind_safety(config)
        if args.local_cluster:
            start_local_cluster(config, args.config)
        run(config)
    except (ConfigError, EngineError) as e:
        # Start-up errors (a bad config, a missing model file) are for the operator; they may name paths.
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
