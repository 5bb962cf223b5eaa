"""The Serve application of engine replicas, and the commands that run it.

``build_app`` is the import path KubeRay's ``RayService`` names (``serveConfigV2``:
``import_path: engine_cluster.app:build_app`` with ``args: {config: ...}``); ``deploy`` does the
same from Python for ``make cluster``, the tests and the benchmark.

    python -m engine_cluster deploy --config configs/cluster.toml [--replicas N]
    python -m engine_cluster status --config configs/cluster.toml
    python -m engine_cluster shutdown --config configs/cluster.toml
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from engine_cluster.config import ClusterConfig
from engine_cluster.replica import EngineReplica, directory_handle, load_replica_configs

DEPLOYMENT_NAME = "EngineReplica"
POLICY_PATH = "engine_cluster.policy:QueueKvPolicy"
DEPLOY_TIMEOUT_S = 600.0


def deployment_options(cluster: ClusterConfig, replicas: int | None = None) -> dict[str, Any]:
    """Serve options of the replica deployment: a fixed count, or autoscaling by our policy."""
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": cluster.replica_cpus, "num_gpus": cluster.replica_gpus},
        # A replica being removed drains for drain_timeout_s; Serve must not kill it sooner.
        "graceful_shutdown_timeout_s": cluster.drain_timeout_s + 15.0,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
    }
    if replicas is not None:
        options["num_replicas"] = replicas
        return options
    options["autoscaling_config"] = {
        "min_replicas": cluster.min_replicas,
        "max_replicas": cluster.max_replicas,
        "initial_replicas": cluster.initial_replicas,
        "upscale_delay_s": cluster.upscale_delay_s,
        "downscale_delay_s": cluster.downscale_delay_s,
        "metrics_interval_s": cluster.metrics_interval_s,
        "look_back_period_s": cluster.look_back_period_s,
        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": cluster.policy_kwargs()},
    }
    return options


def build_app(args: dict[str, str]) -> serve.Application:
    """Serve's application builder: ``args = {"config": path, "replicas": "N" (optional)}``."""
    config_path = str(Path(args["config"]).resolve())
    cluster, *_ = load_replica_configs(config_path)  # a bad config fails here, before any replica starts
    replicas = int(args["replicas"]) if args.get("replicas") else None
    return serve.deployment(EngineReplica).options(**deployment_options(cluster, replicas)).bind(config_path)


def connect(cluster: ClusterConfig) -> None:
    if not ray.is_initialized():
        ray.init(address=cluster.ray_address, namespace=cluster.namespace, log_to_driver=False)


def deploy(config_path: str, replicas: int | None = None) -> None:
    """Deploy (or update) the application and return once its first replicas serve."""
    cluster, *_ = load_replica_configs(config_path)
    connect(cluster)
    directory_handle(cluster.namespace, cluster.app_name)  # before the replicas, so none races to create it
    args = {"config": config_path, **({"replicas": str(replicas)} if replicas else {})}
    print(f"deploying {cluster.app_name} ({f'{replicas} replicas' if replicas else 'autoscaling'})",
          file=sys.stderr, flush=True)
    serve.run(build_app(args), name=cluster.app_name, route_prefix=None, blocking=False)
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while time.monotonic() < deadline:
        status = serve.status().applications.get(cluster.app_name)
        if status is not None and status.status == "RUNNING":
            print(f"{cluster.app_name} is running", file=sys.stderr, flush=True)
            return
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"{cluster.app_name}: {status.status}: {status.message}")
        time.sleep(1.0)
    raise TimeoutError(f"{cluster.app_name} did not start within {DEPLOY_TIMEOUT_S:.0f} s")


def replica_states(app_name: str) -> tuple[str, dict[str, int]]:
    """The application's status and its replicas counted by state, as Serve reports them."""
    app = serve.status().applications.get(app_name)
    deployment = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
    states = ({str(getattr(k, "value", k)): int(v) for k, v in deployment.replica_states.items()}
              if deployment is not None else {})
    return (app.status if app is not None else "NOT_DEPLOYED"), states


def status(config_path: str) -> dict[str, Any]:
    cluster, *_ = load_replica_configs(config_path)
    connect(cluster)
    app_status, states = replica_states(cluster.app_name)
    members = ray.get(directory_handle(cluster.namespace, cluster.app_name).members.remote(
        cluster.membership_ttl_s)) if app_status != "NOT_DEPLOYED" else {}
    return {"app": app_status, "replica_states": states, "members": members}


def shutdown(config_path: str) -> None:
    cluster, *_ = load_replica_configs(config_path)
    connect(cluster)
    serve.delete(cluster.app_name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_cluster", description="engine replicas on Ray Serve")
    parser.add_argument("command", choices=("deploy", "status", "shutdown"))
    parser.add_argument("--config", default="configs/cluster.toml")
    parser.add_argument("--replicas", type=int, default=None, help="a fixed replica count instead of autoscaling")
    args = parser.parse_args(argv)
    config_path = str(Path(args.config).resolve())
    if args.command == "deploy":
        deploy(config_path, args.replicas)
    elif args.command == "status":
        print(json.dumps(status(config_path), indent=2, default=str))
    else:
        shutdown(config_path)
    return 0
