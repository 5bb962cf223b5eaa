"""The gateway's configuration: TOML files in configs/ loaded into frozen dataclasses.

Validation happens here, at start-up: an unknown key, a wrong type or an impossible value is
a ConfigError naming the key. API keys may come from the file or from the environment
variable named by ``server.api_keys_env``; they are never logged (``repr`` hides them).
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from engine_edge.configtools import build, require
from engine_edge.errors import ConfigError
from engine_gpu.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.toml"


@dataclass(frozen=True)
class ModelConfig:
    id: str = ""
    source: str = ""  # path, or package:<module>/<file>
    format: Literal["gguf", "safetensors"] = "gguf"
    tokenizer: str = ""  # tokenizer.json path for safetensors checkpoints; "" = inside the model
    context_length: int = 0  # 0 = read from the model
    family: str = ""  # tokenizer family; a drafter must share its target's family

    def __post_init__(self) -> None:
        require(bool(self.id), "every model needs an id")
        require(bool(self.source), f"models.{self.id}.source is required")


@dataclass(frozen=True)
class EdgeConfig:
    backend: Literal["llama_cpp", "onnx"] = "llama_cpp"
    model: str = "smollm2-135m"
    n_ctx: int = 18432  # KV cells; every sequence (and the drafter) gets n_ctx // (n_seq_max + 1)
    n_seq_max: int = 8  # concurrent sequences batched in one context
    n_threads: int = 0  # 0 = all cores
    max_queued: int = 64  # waiting requests beyond this are rejected as overloaded

    def __post_init__(self) -> None:
        require(self.n_ctx >= 64, "edge.n_ctx must be >= 64")
        require(1 <= self.n_seq_max <= 64, "edge.n_seq_max must be in 1..64")
        require(self.n_threads >= 0, "edge.n_threads must be >= 0")
        require(self.max_queued >= 0, "edge.max_queued must be >= 0")


@dataclass(frozen=True)
class RoutingConfig:
    default: Literal["edge", "gpu"] = "edge"  # until the cascade decides per turn


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_env: str = "GATEWAY_API_KEYS"  # comma-separated keys, added to api_keys
    allowed_origins: tuple[str, ...] = ()  # browser Origins allowed; empty = same-host only
    max_frame_bytes: int = 256 * 1024
    max_conversation_items: int = 512
    max_conversation_chars: int = 200_000
    max_sessions_per_key: int = 64
    max_sessions: int = 50_000
    idle_timeout_s: float = 600.0
    ping_interval_s: float = 20.0
    ping_timeout_s: float = 20.0
    requests_per_minute: int = 600  # per key; token bucket
    tokens_per_minute: int = 200_000  # per key; output tokens
    send_queue_high: int = 256  # outgoing events queued before deltas are coalesced
    send_queue_limit: int = 4096  # past this the response is cancelled (slow consumer)
    send_queue_max_bytes: int = 4 * 1024 * 1024  # same, in queued bytes (coalesced deltas grow)
    shutdown_grace_s: float = 5.0
    default_max_output_tokens: int = 512
    max_output_tokens: int = 4096

    def __post_init__(self) -> None:
        require(1 <= self.port <= 65535 or self.port == 0, f"server.port must be 0..65535, got {self.port}")
        require(self.max_frame_bytes >= 1024, "server.max_frame_bytes must be >= 1024")
        for name in ("max_conversation_items", "max_conversation_chars", "max_sessions_per_key", "max_sessions",
                     "requests_per_minute", "tokens_per_minute", "send_queue_high", "send_queue_limit", "send_queue_max_bytes",
                     "default_max_output_tokens", "max_output_tokens"):
            require(getattr(self, name) >= 1, f"server.{name} must be >= 1")
        for name in ("idle_timeout_s", "ping_interval_s", "ping_timeout_s", "shutdown_grace_s"):
            require(getattr(self, name) > 0, f"server.{name} must be > 0")
        require(self.send_queue_high < self.send_queue_limit, "server.send_queue_high must be below send_queue_limit")
        require(self.default_max_output_tokens <= self.max_output_tokens,
                "server.default_max_output_tokens must be <= max_output_tokens")

    def all_api_keys(self) -> frozenset[str]:
        from_env = os.environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        return frozenset(k.strip() for k in (*self.api_keys, *from_env.split(",")) if k.strip())

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    models: dict[str, ModelConfig]
    edge: EdgeConfig
    engine: EngineConfig
    routing: RoutingConfig
    path: Path | None = None

    def __post_init__(self) -> None:
        require(self.edge.model in self.models, f"edge.model {self.edge.model!r} is not one of [models]: {sorted(self.models)}")
        require(self.engine.model in self.models, f"engine.model {self.engine.model!r} is not one of [models]: {sorted(self.models)}")
        require(self.models[self.edge.model].format == "gguf",
                f"the edge tier ({self.edge.backend}) needs a gguf model; edge.model {self.edge.model!r} is "
                f"{self.models[self.edge.model].format}")

    def model(self, model_id: str) -> ModelConfig:
        return self.models[model_id]

    def with_server(self, **changes: object) -> Config:
        return replace(self, server=replace(self.server, **changes))


def load_config(path: str | Path = DEFAULT_CONFIG) -> Config:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"config file {str(path)!r} not found") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from e
    return parse_config(raw, path)


def parse_config(raw: dict, path: Path | None = None) -> Config:
    known = {"server", "models", "edge", "engine", "routing"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown}; known sections: {sorted(known)}")
    models_raw = raw.get("models", {})
    if not isinstance(models_raw, dict) or not models_raw:
        raise ConfigError("[models] must define at least one model, e.g. [models.smollm2-135m]")
    models = {}
    for model_id, table in models_raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"[models.{model_id}] must be a table")
        models[model_id] = build(ModelConfig, {"id": model_id, **table}, f"models.{model_id}")
    models = {k: _relative_to_repo(m) for k, m in models.items()}
    return Config(
        server=build(ServerConfig, raw.get("server", {}), "server"),
        models=models,
        edge=build(EdgeConfig, raw.get("edge", {}), "edge"),
        engine=build(EngineConfig, raw.get("engine", {}), "engine"),
        routing=build(RoutingConfig, raw.get("routing", {}), "routing"),
        path=path,
    )


def _relative_to_repo(model: ModelConfig) -> ModelConfig:
    """Relative model paths in a config file are relative to the repository root."""

    def fix(p: str) -> str:
        if not p or p.startswith("package:") or Path(p).expanduser().is_absolute():
            return p
        return str(REPO_ROOT / p)

    return replace(model, source=fix(model.source), tokenizer=fix(model.tokenizer))
