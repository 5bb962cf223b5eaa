"""One CPU budget per host: the compute pools' threads derived from it never exceed it, an explicit
setting wins, and the plan reaches the tiers' configurations."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_edge.config import EdgeConfig
from engine_gpu.config import EngineConfig, SpeculativeConfig
from gateway.config import DEFAULT_CONFIG, load_config
from gateway.config.host import HostConfig, apply_plan, plan_threads, usable_cpus
from gateway.tiers.build import host_plan
from llm_shared.errors import ConfigError

DRAFTING = EngineConfig(speculative=SpeculativeConfig(method="edge", draft_model="smollm2-135m"))


def test_the_default_cascade_on_two_cores_runs_one_thread_per_pool() -> None:
    plan = plan_threads(HostConfig(cpus=2), EdgeConfig(), DRAFTING)
    assert (plan.edge, plan.engine, plan.drafter) == (1, 1, 1) and plan.computing_at_once == 2
    assert plan.describe() == "CPU budget 2: edge 1, torch 1, drafter 1"


def test_one_tier_on_the_host_gets_the_whole_budget() -> None:
    assert plan_threads(HostConfig(cpus=8), EdgeConfig(), None).edge == 8
    alone = plan_threads(HostConfig(cpus=8), None, DRAFTING)
    assert (alone.edge, alone.engine, alone.drafter) == (0, 8, 8)
    synthetic = plan_threads(HostConfig(cpus=8), EdgeConfig(), replace(DRAFTING, backend="synthetic"))
    assert synthetic.edge == 8 and synthetic.engine == 0  # a synthetic tier computes nothing


def test_on_cuda_torch_takes_one_thread_and_the_drafter_the_cores_share() -> None:
    plan = plan_threads(HostConfig(cpus=16, edge_share=0.25), EdgeConfig(), replace(DRAFTING, device="cuda"))
    assert (plan.edge, plan.engine, plan.drafter) == (4, 1, 12)


def test_an_explicit_setting_wins_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    plan = plan_threads(HostConfig(cpus=2), EdgeConfig(n_threads=2), replace(DRAFTING, threads=2))
    assert (plan.edge, plan.engine, plan.drafter) == (2, 2, 1) and plan.configured == ("edge", "torch")
    assert "edge 2 (configured)" in plan.describe()
    assert any("more threads at once than the host's CPU budget of 2" in r.getMessage() for r in caplog.records)


@given(cpus=st.integers(1, 256), share=st.floats(0.01, 0.99), edge=st.booleans(), engine=st.booleans(),
       cuda=st.booleans(), drafting=st.booleans())
def test_the_budget_is_never_exceeded(cpus: int, share: float, edge: bool, engine: bool, cuda: bool,
                                      drafting: bool) -> None:
    engine_cfg = replace(EngineConfig(device="cuda" if cuda else "cpu"),
                         speculative=DRAFTING.speculative if drafting else SpeculativeConfig())
    plan = plan_threads(HostConfig(cpus=cpus, edge_share=share), EdgeConfig() if edge else None,
                        engine_cfg if engine else None)
    pools = int(edge) + int(engine)
    assert plan.computing_at_once <= max(cpus, pools)  # one core and two tiers: one thread each, no fewer
    assert (plan.edge >= 1) == edge and (plan.engine >= 1) == engine and (plan.drafter >= 1) == (engine and drafting)


def test_the_plan_reaches_the_tiers_and_all_cores_means_the_affinity_mask() -> None:
    config = load_config(DEFAULT_CONFIG)
    plan = host_plan(config)
    assert plan.cpus == usable_cpus()
    edge, engine = apply_plan(plan, config.edge, config.engine)
    assert (edge.n_threads, engine.threads, engine.speculative.draft_threads) == (plan.edge, plan.engine, plan.drafter)
    assert host_plan(replace(config, host=HostConfig(cpus=6))).describe() == "CPU budget 6: edge 3, torch 3, drafter 3"
    with pytest.raises(ConfigError, match=r"host\.edge_share"):
        HostConfig(edge_share=1.0)


def test_the_threads_follow_the_load_only_where_they_can_move_safely() -> None:
    from gateway.tiers.build import threads_follow_load, with_host_plan

    shipped = load_config(DEFAULT_CONFIG)
    shipped = replace(shipped, host=replace(shipped.host, cpus=2))
    assert threads_follow_load(shipped)
    planned = with_host_plan(shipped)  # its counts now look configured: the decision travels with it
    assert planned.host.follow_load and planned.edge.n_threads == 1 and planned.engine.threads == 1
    for static in (replace(shipped, host=replace(shipped.host, follow_load=False)),
                   replace(shipped, edge=replace(shipped.edge, n_threads=2)),  # a pool set by hand keeps it
                   replace(shipped, edge=replace(shipped.edge, backend="onnx"))):  # threads fixed in the session
        assert not threads_follow_load(static)
        assert not with_host_plan(static).host.follow_load
    workers = replace(shipped, limits=replace(shipped.limits, backend="redis"),  # what several workers need
                      server=replace(shipped.server, workers=2))
    assert not threads_follow_load(workers)  # every worker's edge would move the one core's threads
