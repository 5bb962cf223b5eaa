"""Token sampling for a batch of rows, each with its own SamplingParams.

Randomness is counter-based: a seeded request's uniform for its n-th output token is a pure
function of (seed, n), and every row is filtered and sampled independently (inverse CDF over its
own cumulative sum). So the same seed gives the same tokens whatever else shares the
batch, and no global RNG is touched. Unseeded rows draw their seed from this sampler's own
``random.Random``. Reported logprobs are under the unmodified model distribution (temperature 1,
no top-k/top-p), as the OpenAI API reports them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llm_shared.contract import SamplingParams

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


# Top-p first looks for its cut among the CANDIDATES most likely tokens (topk is cheap); only rows
# whose nucleus is wider sort the whole vocabulary. torch's CPU sort is ~25x slower than numpy's
# SIMD sort on these machines, so that fallback sorts with numpy on CPU.
CANDIDATES = 256


def sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Filtered, renormalised probabilities in vocab order.

    logits [n, V] float32; temperature [n] (> 0); top_k [n] (0 = off); top_p [n] in (0, 1].
    Top-k keeps the tokens at least as likely as the k-th; top-p then keeps the smallest
    most-likely-first prefix whose mass reaches top_p (always at least one token). Both cut by a
    probability threshold, so tokens tied at the cut are kept or dropped together.
    """
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    with_k = (top_k > 0).nonzero().squeeze(1)
    if with_k.numel():
        k = top_k[with_k].clamp(max=logits.shape[1])
        kth = probs[with_k].topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [r, 1]
        probs[with_k] = _keep_at_least(probs[with_k], kth)
    with_p = (top_p < 1.0).nonzero().squeeze(1)
    if with_p.numel():
        probs[with_p] = _keep_at_least(probs[with_p], _nucleus_floor(probs[with_p], top_p[with_p]))
    return probs


def _keep_at_least(probs: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    kept = torch.where(probs >= floor, probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[r, 1]: the probability of the last token of each row's top-p nucleus."""
    floor = torch.empty(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    width = min(CANDIDATES, probs.shape[1])
    head = probs.topk(width, dim=-1).values  # descending
    cut, reached = _cut(head, top_p)
    floor[reached] = cut[reached]
    rest = (~reached).nonzero().squeeze(1)
    if rest.numel():
        if probs.device.type == "cpu":
            ordered = torch.from_numpy(np.ascontiguousarray(np.sort(probs[rest].numpy(), axis=-1)[:, ::-1]))
        else:
            ordered = probs[rest].sort(dim=-1, descending=True).values
        floor[rest] = _cut(ordered, top_p[rest])[0]
    return floor


def _cut(descending: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Value at the first index whose cumulative mass reaches top_p [r, 1], and whether it was reached."""
    cumulative = torch.cumsum(descending, dim=-1)
    index = (cumulative < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(max=descending.shape[1] - 1)
    return descending.gather(1, index), cumulative[:, -1] >= top_p


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [r, V] (unnormalised is fine), uniforms [r] in [0, 1) -> [r]: each row's token whose
    cumulative mass first exceeds its uniform's share of the row's total."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1]
    # strictly below the total even after rounding, so the pick is never past the last kept token
    targets = torch.minimum(uniforms.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    # first index whose cumulative mass exceeds the target: a token with positive probability
    return torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # Only for unseeded requests; seeded ones never consult it.
        self._rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def seed_for(self, params: SamplingParams) -> int:
        """The request's seed, or a fresh one from this sampler's generator if it has none."""
        return params.seed if params.seed is not None else self._rng.getrandbits(63)

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
        return [SampledToken(chosen_ids[i], chosen_logprobs[i], top[i]) for i in range(n)]

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
        return inverse_cdf(probs, torch.tensor(uniforms, dtype=torch.float32, device=device))

    @staticmethod
    def _top_logprobs(logprobs: torch.Tensor, params: Sequence[SamplingParams]) -> list[tuple[tuple[int, float], ...]]:
        out: list[tuple[tuple[int, float], ...]] = [()] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs > 0]
        if not rows:
            return out
        most = min(max(params[i].logprobs for i in rows), logprobs.shape[1])
        values, ids = logprobs[rows].topk(most, dim=-1)
        for i, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
            n = params[i].logprobs
            out[i] = tuple(zip(row_ids[:n], row_values[:n], strict=True))
        return out
