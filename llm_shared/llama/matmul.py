"""``x @ w.T`` for the model's projections, in whichever of two equal formulations this machine
computes faster for a few rows at a time.

``F.linear(x, w)`` and ``torch.mm(w, x.T).T`` compute the same product. On some CPUs their
speed differs by 3x for 2..32 rows (measured on an AVX2 EPYC in float32: the 49,152 x 576
output head took 33 ms through ``linear`` and 10 ms the other way for 5 rows, 14 ms either way
for 1), and those few-row shapes are exactly a speculative verification (k + 1 tokens) and a
small decode batch. Which form wins depends on the CPU and its BLAS, so nothing is assumed:
``tune`` times both on the model's own weight shapes at start-up and records, per shape and
row-count bucket, the faster one. Untuned (the default, and always on GPUs), every call is
``F.linear``. Timing takes seconds at start-up; given a ``LoadCache``, the decisions are kept,
keyed by the CPU model, torch's thread count and version, and the shapes, and reused.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llm_shared.load_cache import CorruptEntry, LoadCache

log = logging.getLogger(__name__)

CACHE_VERSION = "1"  # bump when what tune measures or decides changes
DECISIONS_FILE = "decisions.json"

ROW_BUCKETS = (2, 4, 8, 16, 32, 64)  # rows up to each bound share a decision; more rows: linear
_TRANSPOSED: set[tuple[int, int, torch.dtype, int]] = set()  # (out, in, dtype, bucket) where mm(w, x.T).T wins


def _bucket(rows: int) -> int:
    for bound in ROW_BUCKETS:
        if rows <= bound:
            return bound
    return 0


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), computed the tuned way for this shape. Never while the
    model is traced (``torch.export``, the ONNX exporter, ``torch.compile``): the choice is this
    CPU's, and it branches on the row count, which a traced graph keeps symbolic."""
    if _TRANSPOSED and x.device.type == "cpu" and not torch.compiler.is_compiling():
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


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo), or what the platform says where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _tuning_key(shapes: Iterable[tuple[int, int, torch.dtype]], margin: float) -> dict[str, object]:
    return {"kind": "matmul", "version": CACHE_VERSION, "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "margin": margin, "buckets": list(ROW_BUCKETS),
            "shapes": sorted([out, inp, str(dtype)] for out, inp, dtype in shapes)}


def _read_decisions(folder: Path, shapes: dict[tuple[int, int, torch.dtype], torch.Tensor]
                    ) -> tuple[set[tuple[int, int, torch.dtype, int]], dict[str, float]]:
    dtypes = {str(dtype): dtype for _, _, dtype in shapes}
    try:
        raw = json.loads((folder / DECISIONS_FILE).read_text(encoding="utf-8"))
        transposed = {(int(out), int(inp), dtypes[dtype], int(rows)) for out, inp, dtype, rows in raw["transposed"]}
        ratios = {str(k): float(v) for k, v in raw["ratios"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptEntry(f"{DECISIONS_FILE} is not what tune writes: {e}") from e
    if any((out, inp, dtype) not in shapes or rows not in ROW_BUCKETS for out, inp, dtype, rows in transposed):
        raise CorruptEntry(f"{DECISIONS_FILE} names a shape or row bucket that was not tuned")
    return transposed, ratios


def _write_decisions(folder: Path, transposed: set[tuple[int, int, torch.dtype, int]], ratios: dict[str, float]) -> None:
    rows = sorted([out, inp, str(dtype), bucket] for out, inp, dtype, bucket in transposed)
    (folder / DECISIONS_FILE).write_text(json.dumps({"transposed": rows, "ratios": ratios}), encoding="utf-8")


@torch.inference_mode()
def tune(weights: Iterable[torch.Tensor], *, margin: float = 0.8, cache: LoadCache | None = None) -> dict[str, float]:
    """Time both forms for each distinct CPU weight shape and row bucket; keep ``mm(w, x.T).T``
    where it takes under ``margin`` of ``linear``'s time. Returns the ``linear`` / transposed
    time ratio per shape at 8 rows (for the log). With ``cache``, earlier decisions for this
    CPU, thread count and set of shapes are reused instead of timed."""
    shapes = {(w.shape[0], w.shape[1], w.dtype): w for w in weights if w.device.type == "cpu" and w.dim() == 2}
    pairs = {(out, inp, dtype, rows) for out, inp, dtype in shapes for rows in ROW_BUCKETS}
    cache_key = _tuning_key(shapes, margin) if cache is not None and cache.enabled and shapes else None
    if cache is not None and cache_key is not None:
        found = cache.load(cache_key, lambda folder: _read_decisions(folder, shapes))
        if found is not None:
            chosen, cached_ratios = found
            _TRANSPOSED.difference_update(pairs)
            _TRANSPOSED.update(chosen)
            log.info("matmul tuning from the load cache: transposed for %d of %d shape-row pairs",
                     len(chosen), len(pairs))
            return cached_ratios
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
             time.perf_counter() - started, {k: round(v, 2) for k, v in ratios.items()}, len(_TRANSPOSED & pairs),
             len(pairs))
    if cache is not None and cache_key is not None:
        decided = _TRANSPOSED & pairs
        cache.store(cache_key, lambda folder: _write_decisions(folder, decided, ratios))
    return ratios


def reset() -> None:
    """Back to ``F.linear`` everywhere (tests)."""
    _TRANSPOSED.clear()
