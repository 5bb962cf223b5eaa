"""Turning a stream of token ids into text a client can be sent, token by token.

Two layers: ``IncrementalDetokenizer`` works on bytes so a character split across tokens
(emoji, CJK) is emitted once it is complete, never as U+FFFD halves; ``TextStream`` adds
stop strings, holding back any tail that might be the start of one. Both cost O(new bytes)
per token: nothing is re-decoded.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from llm_shared.errors import InvalidRequestError
from llm_shared.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Token ids in, newly complete text out. Concatenated output equals ``tokenizer.decode``."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._texts = tokenizer.whole_texts
        # The stdlib incremental decoder keeps an incomplete trailing sequence pending and
        # replaces invalid bytes exactly as bytes.decode(errors="replace") does.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = False  # the decoder holds bytes of an unfinished character

    def push(self, token_id: int) -> str:
        """Text completed by this token ("" while a multi-byte character is still pending)."""
        # Nearly every token is whole characters: while nothing is pending its text is a lookup.
        if not self._pending and type(token_id) is int and 0 <= token_id < len(self._texts):
            text = self._texts[token_id]
            if text is not None:
                return "" if token_id in self._skip else text
        data = self._tokenizer.token_bytes(token_id)  # checks the id
        if token_id in self._skip:
            return ""
        text = self._decoder.decode(data)
        self._pending = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        """End of stream: bytes still pending cannot complete and become U+FFFD."""
        self._pending = False
        return self._decoder.decode(b"", final=True)


class TextStream:
    """Detokenizer plus stop strings; every engine uses one per request to fill ``TokenEvent.text``."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *, skip_special: bool = True) -> None:
        if isinstance(stop, str):
            raise InvalidRequestError("stop must be a list of strings", param="stop")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop entries must be non-empty strings", param="stop")
        self._detok = IncrementalDetokenizer(tokenizer, skip_special=skip_special)
        self._stops = tuple(dict.fromkeys(stop))
        self._held = ""  # decoded but not emitted: a tail that may begin a stop string
        self._emitted: list[str] = []
        self._stopped = False
        self._matched_stop: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far (joined on demand: O(length), so read it at the end, not per token)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the stream, if one did."""
        return self._matched_stop

    def push(self, token_id: int) -> tuple[str, bool]:
        """(text safe to emit now, stopped). After a stop, further tokens yield ("", True)."""
        if self._stopped:
            return "", True
        if not self._stops:  # nothing to hold back or find
            text = self._detok.push(token_id)
            if text:
                self._emitted.append(text)
            return text, False
        return self._advance(self._detok.push(token_id))

    def finish(self) -> str:
        """End of generation: the held-back tail (and any pending bytes) that no stop string completed."""
        if self._stopped:
            return ""
        text, stopped = self._advance(self._detok.flush())
        if stopped:
            return text
        rest, self._held = self._held, ""
        self._emitted.append(rest)
        return text + rest

    def _advance(self, new: str) -> tuple[str, bool]:
        if not new:
            return "", False
        buf = self._held + new
        # A stop string cannot start in text already emitted (that tail would have been held),
        # so searching the held tail plus the new text finds every match.
        first = -1
        for s in self._stops:
            at = buf.find(s)
            if at != -1 and (first == -1 or at < first):
                first, self._matched_stop = at, s
        if first != -1:
            self._stopped = True
            self._held = ""
            out = buf[:first]
            self._emitted.append(out)
            return out, True
        keep = self._hold_from(buf)
        out, self._held = buf[:keep], buf[keep:]
        self._emitted.append(out)
        return out, False

    def _hold_from(self, buf: str) -> int:
        """Index where the longest suffix of ``buf`` that is a proper prefix of some stop begins."""
        hold = len(buf)
        for s in self._stops:
            # Only the last len(s) - 1 characters can begin an unfinished match of s.
            start = max(0, len(buf) - len(s) + 1)
            at = buf.find(s[0], start, hold)
            while at != -1:
                if s.startswith(buf[at:]):
                    hold = at
                    break
                at = buf.find(s[0], at + 1, hold)
        return hold
