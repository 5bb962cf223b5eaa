"""How much one gateway process carries, and how it behaves past that (issue 14).

Every arm runs a ``python -m gateway serve`` subprocess with the synthetic edge backend
(``[edge] backend = "synthetic"``: real tokens from the embedded model's tokenizer at 20 tokens/s
per stream, one step loop for all streams, no model arithmetic), so the figures are the
gateway's own. The clients run in this process, on the same 2 cores: lean RFC 6455 sessions
(``bench/_ws_lean.py``: every frame parsed and its JSON decoded, but no task wake per event), so
that the clients' own cost sets the ceiling as late as possible; the report gives both processes'
CPU. Metric definitions follow ``vllm bench serve``: TTFT from the request sent to its first
delta, ITL the gap between consecutive deltas of one response, TPOT a response's time from its
first delta to its last over its output tokens but one, E2EL from the request sent to its
``response.done``, and goodput the completed requests a second that met every SLO of
``--goodput`` (vLLM's syntax, in ms; default ``ttft:1000 tpot:55``: a first token within a
second, and 20 tokens/s within 10%).

- ``streams``: N sessions stream responses of 60 tokens back to back, their first starts spread
  over one response's length, so N streams run at every moment; after that warm-up the ITL and
  TTFT of a 6 s window are taken, with both processes' CPU and the gateway's full garbage
  collections in it. N steps through 100 ... 2,000; ``max_streams_itl_p99_under_100ms`` is the
  largest N whose ITL p99 stayed under 100 ms, whose mean gap between engine steps stayed within
  5% of 50 ms (the streams really got 20 tokens/s: a saturated gateway stretches the engine's
  steps, which a p99 alone can hide) and whose responses all completed.
- ``cascade``: the streams arm on the product's default route, the confidence cascade, with the
  torch tier synthetic too (``[engine] backend = "synthetic"``, the same 20 tokens/s): every turn
  holds its first 8 edge tokens while they are scored, then either the edge keeps it
  (``confident``, the synthetic tokens' probability 0.9 is over the threshold) or, with the
  threshold at 1, the edge request is aborted and the torch tier takes the turn with the held
  tokens as verified drafts (``escalated``). ``cascade_confident_max_streams`` and
  ``cascade_escalated_max_streams`` as above, and each route's gateway CPU per delta over the edge
  route's at the largest level all three sustained (``cascade_*_us_per_delta_over_edge``).
  Released held tokens and verified drafts arrive together, so the 20 tokens/s check reads the
  mean of the gaps that span an engine step (over half of one); the p99 is taken over all gaps.
- ``lane``: 300 streams as above, once with the outbox's fast lane (``server.direct_writes``,
  the default) and once with every frame through the writer task: the gateway's CPU per delta,
  side by side (``writer_task_over_fast_lane_us``).
- ``floor``: what 2,000 streams cost this machine before any gateway code: a bare uvloop process
  writing a delta-sized frame to each of 2,000 connections every 50 ms, and this process reading
  them raw (``floor_2000_writer_cores``): the kernel's share of a delta, which the gateway pays
  on its one event-loop thread on top of its own Python.
- ``overload``: the engine admits 100 streams (``synthetic_max_streams``); a response of 20
  tokens holds one for ~1 s, so it serves ~100 requests/s. Baseline: Poisson arrivals at 0.8x
  that for 8 s (TTFT p99). Overload: Poisson arrivals at 10x (1,000/s) for 8 s, each on a
  session with no response in progress: the excess must be refused fast with a clear error
  (``response.done`` failed, code ``overloaded``; ``overload_reject_p99_ms`` from
  ``response.create`` sent to that), and the admitted ones' TTFT p99 over the baseline's is
  ``overload_accepted_ttft_p99_ratio`` (goal under 2). Then the same 10x as one burst: 1,000
  sessions at the same instant (``burst_reject_p99_ms``, ``burst_accepted_ttft_p99_ratio``): what
  one event loop takes to answer a thousand requests at once.
- ``slow_readers``: 100 sessions that stop reading: each creates a 100 KB item, then floods
  ``conversation.item.retrieve`` and starts a long response, with a 4 KB receive buffer.
  ``slow_reader_rss_mib`` is the server's RSS growth at its peak over 20 s (every session's queue is
  bounded in bytes; the server closes the ones that stay behind after ``slow_client_timeout_s``).

Progress on stderr; a summary and, as the last line, one JSON object with
``max_streams_itl_p99_under_100ms``, ``overload_reject_p99_ms``, ``overload_accepted_ttft_p99_ratio``,
``slow_reader_rss_mib``, the cascade, burst and lane figures and ``cpu``. Everything goes to
bench/out/load.json.

Run: ``.venv/bin/python bench/load.py`` (about 8 minutes on a 2-core machine). ``--smoke``: every
arm at tiny sizes (``SMOKE_SIZES``, ``SMOKE_ARGS``: 20 streams, a 1 s window, the floor at 50
streams, overload against a capacity of 10), under a minute; the figures mean nothing then (the
``floor_2000_writer_cores`` key holds the floor at 50 streams), results in bench/out/smoke/.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import uvloop

from bench._common import (
    SMOKE_HELP,
    cpu_facts,
    percentile,
    progress,
    raise_nofile_limit,
    result_path,
    write_json,
)
from bench._gateway_clients import BenchError
from bench._gateway_server import GatewayProcess
from bench._load_figures import (
    gc_delta,
    overload_figures,
    parse_goodput,
    plot,
    request_figures,
    sustained,
    window_figures,
)
from bench._load_floor import arm_floor, arm_slow_readers
from bench._load_setup import CASCADE_THRESHOLDS, ITL_GOAL_S, TOKENS_PER_S, synthetic_config
from bench._ws_lean import LeanSession, Stream

STEPS = (100, 200, 300, 400, 500, 600, 800, 1000, 1200, 1500, 2000)
CASCADE_STEPS = (200, 400, 600, 800, 1000, 1200, 1500)
FLOOR_STREAMS = 2000  # the goal's stream count, for the machine's floor
LANE_STREAMS = 300  # the fast lane against the writer task, side by side at this many streams
STREAM_TOKENS = 60
DEFAULT_GOODPUT = ("ttft:1000", "tpot:55")
EVENT_TIMEOUT_S = 60.0
MEASURE_S = 6.0  # the window each streams level is measured over, after one response of warm-up
OVERLOAD_TOKENS = 20  # a response holds its stream ~1 s
OVERLOAD_SECONDS = 8.0


@dataclass(frozen=True)
class Sizes:
    """How long and how wide each arm runs: the full run's, or ``SMOKE_SIZES``."""

    stream_tokens: int = STREAM_TOKENS  # a sustained stream's response
    measure_s: float = MEASURE_S
    lane_streams: int = LANE_STREAMS
    lane_pairs: int = 3
    floor_streams: int = FLOOR_STREAMS
    floor_s: float = 5.0
    overload_s: float = OVERLOAD_SECONDS


