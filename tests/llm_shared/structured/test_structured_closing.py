"""Answers end valid within their budget: a closing walk finishes a document from wherever a model
left it, and a matcher given ``max_tokens`` forces that closing in time, so a model that loops
inside the JSON still ends with an answer that parses and validates, EOS within the budget. Also:
a closing is what speculation verifies, and a budget with room changes nothing."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import top_schemas
from structured_helpers import TIMER, chat_tool, constraints

from llm_shared.structured import (
    CallDone,
    CompiledGrammar,
    GrammarCompiler,
    TextDelta,
    allocate_bitmask,
    allowed_tokens,
    get_family,
    parse_chat_constraints,
)
from llm_shared.structured.closing import closing_tokens
from llm_shared.structured.matcher import CLOSE_MARGIN, closing_margin
from llm_shared.tokenizer import Tokenizer

pytestmark = pytest.mark.model

SCHEMAS = Path(__file__).resolve().parents[3] / "configs" / "structured_schemas.json"


def shipped_cases() -> list[tuple[str, dict[str, Any], dict[str, dict[str, Any]]]]:
    """(name, request body, tool name -> schema; "" -> the answer's schema) of each shipped schema."""
    doc = json.loads(SCHEMAS.read_text(encoding="utf-8"))
    out = []
    for entry in doc["tools"]:
        fn = entry["tool"]["function"]
        out.append((fn["name"], {"tools": [entry["tool"]], "tool_choice": "required", "parallel_tool_calls": False},
                    {fn["name"]: fn["parameters"]}))
    for entry in doc["response_formats"]:
        fmt = entry["response_format"]
        out.append((fmt["json_schema"]["name"], {"response_format": fmt}, {"": fmt["json_schema"]["schema"]}))
    return out


CASES = shipped_cases()


@dataclass(frozen=True)
class Shipped:
    name: str
    compiled: CompiledGrammar
    schemas: dict[str, dict[str, Any]]  # tool name -> its parameters; "" -> the answer's schema


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def shipped(request: pytest.FixtureRequest, compiler: GrammarCompiler) -> Shipped:
    """One shipped schema, compiled as the gateway compiles it."""
    name, body, schemas = request.param
    compiled = compiler.compile(parse_chat_constraints(body))
    assert compiled is not None
    return Shipped(name, compiled, schemas)


def check(text: str, schemas: dict[str, dict[str, Any]]) -> None:
    """``text`` is a valid answer: JSON of the answer's schema, or exactly one call of a known tool
    with arguments of its schema. Formats are the grammar's to enforce (its date-time allows a leap
    second that Python's checker refuses), so the validator checks structure and values."""
    if "" in schemas:
        jsonschema.validate(json.loads(text), schemas[""], cls=jsonschema.Draft202012Validator)
        return
    parser = get_family("smollm2").new_parser()
    events = [*parser.feed(text), *parser.finish()]
    assert not any(isinstance(e, TextDelta) and e.text.strip() for e in events), text
    calls = [e for e in events if isinstance(e, CallDone)]
    assert len(calls) == 1 and calls[0].complete, text
    jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name], cls=jsonschema.Draft202012Validator)


def wander(compiler: GrammarCompiler, compiled: CompiledGrammar, rng: random.Random, steps: int,
           vocab: int) -> tuple[Any, list[int]]:
    """A pristine matcher copy taken ``steps`` random allowed tokens in (never EOS): a model that
    stopped anywhere, mid-string, mid-number, mid-name, in whitespace."""
    m = compiled._pristine.deep_copy()
    ids: list[int] = []
    eos = compiler.tokenizer.eos_id
    for _ in range(steps):
        allowed = [int(t) for t in allowed_tokens(np.frombuffer(m.compute_bitmask(), dtype=np.int32), vocab)
                   if t != eos]
        if not allowed or m.is_accepting():
            break
        token = rng.choice(allowed)
        assert m.consume_token(token)
        ids.append(token)
    return m, ids


