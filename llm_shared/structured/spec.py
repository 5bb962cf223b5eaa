"""What a request asks of the output's shape: function tools, ``tool_choice``, parallel calls and
``response_format``, as frozen types checked once at the boundary (``parse.py``) and trusted after.

Schemas are kept as their compact JSON text, in the client's key order: llguidance fixes the order
of object properties to the order in the schema, the text is what the grammar embeds, and a string
cannot be mutated behind the cache's back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from llm_shared.configtools import require

ToolChoiceMode = Literal["none", "auto", "required", "function"]
ResponseFormatType = Literal["text", "json_object", "json_schema"]


def _invariant(ok: bool, message: str) -> None:
    # The request types are built by parse.py, which has already refused bad input with an error
    # naming the field; failing here is a bug in the caller, not the client's fault.
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class StructuredLimits:
    """Bounds on what a client may ask to be compiled, so that a request is refused (with the field
    named) before llguidance spends time on it. The defaults take OpenAI's published limits where
    there is one (128 tools, names of 64 characters) and leave generous room for the schemas the
    official SDK generates from Pydantic models."""

    max_tools: int = 128  # OpenAI's limit on tools per request
    max_schema_bytes: int = 64 * 1024  # one schema's compact JSON
    max_total_schema_bytes: int = 256 * 1024  # all schemas of one request together
    # JSON nesting of the schema document (objects and lists), not of the data it describes: an
    # object property costs two levels ("properties", then the property), so 10 levels of nested
    # objects (OpenAI's limit) fit in ~24. Bounded before anything recurses over the schema.
    max_schema_depth: int = 32
    # llguidance's own limits, applied when compiling and on every mask step (LLParserLimits):
    # lexer fuel for building the grammar (~50k/ms: 20 ms) bounds a compile, and the grammar size
    # bounds what a huge enum or anyOf expands to.
    initial_lexer_fuel: int = 1_000_000
    max_grammar_size: int = 500_000
    step_lexer_fuel: int = 200_000  # per mask step (~14k/ms)
    step_max_items: int = 50_000  # Earley items per mask step (~20k/ms)
    max_lexer_states: int = 250_000

    def __post_init__(self) -> None:
        for name in (
            "max_tools",
            "max_schema_bytes",
            "max_total_schema_bytes",
            "max_schema_depth",
            "initial_lexer_fuel",
            "max_grammar_size",
            "step_lexer_fuel",
            "step_max_items",
            "max_lexer_states",
        ):
            require(getattr(self, name) > 0, f"structured.{name} must be positive")
        require(
            self.max_schema_bytes <= self.max_total_schema_bytes,
            "structured.max_schema_bytes must not exceed max_total_schema_bytes",
        )


@dataclass(frozen=True)
class FunctionTool:
    """One function the model may call."""

    name: str  # ^[a-zA-Z0-9_-]{1,64}$: it is written into the grammar and the prompt as is
    description: str
    parameters_json: str  # the arguments' JSON schema (an object schema), compact, client key order
    strict: bool  # strict: unsupported schema keywords are refused; else ignored (best effort)
    # Where the schema sat on the wire ("tools[2].function.parameters"), so that a compile failure
    # found later, with the grammar of all tools together, still names the field at fault.
    param: str = field(default="", compare=False)

    def parameters(self) -> dict[str, Any]:
        """The schema as a fresh dict (the caller may change it)."""
        return json.loads(self.parameters_json)


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode
    name: str | None = None  # the function's name when mode == "function", else None

    def __post_init__(self) -> None:
        _invariant(
            (self.mode == "function") == (self.name is not None),
            "tool_choice names a function exactly when its mode is 'function'",
        )


@dataclass(frozen=True)
class ResponseFormat:
    type: ResponseFormatType = "text"
    name: str = ""  # json_schema's name (informational; the schema is what constrains)
    schema_json: str | None = None  # json_schema only; json_object means any JSON object
    strict: bool = False
    param: str = field(default="", compare=False)  # as FunctionTool.param

    def __post_init__(self) -> None:
        _invariant(
            (self.type == "json_schema") == (self.schema_json is not None),
            "response_format has a schema exactly when its type is json_schema",
        )


TEXT = ResponseFormat()


@dataclass(frozen=True)
class OutputConstraints:
    """Everything that shapes one response's output. ``grammar.build_grammar`` turns it into one
    grammar, or None when nothing constrains it (free decoding then costs nothing)."""

    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True  # False: at most one call per response
    response_format: ResponseFormat = TEXT

    def __post_init__(self) -> None:
        names = [t.name for t in self.tools]
        _invariant(len(set(names)) == len(names), "tool names must be unique")
        _invariant(
            self.tool_choice.name is None or self.tool_choice.name in names, "tool_choice must name one of the tools"
        )
        # "auto" without tools is a Realtime session's default and means no calls.
        _invariant(
            self.tool_choice.mode in ("none", "auto") or bool(self.tools),
            "tool_choice 'required' or a function needs tools",
        )

    @property
    def calls_allowed(self) -> bool:
        """Whether the model may call a function in this response."""
        return self.tool_choice.mode != "none" and bool(self.tools)

    def tool(self, name: str) -> FunctionTool | None:
        return next((t for t in self.tools if t.name == name), None)


UNCONSTRAINED = OutputConstraints()
