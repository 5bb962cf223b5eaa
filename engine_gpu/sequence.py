"""One request's state inside the torch engine's scheduler. Pure Python, no torch.

There is no prefill or decode phase: a sequence has ``token_ids`` (prompt, then accepted
output) and ``num_computed_tokens`` (how many of them have KV in the cache). Whatever lies
between the two, plus any unverified draft tokens, is what the scheduler may hand out next.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from llm_shared.contract import FinishReason, Priority, SamplingParams, check_cache_salt
from llm_shared.errors import EmptyPromptError, InvalidRequestError

MAX_TOKEN_ID = 2**31 - 1  # token ids are hashed as int64 and fed to int32 tensors


class SeqStatus(Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed; holds no blocks
    RUNNING = "running"  # holds blocks; scheduled every step while budget allows
    FINISHED = "finished"  # done, aborted or rejected; holds no blocks


@dataclass(eq=False)  # identity equality: sequences are dict keys and may share token lists
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt then accepted output tokens; append-only
    num_prompt_tokens: int
    params: SamplingParams
    priority: Priority
    arrival: float  # seconds, any monotonic clock; later arrivals are preempted first
    seq_no: int  # order of add_request calls: breaks ties between equal arrivals
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # leading token_ids whose KV is in the cache
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission; -1 until admitted
    block_table: list[int] = field(default_factory=list)  # physical block of each block_size slice of positions
    # A copy of block_table's first blocks that nobody mutates, handed to the runner step after step
    # (no copy per step); the BlockManager, which alone changes block_table, drops it on every change.
    table_snapshot: list[int] | None = field(default=None, repr=False)
    # Chained hashes of the leading full blocks of token_ids. They depend on the tokens only,
    # and tokens are append-only, so the list survives preemption and is never recomputed.
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0  # leading block_table entries already offered to the prefix cache
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens to verify next step
    finish_reason: FinishReason | None = None
    # Whose prefix cache it may use (Engine.generate's cache_salt, "" for none): its block hash
    # chain starts from this salt's seed, so it shares blocks only with requests of the same salt.
    cache_salt: str = ""

    def block_table_prefix(self, num_blocks: int) -> list[int]:
        """``block_table[:num_blocks]`` as a list that is never mutated (a ScheduledSeq's)."""
        snapshot = self.table_snapshot
        if snapshot is None or len(snapshot) != num_blocks:
            snapshot = self.table_snapshot = self.block_table[:num_blocks]
        return snapshot

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens it may generate; its KV never covers the very last one."""
        return self.num_prompt_tokens + self.params.max_tokens

    def ends_by_length(self, num_tokens: int, max_model_len: int) -> bool:
        """Holding ``num_tokens`` tokens, it has generated all it may or filled the context."""
        return num_tokens - self.num_prompt_tokens >= self.params.max_tokens or num_tokens >= max_model_len

    # The properties below read len(token_ids) rather than num_tokens: the scheduler asks them of
    # every running sequence every step, and a property calling a property costs twice.

    @property
    def draft_room(self) -> int:
        """Drafts it may still verify: what it may generate, less the token a verification adds."""
        return max(0, self.max_total_tokens - len(self.token_ids) - 1)

    @property
    def is_caught_up(self) -> bool:
        """Only the last accepted token (and drafts) lack KV: the sequence is decoding."""
        return self.num_computed_tokens >= len(self.token_ids) - 1

    @property
    def num_pending_tokens(self) -> int:
        """Tokens the next step could compute: the uncomputed tail plus drafts to verify."""
        return len(self.token_ids) + len(self.draft_token_ids) - self.num_computed_tokens

    def order_key(self) -> tuple[int, float, int]:
        """Smaller runs first; the largest key is the preemption victim."""
        return (int(self.priority), self.arrival, self.seq_no)


def as_token_ids(values: Iterable[object]) -> list[int]:
    """Copy token ids into a list of plain ints (numpy integers are fine), or raise ValueError."""
    out: list[int] = []
    for v in values:
        if isinstance(v, bool):
            raise ValueError("token ids must be integers, not booleans")
        try:
            t = operator.index(v)
        except TypeError:
            raise ValueError(f"token ids must be integers, got {type(v).__name__}") from None
        if not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"token ids must be in [0, 2**31), got {t}")
        out.append(t)
    return out


def new_sequence(
    request_id: object, prompt_ids: Iterable[object], params: object, priority: object, arrival: object, seq_no: int,
    cache_salt: object = "",
) -> Sequence:
    """A waiting sequence from an in-process caller's input, or an ``InvalidRequestError`` naming
    the bad field. Limits that depend on the engine (vocabulary, context length, pool size, load)
    are the scheduler's."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request id must be a non-empty string", param="request_id")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("sampling parameters are missing or malformed", param="params")
    try:
        priority = Priority(priority)
    except ValueError:
        raise InvalidRequestError(f"unknown priority {priority!r}", param="priority") from None
    try:
        tokens = as_token_ids(prompt_ids)
    except ValueError as e:
        raise InvalidRequestError(f"prompt: {e}", param="prompt") from None
    if not tokens:
        raise EmptyPromptError("the prompt is empty", param="prompt")
    salt = check_cache_salt(cache_salt)
    if arrival is None:
        arrival = time.monotonic()
    elif isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival):
        raise InvalidRequestError("arrival must be a finite number of seconds", param="arrival")
    return Sequence(
        request_id=request_id,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        params=params,
        priority=priority,
        arrival=float(arrival),
        seq_no=seq_no,
        cache_salt=salt,
    )
