"""Comparing greedy runs that were computed differently, so that the comparison holds on every CPU.

Two greedy runs of one prompt computed in different ways (another batch split or shape, another
KV cell layout, another runtime, a resumed KV, a verification forward of several tokens) round
differently, and how they round depends on the CPU: AVX2 and AVX-512 kernels, emulated or
native bf16. Where the reference's best two candidates were within those rounding differences
the runs may part, and past that point they are two different texts. The end of the sequence is
a candidate like any token: one run may end where the other goes on.

- ``assert_same_greedy``: equal, or equal up to a point where they part at a near-tie of the
  run that went on there; a run that continues another conversation, reads the wrong KV or
  stops early with a clear margin fails.
- ``assert_clear_picks``: where a test compares token for token (float32 paths, whose rounding
  differs by ~1e-5), its reference's every pick must win by a margin no rounding reaches; then
  exact equality is a property of the data, not of this CPU.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch  # only pick_from_logits needs it; the edge tier's tests run without


# A pick this far ahead of its runner-up is the same on every float32 path of ours: the engine's
# logprobs differ from transformers' by at most 5.5e-6 nats, alone and batched (measured on the
# tiny checkpoints of tests/engine_gpu).
FLOAT32_CLEAR_MARGIN = 1e-3


class Step(Protocol):
    """One greedy pick with its alternatives (``llm_shared.contract.TokenEvent`` is one)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Pick:
    """A step of a reference computed here from logits."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def pick_from_logits(logits: torch.Tensor, top: int = 5) -> Pick:
    """The greedy pick of one row of logits, with its ``top`` best candidates as logprobs."""
    logprobs = logits.float().log_softmax(dim=-1)
    values, ids = logprobs.topk(top)
    alternatives = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return Pick(alternatives[0][0], alternatives[0][1], alternatives)


def _within(step: Step, candidates: Collection[int], near_tie: float) -> bool:
    alternatives = dict(step.top_logprobs)
    return any(c in alternatives and step.logprob - alternatives[c] < near_tie for c in candidates)


def assert_same_greedy(ours: Sequence[Step], reference: Sequence[Step], *, near_tie: float,
                       end_ids: Collection[int]) -> None:
    """Equal token for token (and in length), or equal up to the first point where they part, if
    they part at a near-tie there: the run that went on at that point (the reference where both
    did) had the other's choice, a token or an end in ``end_ids``, among its alternatives within
    ``near_tie`` nats of its own pick. Both runs must have had the same ``max_tokens``, so the
    shorter one ended on an end token."""
    for i in range(max(len(ours), len(reference))):
        if i < len(ours) and i < len(reference):
            if ours[i].token_id == reference[i].token_id:
                continue
            went_on, other, what = reference[i], {ours[i].token_id}, f"{ours[i].token_id} where the reference picked"
        elif i < len(reference):
            went_on, other, what = reference[i], end_ids, "the end where the reference picked"
        else:
            went_on, other, what = ours[i], end_ids, "where the reference ended, ours picked"
        assert _within(went_on, other, near_tie), (
            f"token {i}: {what} {went_on.token_id} with a clear margin ({went_on.logprob:.3f} against "
            f"{went_on.top_logprobs}; near-tie {near_tie} nats, end ids {sorted(end_ids)})")
        return  # past a near-tie the two continuations are different texts


def assert_clear_picks(picks: Sequence[Step], margin: float) -> None:
    """Every pick wins over its runner-up by at least ``margin`` nats (picks need two alternatives)."""
    for i, pick in enumerate(picks):
        assert len(pick.top_logprobs) >= 2, f"pick {i} has no runner-up to compare with"
        (_, best), (runner_up, second) = pick.top_logprobs[0], pick.top_logprobs[1]
        assert best - second >= margin, (
            f"pick {i}: {pick.token_id} wins over {runner_up} by only {best - second:.2e} nats, under the "
            f"{margin} this comparison needs to hold on every CPU; choose other test data")
