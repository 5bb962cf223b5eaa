"""Gateway metrics that are not about one request: the collector's pauses of the event loop."""

import gc

from gateway.metrics import GatewayMetrics, GcPauses


def pause_count(metrics: GatewayMetrics, generation: int) -> float:
    value = metrics.registry.get_sample_value("gateway_gc_pause_seconds_count", {"generation": str(generation)})
    return value or 0.0


def test_each_collection_is_timed_while_installed_and_none_after() -> None:
    metrics = GatewayMetrics(dict)
    with GcPauses(metrics):
        gc.collect()
        gc.collect(0)
    assert pause_count(metrics, 2) == 1 and pause_count(metrics, 0) == 1
    assert metrics.registry.get_sample_value("gateway_gc_pause_seconds_sum", {"generation": "2"}) > 0
    gc.collect()  # uninstalled: the process's later collections are not this app's to count
    assert pause_count(metrics, 2) == 1
