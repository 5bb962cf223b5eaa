"""One CPU budget per host: the thread counts of every compute pool the gateway runs or starts.

On one host the edge tier (llama.cpp or ONNX Runtime threads in the gateway process), the torch
engine core (torch's intra-op threads) and its drafter (llama.cpp threads in the core process)
compute on the same cores. Each pool used to default to every core: on 2 cores the cascade ran
five compute threads at once, each slowed the others, and a busy tier looked dead to its
health probes. Here the pools are sized from one budget, ``[host] cpus`` (0: the cores this
process may run on), so that together they do not exceed it:

- one tier on this host: it gets the whole budget;
- both (the cascade, the torch tier not on a cluster): the edge gets ``edge_share`` of the
  budget, the engine core the rest, each at least one thread. The core's torch threads and its
  drafter take turns within a step (draft, then verify), so both get the core's share. That
  split is what both compute on while both have work; with ``follow_load`` (the default) a
  tier alone with work gets the whole budget (``gateway.tiers.cores``);
- the torch tier on CUDA: its intra-op threads only launch kernels, so one thread; the drafter
  still computes on the CPU and keeps the core's share.

A pool configured explicitly (``edge.n_threads``, ``engine.threads``,
``engine.speculative.draft_threads`` above 0) keeps its setting; the plan says so, and warns
when the settings exceed the budget. Measured on the 2-core dev machine (bench/cascade_load.py,
docs/benchmarks.md): the 1 + 1 split serves the cascade with no tier-down transitions where
every pool on all cores refused turns.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from engine_edge.config import EdgeConfig
from engine_gpu.config import EngineConfig
from llm_shared.configtools import require

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostConfig:
    cpus: int = 0  # the CPU budget of every compute pool on this host; 0: the cores this process may run on
    edge_share: float = 0.5  # the edge tier's share of the budget while the engine core has work too
    # a tier alone with work computes on the whole budget (gateway/tiers/cores.py); false: the
    # split above holds at every moment
    follow_load: bool = True
    lend_after_ms: int = 50  # a tier's cores go to the busy one after it has had no work this long

    def __post_init__(self) -> None:
        require(isinstance(self.cpus, int) and 0 <= self.cpus <= 4096, "host.cpus must be an integer in 0..4096")
        require(0.0 < self.edge_share < 1.0, "host.edge_share must be between 0 and 1 (exclusive)")
        require(isinstance(self.follow_load, bool), "host.follow_load must be true or false")
        require(isinstance(self.lend_after_ms, int) and 0 <= self.lend_after_ms <= 60_000,
                "host.lend_after_ms must be an integer in 0..60000")

    def budget(self) -> int:
        return self.cpus or usable_cpus()


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadPlan:
    """Threads of each compute pool on this host (0 where that pool does not run here)."""

    cpus: int  # the budget
    edge: int  # the edge tier's llama.cpp / onnxruntime threads, in the gateway process
    engine: int  # torch intra-op threads in the engine core process
    drafter: int  # the core's drafter (llama.cpp) threads
    configured: tuple[str, ...] = ()  # pools whose threads the configuration set explicitly

    @property
    def computing_at_once(self) -> int:
        """Threads that may compute at the same moment: the core's torch and drafter alternate."""
        return self.edge + max(self.engine, self.drafter)

    def describe(self) -> str:
        parts = [f"{name} {threads}" + (" (configured)" if name in self.configured else "")
                 for name, threads in (("edge", self.edge), ("torch", self.engine), ("drafter", self.drafter))
                 if threads]
        return f"CPU budget {self.cpus}: " + (", ".join(parts) or "no compute pool on this host")


def plan_threads(host: HostConfig, edge: EdgeConfig | None, engine: EngineConfig | None) -> ThreadPlan:
    """The pools' threads for the tiers this host runs (``None``: that tier is not here, or is
    not computed here: a synthetic tier, the torch tier on a Ray cluster)."""
    cpus = host.budget()
    local_edge = edge is not None and edge.backend != "synthetic"
    local_engine = engine is not None and engine.backend != "synthetic"
    edge_share = cpus if not local_engine else max(1, min(cpus - 1, round(cpus * host.edge_share)))
    core_share = cpus if not local_edge else max(1, cpus - edge_share)
    configured: list[str] = []
    edge_threads = engine_threads = drafter_threads = 0
    if local_edge:
        assert edge is not None
        edge_threads = edge.n_threads or edge_share
        if edge.n_threads:
            configured.append("edge")
    if local_engine:
        assert engine is not None
        engine_threads = engine.threads or (1 if engine.device == "cuda" else core_share)
        if engine.threads:
            configured.append("torch")
        if engine.speculative.method == "edge":
            drafter_threads = engine.speculative.draft_threads or core_share
            if engine.speculative.draft_threads:
                configured.append("drafter")
    plan = ThreadPlan(cpus, edge_threads, engine_threads, drafter_threads, tuple(configured))
    if configured and plan.computing_at_once > cpus:
        log.warning("the configured threads (%s) compute more threads at once than the host's CPU budget of %d: "
                    "the tiers will slow each other down", plan.describe(), cpus)
    return plan


def apply_plan(plan: ThreadPlan, edge: EdgeConfig, engine: EngineConfig) -> tuple[EdgeConfig, EngineConfig]:
    """The tiers' configurations with the plan's thread counts in place of "all cores" (0)."""
    if plan.edge:
        edge = replace(edge, n_threads=plan.edge)
    if plan.engine:
        engine = replace(engine, threads=plan.engine)
    if plan.drafter:
        engine = replace(engine, speculative=replace(engine.speculative, draft_threads=plan.drafter))
    return edge, engine
