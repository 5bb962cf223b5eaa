"""Paged attention as a Triton kernel that reads the KV pool where it lies, with its torch reference.

Used by the 'triton' attention backend (engine_gpu.attention.triton_backend) and imported only with it. On
CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is
imported: ``triton.jit`` picks the interpreter when it decorates), for tests.

The kernel
    Grid (sequences, KV heads, splits). A program owns one sequence and one KV head, and takes all
    of that sequence's new tokens (1 for a decode, up to ``MAX_QUERY`` = 16 for a speculative
    verification) times all the query heads that share the KV head as the rows of one query tile:
    row r is token ``r // GROUP`` and query head ``kv_head * GROUP + r % GROUP``, padded to
    ``BLOCK_M`` >= 16 rows. So each K/V tile is read once per KV head and multiplied against the
    whole group with ``tl.dot`` (GQA without repeating K/V). It walks its keys in [BLOCK_N, D]
    tiles, looking each key's page up in the block table inside the kernel (no gather into a
    contiguous copy; one scalar lookup per tile when a tile lies in one page, as with block_size
    256), masks the tail of the last page and the causal offset (token t of a sequence with ``c``
    cached tokens sees keys ``<= c + t``), and keeps an online softmax in float32 (base 2: the
    scale carries log2(e)). Pointer offsets are int64. The pool is addressed through its strides,
    so either layout of engine_gpu.kv_cache works.

Split-K (flash-decoding)
    At small batch the (sequence, KV head) programs leave most of the GPU idle while each walks a
    long context alone. Then each sequence's keys are cut into ``num_splits`` ranges of whole tiles,
    one program each; a program writes its normalized partial output and its log2-sum-exp to
    float32 scratch, and a small merge kernel (grid: query rows x heads) weighs the partials by
    ``exp2(lse - max lse)``. A split with no keys for a row (a short sequence in a long batch, or
    keys past a draft token's causal limit) writes lse = -inf and weighs nothing; split 0 always
    holds key 0, so every real row has a finite maximum. The rule (``choose_num_splits``): no split
    once sequences x KV heads fill the SMs; else enough splits for about one program per SM, a power
    of two up to 16, and at most one per ``MIN_SPLIT_KEYS`` (256) keys of the longest sequence, so
    the partial writes and the merge stay small next to the reads they spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine_gpu.attention.base import SMALL_QUERY, PagedLayout
from engine_gpu.kv_cache import KVLayout
from engine_gpu.kv_write_triton import pool_strides

MAX_QUERY = SMALL_QUERY  # most new tokens of one sequence the kernel takes; longer chunks go to torch
BLOCK_N = 64  # keys per tile
MAX_SPLITS = 16
MIN_SPLIT_KEYS = 256  # fewest keys of the longest sequence per split


# Triton's interpreter (3.9) multiplies bfloat16 tl.dot operands as their raw 16-bit patterns; under it
# bf16 operands are widened to float32 first. That is exact (a bf16 product fits a float32) and sums in
# float32, as the GPU's bf16 MMA does, so the interpreter checks the GPU's arithmetic.
INTERPRETED = bool(triton.knobs.runtime.interpret)  # read when the kernels below are decorated


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    if WIDEN:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _tile_offsets(table, n0, keys, key_ok, stride_cb, stride_ct, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pool offsets [BLOCK_N] int64 of keys n0 .. n0 + BLOCK_N of one sequence, through its block table."""
    if PAGE >= BLOCK_N:  # tiles start at multiples of BLOCK_N, which divides PAGE: one page per tile
        page = tl.load(table + n0 // PAGE).to(tl.int64)
        offsets = page * stride_cb + (n0 % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_ct
    else:  # a tile spans several pages: one table entry per key
        pages = tl.load(table + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        offsets = pages * stride_cb + (keys % PAGE).to(tl.int64) * stride_ct
    return offsets


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr,  # [N, H, D] the step's queries; the output (written here unless SPLIT)
    k_cache_ptr, v_cache_ptr,  # one layer of the pool, addressed through its strides
    block_table_ptr,  # [B, max_blocks] int32: each sequence's pages
    seq_lens_ptr, q_starts_ptr, q_lens_ptr,  # [B] int32: keys after this step, first query row, queries
    mid_o_ptr, mid_lse_ptr,  # [N, H, splits, D], [N, H, splits] float32 partials (SPLIT only)
    num_splits, sm_scale_log2,  # splits per sequence; D**-0.5 * log2(e)
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_ch, stride_cb, stride_ct,  # the pool's (KV head, block, token) strides
    stride_bt, stride_mn, stride_mh, stride_ms, stride_ln, stride_lh,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(q_starts_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)

    # query tile: row r = (token r // GROUP, query head kv_head * GROUP + r % GROUP)
    rows = tl.arange(0, BLOCK_M)
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_ok = t < q_len
    token = (q_start + t).to(tl.int64)
    last_key = seq_len - q_len + t  # causal: the last key each row sees
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # this program's keys: whole tiles, so no tile straddles two splits
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_ch
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_ch

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a row with no key yet keeps alpha = 1, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        offsets = _tile_offsets(table, n0, keys, key_ok, stride_cb, stride_ct, PAGE, BLOCK_N)  # [BLOCK_N]
        k = tl.load(k_head + offsets[None, :] + dims[:, None],
                    mask=dim_ok[:, None] & key_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = _dot(q, k, PRECISION, WIDEN) * sm_scale_log2  # [BLOCK_M, BLOCK_N] float32
        s = tl.where(key_ok[None, :] & (keys[None, :] <= last_key[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + offsets[:, None] + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
        m_i = m_new

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    store = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # -inf: no key here
        tl.store(mid_o_ptr + token[:, None] * stride_mn + head[:, None] * stride_mh + split * stride_ms
                 + dims[None, :], o, mask=store)
        tl.store(mid_lse_ptr + token * stride_ln + head * stride_lh + split, lse, mask=row_ok)
    else:
        tl.store(out_ptr + token[:, None] * stride_on + head[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store)


@triton.jit
def _merge_splits_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,  # [N, H, splits, D], [N, H, splits] float32; [N, H, D]
    rows_ptr, num_splits,  # [R] int64: the query rows to merge
    stride_mn, stride_mh, stride_ms, stride_ln, stride_lh, stride_on, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    token = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(mid_lse_ptr + token * stride_ln + head * stride_lh + splits, mask=split_ok,
                  other=float("-inf"))  # [BLOCK_S]
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 holds key 0: the max is finite
    o = tl.load(mid_o_ptr + token * stride_mn + head * stride_mh + splits[:, None] * stride_ms + dims[None, :],
                mask=split_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    merged = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token * stride_on + head * stride_oh + dims, merged.to(out_ptr.dtype.element_ty), mask=dim_ok)


def choose_num_splits(batch: int, kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Programs per (sequence, KV head) along the keys: 1 once the grid fills the SMs, else about one
    program per SM, a power of two <= MAX_SPLITS, and at most one split per MIN_SPLIT_KEYS keys."""
    programs = batch * kv_heads
    if programs >= num_sms:
        return 1
    want = triton.next_power_of_2(-(-num_sms // programs))
    by_keys = max_seq_len // MIN_SPLIT_KEYS
    if by_keys < 2:
        return 1
    return min(want, MAX_SPLITS, 1 << (by_keys.bit_length() - 1))


@dataclass(frozen=True)
class KernelBatch:
    """The sequences the kernel attends in one step and its launch shape; built once, used by every layer."""

    block_table: torch.Tensor  # [B, max_blocks] int32: each sequence's pages
    seq_lens: torch.Tensor  # [B] int32: keys of each sequence after this step (cached + new)
    q_starts: torch.Tensor  # [B] int32: row of each sequence's first new token in q
    q_lens: torch.Tensor  # [B] int32: new tokens of each sequence (1..MAX_QUERY)
    block_m: int  # query rows per program: GROUP x the longest query, a power of two >= 16 (tl.dot)
    num_splits: int  # programs per (sequence, KV head) along the keys; 1 = no scratch, no merge
    rows: torch.Tensor | None  # [R] int64: the rows of q these sequences own (the merge's grid)
    mid_o: torch.Tensor | None  # [N, H, splits, D] float32 partial outputs
    mid_lse: torch.Tensor | None  # [N, H, splits] float32 log2-sum-exp of each partial


def kernel_batch(
    layout: PagedLayout, members: list[int], *, num_heads: int, num_kv_heads: int, head_dim: int,
    num_splits: int,
) -> KernelBatch:
    """Index tensors for sequences ``members`` of ``layout`` (each with at most MAX_QUERY new tokens)."""
    device = layout.positions.device
    firsts = [0]
    for n in layout.lengths:
        firsts.append(firsts[-1] + n)
    seq_lens = [layout.starts[i] + layout.lengths[i] for i in members]
    q_lens = [layout.lengths[i] for i in members]
    assert max(q_lens) <= MAX_QUERY
    index = torch.tensor([seq_lens, [firsts[i] for i in members], q_lens], dtype=torch.int32, device=device)
    table = layout.block_table
    if len(members) < len(layout.lengths):
        table = table.index_select(0, torch.tensor(members, device=device))
    group = num_heads // num_kv_heads
    rows = mid_o = mid_lse = None
    if num_splits > 1:
        rows = torch.tensor([r for i in members for r in range(firsts[i], firsts[i + 1])], device=device)
        n = firsts[-1]
        mid_o = torch.empty(n, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        mid_lse = torch.empty(n, num_heads, num_splits, dtype=torch.float32, device=device)
    return KernelBatch(table.to(torch.int32), index[0], index[1], index[2],
                       max(16, triton.next_power_of_2(group * max(q_lens))), num_splits, rows, mid_o, mid_lse)


def paged_attention(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: KernelBatch,
    layout: KVLayout = "heads_first",
) -> None:
    """Attention of ``batch``'s query rows of q [N, H, D] over one layer's pool, into out [N, H, D]."""
    _, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0] if layout == "heads_first" else k_cache.shape[2]
    page = k_cache.shape[2] if layout == "heads_first" else k_cache.shape[1]
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    split = batch.num_splits > 1
    mid_o = batch.mid_o if split else out  # unused pointers when not split
    mid_lse = batch.mid_lse if split else out
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot's inner dim is at least 16
    grid = (batch.seq_lens.shape[0], kv_heads, batch.num_splits)
    _paged_attention_kernel[grid](
        q, out, k_cache, v_cache, batch.block_table, batch.seq_lens, batch.q_starts, batch.q_lens,
        mid_o, mid_lse, batch.num_splits, head_dim**-0.5 * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *pool_strides(k_cache, layout),
        batch.block_table.stride(0), *mid_o.stride()[:3], *mid_lse.stride()[:2],
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=batch.block_m, BLOCK_N=BLOCK_N,
        PAGE=page, SPLIT=split, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN=INTERPRETED and q.dtype == torch.bfloat16,
        num_warps=4, num_stages=2,
    )
    if split:
        assert batch.rows is not None and batch.mid_o is not None and batch.mid_lse is not None
        _merge_splits_kernel[(batch.rows.shape[0], heads)](
            batch.mid_o, batch.mid_lse, out, batch.rows, batch.num_splits,
            *batch.mid_o.stride()[:3], *batch.mid_lse.stride()[:2], out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(batch.num_splits),
            num_warps=1 if head_dim <= 64 else 2,
        )


def paged_attention_reference(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: KernelBatch,
    layout: KVLayout = "heads_first",
) -> None:
    """``paged_attention``'s contract in plain torch, one sequence at a time, float32 softmax (tests)."""
    if layout == "blocks_first":  # [blocks, page, KVH, D] -> [KVH, blocks, page, D]
        k_cache, v_cache = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)
    kv_heads, _, page, head_dim = k_cache.shape
    group = q.shape[1] // kv_heads
    for b in range(batch.seq_lens.shape[0]):
        seq_len, start, n = (int(x[b]) for x in (batch.seq_lens, batch.q_starts, batch.q_lens))
        pages = batch.block_table[b, : -(-seq_len // page)].long()
        k = k_cache[:, pages].flatten(1, 2)[:, :seq_len].float().repeat_interleave(group, 0)  # [H, S, D]
        v = v_cache[:, pages].flatten(1, 2)[:, :seq_len].float().repeat_interleave(group, 0)
        scores = torch.einsum("thd,hsd->hts", q[start:start + n].float(), k) * head_dim**-0.5  # [H, n, S]
        allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]  # [n, S]
        probs = scores.masked_fill(~allowed.to(q.device), float("-inf")).softmax(-1)
        out[start:start + n] = torch.einsum("hts,hsd->thd", probs, v).to(out.dtype)
