"""Output grammars on the llama.cpp edge tier (``SamplingParams.grammar``) with the embedded model:
a JSON answer of the schema and a tool call whose arguments fit the tool, whatever the small model
would have written, also for schemas hypothesis generates; a grammar that does not compile is
refused at ``generate``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import top_schemas

from engine_edge import create_backend
from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_backend import LlamaCppBackend
from llm_shared.contract import FinishEvent, SamplingParams, TokenEvent
from llm_shared.errors import InvalidRequestError
from llm_shared.modelfile import default_gguf_path
from llm_shared.structured import CallDone, build_grammar, get_family, parse_chat_constraints

pytestmark = pytest.mark.model

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"],
                                                           "properties": {"city": {"type": "string",
                                                                                   "maxLength": 30},
                                                                          "unit": {"enum": ["C", "F"]}}}}}


@pytest.fixture(scope="module")
def backend() -> Iterator[LlamaCppBackend]:
    engine = create_backend(EdgeConfig(kv_cache_mib=64, n_seq_max=4, n_threads=1), default_gguf_path())
    assert isinstance(engine, LlamaCppBackend)
    yield engine
    asyncio.run(engine.close())


def grammar_of(body: dict) -> str:
    source = build_grammar(parse_chat_constraints(body), get_family("smollm2"))
    assert source is not None
    return source.text


async def run(engine: LlamaCppBackend, rid: str, text: str, params: SamplingParams) -> tuple[str, FinishEvent]:
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    out = []
    async for event in engine.generate(rid, prompt, params):
        if isinstance(event, TokenEvent):
            out.append(event.text)
        else:
            assert isinstance(event, FinishEvent)
            return "".join(out) + event.text, event
    raise AssertionError("no FinishEvent")


def test_json_answers_fit_their_schema(backend: LlamaCppBackend) -> None:
    grammar = grammar_of({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}})

    async def main() -> list[tuple[str, FinishEvent]]:
        return await asyncio.gather(*(run(backend, f"p{i}", "Describe a person as JSON.",
                                          SamplingParams(temperature=0.9, seed=i, max_tokens=120, grammar=grammar))
                                      for i in range(3)))

    for text, finish in asyncio.run(main()):
        assert finish.reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_a_required_call_names_the_tool_and_fits_its_parameters(backend: LlamaCppBackend) -> None:
    grammar = grammar_of({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    text, finish = asyncio.run(run(backend, "call", "What is the weather in Paris?",
                                   SamplingParams(temperature=0.0, max_tokens=120, grammar=grammar)))
    assert finish.reason == "stop", text
    parser = get_family("smollm2").new_parser()
    done = [e for e in [*parser.feed(text), *parser.finish()] if isinstance(e, CallDone)]
    assert [d.name for d in done] == ["get_weather"] and done[0].complete
    jsonschema.validate(json.loads(done[0].arguments), WEATHER["function"]["parameters"])


def test_a_grammar_that_does_not_compile_is_refused(backend: LlamaCppBackend) -> None:
    async def main() -> None:
        stream = backend.generate("bad", [1, 2, 3], SamplingParams(grammar='start: %json {"type": 7}'))
        with pytest.raises(InvalidRequestError) as refused:
            await anext(stream)
        assert refused.value.param == "grammar"

    asyncio.run(main())


@settings(derandomize=True, deadline=None, max_examples=12,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=top_schemas, seed=st.integers(0, 2**31 - 1))
def test_answers_for_generated_schemas_fit_them(backend: LlamaCppBackend, schema: dict[str, Any], seed: int) -> None:
    """Valid by construction with the real model: every answer ends by itself within max_tokens
    (one that would run on is closed in time) and validates against its schema."""
    grammar = grammar_of({"response_format": {"type": "json_schema", "json_schema": {
        "name": "out", "schema": schema, "strict": False}}})

    async def main() -> list[tuple[list[int], FinishEvent]]:
        async def one(i: int) -> tuple[list[int], FinishEvent]:
            prompt = backend.tokenizer.encode_chat([{"role": "user", "content": "Answer with a JSON value."}])
            ids: list[int] = []
            async for event in backend.generate(f"h-{seed}-{i}", prompt, SamplingParams(
                    temperature=0.8, seed=seed + i, max_tokens=96, grammar=grammar)):
                if isinstance(event, TokenEvent):
                    ids.append(event.token_id)
                else:
                    return ids, event
            raise AssertionError("no FinishEvent")

        return await asyncio.gather(one(0), one(1))

    for ids, finish in asyncio.run(main()):
        text = backend.tokenizer.decode(ids)
        assert finish.reason == "stop" and len(ids) < 96, (finish, text)  # the budget closes a long one
        jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator)


async def test_grammars_compile_on_the_edge_compile_thread(backend: LlamaCppBackend,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Never on the event loop nor in the worker's decode loop (issue 39, item 3): the request
    reaches the worker once its matcher exists; a schema the compiler refuses ends the stream."""
    import threading

    from llm_shared.structured import GrammarCompiler

    threads: list[str] = []
    text_matcher = GrammarCompiler.text_matcher

    def recorded(self: GrammarCompiler, grammar: str, max_tokens: int) -> Any:
        threads.append(threading.current_thread().name)
        return text_matcher(self, grammar, max_tokens)

    monkeypatch.setattr(GrammarCompiler, "text_matcher", recorded)
    grammar = grammar_of({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}})
    text, finish = await run(backend, "edge-compile-thread", "Give me a number.",
                             SamplingParams(max_tokens=24, temperature=0.0, grammar=grammar))
    assert threads and all(name.startswith("edge-grammar") for name in threads), threads
    assert finish.reason in ("stop", "length") and text.lstrip().startswith("{")
    with pytest.raises(InvalidRequestError) as refused:
        await run(backend, "edge-bad-grammar", "x", SamplingParams(max_tokens=4, grammar="start: %json {\"type\": 7}"))
    assert refused.value.param == "grammar"
