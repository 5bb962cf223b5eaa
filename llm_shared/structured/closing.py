"""A short way to finish what a grammar has started: the tokens that close an answer in time.

A small model under a JSON grammar can loop inside the document (an array that never ends, a
string that goes on) until ``max_tokens`` cuts it, and a cut document does not parse. The grammar
makes every token valid, not the answer finished. So each constrained sequence knows its token
budget, and when the budget left is no more than a way to close the answer (plus EOS and a margin),
the matcher allows only that way: the answer ends valid, with the content the model wrote so far.

The way to close is found by walking the grammar a byte at a time on a copy of the matcher, asking
which printable bytes it allows next (``validate_tokens`` per byte token: ~100 checks of ~0.4 µs,
where a whole-vocabulary mask inside a string costs ~100 µs). At each step:
- a byte that ends something, when allowed: ``"`` (a string), ``}`` and ``]`` (containers);
- else, where ``"`` is refused (a string a pattern or format keeps open: ``ab`` anywhere, an
  email's domain), one or two bytes after which it is allowed, if some are;
- else ``,`` and ``:`` (what an object's next required property needs), ``1`` (a one-byte number
  that meets the usual lower bounds and fills a date's digits with a real date);
- else a byte chosen to move through a pattern rather than round a loop in it: one that became
  allowed since (``@`` once an email's local part has begun), else one not used yet in this
  string, lowest first; whitespace only when nothing else is allowed, a special token only when no
  byte is. A byte that left the choices unchanged (string or number content) is not taken again
  until they change, so the walk never circles.
The grammar allows only bytes that can still lead to a complete answer, so each step makes
progress; a step bound and a look-ahead budget stop a pattern the choices above cannot finish
(then there is no closing, and the answer may be cut as before). The bytes are then tokenized as
text and kept as those tokens when the grammar takes all of them (fewer steps), else one byte
token each. The walk takes ~2 ms at the median and ~10 ms at p99 over the shipped schemas from
random points (more for a pattern-heavy string); it runs only near the end of a budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from llm_shared.structured.bitmask import allowed_tokens

if TYPE_CHECKING:
    import llguidance

# Bytes tried first, in order: those that end a string, an object, an array; what an object's next
# required property needs; the shortest value.
_PREFERRED = b'"}],:1'
_WHITESPACE = frozenset(b" \t\r\n")
# Bytes a look-ahead for a string's end never tries: a backslash (its quote would be content), and
# openers (their quote would begin a new string inside a new container).
_NOT_AHEAD = frozenset(b"\\{[")
MAX_CLOSE_STEPS = 1024  # tokens of a closing walk before it gives up (a pattern it cannot finish)
LOOKAHEAD_CHECKS = 100_000  # look-ahead validations a walk may make in all (~0.5 µs each)


class ByteTokens:
    """The single-byte token of each byte value in one vocabulary (byte-level BPE has all 256),
    and llguidance's tokenizer to shorten a closing text into fewer tokens. Built once per model."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids: set[int] | frozenset[int],
                 ll_tokenizer: llguidance.LLTokenizer) -> None:
        by_byte: dict[int, int] = {}
        for token_id, raw in enumerate(token_bytes):
            if len(raw) == 1 and token_id not in special_ids:
                by_byte.setdefault(raw[0], token_id)
        self.by_byte = by_byte
        self.ll_tokenizer = ll_tokenizer
        self.preferred = [by_byte[b] for b in _PREFERRED if b in by_byte]
        self.closers = frozenset(by_byte[b] for b in b"}]" if b in by_byte)
        self.ender_order = [by_byte[b] for b in b'"}]' if b in by_byte]
        self.enders = frozenset(self.ender_order)
        # the rest, lowest byte first and whitespace last: printable ASCII, then any other byte
        # (continuing a character the model began)
        ordered = [b for b in sorted(by_byte) if b not in _WHITESPACE] + [b for b in sorted(by_byte) if b in _WHITESPACE]
        self.ascii = [by_byte[b] for b in ordered if 0x20 <= b < 0x7F or b in _WHITESPACE]
        self.other = [by_byte[b] for b in ordered if not (0x20 <= b < 0x7F or b in _WHITESPACE)]
        self.id_to_byte = {token_id: b for b, token_id in by_byte.items()}


def closing_tokens(matcher: llguidance.LLMatcher, tokens: ByteTokens, *, max_steps: int = MAX_CLOSE_STEPS
                   ) -> list[int] | None:
    """Tokens that take ``matcher`` from where it is to a complete answer ([] if it already is one),
    or None when the walk finds none within ``max_steps`` (the matcher is not changed)."""
    if matcher.is_accepting():
        return []
    walk = matcher.deep_copy()
    steps: list[int] = []
    state = _Walk()
    while not walk.is_accepting():
        if len(steps) >= max_steps or walk.is_error() or walk.is_stopped():
            return None
        blind = state.blind_ender(walk, tokens)
        if blind is not None:  # the common step, without asking about every byte
            steps.append(blind)
            state.took(blind, tokens)
            continue
        allowed = _allowed_bytes(walk, tokens.ascii) or _allowed_bytes(walk, tokens.other)
        ordered = state.order(allowed, tokens)
        if ordered and ordered[0] in tokens.enders:  # `"`, `}` or `]` ends something: take it
            path = ordered[:1]
        else:  # a pattern's string that one or two bytes let end, else the best byte
            path = state.to_quote(walk, allowed, tokens) or ordered[:1] or _allowed_special(walk)[:1]
        if not path or walk.try_consume_tokens(path) != len(path):
            return None
        for token_id in path:
            steps.append(token_id)
            state.took(token_id, tokens)
    return _shortened(matcher, tokens, steps)


