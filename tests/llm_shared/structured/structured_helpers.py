"""Shared by the structured-output tests: request builders, a "random model" that samples only what
the grammar allows, and joining streamed events."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from llm_shared.structured import (
    ArgumentsDelta,
    CompiledGrammar,
    GrammarCompiler,
    OutputConstraints,
    TextDelta,
    ToolCallEvent,
    allocate_bitmask,
    allowed_tokens,
    parse_chat_constraints,
)
from llm_shared.tokenizer import Tokenizer


def chat_tool(name: str, parameters: dict[str, Any] | None = None, *, strict: bool = True) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "description": f"the {name} function", "strict": strict}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def constraints(tools: Sequence[dict[str, Any]] = (), **body: Any) -> OutputConstraints:
    return parse_chat_constraints({"tools": list(tools) or None, **body})


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIMER = {
    "type": "object",
    "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 120}},
    "required": ["minutes"],
    "additionalProperties": False,
}
TOOLS = [chat_tool("get_weather", WEATHER), chat_tool("set_timer", TIMER)]


def merged(events: Sequence[ToolCallEvent]) -> list[ToolCallEvent]:
    """Adjacent text deltas, and adjacent argument deltas of one call, joined: the events of a
    stream whatever its split points."""
    out: list[ToolCallEvent] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + e.text)
        elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
            out[-1] = ArgumentsDelta(e.index, last.delta + e.delta)
        else:
            out.append(e)
    return out


class RandomModel:
    """Picks, at every step, a random token among those the bitmask allows. Before ``soft_limit``
    tokens: uniformly, half the time among the short (1-2 byte, not blank) allowed tokens, which
    are the JSON punctuation (so lists and objects get more than one member). After it: EOS when allowed, else
    tokens that close a string, object or list, else a comma, else one ASCII character, so that
    every output ends; ``hard_limit`` is a test failure, not a cut."""

    def __init__(self, tokenizer: Tokenizer, *, soft_limit: int = 40, hard_limit: int = 1500) -> None:
        self.tokenizer = tokenizer
        self.soft_limit = soft_limit
        self.hard_limit = hard_limit
        vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        special = tokenizer.special_ids
        self.short = np.array([len(b) <= 2 and bool(b.strip()) and i not in special for i, b in enumerate(vocab)])
        self.closer = np.array([bool(b) and set(b) <= set(b'"}]') and i not in special for i, b in enumerate(vocab)])
        self.comma = np.array([b == b"," for b in vocab])
        self.ascii1 = np.array([len(b) == 1 and 33 <= b[0] < 127 for b in vocab])

    def generate(
        self, compiler: GrammarCompiler, compiled: CompiledGrammar, seed: int, prefix: Sequence[int] = ()
    ) -> list[int]:
        """Token ids ending with EOS (asserted)."""
        rng = random.Random(seed)
        matcher = compiler.matcher(compiled)
        eos = self.tokenizer.eos_id
        ids: list[int] = []
        for token in prefix:
            assert matcher.accept(token), f"prefix token {token} refused"
            ids.append(token)
        bitmask = allocate_bitmask(1, self.tokenizer.vocab_size)
        for step in range(self.hard_limit):
            matcher.fill_bitmask(bitmask[0])
            allowed = allowed_tokens(bitmask[0], self.tokenizer.vocab_size)
            assert allowed.size, f"nothing allowed after {self.tokenizer.decode(ids)!r}"
            token = self._pick(allowed, step, rng)
            assert matcher.accept(token), f"the matcher refused token {token} its own mask allowed"
            ids.append(token)
            if token == eos:
                assert matcher.is_terminated
                return ids
        raise AssertionError(f"no EOS within {self.hard_limit} tokens: {self.tokenizer.decode(ids)[:300]!r}")

    def _pick(self, allowed: np.ndarray, step: int, rng: random.Random) -> int:
        eos = self.tokenizer.eos_id
        if step >= self.soft_limit:
            if eos in allowed:
                return eos
            for preferred in (self.closer, self.comma, self.ascii1):
                subset = allowed[preferred[allowed]]
                if subset.size:
                    return int(subset[rng.randrange(subset.size)])
        elif rng.random() < 0.5:
            subset = allowed[self.short[allowed]]
            if subset.size:
                return int(subset[rng.randrange(subset.size)])
        return int(allowed[rng.randrange(allowed.size)])
