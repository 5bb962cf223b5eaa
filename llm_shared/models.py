"""The model registry of a config file: ``[models.<id>]`` tables as ``ModelConfig``s.

Every process reads the same tables (the gateway, the engine core, the client SDK's on-device
fallback), so this lives below all of them; ``tokenizer_for`` finds a model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from llm_shared.configtools import build, require
from llm_shared.errors import ConfigError, ModelFileError
from llm_shared.load_cache import LoadCache
from llm_shared.modelfile import resolve_source
from llm_shared.tokenizer import Tokenizer

# Relative model paths in a config file are relative to the directory holding the packages
# (the repository in a checkout), so a config means the same files from any working directory.
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ModelConfig:
    id: str = ""
    source: str = ""  # path, or package:<module>/<file>
    format: Literal["gguf", "safetensors"] = "gguf"
    tokenizer: str = ""  # tokenizer.json path for safetensors checkpoints; "" = inside the model
    context_length: int = 0  # 0 = read from the model
    family: str = ""  # tokenizer family; a drafter must share its target's family
    # The gateway serves the file at /v1/models/<id>/file (behind the API's keys) for clients that
    # run it on the device when the gateway is away (the JS SDK's in-browser engine). GGUF only.
    downloadable: bool = False

    def __post_init__(self) -> None:
        require(bool(self.id), "every model needs an id")
        require(bool(self.source), f"models.{self.id}.source is required")
        require(not self.downloadable or self.format == "gguf",
                f"models.{self.id}.downloadable needs a gguf model (the on-device runtimes read GGUF)")


def parse_models(raw: Any) -> dict[str, ModelConfig]:
    """The ``[models]`` table of a config file: at least one model, relative paths made absolute."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("[models] must define at least one model, e.g. [models.smollm2-135m]")
    models = {}
    for model_id, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"[models.{model_id}] must be a table")
        model = build(ModelConfig, {"id": model_id, **table}, f"models.{model_id}")
        models[model_id] = replace(model, source=_absolute(model.source), tokenizer=_absolute(model.tokenizer))
    return models


def _absolute(p: str) -> str:
    if not p or p.startswith("package:") or Path(p).expanduser().is_absolute():
        return p
    return str(REPO_ROOT / p)


def require_model(models: Mapping[str, ModelConfig], model_id: str, key: str) -> ModelConfig:
    """The model a tier's ``key`` names, or a ConfigError listing the known ids."""
    if model_id not in models:
        raise ConfigError(f"{key} {model_id!r} is not one of [models]: {sorted(models)}")
    return models[model_id]


def tokenizer_for(model_cfg: ModelConfig, *, cache: LoadCache | None = None) -> Tokenizer:
    """The tokenizer inside a GGUF file (through ``cache``, default ``LoadCache.from_env()``), or
    the tokenizer.json of a safetensors checkpoint."""
    if model_cfg.format == "gguf":
        cache = cache if cache is not None else LoadCache.from_env()
        return Tokenizer.from_gguf(resolve_source(model_cfg.source), cache=cache)
    path = Path(model_cfg.tokenizer) if model_cfg.tokenizer else resolve_source(model_cfg.source) / "tokenizer.json"
    if not path.is_file():
        raise ModelFileError(f"tokenizer file {str(path)!r} not found; set models.{model_cfg.id}.tokenizer")
    return Tokenizer.from_hf(path)
