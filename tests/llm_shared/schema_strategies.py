"""Hypothesis strategies for JSON schemas of the kinds tools and response formats use: objects
with required properties, arrays with item bounds, enums, bounded integers and numbers, strings
with patterns and lengths, nullable (anyOf null) parts, nested a few levels, and $defs/$ref as
Pydantic writes them. Shared by the structured layer's property tests and the tiers' tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

NAMES = st.sampled_from(["a", "b", "city", "count", "tags", "x_1", "Name", "z-9", "ünï"])
PATTERNS = st.sampled_from(["^[a-z]+$", "^[0-9]{3}-[0-9]{4}$", "^(red|green|blue)$", "^[A-Z][a-z]{0,5}$", "ab"])


@st.composite
def integers(draw: st.DrawFn) -> dict[str, Any]:
    low = draw(st.integers(-1000, 1000))
    schema: dict[str, Any] = {"type": "integer"}
    bound = draw(st.sampled_from(["none", "inclusive", "exclusive", "min-only"]))
    if bound == "inclusive":
        schema |= {"minimum": low, "maximum": low + draw(st.integers(0, 500))}
    elif bound == "exclusive":
        schema |= {"exclusiveMinimum": low, "exclusiveMaximum": low + draw(st.integers(2, 500))}
    elif bound == "min-only":
        schema |= {"minimum": low}
    return schema


@st.composite
def numbers(draw: st.DrawFn) -> dict[str, Any]:
    low = draw(st.integers(-400, 400)) / 4
    high = low + draw(st.integers(1, 400)) / 4
    if draw(st.booleans()):
        return {"type": "number", "minimum": low, "maximum": high}
    # An exclusive lower bound with an upper one less than 1 above it: llguidance 1.9.1 lets the
    # integer form of the bound through ((0, 0.25] takes "0"). A known library bug, pinned by
    # test_structured_grammar.py's xfail; the property is tested around it.
    return {"type": "number", "exclusiveMinimum": low, "maximum": max(high, low + 1)}


@st.composite
def strings(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    if draw(st.booleans()):
        schema["pattern"] = draw(PATTERNS)
        if draw(st.booleans()):
            schema["maxLength"] = draw(st.integers(8, 20))
    else:
        high = draw(st.integers(0, 16))
        schema |= {"maxLength": high, "minLength": draw(st.integers(0, high))}
    return schema


enums = st.lists(
    st.one_of(st.text("abcxyz -", min_size=1, max_size=6), st.integers(-5, 5)), min_size=1, max_size=5, unique=True
).map(lambda values: {"enum": values})
leaves = st.one_of(
    integers(),
    numbers(),
    strings(),
    enums,
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.just({"const": "fixed"}),
)


@st.composite
def objects(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    properties = {name: draw(children) for name in names}
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    required = draw(st.sampled_from(["all", "some", "none"]))
    if required == "all":
        schema["required"] = names
    elif required == "some":
        schema["required"] = names[: len(names) // 2 + 1]
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


@st.composite
def arrays(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    low = draw(st.integers(0, 2))
    return {"type": "array", "items": draw(children), "minItems": low, "maxItems": low + draw(st.integers(0, 3))}


def schemas(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    if depth == 0:
        return leaves
    inner = schemas(depth - 1)
    return st.one_of(leaves, objects(inner), arrays(inner), inner.map(lambda s: {"anyOf": [s, {"type": "null"}]}))


@st.composite
def with_defs(draw: st.DrawFn) -> dict[str, Any]:
    """A top-level object with a part under $defs, referenced by $ref (as Pydantic writes models)."""
    part = draw(objects(schemas(1)))
    return {
        "type": "object",
        "$defs": {"Part": part},
        "properties": {
            "part": {"$ref": "#/$defs/Part"},
            "more": {"anyOf": [{"$ref": "#/$defs/Part"}, {"type": "null"}]},
        },
        "required": ["part", "more"],
        "additionalProperties": False,
    }


top_schemas = st.one_of(objects(schemas(2)), arrays(schemas(2)), with_defs())
