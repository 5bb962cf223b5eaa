"""What every paged-attention backend shares: the step's layout types, the backend interfaces, and
the torch code that attends a group of sequences over gathered blocks.

The group helpers (``QueryGroup``, ``query_group``, ``attend``) are the torch backend's whole path
and the Triton backend's path for long prompt chunks, so both read the same pool with one code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from engine_gpu.kv_cache import KVLayout, PagedKVCache
from llm_shared.llama.model import Attention

# Sequences with at most this many new tokens are padded into one batched SDPA call (decodes,
# speculative drafts); longer prompt chunks each get their own call so nobody pads to 256 tokens.
SMALL_QUERY = 16
# Short queries of at most this many sequences go to SDPA with the query heads folded (its fused
# kernel: one call); more go to two batched matmuls. Measured on CPU (AMD EPYC, 2 threads, 9
# heads over 3 KV heads, 128-512 keys, 2026-11-29): SDPA took 18-39 us against 57-70 for one
# bf16 row, 42-108 against 70-121 for four, and lost from eight (79-209 against 88-161); in
# float32 it won for one or two rows only (20-53 against 28-62).
FOLDED_SDPA_ROWS = {torch.float32: 2}
FOLDED_SDPA_ROWS_DEFAULT = 4  # bf16, fp16


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
class QueryGroup:
    """Sequences attended together, queries padded to the longest of them."""

    token_index: torch.Tensor | None  # [Bg, Tq] rows of the flattened batch; None = all N rows in order
    out_rows: torch.Tensor | None  # [n] rows of the flattened output ...
    res_rows: torch.Tensor | None  # [n] ... filled from these rows of the group's [Bg * Tq] result
    block_ids: torch.Tensor  # [Bg * nblk] each sequence's blocks, padded to the group's longest
    # additive (0 / -inf) over S = nblk * block_size keys: [Bg, 1, Tq, S] in the model dtype when
    # "sdpa", else [1, Bg, G * Tq, S] with the query heads folded into the query axis (float32 for "matmul")
    mask: torch.Tensor
    queries: tuple[int, int]  # (Bg, Tq)
    # "sdpa": long queries, SDPA's fused kernel over the heads; "folded_sdpa": short queries of a
    # few sequences, SDPA over the folded heads; "matmul": short queries of many, two batched
    # matmuls (faster on CPU there)
    kernel: Literal["sdpa", "folded_sdpa", "matmul"]


def query_group(
    kv_cache: PagedKVCache, layout: PagedLayout, members: list[int], cu: list[int], dtype: torch.dtype,
    whole: bool, groups_per_kv: int,
) -> QueryGroup:
    """The index tensors and causal mask for attending ``members`` (sequence indices of ``layout``)
    together; ``cu``: each sequence's first row in the flattened batch; ``whole``: the group is
    every row in order, with no padding."""
    device = layout.positions.device
    lengths = [layout.lengths[i] for i in members]
    tq = max(lengths)
    kernel: Literal["sdpa", "folded_sdpa", "matmul"] = (
        "sdpa" if tq > SMALL_QUERY
        else "folded_sdpa" if len(members) <= FOLDED_SDPA_ROWS.get(dtype, FOLDED_SDPA_ROWS_DEFAULT) else "matmul")
    nblk = max(layout.num_blocks[i] for i in members)
    idx = torch.tensor(members, device=device)
    lens = torch.tensor(lengths, device=device)
    starts = torch.tensor([layout.starts[i] for i in members], device=device)
    steps = torch.arange(tq, device=device)
    # key s is visible to the query at absolute position start + t iff s <= start + t
    query_pos = starts[:, None] + steps[None, :]  # [Bg, Tq]
    keys = torch.arange(nblk * kv_cache.block_size, device=device)
    allowed = keys[None, None, :] <= query_pos[:, :, None]  # [Bg, Tq, S]
    if kernel == "sdpa":  # SDPA wants the query dtype
        allowed = allowed.unsqueeze(1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    else:  # folded heads; the matmul path adds the mask to float32 scores
        allowed = allowed.unsqueeze(1).expand(-1, groups_per_kv, -1, -1).flatten(1, 2).unsqueeze(0)
        mask = torch.zeros(allowed.shape, dtype=dtype if kernel == "folded_sdpa" else torch.float32, device=device)
    mask.masked_fill_(~allowed, float("-inf"))
    block_ids = layout.block_table.index_select(0, idx)[:, :nblk].reshape(-1)
    if whole:
        return QueryGroup(None, None, None, block_ids, mask, (len(members), tq), kernel)
    firsts = torch.tensor([cu[i] for i in members], device=device)
    # Padded query rows repeat the sequence's last token: valid reads, results dropped.
    token_index = firsts[:, None] + torch.minimum(steps[None, :], lens[:, None] - 1)
    valid = (steps[None, :] < lens[:, None]).flatten()
    res_rows = valid.nonzero().squeeze(1)
    out_rows = token_index.flatten().index_select(0, res_rows)
    return QueryGroup(token_index, out_rows, res_rows, block_ids, mask, (len(members), tq), kernel)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: QueryGroup) -> torch.Tensor:
    """q [Bg, Tq, H, D] against the group's blocks of a heads-first pool -> [Bg, Tq, H, D]."""
    bg, tq, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    g = heads // kv_heads
    # One gather per tensor; each (head, sequence) slice comes out as a contiguous [S, D] matrix.
    # Blocks as flat rows: index_select copies whole rows then (~6x faster than on a 4-D view).
    blocks = k_cache.shape[1]
    k = k_cache.view(kv_heads, blocks, -1).index_select(1, group.block_ids).view(kv_heads, bg, -1, dim)  # [KVH, Bg, S, D]
    v = v_cache.view(kv_heads, blocks, -1).index_select(1, group.block_ids).view(kv_heads, bg, -1, dim)
    if group.kernel == "sdpa":  # Bg is 1 here, so the transposes are free views
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1), attn_mask=group.mask, enable_gqa=True
        )  # [Bg, H, Tq, D]
        return o.transpose(1, 2)
    # Fold the query heads sharing a KV head into the query axis: GQA without repeating K/V.
    qf = q.reshape(bg, tq, kv_heads, g, dim).permute(2, 0, 3, 1, 4).reshape(kv_heads, bg, g * tq, dim)
    if group.kernel == "folded_sdpa":  # KV heads as SDPA's batch, sequences as its heads
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=group.mask)  # [KVH, Bg, G * Tq, D]
        return o.reshape(kv_heads, bg, g, tq, dim).permute(1, 3, 0, 2, 4).reshape(bg, tq, heads, dim)
    # HF-eager style: scores in the model dtype, softmax in float32
    scores = torch.matmul(qf * dim**-0.5, k.transpose(-1, -2)).float() + group.mask  # [KVH, Bg, G * Tq, S]
    o = torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)  # [KVH, Bg, G * Tq, D]
    return o.reshape(kv_heads, bg, g, tq, dim).permute(1, 3, 0, 2, 4).reshape(bg, tq, heads, dim)