SMOKE_SIZES = Sizes(stream_tokens=10, measure_s=1.0, lane_streams=20, lane_pairs=1, floor_streams=50, floor_s=1.0,
                    overload_s=1.5)
SMOKE_ARGS = {"steps": [20], "cascade_steps": [20], "capacity": 10, "slow_clients": 5, "slow_seconds": 2.0}


async def open_sessions(url: str, n: int) -> list[LeanSession]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    sessions: list[LeanSession] = []
    for start in range(0, n, 100):  # in waves: a burst of thousands of handshakes is not the load measured here
        sessions += await asyncio.gather(*(LeanSession.open(host, int(port), timeout=EVENT_TIMEOUT_S)
                                           for _ in range(min(100, n - start))))
    return sessions


async def stream_once(session: LeanSession, max_tokens: int) -> Stream:
    return await asyncio.wait_for(session.start_response(max_tokens), EVENT_TIMEOUT_S + max_tokens / TOKENS_PER_S)


async def close_all(sessions: list[LeanSession]) -> None:
    for session in sessions:
        session.close()
    if sessions:
        await asyncio.wait([s.closed for s in sessions], timeout=EVENT_TIMEOUT_S)


class CpuWatch:
    def __init__(self, server: GatewayProcess) -> None:
        self.server = server
        self.me = psutil.Process()

    def read(self) -> tuple[float, float, float]:
        mine = self.me.cpu_times()
        return time.perf_counter(), self.server.cpu_s(), mine.user + mine.system

    @staticmethod
    def share(before: tuple[float, float, float], after: tuple[float, float, float]) -> dict[str, float]:
        wall = after[0] - before[0]
        return {"server_cores": (after[1] - before[1]) / wall, "clients_cores": (after[2] - before[2]) / wall}


