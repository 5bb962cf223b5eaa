"""Rotary position embeddings for Llama-family models, with the checkpoint's theta and scaling.

Matches Hugging Face's ``rotate_half`` layout (the first and second halves of each head are the
two rotated coordinates). Scaling types we know: ``linear`` and ``llama3`` (HF config names), and
GGUF's per-dimension ``rope_freqs`` factors, which is how llama.cpp stores llama3 scaling.
Anything else is refused at load time rather than silently producing a different model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from llm_shared.errors import ModelFileError

SUPPORTED_SCALING = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: the pre-extension context

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED_SCALING:
            raise ModelFileError(f"unsupported rope scaling type {self.kind!r}; supported: {list(SUPPORTED_SCALING)}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ModelFileError(f"rope scaling factor must be a positive number, got {self.factor!r}")
        if self.kind == "llama3":
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ModelFileError("llama3 rope scaling needs high_freq_factor > low_freq_factor > 0")
            if self.original_max_position_embeddings < 1:
                raise ModelFileError("llama3 rope scaling needs original_max_position_embeddings >= 1")


def parse_rope_scaling(raw: Mapping[str, Any] | None) -> RopeScaling | None:
    """Read HF's ``rope_scaling`` / ``rope_parameters`` dict; None or type 'default' means unscaled."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ModelFileError(f"rope_scaling must be an object, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind in (None, "default", "none"):
        return None
    if kind not in SUPPORTED_SCALING:
        raise ModelFileError(f"unsupported rope scaling type {kind!r}; supported: {list(SUPPORTED_SCALING)}")
    try:
        if kind == "linear":
            return RopeScaling(kind="linear", factor=float(raw["factor"]))
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelFileError(f"{kind} rope scaling is missing {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{kind} rope scaling has a non-numeric value: {e}") from e


def inv_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    freq_factors: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Per-pair rotation frequencies, float32 [head_dim // 2], computed as HF does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        # GGUF llama3 models carry the scaling as precomputed divisors (llama.cpp's rope_freqs).
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, 1, head_dim] in ``dtype`` (angles in float32, as HF)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)  # [B, T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by cos/sin [B, T, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
