"""The edge model as a drafter (llama.cpp in the engine's process) on the embedded GGUF: greedy
drafts are llama.cpp's own greedy tokens, requests draft together in one llama_decode per round,
the KV follows what the target accepted, sampled drafts carry their q, limits shrink drafts
instead of failing, and the tokenizer check refuses a drafter with another vocabulary."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_gpu.sampler import uniform_for
from engine_gpu.speculative.drafter import (
    MAX_DRAFT_TOKENS,
    Draft,
    Drafter,
    DraftRequest,
    draft_uniform,
)
from engine_gpu.speculative.edge_drafter import EdgeDrafter
from llm_shared.contract import SamplingParams
from llm_shared.errors import ConfigError, EngineError
from llm_shared.llamacpp_runtime import ContextShape, LlamaContext, LlamaModel, TokenBatch
from llm_shared.modelfile import default_gguf_path
from llm_shared.tokenizer import Tokenizer, check_same_tokenizer
from llm_shared.tokenizer_load import TokenizerParts, load_gguf

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8)
# Batched rows in a unified pool may flip a near-tie (see test_requests_drafted_together_...).
NEAR_TIE_NATS = 0.5
TEXTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4, 5, 6, 7,",
]


@pytest.fixture(scope="module")
def path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def parts(path: Path) -> TokenizerParts:
    return load_gguf(path)


@pytest.fixture(scope="module")
def tokenizer(parts: TokenizerParts) -> Tokenizer:
    return Tokenizer(parts)


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def model(path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel(path)
    yield m
    m.free()


@pytest.fixture
def drafter(path: Path) -> Iterator[EdgeDrafter]:
    d = EdgeDrafter(path, max_seqs=4, kv_cells=512, n_threads=1)
    yield d
    d.close()


def request(rid: str, ids: Sequence[int], k: int = 4, params: SamplingParams = GREEDY, seed: int = 0,
            output_index: int = 0) -> DraftRequest:
    return DraftRequest(rid, list(ids), k, params, seed, output_index)


def reference_greedy(model: LlamaModel, chunks: Sequence[Sequence[int]], n: int) -> tuple[list[int], list[float]]:
    """llama.cpp's own greedy continuation in a fresh context (each chunk one llama_decode, then
    one token at a time), with the gap between the top two logits at every step."""
    ctx = LlamaContext(model, ContextShape(n_ctx=512, n_seqs=1, n_batch=512, n_threads=1, kv_unified=True))
    batch = TokenBatch(512)
    tokens: list[int] = []
    margins: list[float] = []
    try:
        feed = [list(chunk) for chunk in chunks]
        pos = 0
        while True:
            chunk = feed.pop(0)
            batch.clear()
            for i, token in enumerate(chunk):
                index = batch.add(token, pos + i, 0, i == len(chunk) - 1)
            pos += len(chunk)
            assert ctx.decode(batch) == 0
            if feed:
                continue
            row = ctx.logits(index)
            top2 = np.partition(row, -2)[-2:]
            tokens.append(int(np.argmax(row)))
            margins.append(float(top2[1] - top2[0]))
            if len(tokens) == n:
                return tokens, margins
            feed.append([tokens[-1]])
    finally:
        batch.free()
        ctx.free()


def assert_same_up_to_near_ties(got: list[int], reference: tuple[list[int], list[float]]) -> None:
    tokens, margins = reference
    assert len(got) == len(tokens)
    for j, (a, b) in enumerate(zip(got, tokens, strict=True)):
        if a != b:
            assert margins[j] < NEAR_TIE_NATS, f"draft {j}: {a} != {b} with a top-2 gap of {margins[j]:.3f} nats"
            return  # past a flip the contexts differ, so the rest need not agree


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before[key]


# ---- the contract's pure parts ----------------------------------------------------------------


def test_draft_uniforms_are_their_own_stream() -> None:
    assert draft_uniform(7, 3, 0) == draft_uniform(7, 3, 0)
    assert draft_uniform(7, 3, 0) != uniform_for(7, 3)  # not the target sampler's number
    keys = {draft_uniform(7, n, j) for n in range(4) for j in range(MAX_DRAFT_TOKENS)}
    assert len(keys) == 4 * MAX_DRAFT_TOKENS  # (output index, position) never collide
    with pytest.raises(ValueError, match="draft position"):
        draft_uniform(7, 3, MAX_DRAFT_TOKENS)


# ---- greedy drafting ----------------------------------------------------------------------------


def test_is_a_drafter_and_greedy_drafts_are_llama_cpp_greedy(
    drafter: EdgeDrafter, model: LlamaModel, prompts: list[list[int]]
) -> None:
    assert isinstance(drafter, Drafter)
    out = drafter.propose([request("a", prompts[0], k=6)])
    assert out["a"].probs is None  # greedy proposals are point masses
    assert out["a"].token_ids == reference_greedy(model, [prompts[0]], 6)[0]


def test_requests_drafted_together_match_each_alone_in_one_decode_per_round(
    drafter: EdgeDrafter, model: LlamaModel, prompts: list[list[int]]
) -> None:
    before = drafter.stats()
    out = drafter.propose([request(f"r{i}", ids) for i, ids in enumerate(prompts)])
    after = drafter.stats()
    # the prompts' catch-up (all four in one batch, timed apart), then one call per draft
    # position with one token per sequence: 1 + 4, not 16
    assert delta(before, after, "drafter_decode_calls") == 5
    assert delta(before, after, "drafter_catchup_tokens") == sum(map(len, prompts))
    assert after["drafter_kv_cells_used"] == sum(len(ids) + 3 for ids in prompts)  # last draft not fed
    for i, ids in enumerate(prompts):
        # In a unified pool llama.cpp's attention rounds by where a sequence's cells landed, so a
        # batched row can flip a near-tie against the solo run (the edge backend measured such
        # flips only where the solo top two were within 0.1 nats); anything else must agree.
        assert_same_up_to_near_ties(out[f"r{i}"].token_ids, reference_greedy(model, [ids], 4))


def test_requests_may_ask_for_different_k(drafter: EdgeDrafter, prompts: list[list[int]]) -> None:
    before = drafter.stats()
    out = drafter.propose([request(f"r{i}", ids, k=k) for i, (ids, k) in enumerate(zip(prompts, [1, 3, 2, 1], strict=True))])
    assert [len(out[f"r{i}"].token_ids) for i in range(4)] == [1, 3, 2, 1]
    assert delta(before, drafter.stats(), "drafter_decode_calls") == 4  # catch-up + 3 draft positions


def test_kv_follows_what_the_target_accepted(path: Path, drafter: EdgeDrafter, prompts: list[list[int]]) -> None:
    context = prompts[2]
    first = drafter.propose([request("a", context)])["a"].token_ids
    bonus = next(t for t in (13, 42, 1000) if t != first[2])  # the target rejected draft 2 and sampled this
    accepted = [*context, *first[:2], bonus]
    before = drafter.stats()
    again = drafter.propose([request("a", accepted, output_index=3)])["a"].token_ids
    after = drafter.stats()
    assert delta(before, after, "drafter_catchup_tokens") == 1  # only the bonus: the rejected draft was cut
    assert after["drafter_kv_cells_used"] == len(accepted) + 3
    fresh = EdgeDrafter(path, max_seqs=1, kv_cells=512, n_threads=1)
    try:
        reference = fresh.propose([request("b", accepted)])["b"].token_ids
    finally:
        fresh.close()
    assert again == reference
    # every draft accepted: the next round feeds the last draft and the bonus, nothing more
    before = after
    drafter.propose([request("a", [*accepted, *again, 7], output_index=7)])
    assert delta(before, drafter.stats(), "drafter_catchup_tokens") == 2


def test_behind_counts_what_the_next_propose_feeds(drafter: EdgeDrafter, prompts: list[list[int]]) -> None:
    context = prompts[2]
    assert drafter.behind("a", context) == len(context)  # new: the whole prompt
    first = drafter.propose([request("a", context)])["a"].token_ids
    fed = sum(n for n, _ in drafter.last_forwards)
    assert fed == len(context) + 3 and all(seconds > 0 for _, seconds in drafter.last_forwards)  # + drafts 1..3
    assert drafter.behind("a", [*context, *first, 7]) == 2  # all accepted: the last draft and the bonus
    assert drafter.behind("a", [*context, *first[:1], 7]) == 1  # a rejection: only the bonus
    sat_out = [*context, *first, *range(20, 30)]
    before = drafter.stats()
    assert drafter.behind("a", sat_out) == 11  # the last draft and ten tokens it missed
    drafter.propose([request("a", sat_out)])
    assert delta(before, drafter.stats(), "drafter_catchup_tokens") == 11


def test_a_context_past_the_window_is_drafted_from_its_last_tokens(path: Path, model: LlamaModel,
                                                                   prompts: list[list[int]]) -> None:
    long = [t for p in prompts for t in p]  # ~60 tokens
    drafter = EdgeDrafter(path, max_seqs=2, kv_cells=512, n_threads=1, window=16)
    try:
        assert drafter.behind("w", long) == 16
        out = drafter.propose([request("w", long, k=4)])["w"].token_ids
        assert drafter.stats()["drafter_catchup_tokens"] == 16
        assert drafter.stats()["drafter_kv_cells_used"] == 16 + 3
        assert_same_up_to_near_ties(out, reference_greedy(model, [long[-16:]], 4))  # what the window says
        # following on within the window: only the new tokens; far behind again: the window afresh
        assert drafter.behind("w", [*long, *out, 9]) == 2
        far = [*long, *out, *range(100, 140)]
        assert drafter.behind("w", far) == 16
        before = drafter.stats()
        drafter.propose([request("w", far, k=2)])
        after = drafter.stats()
        assert delta(before, after, "drafter_catchup_tokens") == 16 and after["drafter_kv_cells_used"] == 16 + 1
    finally:
        drafter.close()


def test_calibration_times_forwards_of_growing_size_once(drafter: EdgeDrafter) -> None:
    forwards = drafter.calibrate()
    assert [n for n, _ in forwards] == [1, 2, 4, 8, 16, 64]
    assert all(seconds > 0 for _, seconds in forwards)
    assert drafter.calibrate() is forwards  # timed once
    assert drafter.stats()["drafter_kv_cells_used"] == 0 and drafter.stats()["drafter_slots_in_use"] == 0


# ---- sampled drafting -----------------------------------------------------------------------------


def test_sampled_drafts_come_with_their_distributions(path: Path, drafter: EdgeDrafter,
                                                      prompts: list[list[int]]) -> None:
    reqs = [request("s", prompts[2], params=SAMPLED, seed=1234, output_index=5), request("g", prompts[0])]
    out = drafter.propose(reqs)
    draft = out["s"]
    assert out["g"].probs is None
    assert draft.probs is not None and len(draft.token_ids) == 4
    assert draft.probs.shape == (4, drafter.n_vocab) and draft.probs.dtype == torch.float32
    torch.testing.assert_close(draft.probs.sum(dim=-1), torch.ones(4), atol=1e-4, rtol=0)
    for j, token in enumerate(draft.token_ids):
        assert draft.probs[j, token] > 0
    other = EdgeDrafter(path, max_seqs=2, kv_cells=512, n_threads=1)
    try:
        again = other.propose([request("s", prompts[2], params=SAMPLED, seed=1234, output_index=5)])["s"]
    finally:
        other.close()
    assert again.token_ids == draft.token_ids  # the same seed drafts the same tokens
    torch.testing.assert_close(again.probs, draft.probs, atol=1e-4, rtol=0)


# ---- room, release, bad input ---------------------------------------------------------------------


def test_release_frees_the_cells_at_once(drafter: EdgeDrafter, prompts: list[list[int]]) -> None:
    drafter.propose([request("a", prompts[0]), request("b", prompts[1])])
    assert drafter.stats()["drafter_slots_in_use"] == 2
    drafter.release("a")
    assert drafter.stats()["drafter_kv_cells_used"] == len(prompts[1]) + 3
    drafter.release("b")
    drafter.release("never-seen")
    stats = drafter.stats()
    assert stats["drafter_kv_cells_used"] == 0 and stats["drafter_slots_in_use"] == 0


def test_more_requests_than_slots_draft_as_many_as_fit(path: Path, prompts: list[list[int]]) -> None:
    drafter = EdgeDrafter(path, max_seqs=2, kv_cells=512, n_threads=1)
    try:
        out = drafter.propose([request(f"r{i}", prompts[i], k=2) for i in range(3)])
        assert [len(out[f"r{i}"].token_ids) for i in range(3)] == [2, 2, 0]
        # next round r2 alone: the least recently used idle slot gives way
        drafter.propose([request("r1", prompts[1], k=2)])
        out = drafter.propose([request("r2", prompts[2], k=2)])
        assert len(out["r2"].token_ids) == 2
        stats = drafter.stats()
        assert stats["drafter_evictions"] == 1 and stats["drafter_slots_in_use"] == 2
        assert stats["drafter_kv_cells_used"] == len(prompts[1]) + 1 + len(prompts[2]) + 1  # r0's KV is gone
    finally:
        drafter.close()


def test_limits_give_fewer_drafts_instead_of_failing(path: Path, tokenizer: Tokenizer) -> None:
    long = (tokenizer.encode(" ".join(TEXTS)) * 20)[:254]
    drafter = EdgeDrafter(path, max_seqs=2, kv_cells=200, n_threads=1)  # 256 cells: the pool is the limit
    try:
        assert drafter.n_ctx == drafter.n_ctx_seq == 256
        # the pool: a holds 150 + 3 cells after its round, so b (102 tokens) has room for 2 drafts
        out = drafter.propose([request("a", long[:150]), request("b", long[:102])])
        assert [len(out["a"].token_ids), len(out["b"].token_ids)] == [4, 2]
        assert drafter.stats()["drafter_kv_cells_used"] == 256
        # b alone: a is idle and gives its cells back
        out = drafter.propose([request("b", long[:102])])
        assert len(out["b"].token_ids) == 4 and drafter.stats()["drafter_evictions"] == 1
        # a sequence's last usable position: 254 tokens leave room for 2 drafts, 256 for none
        assert len(drafter.propose([request("b", long)])["b"].token_ids) == 2
        assert drafter.propose([request("b", [*long, 13, 13])])["b"] == Draft([], None)
        assert drafter.stats()["drafter_decode_failures"] == 0
    finally:
        drafter.close()


def test_bad_input_raises_and_leaves_other_slots_intact(drafter: EdgeDrafter, prompts: list[list[int]]) -> None:
    first = drafter.propose([request("a", prompts[0])])["a"].token_ids
    before = drafter.stats()
    bad_requests = [
        [request("a", [*prompts[0], first[0]]), request("x", [*prompts[1], drafter.n_vocab])],
        [request("x", [*prompts[1], -1])],
        [request("x", [*prompts[1], 1.5])],  # type: ignore[list-item]
        [request("x", prompts[1], k=0)],
        [request("x", prompts[1], k=MAX_DRAFT_TOKENS + 1)],
        [request("x", [])],
        [request("a", prompts[0]), request("a", prompts[0])],
    ]
    messages = ["outside the drafter's vocabulary", "outside", "outside", "k must be", "k must be",
                "token_ids is empty", "appears twice"]
    for reqs, message in zip(bad_requests, messages, strict=True):
        with pytest.raises(ValueError, match=message):
            drafter.propose(reqs)
    assert drafter.stats() == {**before}  # nothing fed, nothing cut, no slot taken
    # a's KV is as it was: accepting its first draft feeds just that token
    out = drafter.propose([request("a", [*prompts[0], first[0]])])["a"]
    assert out.token_ids[:3] == first[1:]
    assert delta(before, drafter.stats(), "drafter_catchup_tokens") == 1


def test_a_failed_decode_keeps_the_drafts_made_and_consistent_kv(
    drafter: EdgeDrafter, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = drafter._ctx
    real_decode = ctx.decode
    calls = iter([real_decode, real_decode, real_decode, lambda batch: 1])  # the 4th call (round 2) finds no room
    monkeypatch.setattr(ctx, "decode", lambda batch: next(calls, real_decode)(batch))
    out = drafter.propose([request("a", prompts[0])])["a"]
    assert len(out.token_ids) == 2  # catch-up, draft 0 from the last prompt token, draft 1; round 2 failed
    stats = drafter.stats()
    assert stats["drafter_decode_failures"] == 1
    assert stats["drafter_kv_cells_used"] == len(prompts[0]) + 1  # the failed token's position was cut
    monkeypatch.undo()
    again = drafter.propose([request("a", [*prompts[0], *out.token_ids])])["a"]
    assert len(again.token_ids) == 4
    assert delta(stats, drafter.stats(), "drafter_catchup_tokens") == 1


def test_close_is_idempotent_and_final(path: Path, prompts: list[list[int]]) -> None:
    drafter = EdgeDrafter(path, max_seqs=1, kv_cells=256, n_threads=1)
    drafter.propose([request("a", prompts[0], k=1)])
    drafter.close()
    drafter.close()
    drafter.release("a")
    assert drafter.stats()["drafter_kv_cells_used"] == 0
    with pytest.raises(EngineError, match="closed"):
        drafter.propose([request("a", prompts[0])])


# ---- the tokenizer check ----------------------------------------------------------------------------


def test_same_tokenizer_passes_and_another_is_refused(parts: TokenizerParts, tokenizer: Tokenizer) -> None:
    check_same_tokenizer(tokenizer, tokenizer, "edge")
    table = parts.token_bytes
    smaller = Tokenizer(replace(parts, token_bytes=table[:-10]))
    with pytest.raises(ConfigError, match=r"drafter 'edge' does not share .* 49142 tokens, the target's 49152"):
        check_same_tokenizer(tokenizer, smaller, "edge")
    swapped = Tokenizer(replace(parts, token_bytes=(*table[:300], table[301], table[300], *table[302:])))
    with pytest.raises(ConfigError, match="2 token\\(s\\) differ, first id 300"):
        check_same_tokenizer(tokenizer, swapped, "edge")
    other_eos = Tokenizer(replace(parts, eos_id=0))
    with pytest.raises(ConfigError, match="end-of-sequence id is 0, the target's 2"):
        check_same_tokenizer(tokenizer, other_eos, "edge")


def test_the_constructor_checks_the_target_tokenizer(path: Path, parts: TokenizerParts) -> None:
    smaller = Tokenizer(replace(parts, token_bytes=parts.token_bytes[:-10]))
    with pytest.raises(ConfigError, match="does not share the target's tokenizer"):
        EdgeDrafter(path, max_seqs=1, kv_cells=256, n_threads=1, target_tokenizer=smaller)
