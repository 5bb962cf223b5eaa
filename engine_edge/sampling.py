"""Choosing the next token from raw logits with numpy, the same way for every edge backend.

Temperature, top-k and top-p shape the distribution that is sampled from; the reported
logprob is always that of the chosen token under the *unmodified* distribution (log-softmax
of the raw logits), so clients and the confidence cascade see the model's own belief.
Each request owns a ``numpy.random.Generator`` seeded from ``params.seed`` and draws exactly
one uniform number per sampled token, so a seed gives the same text whatever else is batched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llm_shared.contract import SamplingParams

# top-p first looks at this many of the most likely tokens (a partial sort), widening only
# when they hold less than top_p of the mass: a full sort of a 50k vocabulary costs ~3 ms.
_TOP_P_FIRST_WINDOW = 256
_DRAW_BLOCK = 256


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float  # log-probability under the raw logits (temperature 1, no truncation)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # most likely alternatives, best first


def make_rng(seed: int | None) -> np.random.Generator:
    """A request's private generator; ``None`` draws fresh entropy."""
    return np.random.default_rng(seed)


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))): exponentials in the logits' dtype, summed in float64 (~40 us for 50k)."""
    peak = float(logits.max())
    return peak + math.log(float(np.exp(logits - peak).sum(dtype=np.float64)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of a 1-D logit vector."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def top_logprobs(logits: np.ndarray, n: int, lse: float | None = None) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely (token id, logprob) pairs, best first; ties go to the lower id."""
    if n <= 0:
        return ()
    lse = logsumexp(logits) if lse is None else lse
    n = min(n, logits.shape[0])
    part = np.argpartition(-logits, n - 1)[:n]
    order = np.lexsort((part, -logits[part]))
    return tuple((int(part[i]), float(logits[part[i]]) - lse) for i in order)


def candidate_distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(token ids in increasing order, float64 probabilities summing to 1) that a non-greedy
    draw chooses from. The fixed order is what makes a seeded draw reproducible."""
    ids, probs = _candidates(np.asarray(logits, dtype=np.float32), params)
    return (np.arange(probs.shape[0]) if ids is None else ids), probs


def _candidates(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """Like ``candidate_distribution``; ``None`` ids mean the whole vocabulary in order (a 50k
    ``arange`` per token is not free: fresh large arrays page-fault)."""
    ids: np.ndarray | None = None
    scores = x
    if 0 < params.top_k < x.shape[0]:
        ids = np.sort(np.argpartition(-x, params.top_k - 1)[: params.top_k])
        scores = x[ids]
    # float32 exponentials are vectorized (~30 us for 50k); float64 ones cost ~10x more.
    probs = np.exp((scores - scores.max()) * np.float32(1.0 / params.temperature)).astype(np.float64)
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = _nucleus(probs, params.top_p)
        ids = keep if ids is None else ids[keep]
        probs = probs[keep]
        probs /= probs.sum()
    return ids, probs


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Positions (increasing) of the smallest most-likely set holding at least ``top_p`` of the mass."""
    n = probs.shape[0]
    window = min(_TOP_P_FIRST_WINDOW, n)
    while True:
        head = np.arange(n) if window >= n else np.sort(np.argpartition(probs, n - window)[n - window:])
        order = head[np.argsort(-probs[head])]  # falling probability (ties in a fixed, arbitrary order)
        cumulative = np.cumsum(probs[order])
        if cumulative[-1] >= top_p or window >= n:
            break
        window = min(window * 8, n)
    keep = min(int(np.searchsorted(cumulative, top_p, side="left")) + 1, order.shape[0])
    return np.sort(order[:keep])


def draw(weights: np.ndarray, u: float) -> int:
    """The index where the running sum of ``weights`` first exceeds ``u`` times their total.

    Sums 256-wide blocks first and runs a cumulative sum over one block only: a float64
    cumulative sum is sequential, ~160 us over a 50k vocabulary, against ~15 us this way.
    """
    n = weights.shape[0]
    full = n - n % _DRAW_BLOCK
    block_sums = weights[:full].reshape(-1, _DRAW_BLOCK).sum(axis=1)
    if full < n:
        block_sums = np.append(block_sums, weights[full:].sum())
    block_cum = np.cumsum(block_sums)
    target = u * float(block_cum[-1])
    block = min(int(np.searchsorted(block_cum, target, side="right")), block_cum.shape[0] - 1)
    start = block * _DRAW_BLOCK
    inner = np.cumsum(weights[start:start + _DRAW_BLOCK]) + (float(block_cum[block - 1]) if block else 0.0)
    return start + min(int(np.searchsorted(inner, target, side="right")), inner.shape[0] - 1)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> Sample:
    """Pick the next token from raw ``logits`` [n_vocab]."""
    x = np.asarray(logits, dtype=np.float32)
    lse = logsumexp(x)
    if params.greedy:
        token_id = int(np.argmax(x))  # first maximum: ties go to the lower id
    else:
        ids, probs = _candidates(x, params)
        index = draw(probs, rng.random())
        token_id = index if ids is None else int(ids[index])
    return Sample(token_id, float(x[token_id]) - lse, top_logprobs(x, params.logprobs, lse))


def greedy_with_prob(logits: np.ndarray) -> tuple[int, float]:
    """(argmax token, its probability under the raw logits): what a drafter proposes."""
    x = np.asarray(logits)
    token_id = int(np.argmax(x))
    return token_id, math.exp(float(x[token_id]) - logsumexp(x))
