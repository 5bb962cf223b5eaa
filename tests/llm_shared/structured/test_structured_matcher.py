"""One sequence's matcher: accepting, refusing without harm, rolling back, cutting a draft to its
valid prefix, the masks for a draft, EOS; and the bitmask helpers against llguidance's own."""

from __future__ import annotations

import llguidance.numpy
import numpy as np
import pytest
from structured_helpers import TIMER, constraints

from llm_shared.structured import (
    GrammarCompiler,
    SequenceMatcher,
    allocate_bitmask,
    allowed_tokens,
    apply_bitmask,
    bitmask_words,
)
from llm_shared.tokenizer import Tokenizer

pytestmark = pytest.mark.model

RF = {"type": "json_schema", "json_schema": {"name": "t", "schema": TIMER, "strict": True}}
ANSWER = '{"minutes": 42}'


@pytest.fixture
def matcher(compiler: GrammarCompiler) -> SequenceMatcher:
    compiled = compiler.compile(constraints(response_format=RF))
    assert compiled is not None
    return compiler.matcher(compiled)


def mask_of(m: SequenceMatcher, vocab: int) -> np.ndarray:
    row = allocate_bitmask(1, vocab)[0]
    m.fill_bitmask(row)
    return row


def test_accept_and_eos(matcher: SequenceMatcher, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    for i, token in enumerate(ids):
        assert not matcher.accepts_eos
        assert not matcher.accept(tokenizer.eos_id)  # EOS before the answer is complete
        assert matcher.accept(token)
        assert matcher.num_tokens == i + 1
    assert matcher.accepts_eos and not matcher.is_terminated
    assert list(allowed_tokens(mask_of(matcher, tokenizer.vocab_size), tokenizer.vocab_size)) == [tokenizer.eos_id]
    assert matcher.accept(tokenizer.eos_id)
    assert matcher.is_terminated and not matcher.accepts_eos
    assert not matcher.accept(ids[0])  # nothing after EOS
    assert list(allowed_tokens(mask_of(matcher, tokenizer.vocab_size), tokenizer.vocab_size)) == [tokenizer.eos_id]


def test_a_refused_token_changes_nothing(matcher: SequenceMatcher, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    assert matcher.accept(ids[0])
    before = mask_of(matcher, tokenizer.vocab_size).copy()
    bad = tokenizer.encode("x")[0]
    assert not before[bad // 32] >> (bad % 32) & 1
    assert not matcher.accept(bad)
    assert matcher.error is None and matcher.num_tokens == 1
    assert np.array_equal(mask_of(matcher, tokenizer.vocab_size), before)
    assert all(matcher.accept(t) for t in ids[1:]) and matcher.accepts_eos


def test_rollback(matcher: SequenceMatcher, tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode(ANSWER), tokenizer.eos_id]
    masks = []
    for token in ids:
        masks.append(mask_of(matcher, tokenizer.vocab_size).copy())
        assert matcher.accept(token)
    matcher.rollback(1)  # the EOS
    assert not matcher.is_terminated and matcher.accepts_eos and matcher.num_tokens == len(ids) - 1
    matcher.rollback(4)
    assert matcher.num_tokens == len(ids) - 5
    assert np.array_equal(mask_of(matcher, tokenizer.vocab_size), masks[len(ids) - 5])
    with pytest.raises(ValueError):
        matcher.rollback(matcher.num_tokens + 1)
    matcher.rollback(matcher.num_tokens)
    assert np.array_equal(mask_of(matcher, tokenizer.vocab_size), masks[0])
    assert all(matcher.accept(t) for t in ids) and matcher.is_terminated  # and forward again


def test_valid_prefix_len_cuts_a_draft_at_its_first_bad_token(matcher: SequenceMatcher, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(ANSWER)
    bad = tokenizer.encode("x")[0]
    draft = [*ids[:3], bad, *ids[4:]]
    assert matcher.valid_prefix_len(draft) == 3
    assert matcher.num_tokens == 0  # validating consumed nothing
    assert matcher.valid_prefix_len(ids) == len(ids)
    assert matcher.valid_prefix_len([*ids, tokenizer.eos_id]) == len(ids) + 1
    assert matcher.valid_prefix_len([*ids[:2], tokenizer.eos_id, *ids[2:]]) == 2  # EOS too early
    assert matcher.valid_prefix_len([]) == 0
    assert matcher.accept(ids[0])  # from the middle, too
    assert matcher.valid_prefix_len(draft[1:]) == 2
    assert matcher.num_tokens == 1


def test_draft_masks_are_the_masks_of_each_position(
    matcher: SequenceMatcher, tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    ids = tokenizer.encode(ANSWER)
    bad = tokenizer.encode("x")[0]
    draft = [*ids[:3], bad, *ids[4:]]
    bitmask = allocate_bitmask(8, tokenizer.vocab_size)
    assert matcher.fill_draft_bitmasks(draft, bitmask, first_row=2) == 4  # 3 valid tokens: 4 masks
    assert matcher.num_tokens == 0
    assert (bitmask[:2] == -1).all() and (bitmask[6:] == -1).all()  # other rows untouched
    for i in range(4):
        assert np.array_equal(bitmask[2 + i], mask_of(matcher, tokenizer.vocab_size)), i
        matcher.accept(draft[i])
    # a complete draft ending in EOS: a mask for every position but none after the EOS
    fresh = compiler.matcher(compiler.compile(constraints(response_format=RF)))  # type: ignore[arg-type]
    full = [*ids, tokenizer.eos_id]
    bitmask = allocate_bitmask(len(full) + 1, tokenizer.vocab_size)
    assert fresh.fill_draft_bitmasks(full, bitmask) == len(full)


def test_fill_bitmask_checks_its_row(matcher: SequenceMatcher, tokenizer: Tokenizer) -> None:
    words = bitmask_words(tokenizer.vocab_size)
    for bad in (
        np.zeros(words, np.int64),
        np.zeros(words - 1, np.int32),
        np.zeros((1, words), np.int32),
        np.zeros(2 * words, np.int32)[::2],
    ):
        with pytest.raises(ValueError):
            matcher.fill_bitmask(bad)


def random_mask(rng: np.random.Generator, vocab: int, density: float) -> np.ndarray:
    bits = np.zeros(bitmask_words(vocab) * 32, np.uint8)
    bits[:vocab] = rng.random(vocab) < density
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("density", [0.0, 0.001, 0.5, 0.999, 1.0])
@pytest.mark.parametrize("vocab", [49152, 50000])
def test_apply_bitmask_matches_llguidance(density: float, vocab: int) -> None:
    rng = np.random.default_rng(int(density * 1000) + vocab)
    mask = random_mask(rng, vocab, density)
    logits = rng.standard_normal(vocab + 64).astype(np.float32)  # a padded vocabulary: 64 extra logits
    expected = logits.copy()[None, :]
    llguidance.numpy.apply_token_bitmask_inplace(expected, mask[None, :])
    ours = logits.copy()
    apply_bitmask(ours, mask)
    assert np.array_equal(ours, expected[0])
    assert np.isneginf(ours[vocab:]).all()
    assert np.array_equal(np.flatnonzero(~np.isneginf(ours)), allowed_tokens(mask, vocab))
