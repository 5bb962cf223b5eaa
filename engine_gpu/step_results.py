"""What one sequence's sampled tokens do to it after a step: checked against what the step
verified, then appended up to the first token that finishes the sequence. Pure Python, no torch;
``Scheduler.update_from_output`` applies them to every sequence of the step."""

from __future__ import annotations

from engine_gpu.sched_output import ScheduledSeq
from engine_gpu.sequence import Sequence, as_token_ids
from llm_shared.contract import FinishReason


def checked_tokens(item: ScheduledSeq, tokens: list[int] | None) -> list[int]:
    """A sampling sequence's accepted tokens, or ValueError: one to ``num_draft_tokens + 1`` token
    ids, all but the last a prefix of the drafts the step verified."""
    if tokens is None:
        raise ValueError(f"no sampled tokens for {item.request_id!r}, which sampled this step")
    tokens = as_token_ids(tokens)
    if not 1 <= len(tokens) <= item.num_draft_tokens + 1:
        raise ValueError(f"{item.request_id!r}: expected 1..{item.num_draft_tokens + 1} tokens, got {len(tokens)}")
    drafts = item.token_ids[len(item.token_ids) - item.num_draft_tokens :]
    if tokens[:-1] != drafts[: len(tokens) - 1]:
        raise ValueError(f"{item.request_id!r}: accepted tokens must be a prefix of the drafts")
    return tokens


def append_tokens(seq: Sequence, tokens: list[int], eos_token_id: int | None,
                  max_model_len: int) -> tuple[list[int], FinishReason | None, int | None]:
    """Append accepted tokens up to the first finishing one; returns (to stream, reason, stop id)."""
    params = seq.params
    token_ids = seq.token_ids
    new_ids: list[int] = []
    for t in tokens:
        token_ids.append(t)
        if (t == eos_token_id and not params.ignore_eos) or t in params.stop_token_ids:
            return new_ids, "stop", t
        new_ids.append(t)
        if seq.ends_by_length(len(token_ids), max_model_len):
            return new_ids, "length", None
    return new_ids, None, None
