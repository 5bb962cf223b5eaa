"""What a forward costs, learned: seconds against the number of tokens in it, for the target and
for the drafter, so that the speculation controller can price a step before taking it.

On a GPU a forward of 1 or 40 tokens costs about the same; on these CPUs a bf16 target step of
8 sequences cost 27 ms against 23 for 2, while llama.cpp's drafter, compute-bound on quantized
weights, took 6 ms for 1 token and 30 ms for 8. Neither curve is assumed: each is measured at
start-up (``calibrate``) and then follows every forward the engine takes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

CURVE_EMA = 0.2  # weight of the newest observation in a bucket
_BUCKET_BASE = math.log(1.25)  # buckets past 8 tokens are ~25% apart


@dataclass
class _Point:
    tokens: float  # mean token count of the bucket's observations, smoothed
    seconds: float


def _bucket(tokens: int) -> int:
    return tokens if tokens <= 8 else 8 + round(math.log(tokens / 8) / _BUCKET_BASE)


class CostCurve:
    """Seconds of a forward of ``n`` tokens: a smoothed time per bucket of ``n`` (each count up to
    8, then buckets ~25% apart), read by linear interpolation between the buckets' mean counts;
    flat below the smallest measured count (a forward never costs less than its fixed part) and
    along the last segment's slope above the largest."""

    def __init__(self) -> None:
        self._points: dict[int, _Point] = {}
        self._sorted: list[_Point] | None = []

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        key = _bucket(tokens)
        point = self._points.get(key)
        if point is None:
            self._points[key] = _Point(float(tokens), seconds)
        else:
            point.tokens += CURVE_EMA * (tokens - point.tokens)
            point.seconds += CURVE_EMA * (seconds - point.seconds)
        self._sorted = None

    def observe_all(self, forwards: Iterable[tuple[int, float]]) -> None:
        for tokens, seconds in forwards:
            self.observe(tokens, seconds)

    @property
    def known(self) -> bool:
        return bool(self._points)

    def __call__(self, tokens: float) -> float:
        """Predicted seconds for ``tokens`` (the curve must be ``known``)."""
        if self._sorted is None:
            self._sorted = sorted(self._points.values(), key=lambda p: p.tokens)
        points = self._sorted
        if not points:
            raise ValueError("nothing observed yet")
        if tokens <= points[0].tokens:
            return points[0].seconds
        for lo, hi in itertools.pairwise(points):
            if tokens <= hi.tokens:
                if hi.tokens <= lo.tokens:
                    return hi.seconds
                return lo.seconds + (hi.seconds - lo.seconds) * (tokens - lo.tokens) / (hi.tokens - lo.tokens)
        last = points[-1]
        if len(points) == 1:
            return last.seconds * tokens / last.tokens  # one point: proportional, the cautious guess
        before = points[-2]
        slope = max(0.0, (last.seconds - before.seconds) / (last.tokens - before.tokens))
        return last.seconds + slope * (tokens - last.tokens)

    def points(self) -> list[tuple[float, float]]:
        """(mean tokens, seconds) per bucket, in token order: for stats and benchmarks."""
        return [(p.tokens, p.seconds) for p in sorted(self._points.values(), key=lambda p: p.tokens)]
