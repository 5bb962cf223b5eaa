"""Scoring the edge model's confidence in a turn from its first tokens.

A scorer maps the held tokens' log-probabilities (the edge's own, under its sampling
distribution) to a number in [0, 1]; the cascade keeps the turn on the edge when the score
reaches the threshold. The default is a low quantile of the token probabilities, which Gupta
et al. ("Language Model Cascades: Token-level Uncertainty and Beyond", ICLR 2024) found more
robust to answer length than the mean or the sequence probability: one unsure token in a
sure answer pulls the 10th percentile down without being averaged away.

Scorers are pluggable: ``cascade.scorer = "package.module:factory"`` names a callable taking
the ``CascadeConfig`` and returning an object with ``score`` (a learned probe, for example).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from typing import Protocol

from gateway.config.cascade import CascadeConfig
from llm_shared.errors import ConfigError


class ConfidenceScorer(Protocol):
    name: str

    def score(self, logprobs: Sequence[float]) -> float:
        """Confidence in [0, 1] from the held tokens' log-probabilities (at least one)."""
        ...


def best_final_score(scorer: ConfidenceScorer, logprobs: Sequence[float], hold_tokens: int) -> float | None:
    """The most the score can reach once the hold is full, given its first tokens: the rest
    certain (log-probability 0, the best a token can have). Only for a scorer that says it is
    ``monotone`` (its score never falls when a token's probability rises or a certain token is
    added: the built-in ones); None for any other, whose final score cannot be bounded early. A
    turn whose best final score is under the threshold escalates whatever comes next, so the
    cascade decides it now, not ``hold_tokens`` tokens in (the same decision, sooner)."""
    if not getattr(scorer, "monotone", False):
        return None
    return scorer.score([*logprobs, *[0.0] * max(0, hold_tokens - len(logprobs))])


def _probs(logprobs: Sequence[float]) -> list[float]:
    # NaN or +inf from a broken backend count as no confidence at all, never as full confidence.
    return sorted(math.exp(lp) if math.isfinite(lp) and lp <= 0.0 else 0.0 for lp in logprobs)


class QuantileScorer:
    """The ``q`` quantile of the token probabilities (linear interpolation between order statistics)."""

    monotone = True  # a token made more probable, or a certain one added, never lowers a quantile

    def __init__(self, q: float) -> None:
        self.q = q
        self.name = f"quantile({q:g})"

    def score(self, logprobs: Sequence[float]) -> float:
        probs = _probs(logprobs)
        if not probs:
            return 0.0
        pos = self.q * (len(probs) - 1)
        low = math.floor(pos)
        high = min(low + 1, len(probs) - 1)
        return probs[low] + (probs[high] - probs[low]) * (pos - low)


class MeanScorer:
    """The mean token probability."""

    name = "mean"
    monotone = True

    def score(self, logprobs: Sequence[float]) -> float:
        probs = _probs(logprobs)
        return sum(probs) / len(probs) if probs else 0.0


class MinScorer:
    """The least probable held token's probability."""

    name = "min"
    monotone = True

    def score(self, logprobs: Sequence[float]) -> float:
        probs = _probs(logprobs)
        return probs[0] if probs else 0.0


def build_scorer(config: CascadeConfig) -> ConfidenceScorer:
    """The scorer ``cascade.scorer`` names; a ``module:factory`` path is imported now, at start-up."""
    name = config.scorer
    if name == "quantile":
        return QuantileScorer(config.quantile)
    if name == "mean":
        return MeanScorer()
    if name == "min":
        return MinScorer()
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"cascade.scorer must be 'quantile', 'mean', 'min' or 'package.module:factory', got {name!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cascade.scorer {name!r} cannot be loaded: {e}") from e
    scorer = factory(config)
    if not callable(getattr(scorer, "score", None)):
        raise ConfigError(f"cascade.scorer {name!r} returned {type(scorer).__name__}, which has no score()")
    if not isinstance(getattr(scorer, "name", None), str):
        scorer.name = name
    return scorer
