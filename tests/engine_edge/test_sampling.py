"""numpy sampling: greedy, temperature, top-k, top-p, seeds and reported logprobs, on literal logits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine_edge.sampling import (
    candidate_distribution,
    draw,
    greedy_with_prob,
    log_softmax,
    logsumexp,
    make_rng,
    sample,
    top_logprobs,
)
from llm_shared.contract import SamplingParams

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, 3.0, -1.0], dtype=np.float32)


def reference_nucleus(logits: np.ndarray, temperature: float, top_p: float) -> set[int]:
    """Brute force: full sort by probability, smallest prefix reaching top_p."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += p[i]
        if mass >= top_p:
            break
    return set(kept)


def test_log_softmax_normalizes_and_matches_definition() -> None:
    assert math.isclose(logsumexp(LOGITS), math.log(sum(math.exp(v) for v in LOGITS)), rel_tol=1e-7)
    lp = log_softmax(LOGITS)
    assert math.isclose(float(np.exp(lp).sum()), 1.0, rel_tol=1e-12)
    expected = LOGITS[2] - math.log(sum(math.exp(v) for v in LOGITS))
    assert math.isclose(float(lp[2]), expected, rel_tol=1e-6)


def test_greedy_takes_first_maximum_and_reports_raw_logprob() -> None:
    s = sample(LOGITS, SamplingParams(temperature=0.0), make_rng(0))
    assert s.token_id == 1  # ids 1 and 4 tie; the lower wins
    assert math.isclose(s.logprob, float(log_softmax(LOGITS)[1]), rel_tol=1e-6)
    assert s.top_logprobs == ()


def test_logprob_ignores_temperature_and_truncation() -> None:
    params = SamplingParams(temperature=0.3, top_k=2, top_p=0.5, seed=3)
    s = sample(LOGITS, params, make_rng(3))
    assert math.isclose(s.logprob, float(log_softmax(LOGITS)[s.token_id]), rel_tol=1e-6)


def test_top_logprobs_best_first_with_ties_by_id() -> None:
    pairs = top_logprobs(LOGITS, 3)
    assert [t for t, _ in pairs] == [1, 4, 2]
    assert pairs[0][1] >= pairs[1][1] >= pairs[2][1]
    s = sample(LOGITS, SamplingParams(temperature=0.0, logprobs=20), make_rng(0))
    assert len(s.top_logprobs) == len(LOGITS)  # capped at the vocabulary


def test_top_k_limits_the_candidates() -> None:
    ids, probs = candidate_distribution(LOGITS, SamplingParams(temperature=1.0, top_k=3))
    assert set(ids.tolist()) == {1, 2, 4}
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-12)
    rng = make_rng(11)
    drawn = {sample(LOGITS, SamplingParams(temperature=1.0, top_k=3), rng).token_id for _ in range(300)}
    assert drawn == {1, 2, 4}


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.6)
    ids, probs = candidate_distribution(LOGITS, params)
    assert set(ids.tolist()) == reference_nucleus(LOGITS, 1.0, 0.6) == {1, 4}
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-12)


def test_top_p_on_a_flat_large_vocabulary_widens_its_window() -> None:
    # Almost flat over 5000 tokens: the first 256-token window holds too little mass.
    logits = make_rng(5).normal(0.0, 0.05, size=5000).astype(np.float32)
    for top_p in (0.1, 0.5, 0.95):
        ids, _ = candidate_distribution(logits, SamplingParams(temperature=0.7, top_p=top_p))
        assert set(ids.tolist()) == reference_nucleus(logits, 0.7, top_p)
    assert len(candidate_distribution(logits, SamplingParams(top_p=0.95))[0]) > 4000


def test_sampling_follows_the_distribution() -> None:
    params = SamplingParams(temperature=1.0, seed=1)
    rng = make_rng(1)
    counts = np.bincount([sample(LOGITS, params, rng).token_id for _ in range(20000)], minlength=len(LOGITS))
    expected = np.exp(log_softmax(LOGITS)) * 20000
    # 5 sigma of a binomial count: fails for a wrong distribution, not by chance.
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected) + 1)


def test_low_temperature_sharpens() -> None:
    _, sharp = candidate_distribution(LOGITS, SamplingParams(temperature=0.1))
    _, flat = candidate_distribution(LOGITS, SamplingParams(temperature=2.0))
    assert sharp.max() > 0.49 and sharp[[0, 2, 3, 5]].sum() < 1e-3
    assert flat.max() < 0.35


def test_same_seed_same_tokens_different_seed_differs() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    logits = make_rng(0).normal(size=1000).astype(np.float32)

    def run(seed: int) -> list[int]:
        rng = make_rng(seed)
        return [sample(logits, params, rng).token_id for _ in range(50)]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_greedy_does_not_consume_randomness() -> None:
    rng_a, rng_b = make_rng(9), make_rng(9)
    sample(LOGITS, SamplingParams(temperature=0.0), rng_a)
    assert rng_a.random() == rng_b.random()


def test_greedy_with_prob() -> None:
    token_id, prob = greedy_with_prob(LOGITS)
    assert token_id == 1
    assert math.isclose(prob, float(np.exp(log_softmax(LOGITS)[1])), rel_tol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2])
def test_top_k_one_is_greedy_like(top_k: int) -> None:
    logits = np.array([0.0, 10.0, 9.9, -5.0], dtype=np.float32)
    rng = make_rng(2)
    picks = {sample(logits, SamplingParams(temperature=1.0, top_k=top_k), rng).token_id for _ in range(200)}
    assert picks == ({1} if top_k == 1 else {1, 2})


@pytest.mark.parametrize("n", [1, 5, 256, 1000, 49152])
def test_draw_matches_a_plain_cumulative_search(n: int) -> None:
    rng = make_rng(n)
    weights = rng.random(n) ** 4  # uneven
    cumulative = np.cumsum(weights)
    for u in [0.0, 1e-9, *rng.random(200).tolist(), 1 - 1e-12]:
        expected = min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), n - 1)
        assert abs(draw(weights, u) - expected) <= (1 if weights[expected] < 1e-12 else 0)
