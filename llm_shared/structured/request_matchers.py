"""A tier's grammar compiler, built with its first grammar, and a fresh matcher per request.

Both tiers take a request's grammar as text (``SamplingParams.grammar``, compiled by the gateway's
``GrammarCompiler`` from the request's tools and response format) and need the same thing from
it: one compiler per tokenizer, built lazily (~0.1 s, once), and a matcher per request that ends
its answer within ``max_tokens``.
"""

from __future__ import annotations

import threading

from llm_shared.structured.compiler import GrammarCompiler
from llm_shared.structured.matcher import SequenceMatcher
from llm_shared.tokenizer import Tokenizer


class RequestMatchers:
    """One per engine. Thread-safe: requests compile on a tier's compile thread, while the gateway
    in the same process may compile with ``compiler()`` too."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None  # built with the first request that has a grammar
        self._lock = threading.Lock()

    def compiler(self) -> GrammarCompiler:
        """The compiler and its cache (built once, ~0.1 s; blocking)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, family=None)
            return self._compiler

    def matcher(self, grammar: str, max_tokens: int) -> SequenceMatcher | None:
        """A fresh matcher of ``grammar`` that ends its answer within ``max_tokens`` (compiled once
        per text; SchemaError names ``grammar``), or None for a request without a grammar."""
        if not grammar:
            return None
        return self.compiler().text_matcher(grammar, max_tokens)
