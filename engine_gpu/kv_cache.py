"""The paged KV pool: a fixed number of blocks of ``block_size`` tokens, shared by all sequences.

Two memory layouts per layer, chosen by the attention backend that reads the pool:

- ``blocks_first`` [num_blocks, block_size, KVH, D]: what flash-attn's paged kernels read.
- ``heads_first`` [KVH, num_blocks, block_size, D]: the torch path's. Gathering a batch's blocks
  with one ``index_select`` then yields each KV head's keys as a contiguous [S, D] matrix per
  sequence, so attention runs as plain batched matmuls with no transposing copy (on CPU this is
  ~4x faster than gathering the other layout and handing strided tensors to SDPA).

Which block belongs to which sequence is the block manager's business (plain integers); this
module only owns the memory and the slot arithmetic (slot = block * block_size + offset).

A pool built with ``scratch=True`` has one block more than ``num_blocks``, never handed out: the
padded rows of a fixed-size decode step (engine_gpu.graph_runner) and warm-up forwards write
there, so they can run the same code as real rows without touching anyone's KV.
"""

from __future__ import annotations

from typing import Literal

import torch

from llm_shared.llama.model import ModelArgs

MIB = 1024 * 1024
KVLayout = Literal["blocks_first", "heads_first"]


def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for ``block_size`` tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * element


def blocks_for_budget(args: ModelArgs, *, block_size: int, dtype: torch.dtype, kv_cache_mib: int) -> int:
    return (kv_cache_mib * MIB) // bytes_per_block(args, block_size, dtype)


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: KVLayout = "heads_first",
        scratch: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if layout not in ("blocks_first", "heads_first"):
            raise ValueError(f"unknown KV layout {layout!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout: KVLayout = layout
        # the block past the usable ones: padded and warm-up rows write there (None: no such block)
        self.scratch_block: int | None = num_blocks if scratch else None
        blocks = num_blocks + (1 if scratch else 0)
        if layout == "blocks_first":
            shape = (num_layers, blocks, block_size, num_kv_heads, head_dim)
        else:
            shape = (num_layers, num_kv_heads, blocks, block_size, head_dim)
        # Zeroed, not empty: attention reads whole blocks and masks the unused tail, and a NaN bit
        # pattern there would survive the mask (0 * NaN = NaN) and poison the output.
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    @classmethod
    def for_model(
        cls,
        args: ModelArgs,
        *,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_mib: int = 0,
        num_blocks: int = 0,
        layout: KVLayout = "heads_first",
        scratch: bool = False,
    ) -> PagedKVCache:
        """Size the pool from ``num_blocks`` when positive, else from the ``kv_cache_mib`` budget
        (which then pays for the scratch block too)."""
        if num_blocks <= 0:
            num_blocks = blocks_for_budget(args, block_size=block_size, dtype=dtype, kv_cache_mib=kv_cache_mib)
            num_blocks -= 1 if scratch else 0
            if num_blocks < 1:
                need = -(-bytes_per_block(args, block_size, dtype) // MIB)
                raise ValueError(f"kv_cache_mib={kv_cache_mib} holds no block; one block needs {need} MiB")
        return cls(
            num_layers=args.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            dtype=dtype,
            device=device,
            layout=layout,
            scratch=scratch,
        )

    @property
    def scratch_slot(self) -> int:
        """The first slot of the scratch block (ValueError if the pool has none)."""
        if self.scratch_block is None:
            raise ValueError("this KV pool has no scratch block")
        return self.scratch_block * self.block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, as views in this pool's layout."""
        return self.k[index], self.v[index]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, KVH, D] into ``slots`` [N] of ``layer``."""
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):
            if self.layout == "blocks_first":
                cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, new)
            else:
                cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, slots, new.transpose(0, 1))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [N, KVH, D] stored at ``slots`` of ``layer`` (inspection and tests)."""
        out = []
        for cache in (self.k[layer], self.v[layer]):
            if self.layout == "blocks_first":
                out.append(cache.view(-1, self.num_kv_heads, self.head_dim).index_select(0, slots))
            else:
                out.append(cache.view(self.num_kv_heads, -1, self.head_dim).index_select(1, slots).transpose(0, 1))
        return out[0], out[1]

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
