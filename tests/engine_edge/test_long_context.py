"""The llama.cpp edge tier's shared cell pool, with the real model: a turn may use the model's
whole trained context while cells are free (the old per-slot split capped it at 2,048), a long
conversation stays warm, anything longer is refused naming the limit, batched outputs equal
solo ones (up to near-ties, see ``edge_turns``), and the pool is sized from a memory budget."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from edge_turns import assert_same_greedy, turn

from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_backend import LlamaCppBackend
from llm_shared.contract import SamplingParams
from llm_shared.errors import ConfigError, PromptTooLongError
from llm_shared.modelfile import default_gguf_path

pytestmark = pytest.mark.model

CELL_BYTES = 23040  # SmolLM2-135M: 30 layers x (K, V) x 3 heads x 64 dims x 2 bytes
PROMPTS = ["Tell me about the moon.", "Write a haiku about rain.", "What is 17 times 23?", "List three colors.",
           "Why is the sky blue?", "Name a famous painter.", "How do bees make honey?", "Explain gravity briefly."]


@pytest.fixture(scope="module")
def pool() -> Iterator[LlamaCppBackend]:
    """The default layout and budget: one pool of 11,520 cells for 8 sequences and the drafter."""
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(n_seq_max=8, n_threads=1, max_queued=16))
    yield engine
    asyncio.run(engine.close())


def long_conversation(engine: LlamaCppBackend, n_tokens: int) -> list[int]:
    """A chat of about ``n_tokens`` whose last message asks about its first."""
    messages = [{"role": "user", "content": "My name is Ada. Remember it."},
                {"role": "assistant", "content": "Nice to meet you, Ada."}]
    filler = "Here is some text about the weather, the sea and the mountains. " * 8
    while len(engine.tokenizer.encode_chat(messages)) < n_tokens - 40:
        messages += [{"role": "user", "content": filler}, {"role": "assistant", "content": "Noted."}]
    messages.append({"role": "user", "content": "What is my name?"})
    return engine.tokenizer.encode_chat(messages)


def test_the_pool_is_sized_from_the_memory_budget(pool: LlamaCppBackend) -> None:
    # 256 MiB / 23,040 bytes = 11,650 cells, 11,520 in whole pages of 256; one turn may use the
    # model's trained 8,192 of them.
    assert pool.n_ctx == 11520 and pool.kv_cache_bytes == 11520 * CELL_BYTES
    assert pool.n_ctx_seq == 8192 and pool.max_prompt_tokens == 8191
    stats = pool.stats()
    assert stats["kv_cells_total"] == 11520


async def test_a_turn_longer_than_a_per_slot_share_runs_and_stays_warm(pool: LlamaCppBackend) -> None:
    prompt = long_conversation(pool, 2600)  # more than 11,520 / 9 = 1,280, and than the old 2,048
    assert 2500 < len(prompt) < 2700
    params = SamplingParams(temperature=0.0, max_tokens=8)
    _, reply, first = await turn(pool, "long-1", prompt, "long-session", params)
    assert first.prompt_tokens == len(prompt) and first.cached_tokens == 0 and reply
    follow_up = pool.tokenizer.encode(reply + "<|im_end|>\n<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n")
    _, _, second = await turn(pool, "long-2", prompt + follow_up, "long-session", params)
    assert second.cached_tokens >= len(prompt)  # the whole long history came from the pool
    await pool.end_session("long-session")


async def test_past_the_trained_context_is_refused_naming_the_limit(pool: LlamaCppBackend) -> None:
    with pytest.raises(PromptTooLongError, match="8191 prompt tokens") as caught:
        await anext(pool.generate("too-long", [28] * 8192, SamplingParams(max_tokens=4)))
    assert caught.value.code == "context_length_exceeded"
    # the engine goes on serving
    tokens, _, _ = await turn(pool, "after", pool.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
    assert tokens


async def test_batched_outputs_equal_solo_outputs_in_the_shared_pool(pool: LlamaCppBackend) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5, ignore_eos=True)
    prompts = [pool.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]
    solo = [(await turn(pool, f"solo-{i}", p, "", params))[0] for i, p in enumerate(prompts)]
    batched = await asyncio.gather(*(turn(pool, f"batch-{i}", p, "", params) for i, p in enumerate(prompts)))
    for ours, reference in zip(batched, solo, strict=True):
        assert_same_greedy(ours[0], reference, pool.tokenizer.eos_id)
    # the check has teeth here too: another prompt's continuation is caught
    with pytest.raises(AssertionError, match="clear margin"):
        assert_same_greedy(batched[1][0], solo[0], pool.tokenizer.eos_id)


async def test_turns_that_outgrow_the_pool_take_turns_instead_of_failing() -> None:
    """Two turns that each fit the pool but not together (2 x ~440 > 768 cells): both start (a turn
    reserves its prompt plus 256 cells, not all of max_tokens), the newer is preempted when the
    older needs its cells, resumes by recomputing once they are free, and both finish whole, with
    the same greedy text as alone."""
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=16.875, n_seq_max=2, n_threads=1,
                                                             prefix_reuse=False))
    try:
        assert engine.n_ctx == 768
        params = SamplingParams(temperature=0.0, max_tokens=420, ignore_eos=True, logprobs=5)
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS[:2]]
        solo = [(await turn(engine, f"solo-{i}", p, "", params))[0] for i, p in enumerate(prompts)]
        assert engine.stats()["preemptions"] == 0
        together = await asyncio.gather(*(turn(engine, f"both-{i}", p, "", params) for i, p in enumerate(prompts)))
        assert engine.stats()["preemptions"] >= 1
        for (tokens, _, finish), reference in zip(together, solo, strict=True):
            assert finish.reason == "length" and len(tokens) == 420
            assert_same_greedy(tokens, reference, engine.tokenizer.eos_id)
        assert engine.stats()["kv_cells_used"] == 0 and engine.stats()["waiting"] == 0
    finally:
        await engine.close()


def test_a_budget_too_small_for_one_page_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_mib = 2 holds 91 KV cells"):
        LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=2))
    with pytest.raises(ConfigError, match="9 cache"):
        LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=20, kv_layout="per_sequence"))
