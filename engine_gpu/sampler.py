"""Token sampling for a batch of rows, each with its own SamplingParams.

Randomness is counter-based: a seeded request's uniform for its n-th output token is a pure
function of (seed, n), and every row is filtered and sampled independently (inverse CDF over its
own float64 cumulative sum). So the same seed gives the same tokens whatever else shares the
batch, and no global RNG is touched. Unseeded rows draw their seed from this sampler's own
``random.Random``. Reported logprobs are under the unmodified model distribution (temperature 1,
no top-k/top-p), as the OpenAI API reports them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_edge.types import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float  # of token_id under the unmodified distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()  # params.logprobs best (token, logprob), best first


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, output_index: int) -> float:
    """A uniform in [0, 1) keyed by (seed, output_index): the same key, the same number."""
    return (_splitmix64(_splitmix64(seed) ^ output_index) >> 11) * 2.0**-53


def sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Filtered, renormalised probabilities in vocab order.

    logits [n, V] float32; temperature [n] (> 0); top_k [n] (0 = off); top_p [n] in (0, 1].
    Top-k keeps the k highest logits; top-p then keeps the smallest prefix of the remaining
    tokens (by descending probability) whose mass reaches top_p, always at least one token.
    """
    scaled = logits / temperature[:, None]
    vocab = logits.shape[1]
    needs_sort = (top_k > 0) | (top_p < 1.0)
    if not bool(needs_sort.any()):
        return torch.softmax(scaled, dim=-1)
    probs = torch.softmax(scaled, dim=-1)
    rows = needs_sort.nonzero().squeeze(1)
    # stable: ties keep vocab order, so the kept set never depends on the batch
    values, order = scaled[rows].sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k[rows] > 0, top_k[rows], vocab)
    keep = ranks[None, :] < k[:, None]
    values = values.masked_fill(~keep, float("-inf"))
    sorted_probs = torch.softmax(values, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep &= mass_before < top_p[rows][:, None]
    sorted_probs = torch.where(keep, sorted_probs, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs[rows] = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # Only for unseeded requests; seeded ones never consult it.
        self._rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]
    ) -> list[SampledToken]:
        """logits [n, V] (any float dtype) -> one token per row."""
        n = logits.shape[0]
        if n != len(params) or n != len(output_indices):
            raise ValueError(f"{n} logit rows but {len(params)} params and {len(output_indices)} output indices")
        if n == 0:
            return []
        logits = logits.to(torch.float32)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            chosen[random_rows] = self._sample_rows(logits, params, output_indices, random_rows)
        chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
        chosen_ids = chosen.tolist()
        top = self._top_logprobs(logprobs, params)
        return [
            SampledToken(chosen_ids[i], chosen_logprobs[i], top[i]) for i in range(n)
        ]

    def _sample_rows(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int], rows: list[int]
    ) -> torch.Tensor:
        device = logits.device
        chosen_params = [params[i] for i in rows]
        probs = sampling_probs(
            logits[rows],
            torch.tensor([p.temperature for p in chosen_params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in chosen_params], dtype=torch.int64, device=device),
            torch.tensor([p.top_p for p in chosen_params], dtype=torch.float32, device=device),
        )
        uniforms = [
            uniform_for(p.seed if p.seed is not None else self._rng.getrandbits(63), output_indices[i])
            for p, i in zip(chosen_params, rows, strict=True)
        ]
        cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # [r, V]
        total = cdf[:, -1]
        # strictly below the total even after rounding, so the pick is never past the last kept token
        targets = torch.minimum(torch.tensor(uniforms, dtype=torch.float64, device=device) * total,
                                torch.nextafter(total, torch.zeros_like(total)))
        # first index whose cumulative mass exceeds the target: a token with positive probability
        return torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)

    @staticmethod
    def _top_logprobs(logprobs: torch.Tensor, params: Sequence[SamplingParams]) -> list[tuple[tuple[int, float], ...]]:
        wanted = [p.logprobs for p in params]
        most = max(wanted)
        if most == 0:
            return [()] * len(params)
        values, ids = logprobs.topk(min(most, logprobs.shape[1]), dim=-1)
        values_l, ids_l = values.tolist(), ids.tolist()
        return [
            tuple(zip(ids_l[i][: wanted[i]], values_l[i][: wanted[i]], strict=True)) for i in range(len(params))
        ]
