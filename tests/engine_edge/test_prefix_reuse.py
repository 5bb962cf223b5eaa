"""Conversations that stay warm on the llama.cpp edge tier, with the real model: a resumed turn
(resident, restored from host memory, after a truncate) gives the same greedy tokens as the
same prompt computed from scratch, sessions cycling through few slots never see each other's
KV, the snapshot budget holds, and ending the sessions leaves nothing behind.

Greedy runs are compared with ``edge_turns.assert_same_greedy`` (equal up to a near-tie)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from edge_turns import assert_same_greedy, turn

from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_backend import LlamaCppBackend
from llm_shared.contract import FinishEvent, SamplingParams
from llm_shared.modelfile import default_gguf_path

pytestmark = pytest.mark.model

MiB = 2**20


@pytest.fixture
async def scratch() -> AsyncIterator[LlamaCppBackend]:
    """The reference: every prompt computed from its first token."""
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=96, n_seq_max=2, n_threads=1,
                                                             prefix_reuse=False, max_queued=256))
    yield engine
    await engine.close()


def conversation(engine: LlamaCppBackend, *messages: tuple[str, str]) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": role, "content": text} for role, text in messages])


async def two_turns(engine: LlamaCppBackend, session: str, first: str, second: str,
                    heard: float = 1.0) -> tuple[list[int], list[int], FinishEvent]:
    """Turn 1, then turn 2 over the conversation with the reply cut to ``heard`` of its text;
    the second prompt, the second turn's tokens, and its finish."""
    _, reply, _ = await turn(engine, f"{session}-1", conversation(engine, ("user", first)), session)
    reply = reply[: int(len(reply) * heard)]
    prompt = conversation(engine, ("user", first), ("assistant", reply), ("user", second))
    ids, _, finish = await turn(engine, f"{session}-2", prompt, session)
    return prompt, ids, finish


async def test_a_resumed_turn_equals_the_same_turn_from_scratch(scratch: LlamaCppBackend) -> None:
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=96, n_seq_max=2, n_threads=1))
    try:
        prompt, ids, finish = await two_turns(engine, "s", "Name a color.", "And a fruit?")
        assert finish.cached_tokens > len(prompt) // 2  # turn 1's prompt and most of its reply
        reference, _, ref_finish = await turn(scratch, "ref", prompt)
        assert_same_greedy(ids, reference, engine.tokenizer.eos_id)
        assert ref_finish.cached_tokens == 0
        assert engine.stats()["prefix_cache_hits"] >= finish.cached_tokens
    finally:
        await engine.close()


async def test_after_a_truncate_only_the_heard_part_is_reused(scratch: LlamaCppBackend) -> None:
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=96, n_seq_max=2, n_threads=1))
    try:
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
        first = conversation(engine, ("user", "Tell me about the moon."))
        _, reply, _ = await turn(engine, "t-1", first, "t", long)
        heard = reply[: len(reply) // 3]
        prompt = conversation(engine, ("user", "Tell me about the moon."), ("assistant", heard), ("user", "Go on."))
        ids, _, finish = await turn(engine, "t-2", prompt, "t")
        assert len(first) <= finish.cached_tokens < len(first) + 40  # the unheard rest was not reused
        reference, _, _ = await turn(scratch, "ref", prompt)
        assert_same_greedy(ids, reference, engine.tokenizer.eos_id)
    finally:
        await engine.close()


async def test_a_conversation_evicted_to_host_memory_is_restored_exactly(scratch: LlamaCppBackend) -> None:
    # One slot: every other conversation pushes the previous one out to a host snapshot.
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=48, n_seq_max=1, n_threads=1, snapshot_mib=64))
    try:
        _, reply_a, _ = await turn(engine, "a-1", conversation(engine, ("user", "Name a color.")), "a")
        await turn(engine, "b-1", conversation(engine, ("user", "What is two plus two?")), "b")
        assert engine.stats()["snapshots"] == 1
        prompt = conversation(engine, ("user", "Name a color."), ("assistant", reply_a), ("user", "And a fruit?"))
        ids, _, finish = await turn(engine, "a-2", prompt, "a")
        stats = engine.stats()
        assert stats["snapshot_restores"] == 1 and finish.cached_tokens > len(prompt) // 2
        assert_same_greedy(ids, (await turn(scratch, "ref", prompt))[0], engine.tokenizer.eos_id)
        assert stats["snapshots"] == 1  # b went to host memory when a came back
    finally:
        await engine.close()


async def cycle_sessions(n_sessions: int, n_slots: int, scratch: LlamaCppBackend) -> None:
    budget = 4 * MiB  # ~180 tokens of this model's KV: a few conversations, so snapshots get evicted
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=24 * (n_slots + 1), n_seq_max=n_slots,
                                                             n_threads=1, snapshot_mib=budget // MiB,
                                                             max_queued=n_sessions))  # all start at once
    short = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5)  # a near-tie may have 3 sides
    try:
        # Distinct conversations, started together so they interleave through the slots.
        firsts = [f"My name is Robot{i}. Say hi." for i in range(n_sessions)]
        replies = await asyncio.gather(*(
            turn(engine, f"c{i}-1", conversation(engine, ("user", firsts[i])), f"c{i}", short)
            for i in range(n_sessions)))
        assert engine.stats()["snapshot_bytes"] <= budget
        prompts = [conversation(engine, ("user", firsts[i]), ("assistant", replies[i][1]), ("user", "Who am I?"))
                   for i in range(n_sessions)]
        seconds = await asyncio.gather(*(turn(engine, f"c{i}-2", prompts[i], f"c{i}", short)
                                         for i in reversed(range(n_sessions))))
        assert engine.stats()["snapshot_bytes"] <= budget
        assert sum(finish.cached_tokens > 0 for _, _, finish in seconds) >= n_slots  # reuse happened
        references = await asyncio.gather(*(turn(scratch, f"r{i}", prompts[i], "", short)
                                            for i in reversed(range(n_sessions))))
        for (ids, _, _), (reference, _, _) in zip(seconds, references, strict=True):
            assert_same_greedy(ids, reference, engine.tokenizer.eos_id)
        for i in range(n_sessions):
            await engine.end_session(f"c{i}")
        state = await engine.kv_state()
        assert state["held"] == {} and state["cached"] == {}
        stats = engine.stats()  # end_session publishes fresh stats
        assert stats["snapshot_bytes"] == 0 and stats["snapshots"] == 0 and stats["kv_cells_used"] == 0
    finally:
        await engine.close()


async def test_sessions_cycling_through_few_slots_keep_their_own_kv(scratch: LlamaCppBackend) -> None:
    await cycle_sessions(24, 4, scratch)


@pytest.mark.slow
async def test_200_sessions_cycling_through_8_slots(scratch: LlamaCppBackend) -> None:
    await cycle_sessions(200, 8, scratch)


async def test_the_comparison_catches_another_conversations_continuation(scratch: LlamaCppBackend) -> None:
    """What a slot mixed up with another conversation's KV would look like: clearly different."""
    ours, _, _ = await turn(scratch, "x", conversation(scratch, ("user", "Name a color.")))
    theirs, _, _ = await turn(scratch, "y", conversation(scratch, ("user", "What is two plus two?")))
    with pytest.raises(AssertionError, match="clear margin"):
        assert_same_greedy(ours, theirs, scratch.tokenizer.eos_id)
