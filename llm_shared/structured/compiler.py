"""Compiling grammars for one model: its llguidance tokenizer, built once, and a cache of compiled
grammars keyed by the grammar text's hash.

One ``GrammarCompiler`` per model, made where the tier loads the model and kept for its life (it is
not cached at module level: whoever owns the model owns its compiler). A compile is bounded by
``StructuredLimits`` (lexer fuel, grammar size, lexer states), so a hostile schema costs at most
tens of milliseconds and comes back as a ``SchemaError`` naming the field at fault.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass, field

import llguidance

from llm_shared.errors import InvalidRequestError
from llm_shared.structured.cache import CacheStats, GrammarCache
from llm_shared.structured.closing import ByteTokens, closing_tokens
from llm_shared.structured.errors import SchemaError
from llm_shared.structured.families import ToolCallFamily, get_family
from llm_shared.structured.grammar import GrammarSource, build_grammar
from llm_shared.structured.matcher import Budget, SequenceMatcher, watch_from
from llm_shared.structured.spec import OutputConstraints, StructuredLimits
from llm_shared.tokenizer import Tokenizer


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads, taken from our tokenizer: the raw bytes of every
    id (special tokens marked as such, so free text can never produce one), EOS, and encoding (used
    by llguidance only to tokenize forced text). Built from the same tables the tiers decode with,
    so the grammar's idea of a token's bytes is theirs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes with bytes: say we take text
            raise TypeError("the vocabulary encodes text, not bytes")
        return self._tokenizer.encode(text)


def build_lltokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` (~0.1 s for 49k tokens; build once per model)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)), eos_token=tokenizer.eos_id)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    key: str  # the grammar text's hash
    compile_ms: float  # building the matcher and its first mask, measured when it was compiled
    calls: bool  # tool calls are possible: stream the output through the family's parser
    text: str  # the grammar (what SamplingParams.grammar carries to a tier)
    _pristine: llguidance.LLMatcher = field(repr=False)  # never advanced; sequences get copies
    _byte_tokens: ByteTokens = field(repr=False)  # the model's, for the closing walk

    @functools.cached_property
    def shortest(self) -> int | None:
        """Tokens of the shortest whole answer (the closing walk's from the start; ~1-10 ms, once,
        when a tier first makes a budgeted matcher: a gateway that compiles only to refuse bad
        schemas never pays it); None: none found within the walk's bound, and then no budget
        closes this grammar's answers."""
        walk = closing_tokens(self._pristine, self._byte_tokens)
        return None if walk is None else len(walk)

    @property
    def watch_from(self) -> int:
        """Budget left from which its sequences look for a way to close (``matcher.watch_from``)."""
        return watch_from(self.shortest)


@dataclass(frozen=True)
class _Failure:
    """A compile error, remembered in the cache so a repeated bad schema is refused at once."""

    message: str
    param: str


_POSITION = re.compile(r"^at \d+\(\d+\): ")
_LISTING = re.compile(r"^\s*\d+ \|")  # the grammar listing llguidance appends after the message


def _reason(error: str) -> str:
    """llguidance's message on one line, without its position in our grammar and the listing of it
    (the message may span lines: a regex error shows the pattern, then the cause)."""
    lines = []
    for line in error.strip().splitlines():
        if _LISTING.match(line):
            break
        if line.strip(" ^"):
            lines.append(line.strip())
    text = _POSITION.sub("", " ".join(lines)) or "unknown error"
    text = text.removeprefix("failed to compile JSON schema: ")
    return text if len(text) <= 300 else text[:297] + "..."


# What a cached compiled grammar holds in memory, which Python cannot read from the Rust side:
# measured as the process's RSS growth over 60 distinct compiled tool grammars kept alive (the
# embedded model's tokenizer): 52 KiB for 468 bytes of grammar text, 223 KiB for 2.2 KB, 743 KiB
# for 8.6 KB, i.e. 88-113 bytes per byte of text. Counted as 16 KiB plus 128 bytes a byte, above
# each of those, so the cache's byte bound bounds the memory it keeps.
ATTRIBUTE_BUDGET_S = 0.02  # finding which schema broke a failed compile, at most this long
MATCHER_BASE_BYTES = 16 * 1024
MATCHER_BYTES_PER_TEXT_BYTE = 128


def matcher_bytes(text_bytes: int) -> int:
    """The memory a compiled grammar of ``text_bytes`` of text is counted for in the cache."""
    return MATCHER_BASE_BYTES + MATCHER_BYTES_PER_TEXT_BYTE * text_bytes


def grammar_source(constraints: OutputConstraints, family: ToolCallFamily | None) -> GrammarSource | None:
    """The grammar of ``constraints`` for a model of ``family`` (None: nothing constrains the output);
    InvalidRequestError when tools could be called by a model with no known call syntax. Needs no
    compiler: a caller can skip building one for an unconstrained turn."""
    if constraints.calls_allowed and family is None:
        raise InvalidRequestError("this model has no known tool-call format, so it cannot call tools", param="tools")
    return build_grammar(constraints, family)


