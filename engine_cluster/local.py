"""A Ray cluster on this machine, for ``make cluster``, the Ray tests and ``bench/cluster.py``:
start it with the engine secret in every worker's environment, deploy the replicas, read what
Serve runs, kill a replica the way a crashed node would."""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

import ray
from ray import serve

from engine_cluster.app import DEPLOYMENT_NAME, deploy, replica_states
from engine_cluster.replica import directory_handle, load_replica_configs


def start_local(config_path: str, *, num_cpus: int | None = None) -> str:
    """Start a local Ray cluster in this process (or join a running one); returns the secret its
    workers (the replicas) and this process's gateway share. Workers inherit our environment."""
    cluster, _model, engine_cfg, _draft = load_replica_configs(config_path)
    secret = os.environ.setdefault(engine_cfg.secret_env, secrets.token_urlsafe(32))
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, namespace=cluster.namespace, include_dashboard=False, log_to_driver=False,
                 object_store_memory=200 * 1024 * 1024, configure_logging=False)
    return secret


def delete_app(app_name: str) -> None:
    serve.delete(app_name)


def stop_local() -> None:
    serve.shutdown()
    ray.shutdown()


def running_replicas(app_name: str) -> int:
    return replica_states(app_name)[1].get("RUNNING", 0)


def members(namespace: str, app_name: str, ttl_s: float) -> dict[str, dict[str, Any]]:
    return ray.get(directory_handle(namespace, app_name).members.remote(ttl_s), timeout=30)


def kill_replica(app_name: str, replica_id: str) -> None:
    """Kill a replica's actor without any shutdown hook (its core dies with it: the core exits
    when its parent's pipe closes), as a lost node or an OOM kill would."""
    actor = ray.get_actor(f"SERVE_REPLICA::{app_name}#{DEPLOYMENT_NAME}#{replica_id}", namespace="serve")
    ray.kill(actor, no_restart=True)


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.25) -> float:
    """Poll ``predicate`` until true; the seconds it took. TimeoutError naming ``what``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)
    return time.monotonic() - start


__all__ = ["delete_app", "deploy", "kill_replica", "members", "running_replicas", "start_local", "stop_local", "wait_for"]
