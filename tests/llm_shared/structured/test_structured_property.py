"""Valid by construction: for schemas hypothesis generates, a model that samples anything the
bitmask allows writes JSON that ``json.loads`` reads and ``jsonschema`` accepts; and tool calls
whose names are known and whose arguments validate against that tool's schema. Derandomized, so
a run is reproducible; a failure prints the schema and the seed."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field
from schema_strategies import objects, schemas, top_schemas
from structured_helpers import RandomModel, chat_tool, constraints, merged

from llm_shared.structured import ArgumentsDelta, CallDone, GrammarCompiler, TextDelta, get_family
from llm_shared.tokenizer import Tokenizer

pytestmark = pytest.mark.model

SETTINGS = settings(
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

@pytest.fixture(scope="module")
def model(tokenizer: Tokenizer) -> RandomModel:
    return RandomModel(tokenizer)


def text_of(tokenizer: Tokenizer, ids: list[int]) -> str:
    assert ids[-1] == tokenizer.eos_id
    return tokenizer.decode(ids[:-1])


@SETTINGS
@given(schema=top_schemas, strict=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_json_schema_output_is_valid(
    schema: dict[str, Any], strict: bool, seed: int, compiler: GrammarCompiler, model: RandomModel, tokenizer: Tokenizer
) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": strict}}
    compiled = compiler.compile(constraints(response_format=rf))
    assert compiled is not None
    text = text_of(tokenizer, model.generate(compiler, compiled, seed))
    jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator)


@settings(derandomize=True, deadline=None, max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_json_object_output_is_an_object(
    seed: int, compiler: GrammarCompiler, model: RandomModel, tokenizer: Tokenizer
) -> None:
    compiled = compiler.compile(constraints(response_format={"type": "json_object"}))
    assert compiled is not None
    assert isinstance(json.loads(text_of(tokenizer, model.generate(compiler, compiled, seed))), dict)


@st.composite
def tool_requests(draw: st.DrawFn) -> tuple[list[dict[str, Any]], Any, bool, bool]:
    """(tools, tool_choice, parallel_tool_calls, start the answer with the trigger)."""
    count = draw(st.integers(1, 3))
    tools = [chat_tool(f"tool_{i}", draw(objects(schemas(1))), strict=draw(st.booleans())) for i in range(count)]
    choice = draw(st.sampled_from(["auto", "required", "named"]))
    if choice == "named":
        choice = {"type": "function", "function": {"name": f"tool_{draw(st.integers(0, count - 1))}"}}
    return tools, choice, draw(st.booleans()), draw(st.booleans())


@SETTINGS
@given(request=tool_requests(), seed=st.integers(0, 2**32 - 1))
def test_tool_calls_are_valid(
    request: tuple[list[dict[str, Any]], Any, bool, bool],
    seed: int,
    compiler: GrammarCompiler,
    model: RandomModel,
    tokenizer: Tokenizer,
) -> None:
    tools, choice, parallel, trigger_first = request
    compiled = compiler.compile(constraints(tools, tool_choice=choice, parallel_tool_calls=parallel))
    assert compiled is not None and compiled.calls
    # A random model under "auto" nearly always writes text; half the runs start the call block
    # themselves, so the call side of "auto" is sampled as well.
    prefix = tokenizer.encode("<tool_call>") if choice == "auto" and trigger_first else []
    text = text_of(tokenizer, model.generate(compiler, compiled, seed, prefix))

    parser = get_family("smollm2").new_parser()
    events = merged([*parser.feed(text), *parser.finish()])
    schemas_by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    done = [e for e in events if isinstance(e, CallDone)]
    for call in done:
        assert call.complete
        assert call.name in schemas_by_name
        if isinstance(choice, dict):
            assert call.name == choice["function"]["name"]
        jsonschema.validate(json.loads(call.arguments), schemas_by_name[call.name], cls=jsonschema.Draft202012Validator)
        streamed = "".join(e.delta for e in events if isinstance(e, ArgumentsDelta) and e.index == call.index)
        assert streamed == call.arguments
    if choice != "auto" or prefix:
        assert "<tool_call>" in text
    if choice != "auto":
        assert done, text
    if not parallel:
        assert len(done) <= 1
    assert all("<tool_call>" not in e.text for e in events if isinstance(e, TextDelta))


class Color(StrEnum):
    red = "red"
    blue = "blue"


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Order(BaseModel):
    title: str = Field(max_length=40)
    color: Color
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    pets: list[Cat | Dog] = Field(max_length=3)
    score: float = Field(ge=0, le=1)
    meta: dict[str, int] | None


@pytest.mark.parametrize("seed", range(12))
def test_what_the_sdks_parse_sends_parses_back_into_the_model(
    seed: int, compiler: GrammarCompiler, model: RandomModel, tokenizer: Tokenizer
) -> None:
    """``client.chat.completions.parse(response_format=Order)``: the SDK's own payload (its strict
    rewrite of the Pydantic schema, with $defs, a discriminated oneOf, an Optional) constrains the
    output so that the SDK's ``model_validate_json`` succeeds."""
    compiled = compiler.compile(constraints(response_format=type_to_response_format_param(Order)))
    assert compiled is not None
    Order.model_validate_json(text_of(tokenizer, model.generate(compiler, compiled, seed)))