def _allowed_bytes(walk: llguidance.LLMatcher, candidates: list[int]) -> list[int]:
    """Those of ``candidates`` the grammar allows next (asking per token: ~0.4 µs each, where a
    whole-vocabulary mask inside a string costs ~100)."""
    return [t for t in candidates if walk.validate_tokens([t]) == 1]


def _allowed_special(walk: llguidance.LLMatcher) -> list[int]:
    """A few allowed tokens of any kind, where the grammar allows no single byte (a special token)."""
    row = np.frombuffer(walk.compute_bitmask(), dtype=np.int32)
    return [int(i) for i in allowed_tokens(row, row.size * 32)[:4]]


class _Walk:
    """What the closing walk remembers to choose its next byte: the bytes used, those the grammar
    newly allowed and not used yet, and those that changed nothing (content of a string or a
    number: taking one again would go round a loop)."""

    def __init__(self) -> None:
        self.used: set[int] = set()
        self.fresh: set[int] = set()  # allowed since some step, and not used since
        self.idle: set[int] = set()  # taken at an unchanged allowed set: not again until it changes
        self.allowed: frozenset[int] | None = None
        self.last: int | None = None
        self.lookahead = LOOKAHEAD_CHECKS
        self.repeated: int | None = None  # the last token, when it left the choices unchanged
        self.searched: frozenset[int] | None = None  # the choices of the last two-byte look-ahead that failed

    def order(self, allowed: list[int], tokens: ByteTokens) -> list[int]:
        now = frozenset(allowed)
        if self.allowed is not None and now == self.allowed:
            # A closer may leave the same choices twice (closing an inner then an outer object):
            # it idles at its second repeat, anything else at its first.
            if self.last is not None and (self.last not in tokens.closers or self.last == self.repeated):
                self.idle.add(self.last)
            self.repeated = self.last
        else:
            self.repeated = None
            self.idle.clear()
            if self.allowed is not None:
                self.fresh |= now - self.allowed
        self.fresh &= now
        self.allowed = now
        preferred = [t for t in tokens.preferred if t in now and t not in self.idle]
        fresh = [t for t in allowed if t in self.fresh and t not in self.used and t not in self.idle]
        unused = [t for t in allowed if t not in self.used and t not in self.idle]
        others = [t for t in allowed if t not in self.idle]
        return list(dict.fromkeys([*preferred, *fresh, *unused, *others, *allowed]))

    def blind_ender(self, walk: llguidance.LLMatcher, tokens: ByteTokens) -> int | None:
        """Take ``"``, ``}`` or ``]`` if allowed, without asking about the other bytes (3 checks
        where a step's choices take ~100), unless it was taken before in this string: a repeat goes
        through the full choice, which notices a byte that changes nothing (``}`` in a string)."""
        for token_id in tokens.ender_order:
            if token_id not in self.used and token_id not in self.idle and walk.try_consume_tokens([token_id]) == 1:
                self.allowed, self.repeated = None, None  # the choices were not asked: no comparison next
                return token_id
        return None

    def to_quote(self, walk: llguidance.LLMatcher, allowed: list[int], tokens: ByteTokens) -> list[int]:
        """One or two allowed bytes after which ``"`` is allowed, where it is not now ([]: none, or
        ``"`` is allowed already, or the look-ahead's budget is spent): inside a string that a
        pattern keeps open (``ab`` anywhere, a required suffix), the shortest way to end it. Neither
        byte is a backslash (``\\"`` would be the quote as content)."""
        quote = tokens.by_byte.get(0x22)
        if quote is None or quote in allowed or self.lookahead <= 0:
            return []
        allowed = [t for t in allowed if tokens.id_to_byte.get(t) not in _NOT_AHEAD]
        self.lookahead -= len(allowed)
        for first in allowed:
            if walk.validate_tokens([first, quote]) == 2:
                return [first]
        now = frozenset(allowed)
        if now == self.searched or self.lookahead < len(allowed) ** 2:
            return []  # the same choices found nothing last time: two bytes are not enough here
        self.lookahead -= len(allowed) ** 2
        self.searched = now
        for first in allowed:
            if walk.try_consume_tokens([first]) != 1:
                continue
            second = next((t for t in allowed if walk.validate_tokens([t, quote]) == 2), None)
            walk.rollback(1)
            if second is not None:
                return [first, second]
        return []

    def took(self, token_id: int, tokens: ByteTokens) -> None:
        if tokens.id_to_byte.get(token_id) == 0x22:  # a string began or ended: the next one starts afresh
            self.used.clear()
            self.fresh.clear()
            self.idle.clear()
            self.searched = None
        else:
            self.used.add(token_id)
            self.fresh.discard(token_id)
        self.last = token_id


def _shortened(matcher: llguidance.LLMatcher, tokens: ByteTokens, steps: list[int]) -> list[int]:
    """The walk's bytes as ordinary tokens when the grammar takes them all and they complete the
    answer; else the walk's own tokens."""
    if len(steps) < 2 or any(t not in tokens.id_to_byte for t in steps):
        return steps
    text = bytes(tokens.id_to_byte[t] for t in steps)
    short = tokens.ll_tokenizer.tokenize_bytes(text)
    if len(short) >= len(steps):
        return steps
    probe = matcher.deep_copy()
    if probe.try_consume_tokens(short) == len(short) and probe.is_accepting():
        return list(short)
    return steps