def test_a_closing_finishes_every_shipped_schema_from_anywhere(
    shipped: Shipped, compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    compiled, schemas = shipped.compiled, shipped.schemas
    rng = random.Random(shipped.name)
    for steps in (0, 1, 3, 8, 20, 45, 90):
        m, ids = wander(compiler, compiled, rng, steps, tokenizer.vocab_size)
        before = m.deep_copy()
        closing = closing_tokens(m, compiler.byte_tokens)
        assert closing is not None, f"no closing after {tokenizer.decode(ids)!r}"
        assert m.is_accepting() == before.is_accepting() and m.validate_tokens(closing) == len(closing)  # unchanged
        assert m.try_consume_tokens(closing) == len(closing) and m.is_accepting()
        check(tokenizer.decode(ids + closing), schemas)
    # from the start it is a short whole answer: the grammar's own measure of its size
    assert len(closing_tokens(compiled._pristine, compiler.byte_tokens) or ()) * 2 + 2 * CLOSE_MARGIN <= \
        compiled.watch_from


class LoopingModel:
    """A model that never ends on its own: EOS only when nothing else is allowed; otherwise a random
    allowed token, never one that only closes (``"``, ``}``, ``]``) while another is allowed. Under
    a grammar without a budget it runs to any length; within one, the budget must end it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.closer = np.array([bool(b) and set(b.strip()) <= set(b'"}],') for b in vocab])

    def run(self, matcher: Any, max_tokens: int, rng: random.Random) -> list[int]:
        """Tokens as a tier emits them: at most ``max_tokens``, the last EOS if it ended in time."""
        ids: list[int] = []
        bitmask = allocate_bitmask(1, self.tokenizer.vocab_size)
        eos = self.tokenizer.eos_id
        while len(ids) < max_tokens:
            matcher.fill_bitmask(bitmask[0])
            allowed = allowed_tokens(bitmask[0], self.tokenizer.vocab_size)
            others = allowed[(allowed != eos) & ~self.closer[allowed]]
            pool = others if others.size else allowed[allowed != eos] if (allowed != eos).any() else allowed
            token = int(pool[rng.randrange(pool.size)])
            assert matcher.accept(token)
            ids.append(token)
            if token == eos:
                break
        return ids


def test_a_looping_model_ends_valid_within_its_budget(
    shipped: Shipped, compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    model = LoopingModel(tokenizer)
    for seed, max_tokens in enumerate((shipped.compiled.watch_from, 160, 384)):
        ids = model.run(compiler.matcher(shipped.compiled, max_tokens), max_tokens,
                        random.Random(f"{shipped.name}{seed}"))
        assert ids[-1] == tokenizer.eos_id, f"cut at {max_tokens} tokens: {tokenizer.decode(ids)[-200:]!r}"
        assert len(ids) <= max_tokens
        check(tokenizer.decode(ids[:-1]), shipped.schemas)


@settings(derandomize=True, deadline=None, max_examples=40,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=top_schemas, seed=st.integers(0, 2**32 - 1), spare=st.integers(0, 200))
def test_generated_schemas_end_valid_within_their_budget(
    schema: dict[str, Any], seed: int, spare: int, compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": False}}
    compiled = compiler.compile(constraints(response_format=rf))
    assert compiled is not None
    max_tokens = compiled.watch_from + spare
    ids = LoopingModel(tokenizer).run(compiler.matcher(compiled, max_tokens), max_tokens, random.Random(seed))
    assert ids[-1] == tokenizer.eos_id, f"cut at {max_tokens} tokens: {tokenizer.decode(ids)[-200:]!r}"
    jsonschema.validate(json.loads(tokenizer.decode(ids[:-1])), schema, cls=jsonschema.Draft202012Validator)


def test_a_budget_with_room_changes_nothing(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": TIMER, "strict": True}}
    compiled = compiler.compile(constraints(response_format=rf))
    assert compiled is not None
    free, budgeted = compiler.matcher(compiled), compiler.matcher(compiled, 40)
    rows = allocate_bitmask(2, tokenizer.vocab_size)
    for token in tokenizer.encode('{"minutes": 4'):
        free.fill_bitmask(rows[0])
        budgeted.fill_bitmask(rows[1])
        assert (rows[0] == rows[1]).all()  # 40 tokens leave room to close: the model chooses
        assert free.accept(token) and budgeted.accept(token)


def test_the_closing_is_what_speculation_verifies(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """Once the budget forces the closing, a draft is cut to the closing's prefix (then EOS), and
    the masks for a draft force each of its tokens; a rollback to before the closing lets the model
    choose again."""
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": {
        "type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
        "additionalProperties": False}, "strict": True}}
    compiled = compiler.compile(constraints(response_format=rf))
    assert compiled is not None
    prefix = tokenizer.encode('{"note": "a long note that goes on')
    probe = compiler.matcher(compiled)
    for token in prefix:
        assert probe.accept(token)
    closing = closing_tokens(probe._m, compiler.byte_tokens)
    assert closing is not None and tokenizer.decode(closing) == '"}'
    # a budget one token larger than the closing, its EOS and the margins need after the prefix
    m = compiler.matcher(compiled, len(prefix) + len(closing) + 1 + closing_margin(compiled.shortest) + 1)
    for token in prefix:
        assert m.accept(token)
    # one token left before the closing is forced: the model may still write, e.g., " and"
    row = allocate_bitmask(1, tokenizer.vocab_size)[0]
    m.fill_bitmask(row)
    assert len(allowed_tokens(row, tokenizer.vocab_size)) > 1000
    and_ = tokenizer.encode(" and")
    assert m.accept(and_[0])
    forced = [*closing, tokenizer.eos_id]
    assert m.valid_prefix_len([*forced, 5]) == len(forced)
    assert m.valid_prefix_len([forced[0], and_[0]]) == 1
    rows = allocate_bitmask(len(forced) + 1, tokenizer.vocab_size)
    assert m.fill_draft_bitmasks(forced, rows) == len(forced)
    for i, token in enumerate(forced):
        assert list(allowed_tokens(rows[i], tokenizer.vocab_size)) == [token]
    m.rollback(1)  # back before " and": room again
    m.fill_bitmask(row)
    assert len(allowed_tokens(row, tokenizer.vocab_size)) > 1000


def test_a_text_answer_under_auto_runs_to_its_budget(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """Text needs no closing: near the budget a text answer (tools offered, ``auto``) keeps every
    choice, so it runs to max_tokens as it would without a grammar."""
    compiled = compiler.compile(constraints([chat_tool("set_timer", TIMER)], tool_choice="auto"))
    assert compiled is not None
    text = tokenizer.encode(" ".join(["and then the story went on"] * 6))
    m = compiler.matcher(compiled, len(text) + 2)
    row = allocate_bitmask(1, tokenizer.vocab_size)[0]
    for token in text:
        m.fill_bitmask(row)
        assert len(allowed_tokens(row, tokenizer.vocab_size)) > 1000
        assert m.accept(token)
    m.fill_bitmask(row)
    assert len(allowed_tokens(row, tokenizer.vocab_size)) > 1000  # two slots left: still the model's choice


PARTS = {"type": "object", "$defs": {"Part": {"type": "object", "properties": {
    "b": {"anyOf": [{"const": "fixed"}, {"type": "null"}]}, "Name": {"type": "null"},
    "x_1": {"anyOf": [{"const": "fixed"}, {"type": "null"}]},
    "z-9": {"anyOf": [{"type": "number", "exclusiveMinimum": -97.75, "maximum": 2.25}, {"type": "null"}]}},
    "required": ["b", "Name", "x_1", "z-9"]}},
    "properties": {"part": {"$ref": "#/$defs/Part"}, "more": {"anyOf": [{"$ref": "#/$defs/Part"}, {"type": "null"}]}},
    "required": ["part", "more"], "additionalProperties": False}


def test_a_structure_opened_late_still_closes_within_the_budget(compiler: GrammarCompiler,
                                                                tokenizer: Tokenizer) -> None:
    """Found by the edge's generated-schema test with the real model: an answer that writes extra
    properties and only then opens ``"more": {`` (an object of four required fields: the closing
    grows by about a whole answer in one token) was cut at max_tokens, whatever budget it had. A
    model following this script wherever the mask lets it ends valid at every budget."""
    rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": PARTS, "strict": False}}
    compiled = compiler.compile(constraints(response_format=rf))
    assert compiled is not None
    script = tokenizer.encode('{"part":{"b":"fixed","Name":null,"x_1":"fixed","z-9":1,"t_2":"1","x_2":"32879",'
                              '"y_4":"2178108303","x_3":"11857"},"more":{"q":"' + "and so on " * 40)
    row = allocate_bitmask(1, tokenizer.vocab_size)[0]
    for max_tokens in range(compiled.watch_from, compiled.watch_from + 60):
        matcher, ids = compiler.matcher(compiled, max_tokens), []
        while len(ids) < max_tokens and not matcher.is_terminated:
            matcher.fill_bitmask(row)
            allowed = set(allowed_tokens(row, tokenizer.vocab_size).tolist())
            want = script[len(ids)] if len(ids) < len(script) else tokenizer.eos_id
            token = want if want in allowed else min(allowed - {tokenizer.eos_id} or allowed)
            assert matcher.accept(token)
            ids.append(token)
        assert ids[-1] == tokenizer.eos_id, f"cut at {max_tokens} tokens: {tokenizer.decode(ids)[-120:]!r}"
        jsonschema.validate(json.loads(tokenizer.decode(ids[:-1])), PARTS)
