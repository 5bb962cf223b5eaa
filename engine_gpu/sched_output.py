"""What the scheduler hands the model runner each step, and what it reports back to the engine.

Plain dataclasses with no torch, so the scheduler stays testable without a model. The runner
takes ``SchedulerOutput.scheduled`` as its batch and returns sampled tokens keyed by request id;
lists here are copies the scheduler no longer mutates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llm_shared.contract import FinishReason, SamplingParams

# The token of a step planned ahead (``Scheduler.schedule_ahead``): the one the previous step is
# still sampling. The runner takes it from that step's ids on the device; it never reaches the KV.
PENDING_TOKEN = -1


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    request_id: str  # keys the sampled tokens the runner returns and its per-request state
    token_ids: list[int]  # tokens whose KV this step computes: a prompt chunk, the last sampled token, then drafts
    start_pos: int  # absolute position of token_ids[0]; equals the tokens already computed
    block_table: list[int]  # physical blocks covering positions [0, start_pos + len(token_ids)): where KV is read and written
    sample: bool  # False for a non-final prompt chunk: no logits are needed yet
    num_draft_tokens: int  # the trailing token_ids that are unverified drafts; the runner verifies them
    params: SamplingParams  # how to sample (temperature, seed, logprobs)
    output_index: int  # tokens generated so far: keys a seeded RNG so output is batch-independent


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. Build the batch from ``scheduled``; drop runner state for the others."""

    scheduled: list[ScheduledSeq]  # what to compute, in batch order
    cached_tokens: dict[str, int]  # requests admitted for the first time this step -> prompt tokens served by the prefix cache (usage report)
    preempted: list[str]  # requests whose blocks were taken back this step; they resume later by recomputing
    finished: list[str]  # requests finished or aborted since the previous step: the runner may forget them
    step: int  # counts plans made; lets logs and tests line plans up with updates
    # A plan made ahead: item n's one token is what row source_rows[n] of the previous plan samples
    # (its token_ids hold PENDING_TOKEN). None: every token is known.
    source_rows: list[int] | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass(frozen=True)
class RequestUpdate:
    """What one step produced for one request that sampled."""

    request_id: str
    new_token_ids: list[int]  # tokens to stream, in order; a matched EOS/stop token id is left out
    finish_reason: FinishReason | None  # None while the request continues; a step ends one only by "stop" or "length"
    stop_token_id: int | None = None  # the EOS or stop token that ended it, for callers that report it


@dataclass(frozen=True)
class SchedulerStats:
    running: int  # requests holding KV blocks
    waiting: int  # queued or preempted requests
    kv_blocks_in_use: int  # blocks referenced by live requests; 0 when idle
    kv_blocks_cached: int  # unreferenced blocks still holding a reusable prefix (evictable)
    kv_blocks_free: int  # unreferenced blocks holding nothing reusable
    kv_blocks_total: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache at admissions
    prefix_cache_hits: int  # of those, tokens found
    preemptions: int  # total since start
    num_scheduled_tokens: int  # tokens in the last step's plan
    spec_draft_tokens: int = 0  # draft tokens verified, total since start
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_freed_blocks: int = 0  # blocks given back because only rejected drafts had reached them

    def as_dict(self) -> dict[str, float]:
        """Flat numbers for ``Engine.stats()`` and metrics."""
        return {k: float(v) for k, v in asdict(self).items()}
