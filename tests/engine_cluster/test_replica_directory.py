"""The replica directory (run as a Ray actor in the cluster; plain Python here): membership as
gateways read it, and CPU claims for replicas that start side by side."""

from __future__ import annotations

import pytest

from engine_cluster import directory as directory_module
from engine_cluster.directory import Directory


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(directory_module.time, "monotonic", lambda: now[0])
    return now


def test_members_are_the_registered_replicas_that_keep_beating(clock: list[float]) -> None:
    d = Directory()
    d.register("a", "tcp:10.0.0.1:4000", "10.0.0.1")
    d.register("b", "tcp:10.0.0.2:4000", "10.0.0.2")
    assert set(d.members(ttl_s=5.0)) == {"a", "b"}
    clock[0] += 4.0
    assert d.heartbeat("a", {"queue_depth": 3.0})
    clock[0] += 2.0  # b silent for 6 s: gone; a beat 2 s ago
    members = d.members(ttl_s=5.0)
    assert set(members) == {"a"} and members["a"]["stats"] == {"queue_depth": 3.0}
    assert not d.heartbeat("b", {}), "a replica the directory dropped is told to register again"
    d.leave("a")
    assert d.members(ttl_s=5.0) == {}


def test_replicas_starting_side_by_side_claim_different_cpus(clock: list[float]) -> None:
    d = Directory()
    # Both claim before either has registered (their models are still loading).
    assert d.claim_cpu("a", "n1", 2) == 0
    assert d.claim_cpu("b", "n1", 2) == 1
    assert d.claim_cpu("c", "n2", 2) == 0, "claims are per node"
    d.register("a", "tcp:n1:1", "n1")
    d.leave("b")  # removed: its CPU is free again
    assert d.claim_cpu("d", "n1", 2) == 1
    clock[0] += directory_module.CLAIM_LAPSE_S + 1  # d never registered: its claim lapses
    assert d.claim_cpu("e", "n1", 2) == 1
