"""Paged attention for the engine's model layers: pick a backend (``get_attention_backend``).

  base.py                    the step's layout types, the backend interfaces, the torch group attention
  torch_backend.py           'torch': the paged path in plain torch (any device)
  flash_backend.py           'flash_attn': flash-attn's paged varlen kernel (CUDA); imported only when chosen
  triton_backend.py          'triton': a Triton kernel reading the pool through the block table (CUDA, or
                             CPU through Triton's interpreter for tests); imported only when chosen
  paged_attention_triton.py  that kernel, split-K and its merge, with its torch reference

(``ContiguousAttention``, the past-key/value attention of the reference and ONNX-export path,
lives with the model in llm_shared.llama.model.)
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from engine_gpu.attention.base import AttentionBackend
from engine_gpu.attention.torch_backend import TorchAttentionBackend
from llm_shared.errors import ConfigError

__all__ = ["BACKENDS", "get_attention_backend"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "flash_attn", "triton")


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
        from engine_gpu.attention.flash_backend import FlashAttentionBackend

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
        from engine_gpu.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, device=device)
    return TorchAttentionBackend(num_heads, num_kv_heads)
