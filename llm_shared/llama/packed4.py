"""A GGUF's 4-bit weights kept as 4-bit blocks, multiplied without dequantizing them (on a CPU).

The edge tier's GGUF stores the projections as Q4_0 or Q4_1 blocks of 32 weights along a row: a
scale ``d`` and (Q4_1) a minimum ``m``, both float16, and 32 four-bit values ``q``. The loader
dequantizes them to the model dtype (bf16: 2 bytes a weight), and a decode step of a few rows then
reads 4x the bytes the file holds. torch has CPU kernels for exactly this layout
(``_weight_int4pack_mm_for_cpu``: 4-bit values in groups of 32 along the input, a scale and a zero
per group, ``w = (q - 8) * scale + zero``): Q4_0 is ``scale = d, zero = 0``, Q4_1 is
``scale = d, zero = m + 8 d``. ``Blocks4`` reads a tensor's blocks from the file's bytes, the same
numbers ``gguf.quants.dequantize`` gives (``dequantize`` here says so in the tests); ``Packed4``
holds them in the kernel's layout. Whether a shape and row count goes through it is
``matmul.tune``'s decision, timed on this CPU: on the one measured, a batch-1 decode step of
SmolLM2-135M took 8.7 ms this way against 16.9 dequantized, while past ~16 rows the dense product
was faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # weights per block, along a row
Q4_0, Q4_1 = 2, 3  # ggml's type numbers
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20}


def available() -> bool:
    """Whether this torch has the CPU kernel."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass(frozen=True)
class Blocks4:
    """One weight [out, in] as 4-bit values and per-block scale and zero: ``w = (q - 8) * scale + zero``."""

    q: torch.Tensor  # uint8 [out, in], 0..15
    scale: torch.Tensor  # float32 [out, in / 32]
    zero: torch.Tensor  # float32 [out, in / 32]

    @classmethod
    def from_gguf(cls, raw: np.ndarray, tensor_type: int, shape: tuple[int, int]) -> Blocks4 | None:
        """A GGUF tensor's blocks (``raw``: its bytes, as ``GGUFReader`` maps them), or None when
        it is not Q4_0 or Q4_1."""
        size = _BLOCK_BYTES.get(int(tensor_type))
        out, inp = shape
        if size is None or inp % GROUP:
            return None
        blocks = np.asarray(raw, dtype=np.uint8).reshape(out, inp // GROUP, size)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if int(tensor_type) == Q4_1:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            nibbles = blocks[..., 4:]
            zero = m + 8 * d
        else:
            nibbles = blocks[..., 2:]
            zero = np.zeros_like(d)
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # element j, then element j + 16
        return cls(torch.from_numpy(q.reshape(out, inp)), torch.from_numpy(d), torch.from_numpy(zero))

    def rows(self, order: torch.Tensor) -> Blocks4:
        """The same weight with its rows in ``order`` (the loader's un-permutation of Q and K)."""
        return Blocks4(self.q[order], self.scale[order], self.zero[order])

    @staticmethod
    def cat(parts: list[Blocks4]) -> Blocks4:
        """Weights stacked by rows (the fused Q/K/V and gate/up projections)."""
        return Blocks4(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                       torch.cat([p.zero for p in parts]))

    def dequantize(self) -> torch.Tensor:
        """The weight in float32."""
        out, inp = self.q.shape
        q = self.q.to(torch.float32).reshape(out, inp // GROUP, GROUP)
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).reshape(out, inp)


class Packed4:
    """A weight's blocks in the CPU kernel's layout, for products with ``dtype`` activations, and,
    until the load cache has stored them (``forget_parts``), as it keeps them (``parts``: two
    values a byte, the scales and zeros)."""

    @staticmethod
    def fits(shape: tuple[int, int]) -> bool:
        """Whether the kernel takes a weight of this shape (rows in 16s, whole blocks per row)."""
        return shape[0] % 16 == 0 and shape[1] % GROUP == 0

    def __init__(self, blocks: Blocks4, dtype: torch.dtype, *, keep_parts: bool = True) -> None:
        self.shape = tuple(blocks.q.shape)
        if not self.fits(self.shape):
            raise ValueError(f"the 4-bit kernel takes no weight of shape {list(self.shape)}")
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 1)
        self.scales_zeros = torch.stack([blocks.scale.T, blocks.zero.T], dim=-1).to(dtype).contiguous()
        self._parts: dict[str, torch.Tensor] | None = None
        if keep_parts:
            self._parts = {"q": blocks.q[:, 0::2] | (blocks.q[:, 1::2] << 4), "scale": blocks.scale, "zero": blocks.zero}

    def parts(self) -> dict[str, torch.Tensor]:
        if self._parts is None:
            raise RuntimeError("the 4-bit parts were dropped once stored (Packed4.forget_parts)")
        return self._parts

    def forget_parts(self) -> None:
        """Drop the stored form (the kernel's stays): 80 MiB of a process for SmolLM2-135M."""
        self._parts = None

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor], dtype: torch.dtype, *, keep_parts: bool = False) -> Packed4:
        """What ``parts`` gave (keeping them only with ``keep_parts``: they are stored already);
        ValueError if the tensors do not fit together."""
        nibbles, scale, zero = parts["q"], parts["scale"], parts["zero"]
        out, half = nibbles.shape
        if nibbles.dtype != torch.uint8 or scale.shape != (out, 2 * half // GROUP) or zero.shape != scale.shape:
            raise ValueError(f"4-bit parts of shapes {list(nibbles.shape)}, {list(scale.shape)}, {list(zero.shape)}")
        q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(out, 2 * half)
        return cls(Blocks4(q, scale.to(torch.float32), zero.to(torch.float32)), dtype, keep_parts=keep_parts)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [rows, in] @ w.T`` -> [rows, out]."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, GROUP, self.scales_zeros)
