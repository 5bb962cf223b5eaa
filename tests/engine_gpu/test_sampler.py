"""Sampling: batch-independent seeded draws, top-k/top-p masks, logprobs of the unmodified distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine_gpu.sampler import Sampler, sampling_probs, uniform_for
from llm_shared.contract import SamplingParams

VOCAB = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.0


def test_uniform_is_a_function_of_seed_and_index() -> None:
    values = [uniform_for(7, i) for i in range(1000)]
    assert values == [uniform_for(7, i) for i in range(1000)]
    assert all(0.0 <= u < 1.0 for u in values)
    assert len(set(values)) == 1000
    assert abs(sum(values) / 1000 - 0.5) < 0.05
    assert uniform_for(7, 0) != uniform_for(8, 0)


def test_seeded_sampling_ignores_the_rest_of_the_batch() -> None:
    target = logits_rows(1, seed=1)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=1234)
    alone = [Sampler().sample(target, [params], [i])[0].token_id for i in range(30)]
    others = logits_rows(5, seed=2)
    mixed_params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, seed=5),
                    SamplingParams(), SamplingParams(temperature=0.5, top_p=0.3), params]
    for position in range(5):
        rows = torch.cat([others[:position], target, others[position:]])
        batch_params = [*mixed_params[:position], params, *mixed_params[position:]]
        got = []
        for i in range(30):
            tokens = Sampler().sample(rows, batch_params, [i] * len(batch_params))
            got.append(tokens[position].token_id)
        assert got == alone
    assert len(set(alone)) > 1  # it did sample, not argmax


def test_unseeded_rows_are_random() -> None:
    rows = logits_rows(1).expand(64, -1) * 0.1  # nearly flat: 64 draws must not all agree
    tokens = Sampler().sample(rows, [SamplingParams()] * 64, [0] * 64)
    assert len({t.token_id for t in tokens}) > 5


def test_greedy_is_argmax_with_its_logprob() -> None:
    rows = logits_rows(3)
    tokens = Sampler().sample(rows, [SamplingParams(temperature=0.0)] * 3, [0, 1, 2])
    logprobs = torch.log_softmax(rows, dim=-1)
    for i, t in enumerate(tokens):
        assert t.token_id == int(rows[i].argmax())
        assert t.logprob == pytest.approx(float(logprobs[i, t.token_id]), abs=1e-6)


def test_top_k_keeps_exactly_the_k_best() -> None:
    rows = logits_rows(2)
    probs = sampling_probs(rows, torch.tensor([1.0, 0.7]), torch.tensor([3, 10]), torch.tensor([1.0, 1.0]))
    for i, k in enumerate((3, 10)):
        kept = set(probs[i].nonzero().squeeze(1).tolist())
        assert kept == set(rows[i].topk(k).indices.tolist())
        assert probs[i].sum().item() == pytest.approx(1.0, abs=1e-6)
        best = rows[i].topk(k).indices
        expected = torch.softmax(rows[i, best] / [1.0, 0.7][i], dim=-1)
        assert torch.allclose(probs[i, best], expected, atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    probs = sampling_probs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.8]))
    # sorted: 0.4, 0.3, 0.15 (sum 0.85 >= 0.8) -> tokens 1, 3, 4
    assert probs[0].nonzero().squeeze(1).tolist() == [1, 3, 4]
    assert torch.allclose(probs[0, [1, 3, 4]], torch.tensor([0.4, 0.3, 0.15]) / 0.85, atol=1e-6)
    tiny = sampling_probs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.01]))
    assert tiny[0].nonzero().squeeze(1).tolist() == [1]  # always at least the best token


def test_top_k_then_top_p_and_untouched_rows() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15], [0.05, 0.4, 0.1, 0.3, 0.15]]))
    probs = sampling_probs(logits, torch.tensor([1.0, 1.0]), torch.tensor([2, 0]), torch.tensor([0.5, 1.0]))
    # row 0: top-2 renormalised is 4/7, 3/7; top-p 0.5 keeps just token 1
    assert probs[0].nonzero().squeeze(1).tolist() == [1]
    assert torch.allclose(probs[1], torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]), atol=1e-6)


def test_sampled_tokens_respect_the_mask() -> None:
    rows = logits_rows(1, seed=4)
    allowed = set(rows[0].topk(4).indices.tolist())
    params = SamplingParams(temperature=1.5, top_k=4, seed=3)
    seen = {Sampler().sample(rows, [params], [i])[0].token_id for i in range(200)}
    assert seen == allowed


def test_frequencies_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    sampler = Sampler()
    counts = [0, 0, 0, 0]
    n = 4000
    for i in range(n):
        counts[sampler.sample(logits, [SamplingParams(seed=11)], [i])[0].token_id] += 1
    for c, p in zip(counts, (0.1, 0.2, 0.3, 0.4), strict=True):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_logprobs_are_of_the_unmodified_distribution() -> None:
    rows = logits_rows(2, seed=6)
    params = [SamplingParams(temperature=0.3, top_k=5, seed=1, logprobs=5), SamplingParams(temperature=0.0, logprobs=0)]
    tokens = Sampler().sample(rows, params, [0, 0])
    logprobs = torch.log_softmax(rows, dim=-1)
    assert tokens[0].logprob == pytest.approx(float(logprobs[0, tokens[0].token_id]), abs=1e-6)
    top = tokens[0].top_logprobs
    assert [t for t, _ in top] == logprobs[0].topk(5).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert all(lp == pytest.approx(float(logprobs[0, t]), abs=1e-6) for t, lp in top)
    assert tokens[1].top_logprobs == ()
    # the full distribution the logprobs come from is normalised
    assert torch.logsumexp(logprobs, dim=-1).abs().max().item() < 1e-5


def test_max_top_logprobs() -> None:
    tokens = Sampler().sample(logits_rows(1), [SamplingParams(logprobs=20, seed=0)], [0])
    assert len(tokens[0].top_logprobs) == 20
    assert sum(math.exp(lp) for _, lp in tokens[0].top_logprobs) <= 1.0 + 1e-6


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        Sampler().sample(logits_rows(2), [SamplingParams()], [0])


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Textbook top-k then top-p with a full sort (HF-style), for one row."""
    probs = torch.softmax(logits / temperature, dim=-1)
    values, order = probs.sort(descending=True)
    if top_k:
        values[top_k:] = 0.0
        values /= values.sum()
    mass_before = torch.cumsum(values, 0) - values
    values[mass_before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, values / values.sum())


