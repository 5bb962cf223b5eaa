"""``tools`` + ``tool_choice`` + ``response_format`` -> one Lark grammar for llguidance, or None.

The answer is one of:
- free text (no grammar at all: nothing constrains it),
- JSON of the response format's schema (``json_object``: any JSON object),
- a call block in the model family's syntax (``required``; a named function: only that one),
- under ``auto``, either of the above two; with a text answer, the text may run up to the family's
  trigger and must then become a valid call block, and it never contains the trigger otherwise.
  So a model cannot write half a call and wander off into text, and a parser that sees the
  trigger knows a call follows.

Each schema is embedded with ``%json``, one per function: every schema stays its own document, so
its ``$ref``s resolve against its own root, and each call alternative fixes the function name before
the arguments that must match that function's schema. The text is deterministic in its input, so its
hash is the compiled-grammar cache's key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from llm_shared.structured.families.base import ToolCallFamily
from llm_shared.structured.spec import OutputConstraints

# JSON whitespace between tokens: at most 16 characters at any one place (a newline and the
# indentation of pretty-printed JSON a few levels deep). Unbounded whitespace is the classic way a
# small model under a JSON grammar never finishes: it may pad, but not forever.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,16}"
ANY_OBJECT = '{"type":"object"}'


@dataclass(frozen=True)
class SchemaPart:
    """One embedded schema and the request field it came from, for naming it in a compile error."""

    param: str
    rule: str  # the Lark rule that embeds it, e.g. 'tc_args_0: %json {...}'


@dataclass(frozen=True)
class GrammarSource:
    text: str  # the Lark grammar
    parts: tuple[SchemaPart, ...]  # every embedded schema (grammar text of each, for error attribution)
    calls: bool  # the grammar allows tool calls: the output goes through the family's parser

    @property
    def key(self) -> str:
        """The cache key: the grammar text's SHA-256 (equal texts compile to equal matchers)."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


# Dates and times as the validators that read them accept (jsonschema's format checker, pydantic's
# datetime, Python's fromisoformat): llguidance's own format regexes let through year 0000, 30
# February and second 60, which those refuse. A string with one of these formats (and no pattern
# of its own) is constrained by the pattern here instead: years 0001-9999, each month's days (29
# February in leap years), hours 00-23, seconds 00-59, offsets -23:59..+23:59.
_LEAP = r"(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_YEAR = r"(?:000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d{3})"
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
              r"|02-(?:0[1-9]|1\d|2[0-8]))")
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)"
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,9})?(?:[Zz]|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[Tt]{_TIME}$"}


def _strict_formats(node: object) -> object:
    """``node`` (a parsed schema) with every date, time and date-time format given as a pattern."""
    if isinstance(node, list):
        return [_strict_formats(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_formats(v) for k, v in node.items()}
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "pattern" not in node:
        del out["format"]
        out["pattern"] = FORMAT_PATTERNS[fmt]
    return out


def json_schema_rule(rule: str, schema_json: str, *, strict: bool) -> str:
    """``rule: %json {...}`` with our compiler options first in the schema. Strict schemas are
    compiled exactly (an unsupported keyword is an error); others leniently (it is ignored), which
    is what OpenAI's non-strict mode promises: best effort. Date and time formats become patterns
    (``FORMAT_PATTERNS``)."""
    options = json.dumps({"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}, separators=(",", ":"))
    if '"format"' in schema_json:
        schema_json = json.dumps(_strict_formats(json.loads(schema_json)), separators=(",", ":"))
    rest = schema_json[1:].lstrip()
    inner = rest if rest.startswith("}") else "," + rest
    return f'{rule}: %json {{"x-guidance":{options}{inner}'


def _regex_literal(text: str) -> str:
    """``text`` as a Lark regex body (Rust regex syntax), every special character escaped."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~/" else c for c in text)


def build_grammar(constraints: OutputConstraints, family: ToolCallFamily | None) -> GrammarSource | None:
    """The grammar for ``constraints``, None when they constrain nothing. ``family`` may be None
    only when no tool may be called (a ValueError otherwise: the caller refuses such a request)."""
    rf = constraints.response_format
    lines: list[str] = []
    parts: list[SchemaPart] = []
    answer = None  # the rule of a non-call answer; None: free text
    if rf.type == "json_schema":
        assert rf.schema_json is not None
        part = SchemaPart(rf.param, json_schema_rule("answer", rf.schema_json, strict=rf.strict))
        parts.append(part)
        answer = part.rule
    elif rf.type == "json_object":
        answer = json_schema_rule("answer", ANY_OBJECT, strict=True)

    if not constraints.calls_allowed:
        if answer is None:
            return None
        return GrammarSource(f"start: answer\n{answer}\n", tuple(parts), calls=False)
    if family is None:
        raise ValueError("a grammar with tool calls needs the model family's call syntax")

    choice = constraints.tool_choice
    tools = [t for t in constraints.tools if choice.name is None or t.name == choice.name]
    args_rules = []
    for i, tool in enumerate(tools):
        part = SchemaPart(tool.param, json_schema_rule(f"tc_args_{i}", tool.parameters_json, strict=tool.strict))
        parts.append(part)
        lines.append(part.rule)
        args_rules.append((tool.name, f"tc_args_{i}"))
    calls = family.calls_rules(args_rules, parallel=constraints.parallel_tool_calls, allow_empty=choice.mode == "auto")
    trigger = json.dumps(family.trigger)
    if choice.mode != "auto":
        start = f"start: {trigger} tc_body"
    elif answer is not None:
        start = f"start: answer | {trigger} tc_body"
        lines.append(answer)
    else:
        # Any text, or text up to the trigger and then a call block. The head is a lazy lexeme: it
        # ends at the first trigger, and llguidance then drops the greedy text alternative, so text
        # can never run past a trigger that is not followed by a valid block (the tests pin this
        # down). Both are single lexemes: the choice costs the parser nothing.
        t = _regex_literal(family.trigger)
        start = "start: ANSWER_TEXT | answer_head tc_body"
        lines.append("ANSWER_TEXT: /(?s:.*)/")
        lines.append(f"answer_head[lazy]: /(?s:.*){t}/")
    text = "\n".join([start, *lines]) + "\n" + calls
    return GrammarSource(text, tuple(parts), calls=True)
