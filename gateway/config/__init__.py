"""The gateway's configuration: TOML files in configs/ loaded into frozen dataclasses.

The gateway's own tables each have a module here (``server``, ``cascade`` for routing and the
cascade, ``limits``, ``host`` for the CPU budget); the tiers' and voice's tables are their
packages' own. Nothing in this package imports the rest of the gateway: it is the bottom floor.

Validation happens here, at start-up: an unknown key, a wrong type or an impossible value is
a ConfigError naming the key. API keys may come from the file or from the environment
variable named by ``server.api_keys_env``; they are never logged (``repr`` hides them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from engine_cluster.config import ClusterConfig
from engine_edge.config import EdgeConfig
from engine_gpu.config import EngineConfig, check_engine_models, parse_engine_table
from gateway.config.cascade import CascadeConfig, RoutingConfig
from gateway.config.host import HostConfig
from gateway.config.limits import LimitsConfig
from gateway.config.server import ServerConfig
from llm_shared.configtools import build, read_toml, require
from llm_shared.errors import ConfigError
from llm_shared.models import REPO_ROOT, ModelConfig, parse_models, require_model
from voice.config import VoiceConfig

DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.toml"


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    models: dict[str, ModelConfig]
    edge: EdgeConfig
    engine: EngineConfig
    routing: RoutingConfig
    cascade: CascadeConfig = field(default_factory=CascadeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # the torch tier on Ray Serve replicas
    host: HostConfig = field(default_factory=HostConfig)  # the CPU budget every compute pool here shares
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # where per-key limits live (this process, or Redis)
    voice: VoiceConfig = field(default_factory=VoiceConfig)  # speech in and out of Realtime sessions
    path: Path | None = None

    def __post_init__(self) -> None:
        check_engine_models(self.engine, self.models)  # the served model, and the drafter's if any
        require(require_model(self.models, self.edge.model, "edge.model").format == "gguf",
                f"the edge tier ({self.edge.backend}) needs a gguf model; edge.model {self.edge.model!r} is "
                f"{self.models[self.edge.model].format}")
        if self.routing.default == "cascade":
            edge, gpu = self.models[self.edge.model], self.models[self.engine.model]
            require(edge.family == gpu.family,
                    f"the cascade hands the edge's tokens to the torch tier as drafts, so both need one tokenizer "
                    f"family; edge.model {edge.id!r} is {edge.family!r}, engine.model {gpu.id!r} is {gpu.family!r}")
        require(not self.cluster.enabled or "gpu" in self.routing.tiers,
                "[cluster] enabled serves the torch tier on Ray, but routing.default uses only the edge tier")
        require(not (self.cluster.enabled and self.engine.backend == "synthetic"),
                "[cluster] enabled serves the torch tier on Ray replicas; engine.backend = 'synthetic' serves it "
                "in the gateway process: choose one")
        # The kernel spreads a client's connections over the workers at random: with each worker's
        # own limits a key would get up to N times them, and which ones applied would be chance.
        require(self.server.workers == 1 or self.limits.backend == "redis",
                f'server.workers = {self.server.workers} needs [limits] backend = "redis": with the in-process '
                "backend every worker would keep its own limits, so a key would get up to "
                f"{self.server.workers} times its rate, token and session limits")

    def model(self, model_id: str) -> ModelConfig:
        return self.models[model_id]

    def with_server(self, **changes: object) -> Config:
        return replace(self, server=replace(self.server, **changes))


def load_config(path: str | Path = DEFAULT_CONFIG) -> Config:
    return parse_config(read_toml(path), Path(path))


def parse_config(raw: dict, path: Path | None = None) -> Config:
    known = {"server", "models", "edge", "engine", "routing", "cascade", "cluster", "host", "limits", "voice"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown}; known sections: {sorted(known)}")
    return Config(
        server=build(ServerConfig, raw.get("server", {}), "server"),
        models=parse_models(raw.get("models")),
        edge=build(EdgeConfig, raw.get("edge", {}), "edge"),
        engine=parse_engine_table(raw.get("engine", {})),
        routing=build(RoutingConfig, raw.get("routing", {}), "routing"),
        cascade=build(CascadeConfig, raw.get("cascade", {}), "cascade"),
        cluster=build(ClusterConfig, raw.get("cluster", {}), "cluster"),
        host=build(HostConfig, raw.get("host", {}), "host"),
        limits=build(LimitsConfig, raw.get("limits", {}), "limits"),
        voice=build(VoiceConfig, raw.get("voice", {}), "voice"),
        path=path,
    )

