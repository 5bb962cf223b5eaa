"""Configuration of the edge tier (the ``[edge]`` table). Pure Python: no llama.cpp, no onnxruntime.

Backends take this object whole and trust it: its limits are checked once, here. The KV cache
is given as a memory budget; a backend turns it into cells with ``kv_cells`` once it knows
what one cell of its model costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llm_shared.configtools import require
from llm_shared.errors import ConfigError

MiB = 2**20


@dataclass(frozen=True)
class EdgeConfig:
    backend: Literal["llama_cpp", "onnx", "synthetic"] = "llama_cpp"
    model: str = "smollm2-135m"
    # Memory for the KV of every sequence (and the drafter). 256 MiB is 11,520 cells of the
    # embedded model in llama.cpp (23,040 bytes each: 30 layers x K and V x 3 heads x 64 x f16).
    kv_cache_mib: float = 256
    # "shared": one cell pool; a sequence may grow to the model's trained context while cells are
    # free (batched greedy output may part from solo output at a near-tie: llama.cpp's attention
    # rounds by cell layout). "per_sequence": each slot a fixed share, batched == solo bit for bit.
    kv_layout: Literal["shared", "per_sequence"] = "shared"
    n_seq_max: int = 8  # concurrent sequences batched in one context
    n_threads: int = 0  # 0 = all cores
    max_queued: int = 64  # waiting requests beyond this are rejected as overloaded
    prefix_reuse: bool = True  # a finished turn's KV stays in its slot for the conversation's next turn
    snapshot_mib: int = 256  # host memory for the KV of idle conversations moved out of their slots (0: none)
    # backend = "synthetic" (load tests, bench/load.py): tokens at this rate per stream, up to this many streams
    synthetic_tokens_per_s: float = 20.0
    synthetic_max_streams: int = 4096

    def __post_init__(self) -> None:
        require(self.backend in ("llama_cpp", "onnx", "synthetic"),
                f"edge.backend must be 'llama_cpp', 'onnx' or 'synthetic', got {self.backend!r}")
        require(0 < self.synthetic_tokens_per_s <= 10_000, "edge.synthetic_tokens_per_s must be in (0, 10000]")
        require(1 <= self.synthetic_max_streams <= 1_000_000, "edge.synthetic_max_streams must be in 1..1000000")
        require(self.kv_layout in ("shared", "per_sequence"),
                f"edge.kv_layout must be 'shared' or 'per_sequence', got {self.kv_layout!r}")
        require(0 < self.kv_cache_mib <= 1 << 20, "edge.kv_cache_mib must be in (0, 1048576]")
        require(1 <= self.n_seq_max <= 64, "edge.n_seq_max must be in 1..64")
        require(self.n_threads >= 0, "edge.n_threads must be >= 0")
        require(self.max_queued >= 0, "edge.max_queued must be >= 0")
        require(self.snapshot_mib >= 0, "edge.snapshot_mib must be >= 0")

    def kv_cells(self, bytes_per_cell: int, *, n_streams: int = 1, granularity: int = 1, at_least: int = 64) -> int:
        """Cells of each of ``n_streams`` caches that fit the budget, a multiple of ``granularity``.

        Raises ``ConfigError`` naming the budget a stream of ``at_least`` cells would need."""
        budget = int(self.kv_cache_mib * MiB)
        cells = budget // (bytes_per_cell * n_streams) // granularity * granularity
        if cells < at_least:
            needed = -(-at_least // granularity) * granularity * bytes_per_cell * n_streams
            raise ConfigError(f"edge.kv_cache_mib = {self.kv_cache_mib:g} holds {budget // bytes_per_cell} KV cells of "
                              f"this model ({bytes_per_cell} bytes each); {n_streams} cache(s) of at least {at_least} "
                              f"cells need {needed / MiB:.2f} MiB")
        return cells
