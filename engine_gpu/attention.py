"""Paged attention objects the model layers call in the engine, and the backend registry.

(``ContiguousAttention``, the past-key/value attention of the reference and ONNX-export path,
lives with the model in llm_shared.llama.model and is re-exported here.)

- ``TorchPagedAttention``: the engine's paged path in plain torch (any device). Each step's index
  tensors are built once (``prepare``) and shared by all layers; per layer it writes the new K/V
  into their slots, gathers each sequence's blocks through its block table (one index_select of
  a heads-first pool) and attends with a causal mask offset by the tokens already cached
  (chunked prefill, decode, drafts alike): SDPA for long prompt chunks, two batched matmuls for
  decode-sized queries, which is several times faster than SDPA for those on CPU.
- flash-attn's paged varlen kernel (engine_gpu.attention_flash), imported only when chosen.
- A Triton kernel that reads the pool through the block table (engine_gpu.attention_triton):
  decodes and speculative verification, split-K for long contexts; imported only when chosen.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine_gpu.kv_cache import KVLayout, PagedKVCache
from llm_shared.errors import ConfigError
from llm_shared.llama.model import Attention, ContiguousAttention

__all__ = ["ContiguousAttention", "DecodeSlots", "PagedLayout", "TorchPagedAttention", "get_attention_backend"]

log = logging.getLogger(__name__)

# Sequences with at most this many new tokens are padded into one batched SDPA call (decodes,
# speculative drafts); longer prompt chunks each get their own call so nobody pads to 256 tokens.
SMALL_QUERY = 16

BACKENDS = ("auto", "torch", "flash_attn", "triton")


@dataclass(frozen=True)
class PagedLayout:
    """Where one step's tokens live; built once per step (engine_gpu.runner.build_layout)."""

    starts: list[int]  # per sequence: tokens already in the cache = position of its first new token
    lengths: list[int]  # per sequence: new tokens this step
    positions: torch.Tensor  # [N] int64: absolute position of each new token
    slot_mapping: torch.Tensor  # [N] int64: cache slot (block * block_size + offset) of each new token
    block_table: torch.Tensor  # [B, max_blocks] int64, rows padded with block 0 (masked, never read unmasked)
    num_blocks: list[int]  # per sequence: blocks covering its positions [0, start + length)


@dataclass(frozen=True)
class DecodeSlots:
    """Where a fixed-size decode step's tokens live (engine_gpu.graph_runner): views of persistent
    buffers, filled in place before every step, so an attention built on them once serves every
    step and can be captured in a CUDA graph."""

    slot_mapping: torch.Tensor  # [B] int64: cache slot of each row's new token (the scratch slot on padded rows)
    block_table: torch.Tensor  # [B, W] int32: each row's blocks; entries past its context are stale, still valid ids
    context_lens: torch.Tensor  # [B] int32: keys each row attends to, its new token included (1 on padded rows)


class AttentionBackend(Protocol):
    name: str
    kv_layout: KVLayout  # the pool layout this backend reads

    def prepare(self, kv_cache: PagedKVCache, layout: PagedLayout, dtype: torch.dtype) -> Attention: ...


class StaticDecodeAttention(Protocol):
    """Attention over ``DecodeSlots``: ``refresh`` reads the slots as they are now (called once per
    step, inside the captured region, before the model), then one call per layer."""

    def refresh(self) -> None: ...

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Group:
    """Sequences attended together, queries padded to the longest of them."""

    token_index: torch.Tensor | None  # [Bg, Tq] rows of the flattened batch; None = all N rows in order
    out_rows: torch.Tensor | None  # [n] rows of the flattened output ...
    res_rows: torch.Tensor | None  # [n] ... filled from these rows of the group's [Bg * Tq] result
    block_ids: torch.Tensor  # [Bg * nblk] each sequence's blocks, padded to the group's longest
    # additive (0 / -inf) over S = nblk * block_size keys: [Bg, 1, Tq, S] in the model dtype when
    # fused, else [1, Bg, G * Tq, S] float32 (query heads folded into the query axis)
    mask: torch.Tensor
    queries: tuple[int, int]  # (Bg, Tq)
    fused: bool  # long queries: SDPA's fused kernel; short ones: two batched matmuls (faster on CPU)


