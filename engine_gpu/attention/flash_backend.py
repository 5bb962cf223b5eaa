"""Paged attention through flash-attn's varlen kernel (CUDA only).

Imported only when engine.attention resolves to 'flash_attn', so CPU hosts never import
flash_attn. One ``flash_attn_varlen_func`` call per layer covers the whole mixed batch (prompt
chunks and decodes): queries are packed by ``cu_seqlens_q``, keys are read from the paged pool
through ``block_table`` with per-sequence key lengths from ``cu_seqlens_k``, and ``causal=True``
aligns the mask to the bottom-right corner, i.e. offset by the cached prefix. flash-attn 2.x
requires the page (block) size to be a multiple of 256 for paged KV.
"""

from __future__ import annotations

import torch

from engine_gpu.attention.base import PagedLayout
from engine_gpu.kv_cache import KVLayout, PagedKVCache
from llm_shared.errors import ConfigError

PAGE_MULTIPLE = 256


class FlashPagedAttention:
    def __init__(self, varlen_func: object, kv_cache: PagedKVCache, layout: PagedLayout) -> None:
        device = layout.positions.device
        lengths = layout.lengths
        seq_lens = [s + n for s, n in zip(layout.starts, lengths, strict=True)]
        cu_q, cu_k = [0], [0]
        for n, s in zip(lengths, seq_lens, strict=True):
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + s)
        self._varlen = varlen_func
        self.kv_cache = kv_cache
        self.slot_mapping = layout.slot_mapping
        self.cu_seqlens_q = torch.tensor(cu_q, dtype=torch.int32, device=device)
        self.cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device=device)
        self.max_seqlen_q = max(lengths)
        self.max_seqlen_k = max(seq_lens)
        self.block_table = layout.block_table.to(torch.int32)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, N, H, D]; k, v: [1, N, KVH, D]
        self.kv_cache.write(layer, self.slot_mapping, k[0], v[0])
        k_cache, v_cache = self.kv_cache.layer(layer)  # [num_blocks, block_size, KVH, D]
        out = self._varlen(  # type: ignore[operator]
            q[0],
            k_cache,
            v_cache,
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.max_seqlen_q,
            self.max_seqlen_k,
            causal=True,
            block_table=self.block_table,
        )
        return out.unsqueeze(0)  # [1, N, H, D]


class FlashAttentionBackend:
    name = "flash_attn"
    kv_layout: KVLayout = "blocks_first"  # [num_blocks, page_block_size, KVH, D], as the kernel reads it

    def __init__(self, block_size: int) -> None:
        if block_size % PAGE_MULTIPLE:
            raise ConfigError(
                f"flash-attn's paged kernel needs engine.block_size to be a multiple of {PAGE_MULTIPLE}, "
                f"got {block_size}; use engine.attention = 'torch' or block_size = 256"
            )
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as e:
            raise ConfigError(
                "engine.attention = 'flash_attn' but flash-attn is not installed; "
                "install the 'gpu' extra on a CUDA host or use engine.attention = 'torch'"
            ) from e
        self._varlen = flash_attn_varlen_func

    def prepare(self, kv_cache: PagedKVCache, layout: PagedLayout, dtype: torch.dtype) -> FlashPagedAttention:
        return FlashPagedAttention(self._varlen, kv_cache, layout)
