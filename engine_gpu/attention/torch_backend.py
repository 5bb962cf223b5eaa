"""The 'torch' attention backend: the engine's paged path in plain torch (any device).

Each step's index tensors are built once (``prepare``) and shared by all layers; per layer it
writes the new K/V into their slots, gathers each sequence's blocks through its block table (one
index_select of a heads-first pool) and attends with a causal mask offset by the tokens already
cached (chunked prefill, decode, drafts alike): SDPA for long prompt chunks and for the
decode-sized queries of a few sequences (query heads folded: one fused call), two batched matmuls
for those of many, which is faster than SDPA there on CPU (engine_gpu.attention.base:
``query_group``, ``attend``, ``FOLDED_SDPA_ROWS``).
"""

from __future__ import annotations

import torch

from engine_gpu.attention.base import SMALL_QUERY, DecodeSlots, PagedLayout, QueryGroup, attend, query_group
from engine_gpu.kv_cache import KVLayout, PagedKVCache


class TorchPagedAttention:
    """One step of paged attention in plain torch; built by ``TorchAttentionBackend.prepare``."""

    def __init__(self, kv_cache: PagedKVCache, layout: PagedLayout, groups: list[QueryGroup]) -> None:
        self.kv_cache = kv_cache
        self.slot_mapping = layout.slot_mapping
        self.groups = groups

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, N, H, D]; k, v: [1, N, KVH, D]
        self.kv_cache.write(layer, self.slot_mapping, k[0], v[0])
        k_cache, v_cache = self.kv_cache.layer(layer)  # [KVH, num_blocks, block_size, D]
        q = q[0]
        n, heads, dim = q.shape
        if len(self.groups) == 1 and self.groups[0].token_index is None:
            group = self.groups[0]
            return attend(q.reshape(*group.queries, heads, dim), k_cache, v_cache, group).reshape(1, n, heads, dim)
        out = q.new_empty(n, heads, dim)
        for group in self.groups:
            res = attend(q[group.token_index], k_cache, v_cache, group).flatten(0, 1)  # [Bg * Tq, H, D]
            out.index_copy_(0, group.out_rows, res.index_select(0, group.res_rows))
        return out.unsqueeze(0)


class TorchStaticDecodeAttention:
    """Decode over ``DecodeSlots`` in plain torch: every row gathers its whole table (fixed shapes,
    W blocks) and masks what lies past its context. On CPU it runs eagerly (the static-buffer path
    that CI tests); it reads W blocks where the step-sized path reads only what the batch needs."""

    def __init__(self, kv_cache: PagedKVCache, slots: DecodeSlots, groups_per_kv: int) -> None:
        self.kv_cache = kv_cache
        self.slots = slots
        self.groups_per_kv = groups_per_kv
        width = slots.block_table.shape[1]
        self.keys = torch.arange(width * kv_cache.block_size, device=slots.context_lens.device)  # [S]
        self._group: QueryGroup | None = None

    def refresh(self) -> None:
        rows = self.slots.context_lens.shape[0]
        allowed = self.keys[None, :] < self.slots.context_lens[:, None]  # [B, S]
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        mask = mask[:, None, :].expand(-1, self.groups_per_kv, -1).unsqueeze(0)  # [1, B, G, S]
        self._group = QueryGroup(None, None, None, self.slots.block_table.reshape(-1), mask, (rows, 1), "matmul")

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, B, H, D]; k, v: [1, B, KVH, D]
        if self._group is None:
            raise RuntimeError("refresh() must run before the step's first layer")
        self.kv_cache.write(layer, self.slots.slot_mapping, k[0], v[0])
        k_cache, v_cache = self.kv_cache.layer(layer)
        _, rows, heads, dim = q.shape
        return attend(q[0].reshape(rows, 1, heads, dim), k_cache, v_cache, self._group).reshape(1, rows, heads, dim)


class TorchAttentionBackend:
    name = "torch"
    kv_layout: KVLayout = "heads_first"

    def __init__(self, num_heads: int, num_kv_heads: int) -> None:
        self.groups_per_kv = num_heads // num_kv_heads

    def static_decode(self, kv_cache: PagedKVCache, slots: DecodeSlots) -> TorchStaticDecodeAttention:
        return TorchStaticDecodeAttention(kv_cache, slots, self.groups_per_kv)

    def prepare(self, kv_cache: PagedKVCache, layout: PagedLayout, dtype: torch.dtype) -> TorchPagedAttention:
        small = [i for i, n in enumerate(layout.lengths) if n <= SMALL_QUERY]
        large = [i for i, n in enumerate(layout.lengths) if n > SMALL_QUERY]
        members = ([small] if small else []) + [[i] for i in large]
        whole = len(members) == 1 and len(set(layout.lengths)) == 1  # every row in order, no padding
        cu = [0]
        for n in layout.lengths:
            cu.append(cu[-1] + n)
        groups = [query_group(kv_cache, layout, m, cu, dtype, whole, self.groups_per_kv) for m in members]
        return TorchPagedAttention(kv_cache, layout, groups)
