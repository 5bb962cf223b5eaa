"""Greedy output of the engine against transformers' LlamaForCausalLM on the same tiny random
checkpoint, for 20 prompts: alone, and mixed into a batch of 16 with chunked prefill, prefix-cache
hits and preemption. Exactness is checked in float32 (bfloat16 rounds differently for different
batch shapes, so it is held to top-1 agreement), on data whose every reference pick wins by a
margin no float32 rounding reaches, so token-for-token equality holds on every CPU; seeded
sampling must not depend on the batch."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from greedy_compare import FLOAT32_CLEAR_MARGIN, Pick, assert_clear_picks, pick_from_logits
from tiny_engine import write_tiny_model

from engine_gpu.config import EngineConfig
from engine_gpu.engine import LLMEngine
from llm_shared.contract import SamplingParams
from llm_shared.models import ModelConfig

transformers = pytest.importorskip("transformers")

NUM_PROMPTS = 20
ALONE = EngineConfig(dtype="float32", block_size=16, num_blocks=128, max_num_batched_tokens=512, max_num_seqs=1,
                     enable_prefix_caching=False, threads=1)
BF16_CLEAR_MARGIN = 0.25  # nats: a pick this clear in float32 is bf16's pick too, on every CPU
# Chunked prefill: a 32-token budget splits every prompt longer than that over several steps,
# and prompt chunks are capped at 8 tokens while others decode.
BATCHED = replace(ALONE, max_num_batched_tokens=32, long_prefill_threshold=8, max_num_seqs=16,
                  enable_prefix_caching=True)


def make_prompts() -> tuple[list[list[int]], list[int]]:
    """20 prompts of 3..150 tokens; 8 of them share a 48-token (3-block) prefix, 4 more a 20-token one."""
    rng = random.Random(7)
    shared_long = [rng.randrange(3, 96) for _ in range(48)]
    shared_short = [rng.randrange(3, 96) for _ in range(20)]
    prompts, max_tokens = [], []
    for i in range(NUM_PROMPTS):
        own = [rng.randrange(3, 96) for _ in range(rng.randrange(3, 100))]
        prompts.append(shared_long + own if i % 5 in (0, 2) else shared_short + own if i % 5 == 1 else own)
        max_tokens.append(rng.randrange(4, 24))
    return prompts, max_tokens


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def reference_picks(model_cfg: ModelConfig) -> list[list[Pick]]:
    """Greedy continuations from transformers, recomputing the whole sequence at each token; every
    pick clear of its runner-up (``greedy_compare``), which the speculative tests rely on too."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_cfg.source, torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    prompts, max_tokens = make_prompts()
    out = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_tokens, strict=True):
            seq = list(ids)
            picks = []
            for _ in range(n):
                picks.append(pick_from_logits(model(torch.tensor([seq])).logits[0, -1]))
                seq.append(picks[-1].token_id)
            assert_clear_picks(picks, FLOAT32_CLEAR_MARGIN)
            out.append(picks)
    return out


@pytest.fixture(scope="module")
def reference(reference_picks: list[list[Pick]]) -> list[list[int]]:
    return [[p.token_id for p in picks] for picks in reference_picks]


def greedy_params(max_tokens: list[int]) -> list[SamplingParams]:
    # ignore_eos: the reference does not stop at EOS either
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]


def test_alone_matches_transformers(model_cfg: ModelConfig, reference: list[list[int]]) -> None:
    engine = LLMEngine.from_config(model_cfg, ALONE)
    prompts, max_tokens = make_prompts()
    got = [engine.generate([p], params, prefix=f"r{i}")[0]
           for i, (p, params) in enumerate(zip(prompts, greedy_params(max_tokens), strict=True))]
    assert got == reference


def run_batched(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """One request of the long shared prefix runs first, so the batch finds it in the prefix
    cache; the other 19 are added together: 16 run at once, 3 join as others finish."""
    first = engine.generate([prompts[0]], params[0], prefix="warm")
    return first + engine.generate(prompts[1:], params[1:], prefix="batch")


def test_batched_with_chunked_prefill_and_prefix_hits_matches(model_cfg: ModelConfig,
                                                              reference: list[list[int]]) -> None:
    engine = LLMEngine.from_config(model_cfg, BATCHED)
    prompts, max_tokens = make_prompts()
    assert run_batched(engine, prompts, greedy_params(max_tokens)) == reference
    stats = engine.stats()
    assert stats["prefix_cache_hits"] >= 7 * 48  # the 7 other long-prefix prompts hit at least
    assert stats["kv_blocks_in_use"] == 0


def test_preemption_and_recompute_keep_output_exact(model_cfg: ModelConfig, reference: list[list[int]]) -> None:
    # 24 blocks hold ~3 of these sequences: the scheduler must preempt and recompute.
    engine = LLMEngine.from_config(model_cfg, replace(BATCHED, num_blocks=24))
    prompts, max_tokens = make_prompts()
    assert run_batched(engine, prompts, greedy_params(max_tokens)) == reference
    assert engine.stats()["preemptions"] > 0


def test_seeded_sampling_does_not_depend_on_the_batch(model_cfg: ModelConfig) -> None:
    prompts, max_tokens = make_prompts()
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=100 + i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate(max_tokens)]
    alone_engine = LLMEngine.from_config(model_cfg, ALONE)
    alone = [alone_engine.generate([p], q, prefix=f"s{i}")[0]
             for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    batched = run_batched(LLMEngine.from_config(model_cfg, BATCHED), prompts, params)
    assert batched == alone
    greedy = LLMEngine.from_config(model_cfg, ALONE).generate(prompts[:4], greedy_params(max_tokens[:4]))
    assert alone[:4] != greedy, "sampling at temperature 0.9 should differ from greedy somewhere"


def test_bfloat16_agrees_on_top1(model_cfg: ModelConfig, reference_picks: list[list[Pick]]) -> None:
    """bf16 greedy, batched: the first token of every prompt (one prefill, no compounding) matches
    float32 transformers wherever float32's pick wins by more than bf16 can move two logprobs
    (here at most 0.07 nats each, measured against transformers)."""
    engine = LLMEngine.from_config(model_cfg, replace(BATCHED, dtype="bfloat16"))
    prompts, _ = make_prompts()
    got = run_batched(engine, prompts, greedy_params([1] * NUM_PROMPTS))
    clear = [i for i, picks in enumerate(reference_picks)
             if picks[0].top_logprobs[0][1] - picks[0].top_logprobs[1][1] >= BF16_CLEAR_MARGIN]
    assert len(clear) >= NUM_PROMPTS // 2, "too few clear first picks for the check to mean anything"
    assert [got[i][0] for i in clear] == [reference_picks[i][0].token_id for i in clear]
