"""``x @ w.T`` for the model's projections, in whichever of two equal formulations this machine
computes faster for a few rows at a time.

``F.linear(x, w)`` and ``torch.mm(w, x.T).T`` compute the same product. On some CPUs their
speed differs by 3x for 2..32 rows (measured on an AVX2 EPYC in float32: the 49,152 x 576
output head took 33 ms through ``linear`` and 10 ms the other way for 5 rows, 14 ms either way
for 1), and those few-row shapes are exactly a speculative verification (k + 1 tokens) and a
small decode batch. Which form wins depends on the CPU and its BLAS, so nothing is assumed:
``tune`` times both on the model's own weight shapes at start-up and records, per shape and
row-count bucket, the faster one. Untuned (the default, and always on GPUs), every call is
``F.linear``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ROW_BUCKETS = (2, 4, 8, 16, 32, 64)  # rows up to each bound share a decision; more rows: linear
_TRANSPOSED: set[tuple[int, int, torch.dtype, int]] = set()  # (out, in, dtype, bucket) where mm(w, x.T).T wins


def _bucket(rows: int) -> int:
    for bound in ROW_BUCKETS:
        if rows <= bound:
            return bound
    return 0


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), computed the tuned way for this shape."""
    if _TRANSPOSED and x.device.type == "cpu":
        rows = x.numel() // x.shape[-1]
        key = (weight.shape[0], weight.shape[1], weight.dtype, _bucket(rows))
        if rows > 1 and key in _TRANSPOSED:
            flat = x.reshape(rows, x.shape[-1])
            return torch.mm(weight, flat.T).T.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose product goes through ``linear``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def _median_seconds(fn, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@torch.inference_mode()
def tune(weights: Iterable[torch.Tensor], *, margin: float = 0.8) -> dict[str, float]:
    """Time both forms for each distinct CPU weight shape and row bucket; keep ``mm(w, x.T).T``
    where it takes under ``margin`` of ``linear``'s time. Returns the ``linear`` / transposed
    time ratio per shape at 8 rows (for the log)."""
    shapes = {(w.shape[0], w.shape[1], w.dtype): w for w in weights if w.device.type == "cpu" and w.dim() == 2}
    ratios: dict[str, float] = {}
    started = time.perf_counter()
    for (out, inp, dtype), w in shapes.items():
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, inp, dtype=dtype)
            plain = _median_seconds(lambda x=x, w=w: F.linear(x, w))
            transposed = _median_seconds(lambda x=x, w=w: torch.mm(w, x.T).T.contiguous())
            key = (out, inp, dtype, rows)
            if transposed < margin * plain:
                _TRANSPOSED.add(key)
            else:
                _TRANSPOSED.discard(key)
            if rows == 8:
                ratios[f"{out}x{inp}"] = plain / transposed
    log.info("matmul tuning (%.1f s): linear / transposed time at 8 rows %s; transposed for %d of %d shape-row pairs",
             time.perf_counter() - started, {k: round(v, 2) for k, v in ratios.items()}, len(_TRANSPOSED),
             len(shapes) * len(ROW_BUCKETS))
    return ratios


def reset() -> None:
    """Back to ``F.linear`` everywhere (tests)."""
    _TRANSPOSED.clear()
