"""Output grammars on the torch tier (``SamplingParams.grammar``): every sampled token obeys the
request's mask, so even a random model writes JSON of the schema; a grammar that does not compile
is refused before the request is queued; constrained requests share steps with free ones."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
from tiny_engine import write_tiny_model

from engine_gpu.config import EngineConfig, SpeculativeConfig
from engine_gpu.engine import LLMEngine
from llm_shared.contract import SamplingParams
from llm_shared.errors import InvalidRequestError
from llm_shared.models import ModelConfig
from llm_shared.structured import ResponseFormat, build_grammar
from llm_shared.structured.spec import OutputConstraints

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "size", "tags"],
          "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}}}}
CONFIG = EngineConfig(dtype="float32", block_size=16, num_blocks=64, max_num_seqs=8, threads=1)


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    # 98 ids: the three specials, then every printable ASCII character once ('}' included)
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=5, vocab_size=98)


def grammar(schema: dict) -> str:
    constraints = OutputConstraints(response_format=ResponseFormat("json_schema", "answer", json.dumps(schema), strict=True))
    source = build_grammar(constraints, None)
    assert source is not None
    return source.text


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_random_model_writes_json_of_the_schema(model_cfg: ModelConfig, overlap: str) -> None:
    engine = LLMEngine.from_config(model_cfg, replace(CONFIG, overlap=overlap))
    constrained = SamplingParams(temperature=1.0, seed=7, max_tokens=400, grammar=grammar(SCHEMA))
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]
    params = [replace(constrained, seed=s) for s in (1, 2, 3)]
    outs = engine.generate(prompts + prompts, params + [free] * 3)
    for ids in outs[:3]:  # each ended by EOS once its JSON was complete
        value = json.loads(engine.tokenizer.decode(ids))
        jsonschema.validate(value, SCHEMA)
    assert [len(o) for o in outs[3:]] == [30] * 3  # the free requests ran as free requests
    assert engine.stats()["kv_blocks_in_use"] == 0 and not engine._constrained
    engine.close()


def test_a_grammar_that_does_not_compile_is_refused_before_queueing(model_cfg: ModelConfig) -> None:
    engine = LLMEngine.from_config(model_cfg, CONFIG)
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("bad", [5, 6], SamplingParams(grammar="start: %json {\"type\": \"nope\"}"))
    assert refused.value.param == "grammar"
    assert not engine.has_unfinished() and engine.stats()["waiting"] == 0
    engine.close()


def test_an_aborted_constrained_request_leaves_nothing(model_cfg: ModelConfig) -> None:
    engine = LLMEngine.from_config(model_cfg, CONFIG)
    engine.add_request("c", [5, 6, 7], SamplingParams(max_tokens=50, seed=1, grammar=grammar(SCHEMA)))
    engine.step()
    final = engine.abort_request("c")
    assert final is not None and final.finish is not None and final.finish.reason == "abort"
    assert not engine._constrained and engine.stats()["kv_blocks_in_use"] == 0
    engine.close()


def test_drafts_are_cut_to_their_valid_prefix_and_verified_under_the_grammar(model_cfg: ModelConfig) -> None:
    """Prompt-lookup drafts (which know nothing of the grammar) and a cascade's held tokens that
    break the schema: both are cut to what the grammar allows and verified under its masks, so
    every answer is still JSON of the schema."""
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False, max_batch=16, ngram_min=1,
                             ngram_max=3)
    engine = LLMEngine.from_config(model_cfg, replace(CONFIG, speculative=spec))
    tok = engine.tokenizer
    constrained = SamplingParams(temperature=0.0, max_tokens=400, grammar=grammar(SCHEMA))
    bad_start = tok.encode('{"ok": 12, "size": "xl"}')  # valid up to '{"ok": ', then a number where a boolean goes
    engine.add_request("held", [5, 6, 7], constrained, draft_ids=bad_start)
    assert engine.scheduler._requests["held"].draft_token_ids == tok.encode('{"ok": ')
    outs = {"held": []}
    for i in range(3):
        engine.add_request(f"r{i}", [9 + i, 10, 11, 12], replace(constrained, temperature=1.0, seed=i))
        outs[f"r{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += [t.token_id for t in out.tokens]
    for ids in outs.values():
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    engine.close()