@pytest.mark.parametrize("scale", [0.1, 1.0, 8.0])  # flat (nucleus past the candidates) to peaked
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (0, 0.5), (700, 0.95), (40, 1.0), (300, 0.99)])
def test_filters_match_a_full_sort_on_a_large_vocabulary(scale: float, top_k: int, top_p: float) -> None:
    rows = torch.randn(3, 3000, generator=torch.Generator().manual_seed(9)) * scale
    probs = sampling_probs(rows, torch.tensor([1.0, 0.8, 1.2]), torch.tensor([top_k] * 3), torch.tensor([top_p] * 3))
    for i, temperature in enumerate((1.0, 0.8, 1.2)):
        expected = reference_probs(rows[i], temperature, top_k, top_p)
        assert torch.equal(probs[i] > 0, expected > 0)
        assert torch.allclose(probs[i], expected, atol=1e-6)


def bitmask_of(allowed: list[set[int]], words: int) -> list[np.ndarray]:
    masks = []
    for ids in allowed:
        bits = np.zeros(words * 32, dtype=np.uint8)
        bits[sorted(ids)] = 1
        masks.append(np.packbits(bits, bitorder="little").view(np.int32))
    return masks


def test_grammar_masks_pick_the_best_allowed_token_and_leave_other_rows_alone() -> None:
    # 70 logit columns, a mask of 2 words (64 tokens): columns 64.. are never allowed.
    logits = torch.randn(6, 70, generator=torch.Generator().manual_seed(9))
    logits[0, 66] = 50.0  # row 0's argmax lies past the mask's vocabulary
    logits[1, 5] = logits[1, 7] = 40.0  # row 1: a tie between two allowed tokens, the first wins
    best = logits.argmax(dim=-1).tolist()
    allowed = [set(range(0, 64, 3)), {5, 7, 9}, {best[2]}, set(range(64)) - {best[3]}, {11, 12, 13}]
    masks = dict(enumerate(bitmask_of(allowed, 2)))  # row 5 has no mask
    greedy = SamplingParams(temperature=0.0)
    params = [greedy, greedy, greedy, greedy, SamplingParams(temperature=1.0, seed=2), greedy]
    picks = [t.token_id for t in Sampler().sample_later(logits, params, [0] * 6, masks)()]
    for row in (0, 1, 2, 3):
        ids = sorted(allowed[row])
        assert picks[row] == ids[int(logits[row, ids].argmax())], row
    assert picks[1] == 5 and picks[2] == best[2]
    assert picks[4] in allowed[4] and picks[5] == best[5]
    # the masked rows' logprobs are of the unmasked distribution, and the caller's logits unchanged
    tokens = Sampler().sample_later(logits, params, [0] * 6, masks)()
    logprobs = torch.log_softmax(logits, dim=-1)
    assert tokens[0].logprob == pytest.approx(float(logprobs[0, picks[0]]), abs=1e-6)
    assert logits[0, 66] == 50.0 and logits.argmax(dim=-1).tolist() == best


def test_a_sampled_masked_row_draws_only_allowed_tokens() -> None:
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(5))
    allowed = [{1, 2, 40}, set(range(64))]
    masks = dict(enumerate(bitmask_of(allowed, 2)))
    params = [SamplingParams(temperature=2.0), SamplingParams(temperature=0.0)]
    seen = {Sampler().sample_later(logits, params, [i, i], masks)()[0].token_id for i in range(200)}
    assert seen == allowed[0]
