"""The replicas' autoscaling policy (queue depth and KV use, with hysteresis) and the [cluster]
table, without a Ray cluster: the policy is a pure function of what the replicas report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from engine_cluster.config import ClusterConfig
from engine_cluster.policy import KV_USE, QUEUE, RUNNING, SLOTS, QueueKvPolicy
from gateway.config import parse_config
from llm_shared.configtools import read_toml
from llm_shared.errors import ConfigError
from llm_shared.models import REPO_ROOT


@dataclass
class Ctx:
    """The fields of ray.serve.config.AutoscalingContext the policy reads."""

    current_num_replicas: int
    aggregated_metrics: dict[str, dict[Any, float]] | None
    policy_state: dict[str, Any] = field(default_factory=dict)


def ctx(*replicas: tuple[float, float, float], slots: float = 4.0) -> Ctx:
    """One (queue, running, kv_use) per reporting replica."""
    metrics: dict[str, dict[Any, float]] = {QUEUE: {}, RUNNING: {}, KV_USE: {}, SLOTS: {}}
    for i, (queue, running, kv) in enumerate(replicas):
        metrics[QUEUE][i], metrics[RUNNING][i], metrics[KV_USE][i], metrics[SLOTS][i] = queue, running, kv, slots
    return Ctx(len(replicas), metrics)


POLICY = QueueKvPolicy(target_queue_per_replica=2.0, target_kv_use=0.75, scale_down_headroom=0.5)


def test_a_queue_past_the_target_adds_the_replicas_it_needs() -> None:
    assert POLICY(ctx((8, 4, 0.3)))[0] == 4  # 8 waiting / 2 per replica
    assert POLICY(ctx((3, 4, 0.3)))[0] == 2
    assert POLICY(ctx((2, 4, 0.3)))[0] == 1  # at the target: enough


def test_kv_use_past_the_target_scales_up_without_a_queue() -> None:
    # Long streams: every slot busy, nothing waiting, but KV nearly full. Ongoing-request counts
    # would not see it; KV use does.
    assert POLICY(ctx((0, 4, 0.95)))[0] == 2
    assert POLICY(ctx((0, 4, 0.95), (0, 4, 0.9)))[0] == 3


def test_scale_down_needs_headroom_at_the_smaller_count() -> None:
    # Two replicas, all slots busy and nothing waiting: one replica could not carry it.
    assert POLICY(ctx((0, 4, 0.2), (0, 4, 0.2)))[0] == 2
    # Light load: one replica carries it below half of every target.
    decision, state = POLICY(ctx((0, 1, 0.1), (0, 0, 0.05)))
    assert decision == 1 and "headroom" in state["reason"]
    # Idle: down one replica at a time.
    assert POLICY(ctx((0, 0, 0.0), (0, 0, 0.0), (0, 0, 0.0)))[0] == 2


def test_a_load_between_the_thresholds_keeps_the_count() -> None:
    """Hysteresis: a load that made the policy add a replica does not make it remove one."""
    up = ctx((3, 4, 0.3))  # 3 waiting on one replica: over the target of 2
    assert POLICY(up)[0] == 2
    after = ctx((0, 3, 0.2), (0, 3, 0.2))  # the same work spread over two, queue drained
    assert POLICY(after)[0] == 2  # 6 running on 4 slots would not fit one replica with headroom


def test_no_reports_yet_keeps_the_current_count() -> None:
    assert POLICY(Ctx(2, None))[0] == 2
    assert POLICY(Ctx(1, {QUEUE: {}, RUNNING: {}, KV_USE: {}, SLOTS: {}}))[0] == 1


@pytest.mark.parametrize(("key", "value", "message"), [
    ("min_replicas", 0, "min_replicas"),
    ("max_replicas", 0, "min_replicas"),
    ("initial_replicas", 9, "initial_replicas"),
    ("target_kv_use", 1.5, "target_kv_use"),
    ("scale_down_headroom", 1.0, "scale_down_headroom"),
    ("route", "random", "wrong type"),
    ("membership_ttl_s", 0.5, "membership_ttl_s"),
    ("app_name", "a b", "app_name"),
    ("retries", 99, "retries"),
])
def test_bad_cluster_values_are_refused_with_the_key(key: str, value: object, message: str) -> None:
    raw = read_toml(REPO_ROOT / "configs" / "cluster.toml")
    raw["cluster"][key] = value
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_the_shipped_cluster_config_loads_and_the_default_needs_no_ray() -> None:
    config = parse_config(read_toml(REPO_ROOT / "configs" / "cluster.toml"))
    assert config.cluster.enabled and config.routing.default == "gpu"
    assert config.cluster.policy_kwargs()["target_queue_per_replica"] == 2.0
    default = parse_config(read_toml(REPO_ROOT / "configs" / "default.toml"))
    assert default.cluster == ClusterConfig() and not default.cluster.enabled


def test_a_cluster_without_the_torch_tier_is_refused() -> None:
    raw = read_toml(REPO_ROOT / "configs" / "cluster.toml")
    raw["routing"]["default"] = "edge"
    with pytest.raises(ConfigError, match="cluster"):
        parse_config(raw)
