"""``/metrics`` of a gateway run as several worker processes: whichever worker a scrape lands on
answers for all of them, every series labelled ``worker="<index>"``.

With ``server.workers`` > 1 the kernel hands each connection, a scrape's too, to any worker
(SO_REUSEPORT), so a worker answering only for itself would show Prometheus a different
process at every scrape. prometheus-client's multiprocess mode is no way out: it cannot carry
the collectors computed at scrape time (engine stats, the per-token series) or gauges set by
a function. So each worker also serves its own registry on a private unix socket in the run
directory its parent made (owner-only), and the worker a scrape reaches asks its siblings
there, each within ``SIBLING_TIMEOUT_S``, and merges the answers. A sibling that does not answer
(restarting) is left out for that scrape and shows as ``gateway_worker_up{worker=...} 0``.
Sum over ``worker`` for the host's figures (``sum without (worker) (...)``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.state import STATE
from gateway.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

WORKER_LABEL = "worker"
SIBLING_TIMEOUT_S = 2.0  # a scrape waits at most this long for a sibling (Prometheus' own timeout is 10 s)
PRIVATE_PATH = "/metrics"
_PRIVATE_RUNNER: web.AppKey[web.AppRunner] = web.AppKey("worker_metrics_runner", web.AppRunner)


def metrics_socket(run_dir: Path, index: int) -> Path:
    """Where worker ``index`` serves its own registry."""
    return run_dir / f"metrics-{index}.sock"


class _Families:
    """A collector yielding families already built (the merged ones), for ``generate_latest``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_expositions(bodies: Mapping[int, str | None]) -> bytes:
    """One exposition of every worker's series, each sample labelled ``worker="<index>"``;
    ``None`` for a worker that did not answer (its ``gateway_worker_up`` is 0)."""
    up = GaugeMetricFamily("gateway_worker_up", "1 when the gateway worker answered this scrape",
                           labels=[WORKER_LABEL])
    merged: dict[str, Metric] = {}
    for index, body in sorted(bodies.items()):
        up.add_metric([str(index)], 0.0 if body is None else 1.0)
        if body is None:
            continue
        for family in text_string_to_metric_families(body):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples += [s._replace(labels={**s.labels, WORKER_LABEL: str(index)}) for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([up, *merged.values()]))
    return generate_latest(registry)


async def fetch_sibling(path: Path, timeout_s: float = SIBLING_TIMEOUT_S) -> str | None:
    """A sibling's own exposition from its private socket; None if it does not answer in time."""
    try:
        connector = aiohttp.UnixConnector(path=str(path))
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(f"http://worker{PRIVATE_PATH}") as response:
                if response.status != 200:
                    return None
                return await response.text()
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        log.debug("no metrics from %s: %s", path, e)
        return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def install(app: web.Application, run_dir: Path, index: int, count: int) -> None:
    """Make ``app`` (worker ``index`` of ``count``) serve its registry on its private socket and
    answer ``GET /metrics`` for every worker. Call before the app starts."""
    own_socket = metrics_socket(run_dir, index)
    siblings = {i: metrics_socket(run_dir, i) for i in range(count) if i != index}

    async def own(request: web.Request) -> web.Response:
        return web.Response(body=app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def start_private(app: web.Application) -> None:
        private = web.Application()
        private.router.add_get(PRIVATE_PATH, own)
        runner = web.AppRunner(private, access_log=None)
        await runner.setup()
        own_socket.unlink(missing_ok=True)  # left by this worker's predecessor, if it was killed
        await web.UnixSite(runner, str(own_socket)).start()
        app[_PRIVATE_RUNNER] = runner

    async def stop_private(app: web.Application) -> None:
        runner = app.get(_PRIVATE_RUNNER)
        if runner is not None:
            await runner.cleanup()
        own_socket.unlink(missing_ok=True)

    @web.middleware
    async def every_worker(request: web.Request, handler: Handler) -> web.StreamResponse:
        """The app's own ``/metrics`` (its operator check included), widened to every worker."""
        response = await handler(request)
        if (request.path != "/metrics" or request.method != "GET" or response.status != 200
                or not isinstance(response, web.Response) or not isinstance(response.body, bytes)):
            return response
        answers = await asyncio.gather(*(fetch_sibling(path) for path in siblings.values()))
        bodies: dict[int, str | None] = {index: response.body.decode(), **dict(zip(siblings, answers, strict=True))}
        return web.Response(body=merge_expositions(bodies), headers={"Content-Type": CONTENT_TYPE})

    app.middlewares.append(every_worker)
    app.on_startup.append(start_private)
    app.on_cleanup.append(stop_private)
