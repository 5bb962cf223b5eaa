"""Decode steps over persistent buffers: CUDA graphs on CUDA, the same code run eagerly elsewhere.

A pure decode step (every sequence one new token) runs at a padded batch size from a fixed ladder
(``capture_sizes``: 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to the most running
sequences). All sizes share one set of persistent buffers: token ids, positions, cache slots,
block tables, context lengths and the output hidden states; each size owns views of their first
rows and an attention the backend built on those views once (``static_decode``). A step writes
its inputs into host staging arrays in place (numpy slices: no tensor is made per step), copies
each buffer's rows to the device once (on a CPU the staging is the buffer), and runs its size:
on CUDA by replaying the graph captured at warm-up, largest size first into one shared memory
pool; elsewhere by calling the same function eagerly. Padded rows decode token 0 at position 0
into the KV pool's scratch block, so they read and write nothing real, and their outputs are
never returned. Prefill chunks, mixed steps and speculative verification stay on
``ModelRunner``'s step-sized eager path.

Only ``capture`` and the replay in ``run`` touch CUDA APIs; CI runs everything else on a CPU.
nano-vllm's ``capture_cudagraph`` is the model followed.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from engine_gpu.attention.base import AttentionBackend, DecodeSlots, StaticDecodeAttention
from engine_gpu.kv_cache import PagedKVCache
from llm_shared.errors import ConfigError
from llm_shared.llama.model import LlamaModel

log = logging.getLogger(__name__)

# Backends whose fixed-shape decode reads only each row's context: worth a graph by default.
# (The torch backend's gathers every row's whole table: right for tests, not for serving.)
GRAPH_BACKENDS = ("triton",)


def capture_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, 8, then +8 up to 64 and +16 beyond, the last >= max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 64 else 16))
    return sizes[: bisect.bisect_left(sizes, max_batch) + 1]


def graphs_wanted(setting: str, device: torch.device, backend: AttentionBackend) -> bool:
    """Whether ``engine.cuda_graphs`` (auto / on / off) turns the fixed-shape decode path on."""
    if setting == "off":
        return False
    if setting == "auto":
        return device.type == "cuda" and backend.name in GRAPH_BACKENDS
    if getattr(backend, "static_decode", None) is None:
        raise ConfigError(f"engine.cuda_graphs = 'on' but the {backend.name} attention backend has no "
                          "fixed-shape decode path; use engine.attention = 'triton' or 'torch'")
    return True


class GraphRunner:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, backend: AttentionBackend, *,
                 max_batch: int, max_model_len: int) -> None:
        if kv_cache.scratch_block is None:
            raise ValueError("fixed-shape decode steps need a KV pool with a scratch block (scratch=True)")
        static_decode = getattr(backend, "static_decode", None)
        if static_decode is None:
            raise ConfigError(f"the {backend.name} attention backend has no fixed-shape decode path")
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        self.sizes = capture_sizes(max_batch)
        self.width = -(-max_model_len // kv_cache.block_size)  # blocks in a table row
        rows = self.sizes[-1]
        device = self.device

        def buffer(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buffer(rows)  # [R]
        self.positions = buffer(rows)  # [R]
        self.slot_mapping = buffer(rows)  # [R]
        self.block_table = buffer(rows, self.width, dtype=torch.int32)  # [R, W]
        self.context_lens = buffer(rows, dtype=torch.int32)  # [R]
        self.hidden = buffer(rows, model.args.hidden_size, dtype=model.embed.weight.dtype)  # [R, hidden]
        inputs = (self.input_ids, self.positions, self.slot_mapping, self.block_table, self.context_lens)
        # Host staging, written through numpy views; on a CPU it is the buffers themselves. On a
        # device, two pinned sets taken in turn: a step planned ahead fills one while the previous
        # step's asynchronous copies may still be reading the other.
        self._on_cpu = on_cpu = device.type == "cpu"
        self._stagings = [_Staging(inputs)] if on_cpu else [
            _Staging(tuple(torch.zeros_like(t, device="cpu").pin_memory() for t in inputs)) for _ in range(2)]
        self._turn = 0
        for staging in self._stagings:
            staging.pad(0, rows, self.kv_cache)
        if not on_cpu:
            self._upload(self._stagings[0], rows)
        self._attention: dict[int, StaticDecodeAttention] = {
            b: static_decode(kv_cache, DecodeSlots(self.slot_mapping[:b], self.block_table[:b], self.context_lens[:b]))
            for b in self.sizes
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int:
        """The padded size a step of ``n`` sequences runs at."""
        if not 0 < n <= self.sizes[-1]:
            raise ValueError(f"{n} sequences: fixed-shape steps take 1..{self.sizes[-1]}")
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def covers(self, lengths: Sequence[int], ends: Sequence[int]) -> bool:
        """Whether a step of these new-token counts, reaching these context lengths, runs here."""
        return (0 < len(lengths) <= self.sizes[-1] and all(n == 1 for n in lengths)
                and max(ends) <= self.width * self.block_size)

    def run(self, token_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
            device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of ``len(token_ids)`` sequences -> hidden states [n, hidden], a view of
        the output buffer that the next step overwrites. ``device_ids`` [n], when given, are the
        tokens instead of ``token_ids`` (a step planned ahead: the previous step's picks, still
        on the device; copied in after the upload, in stream order)."""
        n = len(token_ids)
        b = self.bucket(n)
        staging = self._stagings[self._turn]
        self._turn = (self._turn + 1) % len(self._stagings)
        staging.fill(token_ids, positions, block_tables, self.block_size)
        if staging.filled > n:  # rows real in this staging's last step, padding now
            staging.pad(n, staging.filled, self.kv_cache)
        staging.filled = n
        if not self._on_cpu:
            self._upload(staging, b)
        if device_ids is not None:
            self.input_ids[:n].copy_(device_ids)
        graph = self._graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self._step(b)
        return self.hidden[:n]

    def _upload(self, staging: _Staging, rows: int) -> None:
        # Asynchronous copies from pinned staging: that staging is filled again two steps later,
        # after this step's sampled ids came back to the host, which waits for these copies too.
        device_buffers = (self.input_ids, self.positions, self.slot_mapping, self.block_table, self.context_lens)
        for dst, src in zip(device_buffers, staging.tensors, strict=True):
            dst[:rows].copy_(src[:rows], non_blocking=True)

    def _step(self, b: int) -> None:
        """The captured work of size ``b``: attention metadata from the buffers, the model, the output."""
        attention = self._attention[b]
        attention.refresh()
        hidden = self.model(self.input_ids[None, :b], self.positions[None, :b], attention)[0]  # [b, hidden]
        self.hidden[:b].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> float:
        """On CUDA: run each size once (kernel compilation, allocator warm-up), then capture it,
        largest first into one memory pool. Elsewhere nothing to capture. Returns seconds taken."""
        if self.device.type != "cuda":
            return 0.0
        started = time.perf_counter()
        staging = self._stagings[0]
        staging.pad(0, self.max_batch, self.kv_cache)
        staging.filled = 0
        self._upload(staging, self.max_batch)
        pool = None
        for b in reversed(self.sizes):
            self._step(b)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(b)
            if pool is None:
                pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        log.info("captured decode graphs for batch sizes %s in %.1f s", self.sizes, seconds)
        return seconds


