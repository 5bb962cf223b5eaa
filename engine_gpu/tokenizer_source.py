"""Which tokenizer a model config names. Torch-free: the client and the core both call it."""

from __future__ import annotations

from pathlib import Path

from engine_edge.errors import ModelFileError
from engine_edge.modelfile import resolve_source
from engine_edge.tokenizer import Tokenizer
from gateway.config import ModelConfig


def tokenizer_for(model_cfg: ModelConfig) -> Tokenizer:
    """The tokenizer inside a GGUF file, or the tokenizer.json of a safetensors checkpoint."""
    if model_cfg.format == "gguf":
        return Tokenizer.from_gguf(resolve_source(model_cfg.source))
    path = Path(model_cfg.tokenizer) if model_cfg.tokenizer else resolve_source(model_cfg.source) / "tokenizer.json"
    if not path.is_file():
        raise ModelFileError(f"tokenizer file {str(path)!r} not found; set models.{model_cfg.id}.tokenizer")
    return Tokenizer.from_hf(path)
