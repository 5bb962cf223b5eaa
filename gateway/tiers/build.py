"""Building the engine tiers the configuration asks for.

Loading a model takes seconds and blocks, so it runs in a worker thread while the server
already answers ``/healthz`` (and ``/readyz`` says 503). Only the tiers that routing needs are
built: both for the cascade. The gpu tier is a client of the torch engine's core process
(``engine_gpu.client``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from gateway.auth import cache_salts
from gateway.cascade.confidence import build_scorer
from gateway.cascade.engine import CascadeEngine
from gateway.cascade.health import HealthMonitor
from gateway.cascade.route import Tier, with_role
from gateway.cascade.router import Router
from gateway.config import Config
from gateway.config.host import ThreadPlan, apply_plan, plan_threads
from gateway.metrics import GatewayMetrics
from gateway.tiers.supervisor import SupervisedEngine
from llm_shared.contract import Engine
from llm_shared.errors import ConfigError, PromptTooLongError
from llm_shared.modelfile import check_gguf, resolve_source
from llm_shared.tokenizer import check_same_tokenizer

log = logging.getLogger(__name__)

# Prompts longer than this are tokenized in a worker thread, off the event loop.
INLINE_TOKENIZE_CHARS = 16_384


def needed_tiers(config: Config) -> tuple[str, ...]:
    return config.routing.tiers


def host_plan(config: Config) -> ThreadPlan:
    """The threads of each compute pool this host runs for ``config`` (``gateway.config.host``)."""
    tiers = needed_tiers(config)
    return plan_threads(config.host, config.edge if "edge" in tiers else None,
                        config.engine if "gpu" in tiers and not config.cluster.enabled else None)


def threads_follow_load(config: Config) -> bool:
    """Whether the host plan's threads move between the edge and the torch core here: not with
    ``[host] follow_load`` off, a thread count configured explicitly, one tier computing here, an
    ONNX Runtime edge (its threads are fixed when its session is made), or several gateway
    processes (``server.workers``), whose edges each run their own share and would each move the
    one core's threads."""
    plan = host_plan(config)
    return (config.host.follow_load and not plan.configured and config.server.workers == 1
            and bool(plan.edge and plan.engine) and config.edge.backend == "llama_cpp")


def with_host_plan(config: Config) -> Config:
    """``config`` with every "all cores" thread count replaced by its share of the host's budget,
    and ``host.follow_load`` saying whether those shares move here (``threads_follow_load``: the
    counts written in look configured to it afterwards)."""
    plan = host_plan(config)
    log.info("threads: %s", plan.describe())
    edge, engine = apply_plan(plan, config.edge, config.engine)
    host = replace(config.host, follow_load=threads_follow_load(config))
    return replace(config, edge=edge, engine=engine, host=host)


def edge_model_path(config: Config) -> Path:
    model = config.model(config.edge.model)
    path = resolve_source(model.source, base_dir=config.path.parent if config.path else None)
    return check_gguf(path) if config.edge.backend == "llama_cpp" else path


def build_edge_engine(config: Config) -> Engine:
    """The in-process edge tier (llama.cpp or ONNX Runtime). Blocking: call it in a thread."""
    from engine_edge import create_backend  # the registry imports llama.cpp / onnxruntime only when chosen

    edge = config.edge
    path = edge_model_path(config)
    log.info("loading edge model %s (%s backend) from %s", edge.model, edge.backend, path)
    return create_backend(edge, path)


async def build_gpu_engine(config: Config) -> Engine:
    """The torch engine tier: spawns the engine core process and connects its async client,
    under a supervisor that restarts the core when it dies."""
    from engine_gpu.client import EngineClient  # torch itself is only imported by the core process

    if config.cluster.enabled:
        return await build_cluster_engine(config)
    if config.engine.backend == "synthetic":
        return await build_synthetic_gpu_engine(config)
    log.info("starting the torch engine core for %s on %s (%s)", config.engine.model, config.engine.device,
             config.engine.dtype)
    spec = config.engine.speculative
    draft = config.model(spec.draft_model) if spec.method == "edge" else None

    # On a host it shares with the edge tier, torch's OpenMP threads must not spin between ops
    # on cores the edge's threads need (unless the environment says otherwise). Where the threads
    # follow the load they may: the core computes on more than its share only while the edge is
    # idle, and a passive wait costs a sleep and a wake-up per parallel region (measured here: 2
    # threads then decode no faster than 1; spinning, 1.5x).
    shared = host_plan(config).edge > 0 and not config.host.follow_load  # config: with_host_plan's
    environment = {"OMP_WAIT_POLICY": "PASSIVE"} if shared else {}

    async def start() -> EngineClient:
        return await EngineClient.start(config.model(config.engine.model), config.engine, draft_model_cfg=draft,
                                        environment=environment)

    return SupervisedEngine(await start(), start)  # a core that dies is started again


async def build_synthetic_gpu_engine(config: Config) -> Engine:
    """The torch tier's stand-in for load tests (``[engine] backend = "synthetic"``): the synthetic
    engine in this process, on the engine model's tokenizer; it takes the cascade's drafts as the
    torch engine does."""
    from engine_edge.synthetic_backend import SyntheticEngine
    from llm_shared.models import tokenizer_for

    engine = config.engine
    log.warning("the torch tier is SYNTHETIC (load tests): %s tokens/s per stream, no model", engine.synthetic_tokens_per_s)
    tokenizer = await asyncio.to_thread(tokenizer_for, config.model(engine.model))
    return SyntheticEngine(tokenizer, tokens_per_s=engine.synthetic_tokens_per_s,
                           max_streams=engine.synthetic_max_streams, tier="gpu")


