"""The cases of bench/structured.py and how an answer is judged: valid against its schema (formats checked), calls to the tool asked for, the verdicts summed per tier."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jsonschema

from bench._common import (
    progress,
)
from bench._structured_tiers import Out
from llm_shared.contract import SamplingParams
from llm_shared.structured import (
    CallDone,
    TextDelta,
    get_family,
)
from llm_shared.structured.matcher import CLOSE_MARGIN

FAMILY = get_family("smollm2")
NEAR_BUDGET = 3 * CLOSE_MARGIN + 1  # tokens before max_tokens within which an answer "ended near the budget"
TOOLS_OFFERED = 4  # a tool prompt offers its tool and the next three (all 20 make a 2,700-token prompt)
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")

FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(value: object) -> bool:
    # jsonschema checks date-time only with an optional package; RFC 3339 by hand, then the calendar.
    if not isinstance(value, str):
        return True
    if not RFC3339.match(value):
        return False
    datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    return True


@dataclass(frozen=True)
class Case:
    name: str  # the tool's or the response format's name
    prompt: str  # the user's message
    body: dict[str, Any]  # the chat request's tools / tool_choice / parallel_tool_calls or response_format
    schemas: dict[str, dict[str, Any]]  # tool name -> its parameters (every offered tool); "" -> the answer's schema

    @property
    def calls(self) -> bool:
        return "" not in self.schemas


def load_cases(path: Path) -> tuple[list[Case], list[tuple[str, dict[str, Any]]]]:
    """The validity cases, and (name, body) of each shipped schema alone for the compile timings."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    tools = [entry["tool"] for entry in doc["tools"]]
    cases, alone = [], []
    for i, entry in enumerate(doc["tools"]):
        offered = [tools[(i + j) % len(tools)] for j in range(TOOLS_OFFERED)]
        name = entry["tool"]["function"]["name"]
        cases.append(Case(name, entry["prompt"], {"tools": offered, "tool_choice": "required",
                                                  "parallel_tool_calls": False},
                          {t["function"]["name"]: t["function"]["parameters"] for t in offered}))
        alone.append((name, {"tools": [entry["tool"]], "tool_choice": "required", "parallel_tool_calls": False}))
    for entry in doc["response_formats"]:
        fmt = entry["response_format"]
        name = fmt["json_schema"]["name"]
        cases.append(Case(name, entry["prompt"], {"response_format": fmt}, {"": fmt["json_schema"]["schema"]}))
        alone.append((name, {"response_format": fmt}))
    return cases, alone


def schema_error(schema: dict[str, Any], value: Any) -> str:
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema, format_checker=FORMATS).iter_errors(value))
    return "" if error is None else f"{'/'.join(map(str, error.absolute_path))}: {error.message}"[:200]


def check_calls(case: Case, calls: Sequence[tuple[str, str]]) -> str:
    """Why these (name, arguments) calls are not a valid answer to ``case``; "" when they are."""
    if not calls:
        return "no tool call"
    for name, arguments in calls:
        if name not in case.schemas:
            return f"unknown tool {name!r}"
        try:
            value = json.loads(arguments)
        except ValueError as e:
            return f"{name}: arguments are not JSON ({e})"
        why = schema_error(case.schemas[name], value)
        if why:
            return f"{name}: {why}"
    return ""


def check_text(case: Case, text: str) -> tuple[str, str | None]:
    """Why a tier's raw output is not valid for ``case`` ("" when it is), and the called tool's name."""
    if not case.calls:
        try:
            value = json.loads(text)
        except ValueError as e:
            return f"not JSON ({e})", None
        return schema_error(case.schemas[""], value), None
    parser = FAMILY.new_parser()
    events = [*parser.feed(text), *parser.finish()]
    done = [e for e in events if isinstance(e, CallDone)]
    if any(isinstance(e, TextDelta) and e.text.strip() for e in events):
        return "text besides the call", None
    if any(not d.complete for d in done):
        return "a call cut short", None
    return check_calls(case, [(d.name, d.arguments) for d in done]), done[0].name if done else None


@dataclass
class Verdict:
    case: str
    finish: str
    why: str  # "" when valid
    called: str | None = None  # the tool a call named
    tokens: int = 0
    route: str = ""  # the cascade's route
    budget: int = 0  # the answer's max_tokens


def summary(verdicts: Sequence[Verdict], cases: Sequence[Case]) -> dict[str, Any]:
    tool_names = {c.name for c in cases if c.calls}
    calls = [v for v in verdicts if v.case in tool_names]
    finished = [v for v in verdicts if v.finish in ("stop", "tool_calls")]
    return {
        "valid_rate": sum(not v.why for v in verdicts) / len(verdicts) if verdicts else None,
        # of the answers that ended by themselves (not cut by max_tokens): what the grammar vouches for
        "valid_rate_finished": sum(not v.why for v in finished) / len(finished) if finished else None,
        "truncated": len(verdicts) - len(finished),
        # ended within the last tokens of max_tokens: where the budget forces a closing (a model
        # that loops inside the document; it is forced with 2 * CLOSE_MARGIN + 1 slots to spare,
        # and a look may come a few tokens late), or, rarely, an answer that ended there by itself
        "ended_near_budget": sum(v.budget > 0 and v.tokens >= v.budget - NEAR_BUDGET for v in finished),
        "outputs": len(verdicts), "invalid": [vars(v) for v in verdicts if v.why],
        "finish_reasons": {r: sum(v.finish == r for v in verdicts) for r in sorted({v.finish for v in verdicts})},
        "intended_tool_called": sum(v.called == v.case for v in calls) / len(calls) if calls else None,
        "mean_tokens": statistics.fmean(v.tokens for v in verdicts) if verdicts else None,
    }


def verdicts(jobs: Sequence[tuple[Case, SamplingParams]], outs: Sequence[Out]) -> list[Verdict]:
    out = []
    for (case, params), o in zip(jobs, outs, strict=True):
        why, called = check_text(case, o.text)
        if o.finish != "stop":
            why = f"finished {o.finish!r}" + (f": {why}" if why else "")
        out.append(Verdict(case.name, o.finish, why, called, len(o.times), budget=params.max_tokens))
    return out


def report_validity(tier: str, verdicts_: list[Verdict], cases: Sequence[Case]) -> dict[str, Any]:
    result = summary(verdicts_, cases)
    finished = result["valid_rate_finished"]
    progress(f"  {tier}: valid {result['valid_rate']:.3f} of {result['outputs']} outputs ({result['truncated']} cut "
             f"by max_tokens; of the rest {'-' if finished is None else f'{finished:.3f}'}; "
             f"{result['ended_near_budget']} ended near the budget); finish reasons "
             f"{result['finish_reasons']}; the intended tool called {result['intended_tool_called']}")
    for bad in result["invalid"][:5]:
        progress(f"    invalid: {bad['case']}: {bad['why']}")
    return result
