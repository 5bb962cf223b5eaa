"""The autoscaling policy of the engine replicas: queue depth and KV use, not ongoing requests.

Serve's default policy counts requests in flight through its handles, and ours do not go through
them (tokens stream over the engine-core protocol); even if they did, a count of long streams
says little about whether a replica is full. Each replica reports instead (``REPORTED_METRICS``,
from its core's scheduler): requests waiting for a slot, requests running, the share of its KV
blocks in use, and its slot count. Serve averages each over ``look_back_period_s`` per replica
and calls this policy every control-loop tick with an ``AutoscalingContext``; Serve itself then
applies ``upscale_delay_s`` / ``downscale_delay_s`` (the decision must hold that long) and the
min/max bounds.

Scale up to the smallest count that brings the mean waiting queue and the mean KV use under
their targets. Scale down one replica at a time, and only when the count one lower would still
sit below ``scale_down_headroom`` of every target, slot use included: the gap between the two
thresholds is the hysteresis that keeps a load near a boundary from flapping.

No Ray import: the policy is a pure function of the metrics, tested without a cluster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

QUEUE, RUNNING, KV_USE, SLOTS = "queue_depth", "running", "kv_use", "slots"
REPORTED_METRICS = (QUEUE, RUNNING, KV_USE, SLOTS)


class _Context(Protocol):  # the parts of ray.serve.config.AutoscalingContext we read
    current_num_replicas: int
    policy_state: dict[str, Any]

    @property
    def aggregated_metrics(self) -> Mapping[str, Mapping[Any, float]] | None: ...


class QueueKvPolicy:
    """A class policy: Serve instantiates it once with the config's ``policy_kwargs`` and calls
    it every tick; it returns (desired replicas, state to show in Serve's status)."""

    def __init__(self, target_queue_per_replica: float = 4.0, target_kv_use: float = 0.75,
                 scale_down_headroom: float = 0.5) -> None:
        self.target_queue = float(target_queue_per_replica)
        self.target_kv = float(target_kv_use)
        self.headroom = float(scale_down_headroom)

    def __call__(self, ctx: _Context) -> tuple[int, dict[str, Any]]:
        n = int(ctx.current_num_replicas)
        metrics = ctx.aggregated_metrics or {}
        per_replica = {name: dict(metrics.get(name) or {}) for name in REPORTED_METRICS}
        reporting = len(per_replica[QUEUE])
        if n <= 0 or reporting == 0:
            return max(n, 1), {"reason": "no replica has reported yet"}
        # Replicas that have not reported yet (starting) count as empty ones.
        queue = sum(per_replica[QUEUE].values())
        kv = sum(per_replica[KV_USE].values())
        running = sum(per_replica[RUNNING].values())
        slots_each = (sum(per_replica[SLOTS].values()) / len(per_replica[SLOTS])) if per_replica[SLOTS] else 0.0
        state = {"queue": queue, "kv_use_sum": round(kv, 4), "running": running, "replicas": n}
        want = max(math.ceil(queue / self.target_queue - 1e-9), math.ceil(kv / self.target_kv - 1e-9))
        if want > n:
            return want, {**state, "reason": f"queue {queue:g} / KV {kv:.2f} over the targets of {n} replica(s)"}
        if n > 1 and self._fits(n - 1, queue, kv, running, slots_each):
            return n - 1, {**state, "reason": f"the load fits {n - 1} replica(s) with headroom"}
        return n, {**state, "reason": "within the targets"}

    def _fits(self, k: int, queue: float, kv: float, running: float, slots_each: float) -> bool:
        """Would ``k`` replicas carry this load below ``headroom`` of every target?"""
        slot_use = (running + queue) / (k * slots_each) if slots_each > 0 else 0.0
        return (queue / k <= self.headroom * self.target_queue
                and kv / k <= self.headroom * self.target_kv
                and slot_use <= self.headroom)
