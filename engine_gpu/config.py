"""Configuration of the torch engine (scheduler, KV cache, runner). Pure Python, no torch.

The engine core process reads its own tables (``[engine]`` and the model it names from
``[models]``) with ``load_engine_config``; it never needs the gateway's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llm_shared.configtools import build, read_toml, require
from llm_shared.models import ModelConfig, parse_models, require_model


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"  # id in [models]
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    attention: Literal["auto", "torch", "flash_attn"] = "auto"  # flash_attn: CUDA only
    block_size: int = 16  # tokens per KV block
    kv_cache_mib: int = 512  # memory budget for the KV block pool
    num_blocks: int = 0  # >0 overrides the budget (tests)
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunks + decodes)
    max_num_seqs: int = 32  # running sequences at most
    max_waiting: int = 256  # admission control: queued requests beyond this are rejected
    max_model_len: int = 8192  # prompt + output tokens of one sequence
    enable_prefix_caching: bool = True
    long_prefill_threshold: int = 256  # a prompt chunk is at most this many tokens while others decode
    listen: str = ""  # "unix:/path" or "tcp:host:port"; "" picks a private unix socket
    threads: int = 0  # torch intra-op threads in the engine process; 0 = torch default

    def __post_init__(self) -> None:
        require(self.block_size in (8, 16, 32, 64, 128, 256), f"engine.block_size must be a power of two in 8..256, got {self.block_size}")
        require(self.kv_cache_mib > 0, "engine.kv_cache_mib must be positive")
        require(self.num_blocks >= 0, "engine.num_blocks must be >= 0")
        require(self.max_num_batched_tokens >= self.block_size, "engine.max_num_batched_tokens must be at least block_size")
        require(self.max_num_seqs >= 1, "engine.max_num_seqs must be >= 1")
        require(self.max_waiting >= 0, "engine.max_waiting must be >= 0")
        require(self.max_model_len >= 16, "engine.max_model_len must be >= 16")
        require(self.long_prefill_threshold >= 1, "engine.long_prefill_threshold must be >= 1")
        require(self.threads >= 0, "engine.threads must be >= 0")
        require(
            self.listen == "" or self.listen.startswith(("unix:", "tcp:")),
            f"engine.listen must be '', 'unix:/path' or 'tcp:host:port', got {self.listen!r}",
        )
        require(
            not (self.attention == "flash_attn" and self.device != "cuda"),
            "engine.attention = 'flash_attn' needs engine.device = 'cuda'",
        )


def load_engine_config(path: str | Path) -> tuple[ModelConfig, EngineConfig]:
    """The engine's own tables of a config file: ``[engine]`` and the ``[models]`` entry it serves."""
    raw = read_toml(path)
    engine = build(EngineConfig, raw.get("engine", {}), "engine")
    return require_model(parse_models(raw.get("models")), engine.model, "engine.model"), engine
