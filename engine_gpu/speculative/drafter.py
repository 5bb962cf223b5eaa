"""What a drafter is: requests in, proposed tokens (and the distributions they came from) out.

The engine core asks a ``Drafter`` for up to ``k`` tokens per decoding sequence, then verifies
them in one target pass (``speculative.verify``). A drafter keeps whatever per-request state it
likes (an n-gram index, a KV cache) keyed by request id, follows what the target accepted from
the ``token_ids`` it is handed each round, and forgets a request on ``release``.

A drafter that samples needs its own random numbers: ``draft_uniform`` keys them by (seed,
output index, draft position) on a stream of their own, so drafting never shifts the uniforms
the target's sampler and the acceptance test draw, and the same seed drafts the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine_gpu.sampler import uniform_for
from llm_shared.contract import SamplingParams

if TYPE_CHECKING:
    import torch


# XORed into a request's seed for the drafter's stream (the acceptance test salts its own).
DRAFT_SALT = 0xD4AF_7E55_0C0F_FEE1
# Draft positions per output index in the drafter's counter space: k beyond this would reuse
# the uniforms of the next output index's drafts.
MAX_DRAFT_TOKENS = 64


@dataclass(frozen=True)
class DraftRequest:
    request_id: str
    token_ids: Sequence[int]  # prompt + accepted output so far; the target has no KV for the last one yet
    k: int  # drafts wanted, >= 1
    params: SamplingParams  # greedy (params.greedy) -> argmax drafts; otherwise sampled from q
    seed: int  # keys the drafter's randomness (already resolved for unseeded requests)
    output_index: int  # tokens generated so far


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]  # 0..k proposals
    # [len(token_ids), vocab] float32: the distribution each draft was sampled from;
    # None = point masses (a deterministic proposal, e.g. greedy or n-gram)
    probs: torch.Tensor | None


@runtime_checkable
class Drafter(Protocol):
    name: str
    # (tokens, seconds) of every model forward the latest ``propose`` made: the controller prices
    # drafting from them (a drafter without a model reports its lookups as forwards)
    last_forwards: list[tuple[int, float]]

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]: ...

    def behind(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Tokens a ``propose`` for this request and context would feed before its first draft:
        1 or 2 after a round it drafted in, more for a new request or one that sat out."""

    def calibrate(self) -> list[tuple[int, float]]:
        """(tokens, seconds) of forwards of a few sizes, timed now (once; later calls repeat the
        figures): the drafter's cost curve before any request has been drafted for."""

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request and free what it holds (its KV) now."""

    def set_threads(self, threads: int) -> None:
        """Compute the next forwards on ``threads`` threads (a drafter without a model ignores it)."""

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


def draft_uniform(seed: int, output_index: int, j: int) -> float:
    """The uniform that picks draft ``j`` (0-based) of the round starting at ``output_index``.

    Independent of the target sampler's ``uniform_for(seed, n)``: a salted seed, and a counter
    of its own (``output_index * MAX_DRAFT_TOKENS + j``).
    """
    if not 0 <= j < MAX_DRAFT_TOKENS:
        raise ValueError(f"draft position {j} outside 0..{MAX_DRAFT_TOKENS - 1}")
    return uniform_for(seed ^ DRAFT_SALT, output_index * MAX_DRAFT_TOKENS + j)


