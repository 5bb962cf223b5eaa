"""Whether this engine can ever serve a request: its tokens inside the vocabulary, its drafts
within bounds, its prompt plus ``max_tokens`` within the context length and the KV cache. Pure
Python, no torch. What depends on the moment (a duplicate id, the waiting queue's length) is the
scheduler's to check (``Scheduler._admit``), between these two."""

from __future__ import annotations

from engine_gpu.block_manager import BlockManager
from engine_gpu.sequence import Sequence
from llm_shared.contract import MAX_PREFIX_DRAFT_TOKENS
from llm_shared.errors import InvalidRequestError, PromptTooLongError


def check_token_ids(seq: Sequence, drafts: list[int], vocab_size: int | None) -> None:
    """Every prompt and draft token inside the vocabulary (None: no vocabulary to check against),
    and no more drafts than a request may carry; InvalidRequestError naming the field if not."""
    for ids, param in ((seq.token_ids, "prompt"), (drafts, "draft_ids")):
        if vocab_size is not None and ids and max(ids) >= vocab_size:
            bad = next(t for t in ids if t >= vocab_size)
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (size {vocab_size})", param=param)
    if len(drafts) > MAX_PREFIX_DRAFT_TOKENS:
        raise InvalidRequestError(f"draft_ids holds at most {MAX_PREFIX_DRAFT_TOKENS} tokens", param="draft_ids")


def check_fits(seq: Sequence, max_model_len: int, block_manager: BlockManager) -> None:
    """The prompt plus ``max_tokens`` fits the context length and the whole KV cache;
    PromptTooLongError if not."""
    params, total = seq.params, seq.max_total_tokens
    if total > max_model_len:
        raise PromptTooLongError(
            f"the prompt ({seq.num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) exceeds "
            f"the context length of {max_model_len} tokens",
            param="prompt" if seq.num_prompt_tokens >= max_model_len else "max_tokens",
        )
    bm = block_manager
    if bm.blocks_for(total - 1) > bm.num_blocks:  # the last token is never fed back, so needs no KV
        raise PromptTooLongError(
            f"the prompt ({seq.num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) needs "
            f"more KV cache than this server has ({bm.num_blocks * bm.block_size} tokens)",
            param="max_tokens",
        )