class _Staging:
    """One set of host input arrays (numpy views of ``tensors``: ids, positions, slots, block
    tables, context lengths), filled in place step after step."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors
        self.ids, self.pos, self.slots, self.table, self.ctx = (t.numpy() for t in tensors)
        self.filled = 0  # rows that held a real sequence in its latest step: re-padded by the next

    def fill(self, token_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
             block_size: int) -> None:
        n, bs = len(token_ids), block_size
        self.ids[:n] = token_ids
        self.pos[:n] = positions
        self.ctx[:n] = self.pos[:n]
        self.ctx[:n] += 1
        table, slots = self.table, self.slots
        for row, (blocks, pos) in enumerate(zip(block_tables, positions, strict=True)):
            used = pos // bs + 1  # blocks up to this row's new token; the rest of the row is never read unmasked
            table[row, :used] = blocks[:used]
            slots[row] = blocks[pos // bs] * bs + pos % bs

    def pad(self, start: int, stop: int, kv_cache: PagedKVCache) -> None:
        """Rows [start, stop) decode token 0 at position 0 into the scratch block."""
        self.ids[start:stop] = 0
        self.pos[start:stop] = 0
        self.ctx[start:stop] = 1
        self.slots[start:stop] = kv_cache.scratch_slot
        self.table[start:stop, 0] = kv_cache.scratch_block
