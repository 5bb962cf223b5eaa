"""SmolLM2's tool calls, as its instruct models were tuned (the 1.7B model card; xLAM-style data).

The system prompt lists the tools as a JSON list inside ``<tools>...</tools>``; the answer is a
call block, ``<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>`` (``[]`` for "no
call"), and a tool's output comes back as a user turn wrapped in ``<tool_response>``. None of these
markers is a special token in SmolLM2's vocabulary: they are ordinary text, which is why "auto"
needs the grammar's rule that free text never contains ``<tool_call>``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import ClassVar

from llm_shared.structured.families.base import ToolCallFamily, ToolCallParser
from llm_shared.structured.families.json_calls import JsonCallListParser
from llm_shared.structured.spec import FunctionTool

OPENING = "<tool_call>"
CLOSING = "</tool_call>"

# The model card's instructions. Kept close to the tuning prompt: a 135M-1.7B model follows the
# wording it was tuned on far better than a paraphrase.
_INTRO = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n"
)
_FORMAT_CALLS_ONLY = (
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. "
    "If no function call is needed, please make the tool calls an empty list '[]'.\n"
)
_FORMAT_OR_TEXT = (
    "To call functions, the output MUST strictly adhere to the following format.\n"
    "The example format is as follows. Please make sure the parameter type is correct. "
    "If no function call is needed, answer in plain text instead.\n"
)
_EXAMPLE = (
    '<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
    "... (more tool calls as required)\n]</tool_call>"
)
_EXAMPLE_ONE = (
    '<tool_call>[\n{"name": "func_name", "arguments": {"argument1": "value1", "argument2": "value2"}}\n]</tool_call>'
)


def _lark_string(text: str) -> str:
    # A Lark string literal; JSON's escaping is a subset Lark reads the same way.
    return json.dumps(text)


class SmolLM2(ToolCallFamily):
    name: ClassVar[str] = "smollm2"
    trigger: ClassVar[str] = OPENING

    def calls_rules(self, args_rules: Sequence[tuple[str, str]], *, parallel: bool, allow_empty: bool) -> str:
        # The wrapper of each call is fixed text (the spacing json.dumps writes, as in the tuning
        # data); only the list's layout may vary: a newline after "[", between calls and before "]",
        # as in the model card's example. One alternative per function, its name fixed, so the
        # arguments that follow are checked against that function's schema.
        lines = []
        items = 'tc_call ("," TC_WS? tc_call)*' if parallel else "tc_call"
        body = f'"[" TC_WS? {items} TC_WS? "]" {_lark_string(CLOSING)}'
        if allow_empty:
            body += f' | "[]" {_lark_string(CLOSING)}'
        lines.append(f"tc_body: {body}")
        lines.append("tc_call: " + " | ".join(f"tc_call_{i}" for i in range(len(args_rules))))
        for i, (name, args_rule) in enumerate(args_rules):
            head = _lark_string(f'{{"name": "{name}", "arguments": ')
            lines.append(f'tc_call_{i}: {head} {args_rule} "}}"')
        lines.append(r"TC_WS: /[ \n]{1,3}/")
        return "\n".join(lines) + "\n"

    def render_tools(self, tools: Sequence[FunctionTool], *, allow_text: bool, parallel: bool) -> str:
        listed = [{"name": t.name, "description": t.description, "parameters": t.parameters()} for t in tools]
        text = _INTRO + "<tools>" + json.dumps(listed, ensure_ascii=False) + "</tools>\n\n"
        text += _FORMAT_OR_TEXT if allow_text else _FORMAT_CALLS_ONLY
        if not parallel:
            return text + "Make at most one function call.\n" + _EXAMPLE_ONE
        return text + _EXAMPLE

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        items = []
        for name, arguments in calls:
            try:  # as the model writes them: compact values, json.dumps spacing
                args = json.dumps(json.loads(arguments), ensure_ascii=False)
            except ValueError:
                args = json.dumps(arguments, ensure_ascii=False)  # not JSON: kept, as a string
            items.append(f'{{"name": {json.dumps(name)}, "arguments": {args}}}')
        return f"{OPENING}[{', '.join(items)}]{CLOSING}"

    def render_tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def new_parser(self) -> ToolCallParser:
        return JsonCallListParser(OPENING, CLOSING)
