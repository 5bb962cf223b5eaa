"""The token bitmask that applies a grammar to logits, and the helpers that fill and read it.

The layout is llguidance's, the one xgrammar and vLLM use too: int32 words, bit ``i % 32`` of word
``i // 32`` set when token ``i`` is allowed. A torch tier copies the same int32 row to its device
and applies it there (``logits.masked_fill_(~bits, -inf)`` after unpacking, or a fused kernel);
``apply_bitmask`` here is for the edge tier, which gets llama.cpp's logits on the host.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

NEG_INF = np.float32(-np.inf)


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a bitmask for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> NDArray[np.int32]:
    """A [rows, words] bitmask with every token allowed (-1: all bits set)."""
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def allowed_tokens(row: NDArray[np.int32], vocab_size: int) -> NDArray[np.intp]:
    """The ids a bitmask row allows, ascending."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little", count=vocab_size)
    return np.flatnonzero(bits)


def apply_bitmask(logits: NDArray[np.float32], row: NDArray[np.int32]) -> None:
    """Set the logits of disallowed tokens to -inf, in place. ``logits``: [vocab] float32, possibly
    longer than the bitmask covers (a padded vocabulary); tokens past the mask are disallowed.

    Masks are nearly all-allowed (free text) or nearly all-blocked (inside JSON), so the cheaper of
    the two index sets is written: ~10 µs a row of 49k where a boolean-indexed write takes ~25."""
    covered = min(logits.shape[-1], row.shape[-1] * 32)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little", count=covered).view(bool)
    logits[covered:] = NEG_INF
    allowed = np.count_nonzero(bits)
    if allowed * 2 < covered:
        keep = np.flatnonzero(bits)
        kept = logits[keep]
        logits[:covered] = NEG_INF
        logits[keep] = kept
    elif allowed < covered:
        logits[np.flatnonzero(~bits)] = NEG_INF


def allow_only(row: NDArray[np.int32], token_id: int) -> None:
    """Make ``row`` allow ``token_id`` alone."""
    row.fill(0)
    row[token_id // 32] = np.array(1 << (token_id % 32), dtype=np.uint32).view(np.int32)