async def build_cluster_engine(config: Config) -> Engine:
    """The torch tier as engine replicas on Ray Serve (``[cluster] enabled``): joins the cluster,
    follows the replicas' membership and routes across them. Ray restarts replicas, not us."""
    from engine_cluster.pool import RayMembership, ReplicaPool, cluster_secret
    from llm_shared.models import tokenizer_for

    cluster = config.cluster
    log.info("joining the Ray cluster at %s for the engine replicas of %s", cluster.ray_address, cluster.app_name)
    tokenizer = await asyncio.to_thread(tokenizer_for, config.model(config.engine.model))
    pool = ReplicaPool(cluster, tokenizer, RayMembership(cluster), secret=cluster_secret(config.engine.secret_env))
    return await pool.start(wait_s=60.0)


async def load_engines(config: Config, *,
                       build_gpu: Callable[[Config], Awaitable[Engine]] | None = None) -> dict[str, Engine]:
    """Build every needed tier off the event loop, each with its share of the host's CPU budget;
    on failure close the ones already built. ``build_gpu`` replaces ``build_gpu_engine`` (a
    worker process connects to the torch engine core its parent started: gateway/process/workers.py)."""
    config = with_host_plan(config)
    engines: dict[str, Engine] = {}
    try:
        for tier in needed_tiers(config):
            if tier == "edge":
                engines[tier] = await asyncio.to_thread(build_edge_engine, config)
            else:
                engines[tier] = await (build_gpu or build_gpu_engine)(config)
    except BaseException:
        await close_engines(engines)
        raise
    return engines


async def close_engines(engines: Mapping[str, Engine]) -> None:
    for tier, engine in engines.items():
        try:
            await engine.close()
        except Exception:  # one tier failing to close must not keep the others open
            log.exception("closing the %s engine failed", tier)


def build_router(config: Config, engines: Mapping[str, Engine], metrics: GatewayMetrics,
                 computing: Callable[[Engine], bool] | None = None) -> Router:
    """The router over the built tiers; for the cascade, its engine and the tiers' health probes.
    ``computing``: where the tiers share the host's cores, whether a tier computes on them now
    (``gateway.tiers.cores.CoreArbiter.computing``)."""
    missing = [tier for tier in needed_tiers(config) if tier not in engines]
    if missing:
        raise ConfigError(f"routing.default = {config.routing.default!r} needs the {' and '.join(missing)} tier(s), "
                          "which were not built")
    routes = config.routing.served()
    salts = cache_salts(config.server)
    if config.routing.default != "cascade":
        return Router(routes, engines, cache_salts=salts)
    tiers = [Tier(name, engines[name], roles) for name, roles in config.routing.roles().items()]  # type: ignore[arg-type]
    drafter, target = with_role(tiers, "drafter"), with_role(tiers, "target")
    check_same_tokenizer(target.engine.tokenizer, drafter.engine.tokenizer, config.edge.model,
                         role="cascade edge model")
    cascade_cfg = config.cascade
    def tier_changed(tier: str, up: bool) -> None:
        metrics.tier_up.labels(tier).set(1.0 if up else 0.0)
        metrics.tier_transitions.labels(tier).inc()

    health = HealthMonitor(engines, interval_s=cascade_cfg.probe_interval_s,
                           stall_timeout_s=cascade_cfg.stall_timeout_s, on_change=tier_changed)
    for tier in engines:
        metrics.tier_up.labels(tier).set(1.0)
    cascade = CascadeEngine(tiers, cascade_cfg, build_scorer(cascade_cfg), health, metrics, computing)
    metrics.cascade_threshold.set_function(cascade.threshold)
    return Router(routes, engines, cascade, cascade_cfg.escalate_keywords, cache_salts=salts)


async def encode_chat(engine: Engine, messages: Sequence[Mapping[str, str]],
                      max_prompt_tokens: int | None = None) -> list[int]:
    """The prompt ids of ``messages`` (contents encoded as plain text: injection-safe).

    With ``max_prompt_tokens`` (the most the serving tiers could take: ``router.prompt_token_limit``),
    a prompt that certainly has more tokens is refused before any tokenizing, with the error the
    tier's own check gives: its rendered bytes over the longest token's bytes
    (``Tokenizer.min_tokens``) is a lower bound on its length."""
    tokenizer = engine.tokenizer
    rendered = None
    if max_prompt_tokens is not None:
        rendered = tokenizer.apply_chat_template(messages)  # rendered once, for the bound and the encoding
        at_least = tokenizer.min_tokens(rendered)
        if at_least > max_prompt_tokens:
            raise PromptTooLongError(
                f"the prompt has at least {at_least} tokens but this model's context leaves room for at most "
                f"{max(max_prompt_tokens, 0)} prompt tokens with the requested output tokens; shorten the conversation "
                "or ask for fewer output tokens", param="messages")
    if sum(len(m.get("content", "")) for m in messages) > INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(tokenizer.encode_chat, messages, rendered=rendered)
    return tokenizer.encode_chat(messages, rendered=rendered)