async def arm_lane(directory: Path, sizes: Sizes) -> dict[str, Any]:
    """The fast lane against the writer task at ``sizes.lane_streams`` streams, alternated
    ``sizes.lane_pairs`` times (one run of each differs from the next by ±20% on a shared machine):
    the median ratio of the gateway's CPU per delta."""
    runs: dict[str, list[dict[str, Any]]] = {"fast_lane": [], "writer_task": []}
    pairs, streams = sizes.lane_pairs, sizes.lane_streams
    for _ in range(pairs):
        for name, direct in (("fast_lane", True), ("writer_task", False)):
            arm = await arm_streams(directory, (streams,), {}, sizes, direct_writes=direct)
            runs[name].append(arm["levels"][0])
    ratios = sorted(task["server_us_per_delta"] / fast["server_us_per_delta"]
                    for fast, task in zip(runs["fast_lane"], runs["writer_task"], strict=True))
    ratio = ratios[len(ratios) // 2]
    fast_us = sorted(lv["server_us_per_delta"] for lv in runs["fast_lane"])[pairs // 2]
    task_us = sorted(lv["server_us_per_delta"] for lv in runs["writer_task"])[pairs // 2]
    progress(f"at {streams} streams, median of {pairs} alternated pairs: the fast lane {fast_us:.0f} µs of "
             f"server CPU a delta, the writer task {task_us:.0f} µs (ratio {ratio:.2f}; pairs {[round(r, 2) for r in ratios]})")
    return {"streams": streams, "runs": runs, "ratios": ratios, "writer_task_over_fast_lane_us": ratio,
            "fast_lane_us_per_delta": fast_us, "writer_task_us_per_delta": task_us}


async def sustain(session: LeanSession, first_at: float, stop_at: float, out: list[Stream], tokens: int) -> None:
    """One session streaming responses of ``tokens`` back to back from ``first_at`` until ``stop_at``."""
    await asyncio.sleep(max(0.0, first_at - time.perf_counter()))
    while time.perf_counter() < stop_at:
        out.append(await stream_once(session, tokens))


async def arm_streams(directory: Path, steps: tuple[int, ...], slo: dict[str, float], sizes: Sizes,
                      direct_writes: bool = True, cascade_threshold: float | None = None,
                      tables: Mapping[str, Mapping[str, Any]] | None = None, label: str = "") -> dict[str, Any]:
    """Sustained streams at each level of ``steps`` on the edge route, or on the cascade with
    ``cascade_threshold``; ``tables`` as ``synthetic_config`` takes them. The gateway's CPU and
    memory are its process's and its children's (the workers of ``server.workers``)."""
    route = ("edge" if cascade_threshold is None else f"cascade (threshold {cascade_threshold:g})") + label
    server = GatewayProcess(synthetic_config(directory, "streams", max_streams=20_000, direct_writes=direct_writes,
                                             cascade_threshold=cascade_threshold, tables=tables),
                            directory / "streams.log", "127.0.0.1", tree=True)
    server.start()
    levels = []
    sessions: list[LeanSession] = []
    response_s, measure_s = sizes.stream_tokens / TOKENS_PER_S, sizes.measure_s
    try:
        await server.wait_ready()
        url = f"ws://127.0.0.1:{server.port}/v1/realtime"
        watch = CpuWatch(server)
        for n in steps:
            sessions += await open_sessions(url, n - len(sessions))
            # Sustained: every session streams back to back, the first starts spread over one
            # response's length, so N streams run at any moment and starts are spread evenly.
            # Measured over a window after that warm-up.
            now = time.perf_counter()
            start, end = now + response_s + 0.5, now + response_s + 0.5 + measure_s
            streams: list[Stream] = []
            runners = asyncio.gather(*(sustain(ws, now + response_s * i / n, end, streams, sizes.stream_tokens)
                                       for i, ws in enumerate(sessions)))
            await asyncio.sleep(max(0.0, start - time.perf_counter()))
            before, gc_before = watch.read(), await asyncio.to_thread(server.gc_pauses)
            await asyncio.sleep(max(0.0, end - time.perf_counter()))
            cpu = CpuWatch.share(before, watch.read())
            gc_window = gc_delta(gc_before, await asyncio.to_thread(server.gc_pauses))
            await runners
            figures = window_figures(streams, start, end)
            routes = collections.Counter(f"{s.tier}/{s.route}" if s.route else s.tier for s in streams)
            in_window = [s for s in streams if start <= s.sent < end]
            level = {"streams": n, **figures, **request_figures(in_window, measure_s, slo), "routes": dict(routes),
                     "completed": sum(s.status in ("completed", "incomplete") for s in streams),
                     "responses": len(streams), "rss_mib": server.rss() / 2**20, **cpu, "gc": gc_window}
            level["server_us_per_delta"] = cpu["server_cores"] * measure_s / max(1, figures["deltas"]) * 1e6
            levels.append(level)
            progress(f"{route} streams {n:5d}: step gap mean {level['step_gap_mean_ms']:.1f} ms, ITL p50 {level['itl_p50_ms']:.0f} ms, p99 {level['itl_p99_ms']:.0f} ms, "
                     f"TTFT p99 {level['ttft_p99_ms']:.0f} ms, TPOT mean {level['tpot_mean_ms']:.1f} ms, "
                     f"goodput {level['goodput']:.0f}/{level['request_throughput']:.0f} requests/s, "
                     f"server {cpu['server_cores']:.2f} cores "
                     f"({level['server_us_per_delta']:.0f} µs a delta), clients {cpu['clients_cores']:.2f} cores, "
                     f"RSS {level['rss_mib']:.0f} MiB, {gc_window['full_collections']:.0f} full GC "
                     f"({gc_window['full_collection_s'] * 1e3:.0f} ms)")
            if level["itl_p99_ms"] >= ITL_GOAL_S * 1e3 * 3:
                break  # far past the goal: the next step only measures a saturated machine
    finally:
        await close_all(sessions)
        server.stop()
    passing = [lv["streams"] for lv in levels if sustained(lv)]
    return {"levels": levels, "direct_writes": direct_writes, "route": route,
            "max_streams_itl_p99_under_100ms": max(passing, default=0)}


async def arm_cascade(directory: Path, steps: tuple[int, ...], slo: dict[str, float], sizes: Sizes,
                      edge: dict[str, Any] | None) -> dict[str, Any]:
    """The streams arm on the cascade, confident and escalated; each route's CPU per delta over the
    edge route's (``edge``: the streams arm of this run) at the largest level all sustained."""
    result: dict[str, Any] = {}
    for name, threshold in CASCADE_THRESHOLDS.items():
        arm = await arm_streams(directory, steps, slo, sizes, cascade_threshold=threshold)
        expected = {"confident": "edge/confident", "escalated": "gpu/escalated"}[name]
        for level in arm["levels"]:
            if set(level["routes"]) != {expected}:
                raise BenchError(f"the {name} cascade arm routed its turns {level['routes']}, not all {expected}")
        result[name] = arm
        result[f"cascade_{name}_max_streams"] = arm["max_streams_itl_p99_under_100ms"]
    if edge is not None:
        per_delta = {name: {lv["streams"]: lv["server_us_per_delta"] for lv in arm["levels"] if sustained(lv)}
                     for name, arm in (("edge", edge), *((n, result[n]) for n in CASCADE_THRESHOLDS))}
        common = set.intersection(*(set(levels) for levels in per_delta.values()))
        if common:
            n = result["compared_at_streams"] = max(common)
            for name in CASCADE_THRESHOLDS:
                result[f"cascade_{name}_us_per_delta_over_edge"] = per_delta[name][n] / per_delta["edge"][n]
            progress(f"gateway CPU a delta at {n} streams: edge {per_delta['edge'][n]:.0f} µs, cascade confident "
                     f"{per_delta['confident'][n]:.0f} µs, escalated {per_delta['escalated'][n]:.0f} µs")
    return result


async def poisson(sessions: list[LeanSession], rate: float, seconds: float, max_tokens: int) -> list[Stream]:
    """Requests at Poisson arrivals of ``rate`` per second for ``seconds``, each on a session with no
    response in progress (vLLM's ``--request-rate``); returns every request's outcome."""
    rng = random.Random(14)
    idle = list(sessions)
    done: list[Stream] = []
    pending: set[asyncio.Future[Stream]] = set()
    begin = time.perf_counter()
    at = begin

    def finished(session: LeanSession, future: asyncio.Future[Stream]) -> None:
        pending.discard(future)
        idle.append(session)
        if not future.cancelled() and future.exception() is None:
            done.append(future.result())

    while (at := at + rng.expovariate(rate)) < begin + seconds:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        if not idle:
            raise BenchError(f"all {len(sessions)} sessions have a response in progress: add sessions")
        session = idle.pop()
        future = session.start_response(max_tokens)
        pending.add(future)
        future.add_done_callback(lambda f, s=session: finished(s, f))
    if pending:
        await asyncio.wait(pending, timeout=EVENT_TIMEOUT_S + max_tokens / TOKENS_PER_S)
    return done


async def arm_overload(directory: Path, capacity: int, slo: dict[str, float], seconds: float) -> dict[str, Any]:
    """Offered load at 10x what the engine serves, sustained (Poisson arrivals), against a baseline
    at 0.8x; then the same 10x as one burst (every request at the same instant)."""
    server = GatewayProcess(synthetic_config(directory, "overload", max_streams=capacity), directory / "overload.log",
                            "127.0.0.1")
    server.start()
    sessions: list[LeanSession] = []
    # A response of OVERLOAD_TOKENS tokens holds its stream ~1 s: the engine serves ~capacity per second.
    served_per_s = capacity / (OVERLOAD_TOKENS / TOKENS_PER_S)
    try:
        await server.wait_ready()
        url = f"ws://127.0.0.1:{server.port}/v1/realtime"
        sessions = await open_sessions(url, capacity * 15)
        base = await poisson(sessions, 0.8 * served_per_s, seconds, OVERLOAD_TOKENS)
        base_ttft = [s.first - s.sent for s in base if s.first is not None]
        base_requests = request_figures(base, seconds, slo)
        progress(f"overload baseline: {0.8 * served_per_s:.0f} requests/s for {seconds:g} s, "
                 f"{len(base_ttft)} served ({sum(s.status == 'failed' for s in base)} refused), "
                 f"TTFT p99 {percentile(base_ttft, 99) * 1e3:.0f} ms")
        gc_before = await asyncio.to_thread(server.gc_pauses)
        over = await poisson(sessions, 10 * served_per_s, seconds, OVERLOAD_TOKENS)
        sustained = overload_figures(over, base_ttft) | request_figures(over, seconds, slo)
        sustained["gc"] = gc_delta(gc_before, await asyncio.to_thread(server.gc_pauses))
        progress(f"overload 10x sustained ({10 * served_per_s:.0f} requests/s): {sustained['accepted']} admitted, "
                 f"{sustained['refused']} refused ({sustained['refused_codes']}), refusal p99 "
                 f"{sustained['reject_p99_ms']:.0f} ms, admitted TTFT p99 {sustained['accepted_ttft_p99_ms']:.0f} ms "
                 f"({sustained['accepted_ttft_p99_ratio']:.2f}x), goodput {sustained['goodput']:.0f} requests/s "
                 f"(baseline {base_requests['goodput']:.0f}); {sustained['gc']['full_collections']:.0f} full GC "
                 f"({sustained['gc']['full_collection_s'] * 1e3:.0f} ms)")
        burst_sessions = sessions[:capacity * 10]
        burst = list(await asyncio.gather(*(stream_once(ws, OVERLOAD_TOKENS) for ws in burst_sessions)))
        at_once = overload_figures(burst, base_ttft)
        progress(f"overload 10x burst ({len(burst_sessions)} at once): {at_once['accepted']} admitted, "
                 f"{at_once['refused']} refused, refusal p99 {at_once['reject_p99_ms']:.0f} ms, admitted TTFT p99 "
                 f"{at_once['accepted_ttft_p99_ms']:.0f} ms ({at_once['accepted_ttft_p99_ratio']:.2f}x)")
        return {"capacity": capacity, "served_per_s": served_per_s, "seconds": seconds,
                "baseline_requests": len(base), "baseline_refused": sum(s.status == "failed" for s in base),
                "baseline_ttft_p99_ms": percentile(base_ttft, 99) * 1e3, "baseline": base_requests,
                "sustained": sustained, "burst": at_once,
                "overload_goodput_ratio": sustained["goodput"] / max(1e-9, base_requests["goodput"]),
                "overload_reject_p99_ms": sustained["reject_p99_ms"],
                "overload_accepted_ttft_p99_ratio": sustained["accepted_ttft_p99_ratio"]}
    finally:
        await close_all(sessions)
        server.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes: Sizes = args.sizes
    raise_nofile_limit(4 * max(*args.steps, *args.cascade_steps, sizes.floor_streams) + 1000)
    slo = parse_goodput(args.goodput)
    result: dict[str, Any] = {"slo_ms": slo, "sizes": asdict(sizes), "smoke": args.smoke}
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        directory = Path(tmp)
        if "streams" in args.arms:
            result["streams"] = await arm_streams(directory, tuple(args.steps), slo, sizes)
        if "cascade" in args.arms:
            result["cascade"] = await arm_cascade(directory, tuple(args.cascade_steps), slo, sizes,
                                                  result.get("streams"))
        if "lane" in args.arms:
            result["lane"] = await arm_lane(directory, sizes)
        if "floor" in args.arms:
            result["floor"] = await arm_floor(sizes.floor_streams, sizes.floor_s)
        if "overload" in args.arms:
            result["overload"] = await arm_overload(directory, args.capacity, slo, sizes.overload_s)
        if "slow_readers" in args.arms:
            result["slow_readers"] = await arm_slow_readers(directory, args.slow_clients, args.slow_seconds)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=["streams", "cascade", "lane", "floor", "overload", "slow_readers"])
    parser.add_argument("--steps", nargs="+", type=int, default=list(STEPS))
    parser.add_argument("--cascade-steps", nargs="+", type=int, default=list(CASCADE_STEPS))
    parser.add_argument("--capacity", type=int, default=100)
    parser.add_argument("--goodput", nargs="+", default=list(DEFAULT_GOODPUT), metavar="KEY:MS",
                        help="SLOs for goodput, as vllm bench serve takes them (ttft, tpot, e2el in ms)")
    parser.add_argument("--slow-clients", type=int, default=100)
    parser.add_argument("--slow-seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, help="results (default: bench/out/load.json)")
    parser.add_argument("--plot", type=Path, help="figure (default: bench/out/load_streams.png)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE_ARGS} and SMOKE_SIZES")
    args = parser.parse_args(argv)
    args.sizes = SMOKE_SIZES if args.smoke else Sizes()
    if args.smoke:
        for key, value in SMOKE_ARGS.items():
            setattr(args, key, value)
    args.out = args.out or result_path("load.json", args.smoke)
    args.plot = args.plot or result_path("load_streams.png", args.smoke)
    result = uvloop.run(run(args))
    result["cpu"] = cpu_facts()
    write_json(args.out, result)
    if "streams" in result:
        plot(result, args.plot)
        progress(f"plot: {args.plot}")
    streams, overload, slow = result.get("streams", {}), result.get("overload", {}), result.get("slow_readers", {})
    cascade = result.get("cascade", {})
    figures = {
        "max_streams_itl_p99_under_100ms": streams.get("max_streams_itl_p99_under_100ms"),
        "overload_reject_p99_ms": overload.get("overload_reject_p99_ms"),
        "overload_accepted_ttft_p99_ratio": overload.get("overload_accepted_ttft_p99_ratio"),
        "slow_reader_rss_mib": slow.get("slow_reader_rss_mib"),
        "overload_goodput_ratio": overload.get("overload_goodput_ratio"),
        "burst_reject_p99_ms": overload.get("burst", {}).get("reject_p99_ms"),
        "burst_accepted_ttft_p99_ratio": overload.get("burst", {}).get("accepted_ttft_p99_ratio"),
        "writer_task_over_fast_lane_us": result.get("lane", {}).get("writer_task_over_fast_lane_us"),
        "floor_2000_writer_cores": result.get("floor", {}).get("writer_cores"),
        **{f"cascade_{name}_{key}": cascade.get(f"cascade_{name}_{key}")
           for name in CASCADE_THRESHOLDS for key in ("max_streams", "us_per_delta_over_edge")},
    }
    for name in CASCADE_THRESHOLDS:
        if name in cascade:
            print(f"cascade, {name}: {cascade[name]['max_streams_itl_p99_under_100ms']} streams sustained")
    for level in streams.get("levels", []):
        print(f"{level['streams']:5d} streams: ITL p99 {level['itl_p99_ms']:.0f} ms, TPOT mean {level['tpot_mean_ms']:.1f} ms, "
              f"goodput {level['goodput']:.0f} of {level['request_throughput']:.0f} requests/s, server "
              f"{level['server_cores']:.2f} cores ({level['server_us_per_delta']:.0f} µs a delta), clients "
              f"{level['clients_cores']:.2f} cores")
    if lane := result.get("lane"):
        print(f"server CPU a delta at {lane['streams']} streams: the writer task "
              f"{lane['writer_task_over_fast_lane_us']:.2f}x the fast lane's")
    for name, phase in (("sustained", overload.get("sustained")), ("burst", overload.get("burst"))):
        if phase:
            print(f"overload 10x {name}: {phase['refused']} of {phase['requests']} refused ({phase['refused_codes']}), "
                  f"refusal p99 {phase['reject_p99_ms']:.0f} ms, admitted TTFT p99 {phase['accepted_ttft_p99_ratio']:.2f}x "
                  "the baseline's")
    if slow:
        print(f"slow readers: +{slow['slow_reader_rss_mib']:.0f} MiB at peak "
              f"({slow['unbounded_would_be_mib']:.0f} MiB of replies were asked for)")
    rounded = {k: None if v is None else round(v, 3) for k, v in figures.items()}
    print(json.dumps({**rounded, "cpu": result["cpu"]["model"], "python_ref_ms": result["cpu"]["python_ref_ms"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
