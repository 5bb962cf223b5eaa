"""One torch-engine replica as a Ray Serve deployment, and the directory the gateways read.

Each ``EngineReplica`` owns one engine core process (``engine_gpu.core_process``), listening on
TCP on its node and authenticating peers with the cluster's shared secret
(``$ENGINE_CORE_SECRET`` in every Ray worker's environment; a replica without it refuses to
start). Tokens stream from the core to the gateways over the engine-core protocol, not through
Serve's handles: it is the path the single-machine gateway already uses, and it adds no hop
(docs/architecture.md, "Scale-out").

Serve places, health-checks, replaces and autoscales the replicas; the replica reports its
core's queue depth, running requests, KV use and slot count to Serve's autoscaler
(``record_autoscaling_stats``, read by ``engine_cluster.policy``) and to the
``EngineDirectory``, a detached actor where each replica registers its address and heartbeats.
Gateways read membership from that directory: the replicas Ray is running right now, each
refreshed every ``metrics_interval_s`` and dropped after ``membership_ttl_s`` of silence.

When Serve removes a replica (scale-down, redeploy), its ``__del__`` leaves the directory first,
so gateways stop sending it new requests within one membership poll, then serves its running
and waiting requests for up to ``drain_timeout_s`` before the core stops: no stream is cut.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Any

import ray
from ray import serve

from engine_cluster.config import ClusterConfig
from engine_cluster.directory import Directory
from engine_cluster.policy import KV_USE, QUEUE, RUNNING, SLOTS
from engine_gpu.client import EngineClient, kv_use
from engine_gpu.config import check_engine_models, parse_engine_table
from llm_shared.configtools import build, read_toml
from llm_shared.errors import ConfigError
from llm_shared.models import parse_models

log = logging.getLogger("engine_cluster.replica")

DIRECTORY_PREFIX = "engine-directory-"  # one directory per Serve application
HEAD_NODE_RESOURCE = "node:__internal_head__"  # every Ray head node offers it


# Detached and restartable: a restarted directory is empty until the next heartbeats, which
# re-register (``heartbeat`` -> False).
EngineDirectory = ray.remote(num_cpus=0, max_restarts=-1)(Directory)


def directory_handle(namespace: str, app_name: str) -> Any:
    """The application's directory actor, created on first use (replicas and gateways may start in
    any order). It lives on the head node (Ray's built-in head resource): a gateway pod that joins
    the cluster as a 0-CPU node must not take the directory with it when it goes."""
    return EngineDirectory.options(name=DIRECTORY_PREFIX + app_name, namespace=namespace, lifetime="detached",
                                   get_if_exists=True, resources={HEAD_NODE_RESOURCE: 0.001}).remote()


def load_replica_configs(config_path: str) -> tuple[ClusterConfig, Any, Any, Any]:
    """[cluster], the engine's model, its [engine] table and its drafter model from the gateway's
    TOML file (without importing the gateway: engines never depend on it)."""
    raw = read_toml(config_path)
    cluster = build(ClusterConfig, raw.get("cluster", {}), "cluster")
    models = parse_models(raw.get("models"))
    engine_cfg = parse_engine_table(raw.get("engine", {}))
    target, draft = check_engine_models(engine_cfg, models)
    return cluster, target, engine_cfg, draft


class EngineReplica:
    """The Serve deployment's class (wrapped by ``serve.deployment`` in ``engine_cluster.app``)."""

    async def __init__(self, config_path: str) -> None:
        self.cluster, model_cfg, engine_cfg, draft = load_replica_configs(config_path)
        if not os.environ.get(engine_cfg.secret_env):
            raise ConfigError(f"${engine_cfg.secret_env} is not set in this Ray worker's environment: replicas "
                              "and gateways share it to authenticate the engine socket (set it before `ray start`)")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_ip = ray.util.get_node_ip_address()
        self.directory = directory_handle(self.cluster.namespace, self.cluster.app_name)
        if self.cluster.pin_cpus:
            # The core process inherits this affinity when it is spawned; one torch thread fits one CPU.
            cpu = await self.directory.claim_cpu.remote(self.replica_id, self.node_ip, os.cpu_count() or 1)
            os.sched_setaffinity(0, {cpu})
            engine_cfg = replace(engine_cfg, threads=1)
            log.info("replica %s pinned to CPU %d", self.replica_id, cpu)
        host = self.cluster.listen_host or self.node_ip
        engine_cfg = replace(engine_cfg, listen=f"tcp:[{host}]:0" if ":" in host else f"tcp:{host}:0")
        log.info("replica %s: starting an engine core for %s", self.replica_id, model_cfg.id)
        self.client = await EngineClient.start(model_cfg, engine_cfg, draft_model_cfg=draft)
        self.slots = float(engine_cfg.max_num_seqs)
        self._stats: dict[str, float] = self._autoscaling_stats(self.client.stats())
        await self.directory.register.remote(self.replica_id, self.client.address, self.node_ip)
        self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        log.info("replica %s serving on %s", self.replica_id, self.client.address)

    def _autoscaling_stats(self, stats: dict[str, float]) -> dict[str, float]:
        return {QUEUE: float(stats.get("waiting", 0.0)), RUNNING: float(stats.get("running", 0.0)),
                KV_USE: kv_use(stats), SLOTS: self.slots}

    async def _heartbeat_loop(self) -> None:
        interval = min(self.cluster.metrics_interval_s, self.cluster.membership_ttl_s / 4)
        while True:
            try:
                self._stats = self._autoscaling_stats(await asyncio.wait_for(self.client.refresh_stats(), 10.0))
                known = await self.directory.heartbeat.remote(self.replica_id, self._stats)
                if not known:  # the directory restarted (or dropped us after a stall): register again
                    await self.directory.register.remote(self.replica_id, self.client.address, self.node_ip)
            except Exception as e:  # a missed beat is retried; check_health reports a dead core
                log.warning("replica %s: heartbeat failed: %s", self.replica_id, e)
            await asyncio.sleep(interval)

    # --- Serve hooks ---------------------------------------------------------------------------

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (see ``engine_cluster.policy``)."""
        return dict(self._stats)

    def check_health(self) -> None:
        """A replica whose core died is unhealthy: Serve replaces it."""
        if not self.client.ready:
            raise RuntimeError(f"the engine core of replica {self.replica_id} is gone")

    async def describe(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "address": self.client.address, "node_ip": self.node_ip,
                "stats": self.client.stats(), "pid": os.getpid()}

    async def __del__(self) -> None:
        """Removed by Serve: leave the directory, serve what runs for up to drain_timeout_s, stop."""
        heartbeat = getattr(self, "_heartbeat", None)
        if heartbeat is not None:
            heartbeat.cancel()
        client = getattr(self, "client", None)
        if client is None:
            return
        try:
            await asyncio.wait_for(self.directory.leave.remote(self.replica_id), 5.0)
        except Exception as e:  # gateways drop a silent member after its TTL anyway
            log.warning("replica %s: leaving the directory failed: %s", self.replica_id, e)
        deadline = time.monotonic() + self.cluster.drain_timeout_s
        # A gateway may still route here until its next membership poll: wait at least that long.
        settle = time.monotonic() + 2 * self.cluster.membership_poll_s
        while client.ready and time.monotonic() < deadline:
            try:
                stats = await asyncio.wait_for(client.refresh_stats(), 5.0)
            except Exception:  # the core is gone: nothing left to drain
                break
            if stats.get("running", 0) + stats.get("waiting", 0) == 0 and time.monotonic() >= settle:
                break
            await asyncio.sleep(0.1)
        log.info("replica %s drained; stopping its engine core", self.replica_id)
        await client.close()

