"""Helpers for edge-tier tests with the real model: run one turn, and compare two greedy runs.

"The same greedy tokens" allows one thing: llama.cpp's CPU kernels round differently for
different batch splits of the same prompt (a prompt fed as 42 + 51 tokens vs 93 at once, a
reply's KV made one token at a time) and, in a shared cell pool, for different cell layouts, so
two greedy runs may part at a near-tie. They must agree up to a point where the reference's own
top two were within ``NEAR_TIE`` nats; a sequence attending to another's KV, or to the wrong
cells, disagrees at once and by far (``test_prefix_reuse`` shows the check catching that).
"""

from __future__ import annotations

from collections.abc import Sequence

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


def assert_same_greedy(tokens: list[TokenEvent], reference: list[TokenEvent]) -> None:
    """Equal tokens, or equal up to a near-tie of the reference (see the module docstring)."""
    for i, (ours, ref) in enumerate(zip(tokens, reference, strict=False)):
        if ours.token_id == ref.token_id:
            continue
        alternatives = dict(ref.top_logprobs)
        assert ours.token_id in alternatives and ref.logprob - alternatives[ours.token_id] < NEAR_TIE, (
            f"token {i}: {ours.token_id} where the reference picked {ref.token_id} with a clear margin "
            f"({ref.top_logprobs})")
        return  # past a near-tie the two continuations are different texts
    assert len(tokens) == len(reference)
