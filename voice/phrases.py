"""Cutting a streamed answer into phrases to speak, as its text deltas arrive.

Speech is made a phrase at a time so the first audio goes out after the first clause, not after
the whole answer. A phrase ends at a sentence end (``.``, ``!``, ``?``, an ellipsis or a line
break, once the whitespace after it has arrived: ``3.5`` and ``.com`` are not ends), at a clause
mark (``,`` ``;`` ``:`` a dash) once the phrase is long enough to be worth a synthesis of its own,
or, failing both, at the last space before a length bound. The first phrase has lower bounds than
the rest: it sets the time to first audio.

Phrases are exact slices of the text: joined, they give back everything fed (only whitespace at
the very end is dropped), so the alignment and the transcript deltas can be cut from them. The
whitespace after a boundary starts the next phrase.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A sentence end and the whitespace that confirms it (not kept in the match's span end).
_SENTENCE = re.compile(r"(?:[.!?]+|…)[\"'”’)\]]*(?=\s)|(?<=\S)(?=\n)")
_CLAUSE = re.compile(r"[,;:]+[\"'”’)\]]*(?=\s)|\s[-–—]+(?=\s)|[–—](?=\s)")
# Words whose final "." ends no sentence (initials are caught separately: one letter, then ".").
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "st", "vs", "etc", "e.g", "i.e", "jr", "sr", "prof", "no"})


@dataclass(frozen=True)
class PhraseBounds:
    first_clause_chars: int = 16  # a clause mark ends the first phrase once it is this long
    clause_chars: int = 40  # ... and later phrases once they are this long
    first_max_chars: int = 60  # no boundary by then: cut the first phrase at the last space
    max_chars: int = 160

    def __post_init__(self) -> None:
        if not 1 <= self.first_clause_chars <= self.first_max_chars:
            raise ValueError("need 1 <= first_clause_chars <= first_max_chars")
        if not 1 <= self.clause_chars <= self.max_chars:
            raise ValueError("need 1 <= clause_chars <= max_chars")


class PhraseSplitter:
    """One response's splitter. ``feed`` each text delta, then ``flush`` at the end of the text."""

    def __init__(self, bounds: PhraseBounds | None = None) -> None:
        self.bounds = bounds or PhraseBounds()
        self._buffer = ""
        self._emitted = 0  # phrases so far: the first one has its own bounds

    def feed(self, delta: str) -> list[str]:
        self._buffer += delta
        phrases = []
        while (cut := self._next_cut()) is not None:
            phrases.append(self._take(cut))
        return phrases

    def flush(self) -> list[str]:
        """What is left, as phrases within the length bound (none if it is only whitespace)."""
        phrases = self.feed("")
        self._buffer = self._buffer.rstrip()
        while self._buffer:
            limit = self._limit()
            cut = len(self._buffer) if len(self._buffer) <= limit else self._space_cut(limit)
            phrases.append(self._take(cut))
        self._buffer = ""
        return phrases

    def _take(self, cut: int) -> str:
        phrase, self._buffer = self._buffer[:cut], self._buffer[cut:]
        self._emitted += 1
        return phrase

    def _limit(self) -> int:
        return self.bounds.first_max_chars if self._emitted == 0 else self.bounds.max_chars

    def _next_cut(self) -> int | None:
        """Where the buffer's first complete phrase ends, or None to wait for more text."""
        text = self._buffer
        limit = self._limit()
        clause_min = self.bounds.first_clause_chars if self._emitted == 0 else self.bounds.clause_chars
        window = text[:limit + 1]  # a boundary mark at the bound itself still counts
        # The earliest boundary that qualifies, of either kind: the same cuts whether the text
        # comes a character at a time or all at once.
        ends = [m.end() for m in _SENTENCE.finditer(window) if _ends_sentence(text, m) and text[:m.end()].strip()]
        for m in _CLAUSE.finditer(window):
            end = m.start() if m.group()[0].isspace() else m.end()  # " - ": cut before the dash
            if len(text[:end].strip()) >= clause_min:
                ends.append(end)
        ends = [end for end in ends if end <= limit]
        if ends:
            return min(ends)
        if len(text) > limit:
            return self._space_cut(limit)
        return None

    def _space_cut(self, limit: int) -> int:
        """The last whitespace within the bound (a word is not split unless it alone is too long)."""
        space = max(self._buffer.rfind(" ", 0, limit + 1), self._buffer.rfind("\n", 0, limit + 1))
        leading = len(self._buffer) - len(self._buffer.lstrip())
        return space if space > leading else limit


def _ends_sentence(text: str, m: re.Match[str]) -> bool:
    if not m.group().startswith("."):  # "!", "?", "…", or a line break (an empty match before it)
        return True
    word = text[:m.start()].rsplit(None, 1)[-1] if text[:m.start()].strip() else ""
    if len(word) == 1 and word.isalpha():
        return False  # an initial: "J. Smith", "U.S."'s last letter is caught by the next case
    return word.lower().lstrip("(\"'") not in _ABBREVIATIONS and not re.fullmatch(r"(?:\w\.)+\w", word)
