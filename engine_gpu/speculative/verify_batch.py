"""Every drafted sequence of a step verified at once, on the logits' device.

``verify.accept`` and ``verify.token_logprobs`` take one sequence at a time and read single values
back as they go (on a GPU each read waits for the device: several per sequence and step). Here the
same rule runs as tensor operations over all drafted rows of the step: the acceptance test of every
draft, the token every row would draw were it the first rejection (its residual) or the last (the
bonus), and the logprobs of both candidates at every row. One transfer brings them to the host,
which keeps each sequence's accepted drafts and the draw that ends them. Top logprobs, where asked,
come in one more transfer per distinct count. The tokens and logprobs are exactly verify's
(``tests/engine_gpu/test_verify_batch.py``); the randomness is the same counter-based uniforms.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from engine_gpu.sampler import SampledToken, inverse_cdf, request_probs, uniforms_for
from engine_gpu.speculative.verify import ACCEPT_SALT
from llm_shared.contract import SamplingParams


def verify_drafts(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    output_indices: Sequence[int],
) -> list[list[SampledToken]]:
    """For each drafted sequence i, what ``token_logprobs(rows, accept(rows, drafts[i], draft_probs[i],
    params[i], seeds[i], output_indices[i]), params[i])`` returns for its rows of ``logits``.

    logits [R, V] float32: each sequence's len(drafts[i]) + 1 rows in turn; draft_probs[i]
    [len(drafts[i]), V] float32, or None for point masses."""
    device = logits.device
    widths = [len(d) + 1 for d in drafts]
    firsts = list(itertools.accumulate(widths, initial=0))
    num_rows = firsts[-1]
    if logits.shape[0] != num_rows:
        raise ValueError(f"{len(drafts)} drafted sequences need {num_rows} logit rows, got {logits.shape[0]}")
    # per row: its sequence, its index j in that sequence's rows, its draft (0 on the last row)
    row_seq = [i for i, w in enumerate(widths) for _ in range(w)]
    row_j = [j for w in widths for j in range(w)]
    row_draft = torch.tensor([x for d in drafts for x in (*d, 0)], dtype=torch.int64, device=device)  # [R]
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, V]

    sampled_seqs = [i for i, p in enumerate(params) if not p.greedy]
    draw = logits.argmax(dim=-1)  # [R] greedy: the target's pick, which a draft must equal
    accepted = draw == row_draft  # [R]
    if sampled_seqs:
        rows = [r for i in sampled_seqs for r in range(firsts[i], firsts[i + 1])]
        offsets = itertools.accumulate((widths[i] for i in sampled_seqs), initial=0)
        at_of = dict(zip(sampled_seqs, offsets, strict=False))  # each sampled sequence's first row among them
        p = request_probs(logits[rows], [params[row_seq[r]] for r in rows])  # [S, V] over the sampled sequences' rows
        # q per row: the drafter's distribution, a point mass at the draft (None), zero on last rows
        q = torch.zeros_like(p)
        for i in sampled_seqs:
            d, at = len(drafts[i]), at_of[i]
            if draft_probs[i] is not None:
                q[at:at + d] = draft_probs[i].to(p.dtype)
            elif d:
                q[torch.arange(at, at + d, device=device), row_draft[firsts[i]:firsts[i] + d]] = 1.0
        x = row_draft[rows][:, None]  # [S, 1]
        keys = [(seeds[row_seq[r]], output_indices[row_seq[r]] + row_j[r]) for r in rows]
        accept_u = torch.from_numpy(uniforms_for([s ^ ACCEPT_SALT for s, _ in keys], [n for _, n in keys]))
        draw_u = torch.from_numpy(uniforms_for([s for s, _ in keys], [n for _, n in keys]))
        # accepted with probability min(1, p(x) / q(x)), in float64 as verify computes it
        px = p.gather(1, x).squeeze(1).double()
        qx = q.gather(1, x).squeeze(1).double()
        row_accepts = accept_u.to(device) * qx < px
        # the draw were this row the first rejection (residual) or the last row (bonus: q is 0 there)
        residual = torch.clamp(p - q, min=0.0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) <= 0.0, p, residual)
        row_draws = inverse_cdf(residual, draw_u.to(device=device, dtype=torch.float32))
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        accepted = accepted.index_put((index,), row_accepts)
        draw = draw.index_put((index,), row_draws)
    lp_draft = logprobs.gather(1, row_draft[:, None]).squeeze(1)
    lp_draw = logprobs.gather(1, draw[:, None]).squeeze(1)
    # the one transfer: [R, 4] float64 (ids below 2**53 and float32 logprobs convert exactly)
    table = torch.stack((accepted.double(), draw.double(), lp_draft.double(), lp_draw.double()), dim=1).tolist()
    tops = _top_logprobs(logprobs, params, firsts)
    out: list[list[SampledToken]] = []
    for i, d in enumerate(drafts):
        first = firsts[i]
        n = 0
        while n < len(d) and table[first + n][0]:
            n += 1
        emitted = [SampledToken(d[j], table[first + j][2], tops[first + j]) for j in range(n)]
        final = table[first + n]
        emitted.append(SampledToken(int(final[1]), final[3], tops[first + n]))
        out.append(emitted)
    return out


def _top_logprobs(logprobs: torch.Tensor, params: Sequence[SamplingParams],
                  firsts: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """Per row, its sequence's ``params.logprobs`` best (token, logprob), as token_logprobs picks them."""
    tops: list[tuple[tuple[int, float], ...]] = [()] * firsts[-1]
    by_count: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        if p.logprobs > 0:
            by_count.setdefault(min(p.logprobs, logprobs.shape[1]), []).extend(range(firsts[i], firsts[i + 1]))
    for count, rows in by_count.items():
        values, ids = logprobs[rows].topk(count, dim=-1)
        for r, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
            tops[r] = tuple(zip(row_ids, row_values, strict=True))
    return tops
