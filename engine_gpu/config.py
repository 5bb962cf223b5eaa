"""Configuration of the torch engine (scheduler, KV cache, runner). Pure Python, no torch.

The engine core process reads its own tables (``[engine]`` and the model it names from
``[models]``) with ``load_engine_config``; it never needs the gateway's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from llm_shared.configtools import build, read_toml, require
from llm_shared.errors import ConfigError
from llm_shared.models import ModelConfig, parse_models, require_model


@dataclass(frozen=True)
class SpeculativeConfig:
    """``[engine.speculative]``: a drafter proposes, the target verifies in one pass."""

    method: Literal["off", "ngram", "edge"] = "off"  # edge: draft_model through llama.cpp in the core process
    num_draft_tokens: int = 4  # most drafts per sequence and round
    max_batch: int = 8  # no speculation while more sequences than this are decoding
    adaptive: bool = True  # each step priced from measured costs: who drafts, how far, or a plain step
    min_gain: float = 1.2  # a speculative step must promise this many times a plain step's tokens/s (a margin for what pricing misses)
    draft_model: str = ""  # a gguf [models] id with the target's tokenizer (method = "edge")
    draft_kv_mib: float = 64  # the drafter's KV pool (f16 cells; 64 MiB = ~2,900 tokens of a 135M model)
    draft_threads: int = 0  # llama.cpp threads for drafting; 0 = all usable cores
    draft_window: int = 128  # the most context tokens the edge drafter reads (0: all): bounds a catch-up
    ngram_min: int = 2  # n-gram sizes prompt lookup tries, longest first
    ngram_max: int = 4
    initial_acceptance: float = 0.7  # a new sequence's assumed acceptance rate, until it has its own
    initial_cost_ratio: float = 0.1  # a drafter forward / a target forward of as many tokens, until measured

    def __post_init__(self) -> None:
        require(self.method in ("off", "ngram", "edge"),
                f"engine.speculative.method must be 'off', 'ngram' or 'edge', got {self.method!r}")
        require(1 <= self.num_draft_tokens <= 16, "engine.speculative.num_draft_tokens must be in 1..16")
        require(self.max_batch >= 1, "engine.speculative.max_batch must be >= 1")
        require(isinstance(self.min_gain, (int, float)) and 1.0 <= self.min_gain <= 10.0,
                "engine.speculative.min_gain must be in [1, 10]")
        require(isinstance(self.draft_window, int) and 0 <= self.draft_window <= 1 << 20,
                "engine.speculative.draft_window must be an integer >= 0 (0 = the whole context)")
        require(self.draft_kv_mib > 0, "engine.speculative.draft_kv_mib must be positive")
        require(self.draft_threads >= 0, "engine.speculative.draft_threads must be >= 0")
        require(1 <= self.ngram_min <= self.ngram_max <= 16,
                "engine.speculative needs 1 <= ngram_min <= ngram_max <= 16")
        require(0.0 < self.initial_acceptance < 1.0, "engine.speculative.initial_acceptance must be in (0, 1)")
        require(0.0 <= self.initial_cost_ratio <= 10.0, "engine.speculative.initial_cost_ratio must be in [0, 10]")
        require(self.method != "edge" or self.draft_model != "",
                "engine.speculative.method = 'edge' needs draft_model (a gguf model id from [models])")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"  # id in [models]
    # synthetic (load tests only): the gateway serves this tier in-process with tokens of the model's
    # tokenizer at synthetic_tokens_per_s per stream, up to synthetic_max_streams; no core, no torch
    backend: Literal["torch", "synthetic"] = "torch"
    synthetic_tokens_per_s: float = 20.0
    synthetic_max_streams: int = 4096
    device: Literal["cpu", "cuda"] = "cpu"
    # auto: bfloat16 on CUDA, and on a CPU that computes it natively (AVX-512 bf16 or AMX);
    # float32 on other CPUs, where bf16 is emulated (5x slower prefill on an AVX2-only machine)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # auto: flash_attn when usable, else triton on CUDA (when installed), else torch; flash_attn and triton: CUDA only
    attention: Literal["auto", "torch", "flash_attn", "triton"] = "auto"
    # decode steps at padded batch sizes over persistent buffers (engine_gpu.graph_runner). auto: on
    # CUDA with the triton backend, as CUDA graphs captured before ready; on: also elsewhere, run
    # eagerly (the CPU tests' path; slower there); off: every step eager and sized to its batch
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    # overlapped steps: a step's outputs (detokenizing, stop strings, events) are made while the
    # next step's forward runs on the device. auto: on CUDA; on: also on a CPU (tests: nothing
    # runs beside the forward there); off: each step's outputs before the next is planned
    overlap: Literal["auto", "on", "off"] = "auto"
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
    secret_env: str = "ENGINE_CORE_SECRET"  # environment variable holding the core socket's shared secret
    threads: int = 0  # torch intra-op threads in the engine process; 0 = torch default
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        require(self.backend in ("torch", "synthetic"), f"engine.backend must be 'torch' or 'synthetic', got {self.backend!r}")
        require(0 < self.synthetic_tokens_per_s <= 10_000, "engine.synthetic_tokens_per_s must be in (0, 10000]")
        require(1 <= self.synthetic_max_streams <= 1_000_000, "engine.synthetic_max_streams must be in 1..1000000")
        require(self.block_size in (8, 16, 32, 64, 128, 256), f"engine.block_size must be a power of two in 8..256, got {self.block_size}")
        require(self.kv_cache_mib > 0, "engine.kv_cache_mib must be positive")
        require(self.num_blocks >= 0, "engine.num_blocks must be >= 0")
        require(self.max_num_batched_tokens >= self.block_size, "engine.max_num_batched_tokens must be at least block_size")
        require(self.max_num_seqs >= 1, "engine.max_num_seqs must be >= 1")
        require(self.max_waiting >= 0, "engine.max_waiting must be >= 0")
        require(self.max_model_len >= 16, "engine.max_model_len must be >= 16")
        require(self.long_prefill_threshold >= 1, "engine.long_prefill_threshold must be >= 1")
        require(self.threads >= 0, "engine.threads must be >= 0")
        require(self.cuda_graphs in ("auto", "on", "off"),
                f"engine.cuda_graphs must be 'auto', 'on' or 'off', got {self.cuda_graphs!r}")
        require(self.overlap in ("auto", "on", "off"),
                f"engine.overlap must be 'auto', 'on' or 'off', got {self.overlap!r}")
        require(
            self.listen == "" or self.listen.startswith(("unix:", "tcp:")),
            f"engine.listen must be '', 'unix:/path' or 'tcp:host:port', got {self.listen!r}",
        )
        require(
            not (self.attention == "flash_attn" and self.device != "cuda"),
            "engine.attention = 'flash_attn' needs engine.device = 'cuda'",
        )
        # 'triton' on a CPU is refused where the backend is built (engine_gpu.attention), which allows
        # it under TRITON_INTERPRET=1 for tests; the configuration stays free of the environment


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # CPU flags under which torch computes bfloat16 natively


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return set(value.split())
    except OSError:
        pass
    return set()


def resolve_dtype(requested: str, device: str) -> tuple[str, str]:
    """The dtype to run in for ``requested`` ("auto" or a name), and why, for the log."""
    if requested != "auto":
        return requested, "configured"
    if device == "cuda":
        return "bfloat16", "auto: CUDA"
    native = sorted(set(BF16_CPU_FLAGS) & cpu_flags())
    if native:
        return "bfloat16", f"auto: the CPU computes bfloat16 natively ({', '.join(native)})"
    return "float32", "auto: no native bfloat16 on this CPU (no avx512_bf16 or amx_bf16), where it is emulated"


def parse_engine_table(table: Any) -> EngineConfig:
    """``[engine]`` with its ``[engine.speculative]`` sub-table."""
    if not isinstance(table, dict):
        raise ConfigError("[engine] must be a table")
    table = dict(table)
    speculative = build(SpeculativeConfig, table.pop("speculative", {}), "engine.speculative")
    return replace(build(EngineConfig, table, "engine"), speculative=speculative)


def check_engine_models(engine: EngineConfig, models: dict[str, ModelConfig]) -> tuple[ModelConfig, ModelConfig | None]:
    """The model the engine serves and, with an edge drafter, the model it drafts with."""
    target = require_model(models, engine.model, "engine.model")
    spec = engine.speculative
    if spec.method != "edge":
        return target, None
    draft = require_model(models, spec.draft_model, "engine.speculative.draft_model")
    if draft.format != "gguf":
        raise ConfigError(f"engine.speculative.draft_model {draft.id!r} is {draft.format}; the edge drafter "
                          "runs llama.cpp and needs a gguf model")
    if draft.family and target.family and draft.family != target.family:
        raise ConfigError(f"engine.speculative.draft_model {draft.id!r} is of the {draft.family!r} tokenizer family "
                          f"but the target {target.id!r} is {target.family!r}; a drafter must share its target's tokenizer")
    return target, draft


def load_engine_config(path: str | Path) -> tuple[ModelConfig, EngineConfig, ModelConfig | None]:
    """The engine's own tables of a config file: ``[engine]``, the ``[models]`` entry it serves,
    and the one it drafts with (None unless ``engine.speculative.method = "edge"``)."""
    raw = read_toml(path)
    engine = parse_engine_table(raw.get("engine", {}))
    target, draft = check_engine_models(engine, parse_models(raw.get("models")))
    return target, engine, draft
