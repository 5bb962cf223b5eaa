"""The K/V write of a step's new tokens into the paged pool, as one Triton kernel (and its torch reference).

One program per new token: it reads the token's slot (``block * block_size + offset``), then moves
that token's keys and values for every KV head, [KVH, D] tiles of each, into the pool. Both tensors
go in one launch, where the torch path needs an ``index_copy_`` per tensor. A negative slot means
"padding row, write nothing" (the convention padded CUDA-graph batches need), so padded rows never
touch the pool.

The kernel addresses the pool by strides, so it writes either layout of engine_gpu.kv_cache
(``heads_first`` [KVH, blocks, block_size, D] or ``blocks_first`` [blocks, block_size, KVH, D]);
offsets are computed in int64, as a large pool passes 2**31 elements. Imported only when the
'triton' attention backend is chosen (engine_gpu.attention.triton_backend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_gpu.kv_cache import KVLayout


def pool_strides(cache: torch.Tensor, layout: KVLayout) -> tuple[int, int, int]:
    """(KV head, block, token) strides of one layer's pool in either layout; the head dim is contiguous."""
    assert cache.stride(-1) == 1, "the pool's head dim must be contiguous"
    if layout == "heads_first":
        head, block, token, _ = cache.stride()  # [KVH, blocks, block_size, D]
    else:
        block, token, head, _ = cache.stride()  # [blocks, block_size, KVH, D]
    return head, block, token


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # [N, KVH, D] this step's new keys and values (head dim contiguous)
    k_cache_ptr, v_cache_ptr,  # one layer of the pool, addressed through the strides below
    slot_ptr,  # [N] int64: slot of each new token; < 0 = padding, not written
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ch, stride_cb, stride_ct,  # the pool's (KV head, block, token) strides
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,  # PAGE = block_size
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,  # KV_HEADS and HEAD_DIM padded to powers of two
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # a padding row (slot < 0) masks every lane; folded into the bound, not and-ed in as a scalar,
    # which Triton's interpreter refuses in a mask
    dim_limit = tl.where(slot >= 0, HEAD_DIM, 0)
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < dim_limit)  # [BLOCK_H, BLOCK_D]
    dst = heads[:, None].to(tl.int64) * stride_ch + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct
    dst = dst + dims[None, :]
    k = tl.load(k_ptr + token * stride_kn + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vn + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    layout: KVLayout = "heads_first",
) -> None:
    """k, v [N, KVH, D] into ``slots`` [N] of one layer's pool (k_cache, v_cache in ``layout``)."""
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == k.dtype
    page = k_cache.shape[2] if layout == "heads_first" else k_cache.shape[1]
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *pool_strides(k_cache, layout),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if kv_heads * head_dim >= 1024 else 1,
    )


def store_kv_reference(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    layout: KVLayout = "heads_first",
) -> None:
    """The kernel's contract in plain torch (tests): negative slots are skipped."""
    keep = (slots >= 0).nonzero().squeeze(1)
    slots, k, v = slots[keep], k[keep], v[keep]
    for cache, new in ((k_cache, k), (v_cache, v)):
        if layout == "heads_first":  # [KVH, blocks, block_size, D]
            cache.view(cache.shape[0], -1, cache.shape[-1]).index_copy_(1, slots, new.transpose(0, 1))
        else:  # [blocks, block_size, KVH, D]
            cache.view(-1, cache.shape[2], cache.shape[-1]).index_copy_(0, slots, new)
