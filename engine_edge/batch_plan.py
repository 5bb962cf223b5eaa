"""Which tokens of which sequences go into the next decode step: plain integers, no model.

A sequence is anything with a slot, its token list and how many of those tokens are already
in the KV cache; everything past ``n_cached`` is still to be fed (a prompt remainder, or the
one token sampled last step). Tested with literals in tests/engine_edge/test_batch_plan.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Active(Protocol):
    """What scheduling needs of a sequence: its slot, its tokens, and how many are in the KV."""

    slot: int
    tokens: list[int]
    n_cached: int


@dataclass(frozen=True)
class Span:
    """Tokens ``seq.tokens[start:end]`` go into this step's batch."""

    seq: Active
    start: int
    end: int

    @property
    def wants_logits(self) -> bool:
        return self.end == len(self.seq.tokens)


def plan_batch(active: Sequence[Active], budget: int, prefill_chunk: int) -> list[Span]:
    """One token for each decoding sequence first, so none waits behind a prompt; then prompt
    chunks in the given order with what budget is left (capped while others decode)."""
    spans: list[Span] = []
    decoding = [s for s in active if len(s.tokens) - s.n_cached == 1]
    for s in decoding[:budget]:
        spans.append(Span(s, s.n_cached, s.n_cached + 1))
    budget -= len(spans)
    prefill_budget = min(budget, prefill_chunk) if decoding else budget
    for s in active:
        pending = len(s.tokens) - s.n_cached
        if pending <= 1 or prefill_budget <= 0:
            continue
        take = min(pending, prefill_budget)
        spans.append(Span(s, s.n_cached, s.n_cached + take))
        prefill_budget -= take
    return spans


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
