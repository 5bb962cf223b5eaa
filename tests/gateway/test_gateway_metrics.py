"""Gateway metrics that are not about one request: the collector's pauses of the event loop, and
the per-token series kept without prometheus-client's lock."""

import asyncio
import gc

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.metrics import ITL_BUCKETS, GatewayMetrics, GcPauses
from gateway.process.server import full_collections


def pause_count(metrics: GatewayMetrics, generation: int) -> float:
    value = metrics.registry.get_sample_value("gateway_gc_pause_seconds_count", {"generation": str(generation)})
    return value or 0.0


async def test_the_served_process_runs_a_full_collection_on_its_timer() -> None:
    """``server.gc_full_every_s``: what leaves cycles (closed sessions) does not wait for Python's
    rarer full collections."""
    loop = asyncio.get_running_loop()
    collected = loop.create_future()

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2 and not collected.done():
            loop.call_soon_threadsafe(lambda: collected.done() or collected.set_result(None))

    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, 10_000)  # as served: Python's own full collections are rare
    gc.callbacks.append(seen)
    timer = asyncio.create_task(full_collections(0.05))
    try:
        await asyncio.wait_for(collected, 30)
    finally:
        timer.cancel()
        gc.callbacks.remove(seen)
        gc.set_threshold(young, middle, full)


def test_each_collection_is_timed_while_installed_and_none_after() -> None:
    metrics = GatewayMetrics(dict)
    with GcPauses(metrics):
        gc.collect()
        gc.collect(0)
    assert pause_count(metrics, 2) == 1 and pause_count(metrics, 0) == 1
    assert metrics.registry.get_sample_value("gateway_gc_pause_seconds_sum", {"generation": "2"}) > 0
    gc.collect()  # uninstalled: the process's later collections are not this app's to count
    assert pause_count(metrics, 2) == 1


@given(gaps=st.lists(st.one_of(st.sampled_from(ITL_BUCKETS), st.floats(0, 3, allow_nan=False)), max_size=50),
       tokens=st.integers(0, 10_000))
def test_the_token_series_scrape_as_prometheus_own_histogram_and_counter_would(gaps: list[float], tokens: int) -> None:
    """Same names, labels, bucket bounds (a gap equal to a bound counts in it) and values."""
    metrics = GatewayMetrics(dict)
    series = metrics.token_series("realtime")
    assert metrics.token_series("realtime") is series
    reference = CollectorRegistry()
    itl = Histogram("gateway_inter_token_latency_seconds", "Time between consecutive tokens", ["api"],
                    buckets=ITL_BUCKETS, registry=reference).labels("realtime")
    counted = Counter("gateway_output_tokens", "Tokens generated", ["api"], registry=reference).labels("realtime")
    for gap in gaps:
        series.observe_gap(gap)
        itl.observe(gap)
    series.tokens += tokens
    counted.inc(tokens)

    def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
                for s in family.samples
                if s.name.startswith(("gateway_inter_token_latency_seconds", "gateway_output_tokens"))
                and not s.name.endswith("_created")}

    ours, theirs = samples(metrics.registry), samples(reference)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert abs(ours[key] - value) <= 1e-9 * max(1.0, abs(value)), key
