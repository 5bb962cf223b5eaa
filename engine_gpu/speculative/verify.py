"""Exact acceptance of draft tokens against the target's logits.

Greedy rows accept drafts while the target's argmax equals them, then add the argmax at the
first mismatch (or after the last draft): the same tokens as decoding one at a time.

Sampled rows use the rejection rule of Leviathan et al. (2023) / Chen et al. (2023): draft ``x``,
drawn from the drafter's ``q``, is accepted with probability ``min(1, p(x) / q(x))``, where ``p``
is the target's distribution after temperature, top-k and top-p (``sampler.sampling_probs``);
at the first rejection a token is drawn from ``norm(max(0, p - q))`` and the round ends; if all
are accepted, a bonus token is drawn from ``p`` at the next position. Every emitted token is then
distributed exactly as the target's. A deterministic proposal (n-gram, or greedy drafting for a
sampled request) is a point mass: accepted with probability ``p(x)``, residual ``p`` without ``x``.

Randomness is counter-based like the sampler's: the acceptance test of output index ``n`` uses
``uniform_for(seed ^ ACCEPT_SALT, n)``, and the token drawn at index ``n`` (residual or bonus)
uses ``uniform_for(seed, n)``, the very number plain sampling would use there. So a seeded request
is reproducible with speculation on, and a round with no drafts samples what plain decoding would.
"""

from __future__ import annotations

import torch

from engine_gpu.sampler import SampledToken, inverse_cdf, sampling_probs, uniform_for
from llm_shared.contract import SamplingParams

ACCEPT_SALT = 0x5EC0_ACCE_97ED_0001


def draw(row: torch.Tensor, u: float) -> int:
    """One token from a 1-D row of probabilities by the sampler's own inverse-CDF rule."""
    return int(inverse_cdf(row[None, :], torch.tensor([u], device=row.device))[0])


def accept(
    logits: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    params: SamplingParams,
    seed: int,
    output_index: int,
) -> list[int]:
    """The tokens one verification round emits: accepted drafts, then one target token.

    ``logits`` [len(drafts) + 1, V] float32: the target at each draft's position and after the
    last; ``q`` [len(drafts), V] the distributions the drafts were drawn from, or None for point
    masses. ``output_index`` is the output index of the first draft."""
    d = len(drafts)
    if logits.shape[0] != d + 1:
        raise ValueError(f"{d} drafts need {d + 1} logit rows, got {logits.shape[0]}")
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        n = 0
        while n < d and drafts[n] == target[n]:
            n += 1
        return [*drafts[:n], target[n]]
    rows = logits.shape[0]
    p = sampling_probs(
        logits,
        torch.full((rows,), params.temperature, dtype=torch.float32, device=logits.device),
        torch.full((rows,), params.top_k, dtype=torch.int64, device=logits.device),
        torch.full((rows,), params.top_p, dtype=torch.float32, device=logits.device),
    )
    for j, x in enumerate(drafts):
        px = float(p[j, x])
        qx = float(q[j, x]) if q is not None else 1.0
        if uniform_for(seed ^ ACCEPT_SALT, output_index + j) * qx < px:
            continue  # accepted with probability min(1, p(x) / q(x))
        if q is not None:
            residual = torch.clamp(p[j] - q[j], min=0.0)
        else:
            residual = p[j].clone()
            residual[x] = 0.0
        if float(residual.sum()) <= 0.0:  # only by rounding: p == q here, so p itself is exact
            residual = p[j]
        return [*drafts[:j], draw(residual, uniform_for(seed, output_index + j))]
    return [*drafts, draw(p[d], uniform_for(seed, output_index + d))]


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams) -> list[SampledToken]:
    """``SampledToken``s for ``tokens`` emitted at the first ``len(tokens)`` rows of ``logits``,
    with logprobs under the unmodified distribution (as the sampler reports them)."""
    rows = logits[: len(tokens)]
    logprobs = torch.log_softmax(rows, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=rows.device)[:, None]).squeeze(1).tolist()
    top: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if params.logprobs > 0:
        values, ids = logprobs.topk(min(params.logprobs, rows.shape[1]), dim=-1)
        top = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return [SampledToken(t, lp, tp) for t, lp, tp in zip(tokens, chosen, top, strict=True)]
