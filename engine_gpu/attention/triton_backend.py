"""The 'triton' attention backend: paged attention through Triton kernels (CUDA; CPU via the interpreter).

Imported only when engine.attention resolves to 'triton' (engine_gpu.attention), so hosts without
Triton never import it. The kernels live one per file, each beside its torch reference:
engine_gpu.attention.paged_attention_triton (attention over the pool through the block table,
split-K and its merge) and engine_gpu.kv_write_triton (the new tokens' K/V into their slots, both
tensors in one launch).

Per step, ``prepare`` builds the index tensors once for all layers (block table as int32, keys per
sequence, first query row, query count, the scratch for split-K, and the split count from the rule
in ``choose_num_splits``); per layer the callable writes the new K/V, launches the attention kernel
(and the merge) for every sequence with at most MAX_QUERY (16) new tokens, and attends longer
prompt chunks (prefill) through the torch path's own code (engine_gpu.attention.base): SDPA over
that sequence's gathered blocks, one call per chunk, the work there being compute rather than KV
reads. ``static_decode``
serves fixed-shape decode steps from persistent buffers, for CUDA graphs (engine_gpu.graph_runner).

Layout: ``heads_first`` [KVH, blocks, block_size, D], the pool the torch path reads, so the prefill
fallback reads the same memory with no second copy; and for the kernel each (KV head, page) is one
contiguous block_size x D run, so a [BLOCK_N, D] tile is one unbroken stretch of memory.
"""

from __future__ import annotations

import torch
import triton

from engine_gpu.attention.base import DecodeSlots, PagedLayout, QueryGroup, attend, query_group
from engine_gpu.attention.paged_attention_triton import (
    MAX_QUERY,
    KernelBatch,
    choose_num_splits,
    kernel_batch,
    paged_attention,
)
from engine_gpu.kv_cache import KVLayout, PagedKVCache
from engine_gpu.kv_write_triton import store_kv

DEFAULT_SMS = 132  # an H100's SM count: the split rule off CUDA (the interpreter), so tests see the GPU's choices


class TritonPagedAttention:
    """One step of paged attention: the Triton kernel for short queries, torch for long prompt chunks."""

    def __init__(self, kv_cache: PagedKVCache, slot_mapping: torch.Tensor, batch: KernelBatch | None,
                 long_groups: list[QueryGroup]) -> None:
        self.kv_cache = kv_cache
        self.slot_mapping = slot_mapping
        self.batch = batch
        self.long_groups = long_groups

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, N, H, D]; k, v: [1, N, KVH, D]
        k_cache, v_cache = self.kv_cache.layer(layer)  # [KVH, num_blocks, block_size, D]
        store_kv(k_cache, v_cache, self.slot_mapping, k[0], v[0], self.kv_cache.layout)
        q = q[0] if q.stride(-1) == 1 else q[0].contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [N, H, D]
        if self.batch is not None:
            paged_attention(out, q, k_cache, v_cache, self.batch, self.kv_cache.layout)
        for group in self.long_groups:  # prefill chunks: the torch path's SDPA over gathered blocks
            res = attend(q[group.token_index], k_cache, v_cache, group).flatten(0, 1)  # [Tq, H, D]
            out.index_copy_(0, group.out_rows, res.index_select(0, group.res_rows))
        return out.unsqueeze(0)


class TritonStaticDecodeAttention:
    """Decode over ``DecodeSlots`` (engine_gpu.graph_runner): the kernel reads the persistent buffers
    themselves, so nothing is rebuilt per step and the launches can be captured in a CUDA graph. The
    split count is fixed per batch size from the longest context the table can hold; in-kernel each
    sequence cuts its own keys, so a short context leaves the later splits empty (an early exit)."""

    def __init__(self, kv_cache: PagedKVCache, slots: DecodeSlots, *, num_heads: int, num_splits: int) -> None:
        self.kv_cache = kv_cache
        self.slots = slots
        rows, device = slots.context_lens.shape[0], slots.context_lens.device
        group = num_heads // kv_cache.num_kv_heads
        split = num_splits > 1
        scratch = (rows, num_heads, num_splits)
        self.batch = KernelBatch(
            slots.block_table, slots.context_lens,
            torch.arange(rows, dtype=torch.int32, device=device),  # row b is sequence b's only query
            torch.ones(rows, dtype=torch.int32, device=device),
            max(16, triton.next_power_of_2(group)), num_splits,
            torch.arange(rows, device=device) if split else None,
            torch.empty(*scratch, kv_cache.head_dim, dtype=torch.float32, device=device) if split else None,
            torch.empty(*scratch, dtype=torch.float32, device=device) if split else None,
        )

    def refresh(self) -> None:
        """Nothing to derive: the kernels read the slots' buffers as they are at launch."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, B, H, D]; k, v: [1, B, KVH, D]
        k_cache, v_cache = self.kv_cache.layer(layer)
        store_kv(k_cache, v_cache, self.slots.slot_mapping, k[0], v[0], self.kv_cache.layout)
        q = q[0] if q.stride(-1) == 1 else q[0].contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, H, D]
        paged_attention(out, q, k_cache, v_cache, self.batch, self.kv_cache.layout)
        return out.unsqueeze(0)


class TritonAttentionBackend:
    name = "triton"
    # heads_first: the torch path's pool, so long prompt chunks run its code over the same memory;
    # and each (KV head, page) is one contiguous run for the kernel's tiles (module docstring)
    kv_layout: KVLayout = "heads_first"

    def __init__(self, num_heads: int, num_kv_heads: int, *, device: torch.device | str = "cuda",
                 num_splits: int | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.groups_per_kv = num_heads // num_kv_heads  # for long prompt chunks (base.query_group)
        device = torch.device(device)
        on_gpu = device.type == "cuda" and torch.cuda.is_available()
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else DEFAULT_SMS
        self.num_splits = num_splits  # None: choose_num_splits each step; a number forces it (tests)

    def static_decode(self, kv_cache: PagedKVCache, slots: DecodeSlots) -> TritonStaticDecodeAttention:
        """Fixed-shape decode over persistent buffers (engine_gpu.graph_runner's CUDA graphs)."""
        rows, width = slots.block_table.shape
        splits = self.num_splits or choose_num_splits(rows, self.num_kv_heads, width * kv_cache.block_size,
                                                      self.num_sms)
        return TritonStaticDecodeAttention(kv_cache, slots, num_heads=self.num_heads, num_splits=splits)

    def prepare(self, kv_cache: PagedKVCache, layout: PagedLayout, dtype: torch.dtype) -> TritonPagedAttention:
        short = [i for i, n in enumerate(layout.lengths) if n <= MAX_QUERY]
        long = [i for i, n in enumerate(layout.lengths) if n > MAX_QUERY]
        batch = None
        if short:
            longest = max(layout.starts[i] + layout.lengths[i] for i in short)
            splits = self.num_splits or choose_num_splits(len(short), self.num_kv_heads, longest, self.num_sms)
            batch = kernel_batch(layout, short, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                 head_dim=kv_cache.head_dim, num_splits=splits)
        firsts = [0]
        for n in layout.lengths:
            firsts.append(firsts[-1] + n)
        long_groups = [query_group(kv_cache, layout, [i], firsts, dtype, False, self.groups_per_kv) for i in long]
        return TritonPagedAttention(kv_cache, layout.slot_mapping, batch, long_groups)
