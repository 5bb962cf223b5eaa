"""Compiled grammars, remembered by the hash of their text: most requests repeat their tools and
schemas (a Realtime session's tools, an app's fixed response model), and compiling costs
milliseconds where a cache hit costs a dictionary lookup and a matcher copy (~1 µs).

Bounded in entries and in bytes, least recently used first out. The bytes are what each entry
is counted for by its owner: the compiler counts a compiled grammar's matcher by a measured model
of its memory (``compiler.matcher_bytes``: the Rust side's memory cannot be read from Python), a
failure by its text. A schema that failed to compile is remembered too, so a client repeating it
is refused without compiling again. Thread-safe: compile threads and request handlers may share
one cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    evictions: int


class GrammarCache(Generic[V]):
    def __init__(self, *, max_entries: int = 512, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_entries <= 0 or max_bytes <= 0:
            raise ValueError("a grammar cache needs room for at least one entry")
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return found[0]

    def put(self, key: str, value: V, size: int) -> None:
        """Remember ``value``; an entry larger than the whole cache is not kept (it would only
        evict everything else)."""
        with self._lock:
            if size > self._max_bytes:
                return
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while len(self._entries) > self._max_entries or self._bytes > self._max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
                self._evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._entries), self._bytes, self._hits, self._misses, self._evictions)