class GrammarCompiler:
    """Grammars for one model. Thread-safe (the cache locks; llguidance's matchers are built and
    copied without shared mutable state)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        family: str | ToolCallFamily | None,
        limits: StructuredLimits | None = None,
        cache_entries: int = 512,
        cache_bytes: int = 64 * 1024 * 1024,
        ll_tokenizer: llguidance.LLTokenizer | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.family = get_family(family) if isinstance(family, str) else family
        self.limits = limits if limits is not None else StructuredLimits()
        lim = self.limits
        self._ll_limits = llguidance.LLParserLimits(
            initial_lexer_fuel=lim.initial_lexer_fuel,
            step_lexer_fuel=lim.step_lexer_fuel,
            step_max_items=lim.step_max_items,
            max_lexer_states=lim.max_lexer_states,
            max_grammar_size=lim.max_grammar_size,
            verbose_errors=False,  # errors reach clients: no parser state or grammar dumps
        )
        self.ll_tokenizer = ll_tokenizer if ll_tokenizer is not None else build_lltokenizer(tokenizer)
        self.byte_tokens = ByteTokens([tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)],
                                      frozenset(tokenizer.special_ids), self.ll_tokenizer)
        self._cache: GrammarCache[CompiledGrammar | _Failure] = GrammarCache(
            max_entries=cache_entries, max_bytes=cache_bytes
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def cache_stats(self) -> CacheStats:
        return self._cache.stats()

    def clear_cache(self) -> None:
        """Forget every compiled grammar (a benchmark measuring cold compiles)."""
        self._cache.clear()

    def compile(self, constraints: OutputConstraints) -> CompiledGrammar | None:
        """The compiled grammar for ``constraints``, None when nothing constrains the output."""
        source = grammar_source(constraints, self.family)
        return None if source is None else self.compile_source(source)

    def compile_text(self, text: str) -> CompiledGrammar:
        """A grammar that arrived as text (``SamplingParams.grammar``: a tier compiles what the
        gateway built); a failure names ``grammar``, having no schema fields to point at."""
        return self.compile_source(GrammarSource(text, (), False))

    def compile_source(self, source: GrammarSource) -> CompiledGrammar:
        key = source.key
        cached = self._cache.get(key)
        if isinstance(cached, _Failure):
            raise SchemaError(cached.message, param=cached.param)
        if cached is not None:
            return cached
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(
            self.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(source.text), limits=self._ll_limits, log_level=0
        )
        error = matcher.get_error() if matcher.is_error() else ""
        if not error:
            # The first mask builds lexer states that later copies share (~0.1 ms of a first step);
            # build them now, and learn whether even one step exceeds the per-step limits.
            probe = matcher.deep_copy()
            probe.compute_bitmask()
            error = probe.get_error() if probe.is_error() else ""
        size = len(source.text.encode("utf-8"))
        if error:
            failure = self._attribute(source, error)
            self._cache.put(key, failure, size)  # a failure keeps its message alone
            raise SchemaError(failure.message, param=failure.param)
        compiled = CompiledGrammar(key, (time.perf_counter() - start) * 1e3, source.calls, source.text, matcher,
                                   self.byte_tokens)
        self._cache.put(key, compiled, matcher_bytes(size))
        return compiled

    def text_matcher(self, text: str, max_tokens: int | None = None) -> SequenceMatcher:
        """A fresh matcher of a grammar that arrived as text (``SamplingParams.grammar``): what a
        tier makes for each constrained request, with its ``max_tokens``."""
        return self.matcher(self.compile_text(text), max_tokens)

    def matcher(self, compiled: CompiledGrammar, max_tokens: int | None = None) -> SequenceMatcher:
        """A fresh matcher for one sequence (a copy of the pristine one: ~1 µs). With ``max_tokens``
        (output tokens, EOS included) it ends the answer valid within them (``SequenceMatcher``),
        where the grammar has an answer that short."""
        budget = None
        if max_tokens is not None and (shortest := compiled.shortest) is not None and shortest < max_tokens:
            budget = Budget(max_tokens, self.byte_tokens, shortest)
        return SequenceMatcher(compiled._pristine.deep_copy(), eos_id=self.tokenizer.eos_id,
                               vocab_size=self.tokenizer.vocab_size, budget=budget)

    def _attribute(self, source: GrammarSource, error: str) -> _Failure:
        """Which field broke the compile: each schema compiled alone (only on this failure path),
        within ``ATTRIBUTE_BUDGET_S`` of work: a request of many tools whose last one fails (a
        client's way to buy ~85 ms of CPU per request with 128 tools) is told the grammar cannot
        be compiled, naming ``tools`` rather than the one at fault."""
        deadline = time.perf_counter() + ATTRIBUTE_BUDGET_S
        for part in source.parts:
            if time.perf_counter() > deadline:
                break
            rule = part.rule.split(":", 1)[0]
            alone = llguidance.LLMatcher.grammar_from_lark(f"start: {rule}\n{part.rule}\n")
            why = llguidance.LLMatcher.validate_grammar(alone, self.ll_tokenizer, limits=self._ll_limits)
            if why:
                return _Failure(f"{part.param} cannot be enforced: {_reason(why)}", part.param)
        param = ("tools" if source.calls else "response_format") if source.parts else "grammar"
        return _Failure(f"the output grammar for this request cannot be compiled: {_reason(error)}", param)
