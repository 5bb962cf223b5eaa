"""The paged KV pool: a fixed number of blocks of ``block_size`` tokens, shared by all sequences.

Layout per layer is [num_blocks, block_size, num_kv_heads, head_dim], which is what flash-attn's
paged kernels read and what the torch path gathers by block id. Which block belongs to which
sequence is the block manager's business (plain integers); this module only owns the memory.
"""

from __future__ import annotations

import torch

from engine_gpu.model import ModelArgs

MIB = 1024 * 1024


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
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
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
    ) -> PagedKVCache:
        """Size the pool from ``num_blocks`` when positive, else from the ``kv_cache_mib`` budget."""
        if num_blocks <= 0:
            num_blocks = blocks_for_budget(args, block_size=block_size, dtype=dtype, kv_cache_mib=kv_cache_mib)
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
        )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer: [num_blocks, block_size, KVH, D] views of the pool."""
        return self.k[index], self.v[index]

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
