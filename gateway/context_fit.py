"""Fitting a conversation into the model's context by dropping its oldest turns (the Realtime
session's ``truncation``).

A conversation that has grown past the context is cut at a user turn: the instructions stay, the
newest turn stays whole, and the oldest turns go. A cut leaves the conversation after the
instructions at most ``retention_ratio`` of the room the context has for it, so the turns that
follow add to the same prefix until the context is full again: the tiers' prefix caches (the edge
tier's session KV above all) are rebuilt once per cut, not once per turn. The session keeps the cut
(``RealtimeSession.context_truncated``), so every later prompt starts where this one did.

Token counts need the serving tier's tokenizer, so the cut is chosen here, when a turn is
prepared, from the candidate prompts the session offers (``PromptCuts``): the count falls as more
turns are dropped, so a binary search encodes a handful of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.tiers.build import encode_chat
from llm_shared.contract import Engine
from llm_shared.errors import PromptTooLongError

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PromptCuts:
    """The prompts a turn may shrink to. Cut ``i`` (1 .. ``count``) drops the items
    ``dropped(i)``, oldest first, and gives ``render(i)``; cut 0 is the prompt as it is."""

    count: int  # cuts at the user turns after the first kept item; the newest turn is never dropped
    render: Callable[[int], Messages]
    dropped: Callable[[int], tuple[str, ...]]
    instructions: Messages  # the system messages alone: what the context holds before any turn
    retention_ratio: float  # after a cut, the turns hold at most this share of the room left for them
    post_instructions: int | None  # the turns' room in tokens, at most (else what the context leaves)
    sticky: bool  # the prompt is the session's conversation: the cut holds for its later turns


@dataclass(frozen=True)
class Fitted:
    prompt_ids: list[int]
    messages: Messages
    dropped: tuple[str, ...]  # item ids the cut left out (none when the prompt fitted as it was)


async def fit(engine: Engine, messages: Sequence[Mapping[str, str]], cuts: PromptCuts, limit: int) -> Fitted:
    """The prompt as it is when it has at most ``limit`` tokens, else the least cut whose prompt
    holds at most the retained share (or, when none does, the deepest cut that fits at all).
    ``PromptTooLongError`` when even the instructions and the newest turn do not fit; a prompt
    certainly too long (``encode_chat``'s bound) is never tokenized."""
    instructions = -1  # counted when needed

    async def instruction_tokens() -> int:
        nonlocal instructions
        if instructions < 0:
            instructions = len(await encode_chat(engine, cuts.instructions)) if cuts.instructions else 0
        return instructions

    if cuts.post_instructions is not None:
        limit = min(limit, await instruction_tokens() + cuts.post_instructions)
    sizes: dict[int, list[int] | None] = {}  # cut -> its prompt's ids (None: certainly over ``limit``)

    async def size(i: int) -> int:
        if i not in sizes:
            try:
                sizes[i] = await encode_chat(engine, cuts.render(i) if i else messages, limit)
            except PromptTooLongError:
                if i == cuts.count:
                    raise  # not even the newest turn fits
                sizes[i] = None
        ids = sizes[i]
        return limit + 1 if ids is None else len(ids)

    if await size(0) <= limit:
        return Fitted(sizes[0] or [], list(messages), ())
    if cuts.count == 0 or await size(cuts.count) > limit:
        raise _too_long(await size(cuts.count), limit)
    target = await instruction_tokens() + int(cuts.retention_ratio * max(limit - await instruction_tokens(), 0))
    lo, hi = 1, cuts.count  # the least cut within the target, or the deepest when none is
    while lo < hi:
        mid = (lo + hi) // 2
        if await size(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    ids = sizes[lo]
    assert ids is not None and len(ids) <= limit
    return Fitted(ids, cuts.render(lo), cuts.dropped(lo))


def _too_long(tokens: int, limit: int) -> PromptTooLongError:
    return PromptTooLongError(f"the prompt has {tokens} tokens even with the oldest turns left out, but this model's "
                              f"context leaves room for at most {max(limit, 0)} prompt tokens with the requested "
                              "output tokens; shorten the instructions or the newest turn, or ask for fewer output "
                              "tokens", param="messages")
