"""``verify_drafts`` (every drafted sequence at once, one transfer) emits exactly what
``verify.accept`` then ``verify.token_logprobs`` emit one sequence at a time: the same tokens,
logprobs and top logprobs, for greedy and sampled requests, drafter distributions and point
masses, top-k and top-p, drafts that are likely, unlikely or impossible."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_gpu.speculative.verify import accept, token_logprobs
from engine_gpu.speculative.verify_batch import verify_drafts
from llm_shared.contract import SamplingParams

VOCAB = 64

params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1.0, 0.8, 1.5]),
    top_k=st.sampled_from([0, 0, 3, 20]),
    top_p=st.sampled_from([1.0, 1.0, 0.9, 0.5]),
    logprobs=st.sampled_from([0, 0, 2, 5]),
)

sequence_strategy = st.tuples(
    params_strategy,
    st.integers(0, 6),  # drafts
    st.booleans(),  # a drafter distribution (else point masses)
    st.integers(0, 2**63 - 1),  # seed
    st.integers(0, 500),  # output index
    st.floats(0.0, 1.0),  # how often a draft is the target's favourite
)


def reference(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams,
              seed: int, output_index: int) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    emitted = accept(logits, drafts, q, params, seed, output_index)
    return [tuple(t) for t in token_logprobs(logits, emitted, params)]


@settings(max_examples=150, deadline=None)
@given(st.lists(sequence_strategy, min_size=1, max_size=6), st.integers(0, 2**32 - 1))
def test_verify_drafts_equals_accept_one_sequence_at_a_time(sequences: list[tuple], data_seed: int) -> None:
    gen = torch.Generator().manual_seed(data_seed)
    rows, drafts, qs, params, seeds, indices = [], [], [], [], [], []
    for p, num_drafts, with_q, seed, index, agree in sequences:
        logits = torch.randn(num_drafts + 1, VOCAB, generator=gen) * 3
        favourite = logits.argmax(dim=-1).tolist()
        d = [favourite[j] if torch.rand(1, generator=gen).item() < agree else int(torch.randint(0, VOCAB, (1,), generator=gen))
             for j in range(num_drafts)]
        q = None
        if with_q and num_drafts:
            q = torch.softmax(torch.randn(num_drafts, VOCAB, generator=gen) * 2, dim=-1)
            q[torch.arange(num_drafts), d] += 0.05  # drawn from q: its drafts have mass
            q /= q.sum(dim=-1, keepdim=True)
        rows.append(logits)
        drafts.append(d)
        qs.append(q)
        params.append(p)
        seeds.append(seed)
        indices.append(index)
    got = verify_drafts(torch.cat(rows), drafts, qs, params, seeds, indices)
    expected = [reference(*args) for args in zip(rows, drafts, qs, params, seeds, indices, strict=True)]
    assert [[tuple(t) for t in tokens] for tokens in got] == expected


def test_verify_drafts_refuses_a_wrong_row_count() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        verify_drafts(torch.zeros(2, VOCAB), [[1, 2]], [None], [SamplingParams()], [1], [0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_accepted_drafts_end_with_the_bonus_token(temperature: float) -> None:
    drafts = [5, 9, 11]
    logits = torch.full((4, VOCAB), -20.0)
    logits[torch.arange(3), torch.tensor(drafts)] = 20.0  # the target is sure of every draft
    logits[3, 40] = 20.0
    params = SamplingParams(temperature=temperature, logprobs=2)
    [got] = verify_drafts(logits, [drafts], [None], [params], [7], [3])
    assert [t.token_id for t in got] == [5, 9, 11, 40]
    assert [tuple(t) for t in got] == reference(logits, drafts, None, params, 7, 3)


def test_a_drafter_that_equals_the_target_is_always_accepted() -> None:
    from engine_gpu.sampler import sampling_probs

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=gen)
    params = SamplingParams(temperature=1.0, top_k=5)
    q = sampling_probs(logits[:2], torch.ones(2), torch.full((2,), 5), torch.ones(2))  # p itself
    drafts = [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]
    for seed in range(40):  # accepted with probability min(1, p / q) = 1, then the bonus from p
        [got] = verify_drafts(logits, [drafts], [q], [params], [seed], [0])
        assert [t.token_id for t in got][:2] == drafts
        assert [tuple(t) for t in got] == reference(logits, drafts, q, params, seed, 0)
