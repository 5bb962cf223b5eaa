"""Structured outputs for every tier: tools, tool_choice and response_format turned into one
grammar, compiled (and cached) per model with llguidance, applied as a token bitmask, and the
model's streamed tool calls parsed back into events. Torch-free: the edge tier and the client
SDK's on-device fallback run it as it is; the torch tier only moves the same int32 bitmask to its
device.

  parse.py             wire dicts -> the frozen types of spec.py (errors name the field)
  schema_check.py      bounds on a client's schema (size, depth, $ref)
  grammar.py           constraints -> one Lark grammar (or None: nothing to constrain)
  families/            each model family's tool-call syntax, prompt text and streaming parser
  compiler.py          per model: llguidance tokenizer + compiled-grammar cache (cache.py)
  bitmask.py           the token bitmask (llguidance's int32 layout): allocate, read, apply to logits
  matcher.py           one sequence's matcher: bitmask, accept, rollback, draft validation, budget
  request_matchers.py  a tier's lazily built compiler and a fresh matcher per request
  closing.py           a short way to finish an answer, which a budget forces near max_tokens
  history.py           a conversation (text, calls, tool results) rendered in the family's syntax
"""

from llm_shared.structured.bitmask import allocate_bitmask, allowed_tokens, apply_bitmask, bitmask_words
from llm_shared.structured.compiler import CompiledGrammar, GrammarCompiler, build_lltokenizer, grammar_source
from llm_shared.structured.errors import SchemaError
from llm_shared.structured.families import (
    ArgumentsDelta,
    CallDone,
    CallStarted,
    TextDelta,
    ToolCallEvent,
    ToolCallFamily,
    ToolCallParser,
    get_family,
)
from llm_shared.structured.grammar import GrammarSource, build_grammar
from llm_shared.structured.history import Message, ToolCall, render_messages
from llm_shared.structured.matcher import SequenceMatcher
from llm_shared.structured.parse import (
    parse_chat_constraints,
    parse_realtime_constraints,
    parse_response_format,
    parse_tool_choice,
    parse_tools,
)
from llm_shared.structured.request_matchers import RequestMatchers
from llm_shared.structured.spec import (
    FunctionTool,
    OutputConstraints,
    ResponseFormat,
    StructuredLimits,
    ToolChoice,
)

__all__ = [
    "ArgumentsDelta",
    "CallDone",
    "CallStarted",
    "CompiledGrammar",
    "FunctionTool",
    "GrammarCompiler",
    "GrammarSource",
    "Message",
    "OutputConstraints",
    "RequestMatchers",
    "ResponseFormat",
    "SchemaError",
    "SequenceMatcher",
    "StructuredLimits",
    "TextDelta",
    "ToolCall",
    "ToolCallEvent",
    "ToolCallFamily",
    "ToolCallParser",
    "ToolChoice",
    "allocate_bitmask",
    "allowed_tokens",
    "apply_bitmask",
    "bitmask_words",
    "build_grammar",
    "build_lltokenizer",
    "get_family",
    "grammar_source",
    "parse_chat_constraints",
    "parse_realtime_constraints",
    "parse_response_format",
    "parse_tool_choice",
    "parse_tools",
    "render_messages",
]
