"""Prompt-lookup drafting: no model, the context itself proposes.

If the last ``n`` tokens of a sequence occurred earlier in it, the tokens that followed that
earlier occurrence are proposed (longest ``n`` first, most recent occurrence). Strong where a
turn copies from its context (quoting, code edits, lists read back), free elsewhere: a miss
proposes nothing and the step is a plain decode. Proposals are deterministic (point masses),
so verification accepts draft ``x`` with probability ``p(x)``, which keeps sampling exact.

Each request keeps an index from n-gram to the latest position after it, extended with the
tokens appended since the last call, so a lookup costs O(new tokens), not O(context).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine_gpu.speculative.drafter import Draft, DraftRequest


class _Index:
    """n-gram -> start of the tokens that followed its latest occurrence, for n in [min_n, max_n]."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.next_at: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position (exclusive of the last token) are indexed

    def extend(self, token_ids: Sequence[int]) -> None:
        n_old = len(self.tokens)
        if len(token_ids) < n_old or list(token_ids[:n_old]) != self.tokens:  # not an extension: start over
            self.tokens, self.next_at, self.indexed = [], {}, 0
            n_old = 0
        self.tokens.extend(token_ids[n_old:])
        tokens = self.tokens
        # an n-gram ending at position e - 1 is indexed once a token follows it (e < len)
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.next_at[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def lookup(self, k: int) -> list[int]:
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.next_at.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []


class NgramDrafter:
    """``Drafter`` by prompt lookup. Not thread-safe: the engine core calls it from one thread."""

    name = "ngram"

    def __init__(self, *, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _Index] = {}
        self._proposed = 0
        self._lookups = 0
        self._hits = 0
        # a propose's lookups as k "forwards" of one token per request, so that the controller's
        # k rounds of g(requests) price the call at what it took
        self.last_forwards: list[tuple[int, float]] = []

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        started = time.perf_counter()
        out: dict[str, Draft] = {}
        for req in requests:
            index = self._indexes.get(req.request_id)
            if index is None:
                index = self._indexes[req.request_id] = _Index(self.min_n, self.max_n)
            index.extend(req.token_ids)
            drafts = index.lookup(req.k)
            self._lookups += 1
            self._hits += bool(drafts)
            self._proposed += len(drafts)
            out[req.request_id] = Draft(drafts, None)
        rounds = max((req.k for req in requests), default=1)
        self.last_forwards = [(len(requests), (time.perf_counter() - started) / rounds)] * rounds if requests else []
        return out

    def behind(self, request_id: str, token_ids: Sequence[int]) -> int:
        return 0  # a lookup indexes what is new as part of its own (measured) cost

    def calibrate(self) -> list[tuple[int, float]]:
        return []  # no model: priced from its first lookups

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"drafter_tokens_proposed": float(self._proposed), "drafter_lookups": float(self._lookups),
                "drafter_lookup_hits": float(self._hits), "drafter_requests": float(len(self._indexes))}

    def set_threads(self, threads: int) -> None:
        """Nothing to size: lookups run on the step's own thread."""

    def close(self) -> None:
        self._indexes.clear()
