"""The ``[cluster]`` table: torch-engine replicas on Ray Serve instead of one local core.

Read by both sides from the same TOML file: the Serve application (``engine_cluster.app``)
takes the replica count bounds, the autoscaling policy's targets and delays and each replica's
resources; the gateway (``engine_cluster.pool``) takes the routing policy, the overload marks
and how it follows membership. With ``enabled = false`` (the default) none of it is used and
Ray is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llm_shared.configtools import require

RoutePolicy = Literal["prefix", "least_loaded", "round_robin"]
MAX_NAME_CHARS = 64


@dataclass(frozen=True)
class ClusterConfig:
    enabled: bool = False  # the gpu tier is served by Ray Serve replicas (else: one local core)
    ray_address: str = "auto"  # where the gateway joins the Ray cluster ("auto": the local one)
    namespace: str = "rtgw"  # Ray namespace of the directory actor and the Serve application
    app_name: str = "rtgw-engines"  # Serve application holding the EngineReplica deployment
    # --- replicas and autoscaling (the Serve application) ---
    min_replicas: int = 1
    max_replicas: int = 4
    initial_replicas: int = 1
    target_queue_per_replica: float = 4.0  # requests waiting for a slot, per replica, the policy aims at
    target_kv_use: float = 0.75  # fraction of each replica's KV blocks in use the policy aims at
    scale_down_headroom: float = 0.5  # scale down only when the smaller count would sit below this share of the targets
    upscale_delay_s: float = 5.0  # the scale-up signal must hold this long
    downscale_delay_s: float = 30.0  # the scale-down signal must hold this long
    metrics_interval_s: float = 1.0  # replicas report queue depth, running and KV use this often
    look_back_period_s: float = 5.0  # the autoscaler averages the reports over this window
    replica_cpus: float = 1.0  # Ray resources of one replica (its core process runs inside them)
    replica_gpus: float = 0.0
    pin_cpus: bool = False  # pin each replica's core process to its own CPU (benchmarks on one machine)
    drain_timeout_s: float = 30.0  # a replica being removed serves its running requests this long
    listen_host: str = ""  # address the replica's core listens on; "" = the node's IP
    # --- routing across replicas (the gateway) ---
    route: RoutePolicy = "prefix"  # prefix affinity, else least loaded; round_robin for comparison
    overload_queue: int = 8  # an affine replica with this many waiting requests is skipped
    overload_kv_use: float = 0.95  # ... or with this share of its KV in use
    membership_poll_s: float = 0.5  # how often the gateway reads the replica directory
    membership_ttl_s: float = 5.0  # a replica silent this long is no longer a member
    retries: int = 2  # other replicas tried for a request that failed before its first token
    affinity_blocks: int = 65_536  # block hashes remembered per replica

    def __post_init__(self) -> None:
        for name in ("namespace", "app_name"):
            value = getattr(self, name)
            require(0 < len(value) <= MAX_NAME_CHARS and value.replace("-", "").replace("_", "").isalnum(),
                    f"cluster.{name} must be 1..{MAX_NAME_CHARS} letters, digits, '-' or '_'")
        require(self.ray_address != "", "cluster.ray_address must not be empty (\"auto\" joins the local cluster)")
        require(1 <= self.min_replicas <= self.max_replicas,
                f"cluster.min_replicas must be >= 1 and <= max_replicas, got {self.min_replicas}..{self.max_replicas}")
        require(self.min_replicas <= self.initial_replicas <= self.max_replicas,
                "cluster.initial_replicas must lie between min_replicas and max_replicas")
        require(self.target_queue_per_replica > 0, "cluster.target_queue_per_replica must be > 0")
        for name in ("target_kv_use", "overload_kv_use"):
            require(0.0 < getattr(self, name) <= 1.0, f"cluster.{name} must be in (0, 1]")
        require(0.0 < self.scale_down_headroom < 1.0, "cluster.scale_down_headroom must be in (0, 1)")
        for name in ("upscale_delay_s", "downscale_delay_s", "drain_timeout_s"):
            require(getattr(self, name) >= 0, f"cluster.{name} must be >= 0")
        for name in ("metrics_interval_s", "look_back_period_s", "membership_poll_s", "membership_ttl_s",
                     "replica_cpus"):
            require(getattr(self, name) > 0, f"cluster.{name} must be > 0")
        require(self.membership_ttl_s > 2 * self.membership_poll_s,
                "cluster.membership_ttl_s must exceed two membership polls")
        require(self.replica_gpus >= 0, "cluster.replica_gpus must be >= 0")
        require(self.overload_queue >= 1, "cluster.overload_queue must be >= 1")
        require(0 <= self.retries <= 8, "cluster.retries must be 0..8")
        require(self.affinity_blocks >= 1, "cluster.affinity_blocks must be >= 1")

    def policy_kwargs(self) -> dict[str, float]:
        """The autoscaling policy's constructor arguments (JSON-serialisable, as Serve requires);
        the delays are Serve's own ``autoscaling_config`` fields, applied around the policy."""
        return {"target_queue_per_replica": self.target_queue_per_replica, "target_kv_use": self.target_kv_use,
                "scale_down_headroom": self.scale_down_headroom}
