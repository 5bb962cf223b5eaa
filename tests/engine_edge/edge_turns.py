"""Helpers for edge-tier tests with the real model: run one turn, and compare two greedy runs.

"The same greedy tokens" allows one thing: llama.cpp's CPU kernels round differently for
different batch splits of the same prompt (a prompt fed as 42 + 51 tokens vs 93 at once, a
reply's KV made one token at a time) and, in a shared cell pool, for different cell layouts, so
two greedy runs may part at a near-tie, the end of the reply included (one run ends where the
other goes on). They must agree up to a point where the run that went on had the other's choice
within ``NEAR_TIE`` nats (``greedy_compare.assert_same_greedy``); a sequence attending to
another's KV, or to the wrong cells, disagrees at once and by far (``test_prefix_reuse`` shows
the check catching that).
"""

from __future__ import annotations

from collections.abc import Sequence

from greedy_compare import assert_same_greedy as same_up_to_near_tie

from llm_shared.contract import Engine, FinishEvent, SamplingParams, TokenEvent

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, logprobs=5)  # a near-tie may have 3 sides
# nats between the reference's pick and ours where a different rounding may flip the pick: in a
# shared cell pool a token's logprob moved by up to 0.34 nats between batched and solo runs
# (measured on 8 prompts x 64 tokens), so two candidates' order can flip within ~0.7
NEAR_TIE = 0.75


async def turn(engine: Engine, rid: str, prompt: Sequence[int], session: str = "",
               params: SamplingParams = GREEDY) -> tuple[list[TokenEvent], str, FinishEvent]:
    """One request to its end: its tokens, its whole text and its finish (which must be normal)."""
    tokens: list[TokenEvent] = []
    async for event in engine.generate(rid, prompt, params, session_id=session):
        if isinstance(event, TokenEvent):
            tokens.append(event)
        else:
            assert event.reason in ("stop", "length"), event
            return tokens, "".join(t.text for t in tokens) + event.text, event
    raise AssertionError("no finish event")


def assert_same_greedy(tokens: list[TokenEvent], reference: list[TokenEvent], end_id: int) -> None:
    """Equal tokens, or equal up to a near-tie (see the module docstring); ``end_id`` is the
    model's end of sequence, which ended the shorter run if one is shorter."""
    same_up_to_near_tie(tokens, reference, near_tie=NEAR_TIE, end_ids={end_id})