class TorchPagedAttention:
    """One step of paged attention in plain torch; built by ``TorchAttentionBackend.prepare``."""

    def __init__(self, kv_cache: PagedKVCache, layout: PagedLayout, groups: list[_Group]) -> None:
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
            return _attend(q.reshape(*group.queries, heads, dim), k_cache, v_cache, group).reshape(1, n, heads, dim)
        out = q.new_empty(n, heads, dim)
        for group in self.groups:
            res = _attend(q[group.token_index], k_cache, v_cache, group).flatten(0, 1)  # [Bg * Tq, H, D]
            out.index_copy_(0, group.out_rows, res.index_select(0, group.res_rows))
        return out.unsqueeze(0)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group) -> torch.Tensor:
    """q [Bg, Tq, H, D] against the group's blocks of a heads-first pool -> [Bg, Tq, H, D]."""
    bg, tq, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    g = heads // kv_heads
    # One gather per tensor; each (head, sequence) slice comes out as a contiguous [S, D] matrix.
    # Blocks as flat rows: index_select copies whole rows then (~6x faster than on a 4-D view).
    blocks = k_cache.shape[1]
    k = k_cache.view(kv_heads, blocks, -1).index_select(1, group.block_ids).view(kv_heads, bg, -1, dim)  # [KVH, Bg, S, D]
    v = v_cache.view(kv_heads, blocks, -1).index_select(1, group.block_ids).view(kv_heads, bg, -1, dim)
    if group.fused:  # Bg is 1 here, so the transposes are free views
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1), attn_mask=group.mask, enable_gqa=True
        )  # [Bg, H, Tq, D]
        return o.transpose(1, 2)
    # Fold the query heads sharing a KV head into the query axis: GQA without repeating K/V.
    qf = q.reshape(bg, tq, kv_heads, g, dim).permute(2, 0, 3, 1, 4).reshape(kv_heads, bg, g * tq, dim)
    # HF-eager style: scores in the model dtype, softmax in float32
    scores = torch.matmul(qf * dim**-0.5, k.transpose(-1, -2)).float() + group.mask  # [KVH, Bg, G * Tq, S]
    o = torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)  # [KVH, Bg, G * Tq, D]
    return o.reshape(kv_heads, bg, g, tq, dim).permute(1, 3, 0, 2, 4).reshape(bg, tq, heads, dim)


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
        self._group: _Group | None = None

    def refresh(self) -> None:
        rows = self.slots.context_lens.shape[0]
        allowed = self.keys[None, :] < self.slots.context_lens[:, None]  # [B, S]
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        mask = mask[:, None, :].expand(-1, self.groups_per_kv, -1).unsqueeze(0)  # [1, B, G, S]
        self._group = _Group(None, None, None, self.slots.block_table.reshape(-1), mask, (rows, 1), False)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, B, H, D]; k, v: [1, B, KVH, D]
        if self._group is None:
            raise RuntimeError("refresh() must run before the step's first layer")
        self.kv_cache.write(layer, self.slots.slot_mapping, k[0], v[0])
        k_cache, v_cache = self.kv_cache.layer(layer)
        _, rows, heads, dim = q.shape
        return _attend(q[0].reshape(rows, 1, heads, dim), k_cache, v_cache, self._group).reshape(1, rows, heads, dim)


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
        groups = [self._group(kv_cache, layout, m, cu, dtype, whole) for m in members]
        return TorchPagedAttention(kv_cache, layout, groups)

    def _group(
        self, kv_cache: PagedKVCache, layout: PagedLayout, members: list[int], cu: list[int],
        dtype: torch.dtype, whole: bool,
    ) -> _Group:
        device = layout.positions.device
        lengths = [layout.lengths[i] for i in members]
        tq = max(lengths)
        fused = tq > SMALL_QUERY
        nblk = max(layout.num_blocks[i] for i in members)
        idx = torch.tensor(members, device=device)
        lens = torch.tensor(lengths, device=device)
        starts = torch.tensor([layout.starts[i] for i in members], device=device)
        steps = torch.arange(tq, device=device)
        # key s is visible to the query at absolute position start + t iff s <= start + t
        query_pos = starts[:, None] + steps[None, :]  # [Bg, Tq]
        keys = torch.arange(nblk * kv_cache.block_size, device=device)
        allowed = keys[None, None, :] <= query_pos[:, :, None]  # [Bg, Tq, S]
        if fused:  # SDPA wants the query dtype
            allowed = allowed.unsqueeze(1)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        else:  # the matmul path adds the mask to float32 scores of folded heads
            allowed = allowed.unsqueeze(1).expand(-1, self.groups_per_kv, -1, -1).flatten(1, 2).unsqueeze(0)
            mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
        mask.masked_fill_(~allowed, float("-inf"))
        block_ids = layout.block_table.index_select(0, idx)[:, :nblk].reshape(-1)
        if whole:
            return _Group(None, None, None, block_ids, mask, (len(members), tq), fused)
        firsts = torch.tensor([cu[i] for i in members], device=device)
        # Padded query rows repeat the sequence's last token: valid reads, results dropped.
        token_index = firsts[:, None] + torch.minimum(steps[None, :], lens[:, None] - 1)
        valid = (steps[None, :] < lens[:, None]).flatten()
        res_rows = valid.nonzero().squeeze(1)
        out_rows = token_index.flatten().index_select(0, res_rows)
        return _Group(token_index, out_rows, res_rows, block_ids, mask, (len(members), tq), fused)


def get_attention_backend(
    name: str,
    *,
    device: torch.device | str,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype = torch.bfloat16,
) -> AttentionBackend:
    """'torch', 'flash_attn' (CUDA, fp16/bf16 only), 'triton' (CUDA; on CPU only through Triton's
    interpreter, TRITON_INTERPRET=1, for tests), both imported lazily, or 'auto': flash-attn when
    usable, else the Triton kernel on CUDA when triton is installed, else torch."""
    if name not in BACKENDS:
        raise ConfigError(f"engine.attention must be one of {list(BACKENDS)}, got {name!r}")
    device = torch.device(device)
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        usable = device.type == "cuda" and half and importlib.util.find_spec("flash_attn") is not None
        fallback = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
        if usable and block_size % 256 == 0:
            name = "flash_attn"
        else:
            if usable:
                log.warning("flash-attn needs engine.block_size to be a multiple of 256; using %s attention", fallback)
            name = fallback
    if name == "flash_attn":
        if device.type != "cuda":
            raise ConfigError("engine.attention = 'flash_attn' needs engine.device = 'cuda'")
        if not half:
            raise ConfigError("engine.attention = 'flash_attn' needs engine.dtype 'bfloat16' or 'float16'")
        from engine_gpu.attention_flash import FlashAttentionBackend

        return FlashAttentionBackend(block_size)
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                "engine.attention = 'triton' needs engine.device = 'cuda' (on a CPU its kernels run only "
                "through Triton's interpreter, with TRITON_INTERPRET=1 set: for tests, not for serving)"
            )
        if importlib.util.find_spec("triton") is None:
            raise ConfigError("engine.attention = 'triton' but triton is not installed; "
                              "pip install triton, or use engine.attention = 'torch'")
        from engine_gpu.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, device=device)
    return TorchAttentionBackend(num_heads, num_kv_heads)
