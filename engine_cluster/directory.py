"""The replica directory: what each engine replica registers (its core's address) and refreshes
(its stats), and what gateways read as membership. Plain Python; ``engine_cluster.replica`` runs
it as a detached Ray actor, one per Serve application, on the head node."""

from __future__ import annotations

import time
from typing import Any

CLAIM_LAPSE_S = 600.0  # a CPU claimed by a replica that never registered is free again after this


class Directory:
    """Replica id -> address, stats and last heartbeat; CPU claims for pinning."""

    def __init__(self) -> None:
        self._members: dict[str, dict[str, Any]] = {}
        self._cpus: dict[str, tuple[str, int, float]] = {}  # replica id -> (node ip, CPU, claimed at)

    def register(self, replica_id: str, address: str, node_ip: str) -> None:
        self._members[replica_id] = {"address": address, "node_ip": node_ip, "seen": time.monotonic(), "stats": {}}

    def heartbeat(self, replica_id: str, stats: dict[str, float]) -> bool:
        member = self._members.get(replica_id)
        if member is None:
            return False
        member["seen"] = time.monotonic()
        member["stats"] = stats
        return True

    def leave(self, replica_id: str) -> None:
        self._members.pop(replica_id, None)
        self._cpus.pop(replica_id, None)

    def members(self, ttl_s: float) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        for replica_id in [r for r, m in self._members.items() if now - m["seen"] > ttl_s]:
            self.leave(replica_id)
        return {r: {"address": m["address"], "node_ip": m["node_ip"], "stats": m["stats"]}
                for r, m in self._members.items()}

    def claim_cpu(self, replica_id: str, node_ip: str, cpu_count: int) -> int:
        """The lowest CPU index on this node that no replica holds (pinning for benchmarks). A
        claim counts from before its replica registers (replicas start side by side) until it
        leaves; one that never registered lapses after ``CLAIM_LAPSE_S``."""
        now = time.monotonic()
        taken = {cpu for r, (ip, cpu, at) in self._cpus.items()
                 if ip == node_ip and (r in self._members or now - at < CLAIM_LAPSE_S)}
        cpu = next((i for i in range(cpu_count) if i not in taken), len(taken) % cpu_count)
        self._cpus[replica_id] = (node_ip, cpu, now)
        return cpu
