"""``x @ w.T`` for the model's projections, in whichever form this machine computes fastest for a
few rows at a time.

``F.linear(x, w)`` and ``torch.mm(w, x.T).T`` compute the same product. On some CPUs their
speed differs by 3x for 2..32 rows (measured on an AVX2 EPYC in float32: the 49,152 x 576
output head took 33 ms through ``linear`` and 10 ms the other way for 5 rows, 14 ms either way
for 1), and those few-row shapes are exactly a speculative verification (k + 1 tokens) and a
small decode batch. A weight the loader kept as the GGUF's 4-bit blocks (``packed4``) has a
third form, the same numbers as the file's, which reads a quarter of the bytes: a few-row product
is bound by those bytes on a CPU (a batch-1 decode step 1.6x faster than bf16 here), many rows by the
arithmetic, where the dense product wins. Which form wins depends on the CPU and its BLAS, so
nothing is assumed: ``tune`` times them on the model's own weight shapes at start-up and records,
per shape and row-count bucket, the fastest. Untuned (the default, and always on GPUs), every call
is ``F.linear``. Timing takes seconds at start-up; given a ``LoadCache``, the decisions are kept,
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

from llm_shared.llama.packed4 import Packed4
from llm_shared.load_cache import CorruptEntry, LoadCache

log = logging.getLogger(__name__)

CACHE_VERSION = "2"  # bump when what tune measures or decides changes
DECISIONS_FILE = "decisions.json"

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # rows up to each bound share a decision; more rows: linear
_TRANSPOSED: set[tuple[int, int, torch.dtype, int]] = set()  # (out, in, dtype, bucket) where mm(w, x.T).T wins
_PACKED: set[tuple[int, int, torch.dtype, int]] = set()  # ... where the 4-bit blocks win (weights that have them)


def _bucket(rows: int) -> int:
    for bound in ROW_BUCKETS:
        if rows <= bound:
            return bound
    return 0


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Packed4 | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), computed the tuned way for this shape: through
    ``packed`` (the weight's 4-bit blocks, when given) for the row counts where ``tune`` found that
    faster. Never while the model is traced (``torch.export``, the ONNX exporter,
    ``torch.compile``): the choice is this CPU's, and it branches on the row count, which a traced
    graph keeps symbolic."""
    if (_TRANSPOSED or _PACKED) and x.device.type == "cpu" and not torch.compiler.is_compiling():
        rows = x.numel() // x.shape[-1]
        key = (weight.shape[0], weight.shape[1], weight.dtype, _bucket(rows))
        if packed is not None and key in _PACKED:
            return packed.mm(x.reshape(rows, x.shape[-1])).reshape(*x.shape[:-1], weight.shape[0])
        if rows > 1 and key in _TRANSPOSED:
            flat = x.reshape(rows, x.shape[-1])
            return torch.mm(weight, flat.T).T.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose product goes through ``linear``; ``packed``: the weight's
    4-bit blocks, where the loader kept them (``loader.attach_packed4``)."""

    packed: Packed4 | None = None

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed)


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


Key = tuple[int, int, torch.dtype, int]  # (out, in, dtype, row bucket)


def _tuning_key(shapes: Iterable[tuple[int, int, torch.dtype]], packed: Iterable[tuple[int, int, torch.dtype]],
                margin: float) -> dict[str, object]:
    return {"kind": "matmul", "version": CACHE_VERSION, "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "margin": margin, "buckets": list(ROW_BUCKETS),
            "shapes": sorted([out, inp, str(dtype)] for out, inp, dtype in shapes),
            "packed": sorted([out, inp, str(dtype)] for out, inp, dtype in packed)}


def _read_decisions(folder: Path, shapes: dict[tuple[int, int, torch.dtype], torch.Tensor]
                    ) -> tuple[set[Key], set[Key], dict[str, float]]:
    dtypes = {str(dtype): dtype for _, _, dtype in shapes}
    try:
        raw = json.loads((folder / DECISIONS_FILE).read_text(encoding="utf-8"))
        transposed, packed = ({(int(out), int(inp), dtypes[dtype], int(rows)) for out, inp, dtype, rows in raw[name]}
                              for name in ("transposed", "packed"))
        ratios = {str(k): float(v) for k, v in raw["ratios"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptEntry(f"{DECISIONS_FILE} is not what tune writes: {e}") from e
    if any((out, inp, dtype) not in shapes or rows not in ROW_BUCKETS for out, inp, dtype, rows in transposed | packed):
        raise CorruptEntry(f"{DECISIONS_FILE} names a shape or row bucket that was not tuned")
    return transposed, packed, ratios


def _write_decisions(folder: Path, transposed: set[Key], packed: set[Key], ratios: dict[str, float]) -> None:
    def rows(keys: set[Key]) -> list[list[object]]:
        return sorted([out, inp, str(dtype), bucket] for out, inp, dtype, bucket in keys)

    (folder / DECISIONS_FILE).write_text(json.dumps({"transposed": rows(transposed), "packed": rows(packed),
                                                     "ratios": ratios}), encoding="utf-8")


def _decide(chosen: set[Key], key: Key, wins: bool) -> None:
    if wins:
        chosen.add(key)
    else:
        chosen.discard(key)


@torch.inference_mode()
def tune(weights: Iterable[torch.Tensor], *, packed: Iterable[tuple[torch.Tensor, Packed4]] = (),
         margin: float = 0.8, cache: LoadCache | None = None) -> dict[str, float]:
    """Time both forms for each distinct CPU weight shape and row bucket; keep ``mm(w, x.T).T``
    where it takes under ``margin`` of ``linear``'s time. For the shapes of ``packed`` (weights
    with their 4-bit blocks) also time the 4-bit product, kept where it takes under ``margin`` of
    the better dense form. Returns the ``linear`` / transposed time ratio per shape at 8 rows, and
    the dense / 4-bit ratio at 1 row (for the log). With ``cache``, earlier decisions for this
    CPU, thread count and set of shapes are reused instead of timed."""
    shapes = {(w.shape[0], w.shape[1], w.dtype): w for w in weights if w.device.type == "cpu" and w.dim() == 2}
    blocks = {(w.shape[0], w.shape[1], w.dtype): p for w, p in packed if (w.shape[0], w.shape[1], w.dtype) in shapes}
    pairs = {(out, inp, dtype, rows) for out, inp, dtype in shapes for rows in ROW_BUCKETS}
    cache_key = _tuning_key(shapes, blocks, margin) if cache is not None and cache.enabled and shapes else None
    if cache is not None and cache_key is not None:
        found = cache.load(cache_key, lambda folder: _read_decisions(folder, shapes))
        if found is not None:
            chosen, chosen_packed, cached_ratios = found
            _TRANSPOSED.difference_update(pairs)
            _TRANSPOSED.update(chosen)
            _PACKED.difference_update(pairs)
            _PACKED.update(chosen_packed)
            log.info("matmul tuning from the load cache: transposed for %d, 4-bit for %d of %d shape-row pairs",
                     len(chosen), len(chosen_packed), len(pairs))
            return cached_ratios
    ratios: dict[str, float] = {}
    started = time.perf_counter()
    for (out, inp, dtype), w in shapes.items():
        four = blocks.get((out, inp, dtype))
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, inp, dtype=dtype)
            plain = _median_seconds(lambda x=x, w=w: F.linear(x, w))
            key = (out, inp, dtype, rows)
            transposed = plain
            if rows > 1:  # one row always takes F.linear (``linear``)
                transposed = _median_seconds(lambda x=x, w=w: torch.mm(w, x.T).T.contiguous())
                _decide(_TRANSPOSED, key, transposed < margin * plain)
            dense = min(plain, transposed) if key in _TRANSPOSED else plain
            if four is not None:
                four_bit = _median_seconds(lambda x=x, four=four: four.mm(x))
                _decide(_PACKED, key, four_bit < margin * dense)
                if rows == 1:
                    ratios[f"{out}x{inp} 4-bit"] = dense / four_bit
            if rows == 8:
                ratios[f"{out}x{inp}"] = plain / transposed
    log.info("matmul tuning (%.1f s): linear / transposed time at 8 rows, dense / 4-bit at 1 row %s; transposed "
             "for %d, 4-bit for %d of %d shape-row pairs", time.perf_counter() - started,
             {k: round(v, 2) for k, v in ratios.items()}, len(_TRANSPOSED & pairs), len(_PACKED & pairs), len(pairs))
    if cache is not None and cache_key is not None:
        decided, decided_packed = _TRANSPOSED & pairs, _PACKED & pairs
        cache.store(cache_key, lambda folder: _write_decisions(folder, decided, decided_packed, ratios))
    return ratios


def reset() -> None:
    """Back to ``F.linear`` everywhere (tests)."""
    _TRANSPOSED.clear()
    _PACKED.clear()
