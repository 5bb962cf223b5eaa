"""Batch planning with plain sequences and no model."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_edge.batch_plan import Span, common_prefix, plan_batch


@dataclass(eq=False)
class FakeSeq:
    slot: int
    tokens: list[int] = field(default_factory=list)
    n_cached: int = 0


def spans_of(spans: list[Span]) -> list[tuple[int, int, int, bool]]:
    return [(s.seq.slot, s.start, s.end, s.wants_logits) for s in spans]


def test_new_prompts_fill_the_budget_in_order() -> None:
    a, b = FakeSeq(0, list(range(300))), FakeSeq(1, list(range(400)))
    assert spans_of(plan_batch([a, b], 512, 128)) == [(0, 0, 300, True), (1, 0, 212, False)]


def test_decoding_sequences_go_first_and_cap_prefill() -> None:
    decoding = FakeSeq(0, list(range(10)), n_cached=9)
    prompt = FakeSeq(1, list(range(400)), n_cached=100)
    assert spans_of(plan_batch([prompt, decoding], 512, 128)) == [(0, 9, 10, True), (1, 100, 228, False)]


def test_prompt_finishing_within_the_cap_gets_logits() -> None:
    decoding = FakeSeq(0, [1, 2], n_cached=1)
    prompt = FakeSeq(1, list(range(50)), n_cached=0)
    assert spans_of(plan_batch([decoding, prompt], 512, 128)) == [(0, 1, 2, True), (1, 0, 50, True)]


def test_budget_smaller_than_decoders() -> None:
    seqs = [FakeSeq(i, [1, 2], n_cached=1) for i in range(4)]
    assert [s.seq.slot for s in plan_batch(seqs, 3, 128)] == [0, 1, 2]


def test_every_token_is_fed_once_in_order() -> None:
    seqs = [FakeSeq(i, list(range(100 * (i + 1)))) for i in range(5)]
    fed: dict[int, list[int]] = {i: [] for i in range(5)}
    for _ in range(100):
        spans = plan_batch(seqs, 64, 16)
        if not spans:
            break
        assert sum(s.end - s.start for s in spans) <= 64
        for span in spans:
            fed[span.seq.slot] += span.seq.tokens[span.start:span.end]
            span.seq.n_cached = span.end  # type: ignore[misc]
    assert all(fed[i] == seqs[i].tokens for i in range(5))


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2
