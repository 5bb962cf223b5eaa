"""Configuration of the edge tier (the ``[edge]`` table). Pure Python: no llama.cpp, no onnxruntime.

Backends take this object whole and trust it: its limits are checked once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llm_shared.configtools import require


@dataclass(frozen=True)
class EdgeConfig:
    backend: Literal["llama_cpp", "onnx"] = "llama_cpp"
    model: str = "smollm2-135m"
    n_ctx: int = 18432  # KV cells; every sequence (and the drafter) gets n_ctx // (n_seq_max + 1)
    n_seq_max: int = 8  # concurrent sequences batched in one context
    n_threads: int = 0  # 0 = all cores
    max_queued: int = 64  # waiting requests beyond this are rejected as overloaded
    kv_unified: bool = False  # llama.cpp: one cell pool for all sequences (batched output may then differ from solo)
    prefix_reuse: bool = True  # a finished turn's KV stays in its slot for the conversation's next turn
    snapshot_mib: int = 256  # host memory for the KV of idle conversations moved out of their slots (0: none)

    def __post_init__(self) -> None:
        require(self.backend in ("llama_cpp", "onnx"), f"edge.backend must be 'llama_cpp' or 'onnx', got {self.backend!r}")
        require(self.n_ctx >= 64, "edge.n_ctx must be >= 64")
        require(1 <= self.n_seq_max <= 64, "edge.n_seq_max must be in 1..64")
        require(self.n_threads >= 0, "edge.n_threads must be >= 0")
        require(self.max_queued >= 0, "edge.max_queued must be >= 0")
        require(self.snapshot_mib >= 0, "edge.snapshot_mib must be >= 0")
