"""Choosing the next token from raw logits with numpy, the same way for every edge backend.

Temperature, top-k and top-p shape the distribution that is sampled from; the reported
logprob is always that of the chosen token under the *unmodified* distribution (log-softmax
of the raw logits), so clients and the confidence cascade see the model's own belief.
Each request owns a ``numpy.random.Generator`` seeded from ``params.seed`` and draws exactly
one uniform number per sampled token, so a seed gives the same text whatever else is batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_edge.types import SamplingParams

# top-p first looks at this many of the most likely tokens (a partial sort), widening only
# when they hold less than top_p of the mass: a full sort of a 50k vocabulary costs ~3 ms.
_TOP_P_FIRST_WINDOW = 256


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float  # log-probability under the raw logits (temperature 1, no truncation)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # most likely alternatives, best first


def make_rng(seed: int | None) -> np.random.Generator:
    """A request's private generator; ``None`` draws fresh entropy."""
    return np.random.default_rng(seed)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of a 1-D logit vector."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def top_logprobs(logprobs: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely (token id, logprob) pairs, best first; ties go to the lower id."""
    if n <= 0:
        return ()
    n = min(n, logprobs.shape[0])
    part = np.argpartition(-logprobs, n - 1)[:n]
    order = np.lexsort((part, -logprobs[part]))
    return tuple((int(part[i]), float(logprobs[part[i]])) for i in order)


def candidate_distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, probabilities summing to 1) that a non-greedy draw chooses from.

    Ids come in a fixed order for given logits (vocabulary order, or by falling probability
    once top-p had to sort), which is what makes a seeded draw reproducible.
    """
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    n_vocab = x.shape[0]
    if 0 < params.top_k < n_vocab:
        ids = np.sort(np.argpartition(-x, params.top_k - 1)[: params.top_k])
    else:
        ids = np.arange(n_vocab)
    scores = x[ids]
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        ids, probs = _nucleus(ids, probs, params.top_p)
    return ids, probs


def _nucleus(ids: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest most-likely set holding at least ``top_p`` of the mass, renormalized."""
    window = min(_TOP_P_FIRST_WINDOW, probs.shape[0])
    while True:
        if window < probs.shape[0]:
            head = np.argpartition(-probs, window - 1)[:window]
        else:
            head = np.arange(probs.shape[0])
        order = head[np.lexsort((ids[head], -probs[head]))]  # falling probability, then id
        cumulative = np.cumsum(probs[order])
        if cumulative[-1] >= top_p or window == probs.shape[0]:
            break
        window = min(window * 8, probs.shape[0])
    keep = min(int(np.searchsorted(cumulative, top_p, side="left")) + 1, order.shape[0])
    chosen = order[:keep]
    kept = probs[chosen]
    return ids[chosen], kept / kept.sum()


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> Sample:
    """Pick the next token from raw ``logits`` [n_vocab]."""
    logprobs = log_softmax(logits)
    if params.greedy:
        token_id = int(np.argmax(logprobs))  # first maximum: ties go to the lower id
    else:
        ids, probs = candidate_distribution(logits, params)
        cumulative = np.cumsum(probs)
        u = rng.random() * cumulative[-1]
        token_id = int(ids[min(int(np.searchsorted(cumulative, u, side="right")), ids.shape[0] - 1)])
    return Sample(token_id, float(logprobs[token_id]), top_logprobs(logprobs, params.logprobs))


def greedy_with_prob(logits: np.ndarray) -> tuple[int, float]:
    """(argmax token, its probability under the raw logits): what a drafter proposes."""
    logprobs = log_softmax(logits)
    token_id = int(np.argmax(logprobs))
    return token_id, float(np.exp(logprobs[token_id]))
